"""osvl.train"""
