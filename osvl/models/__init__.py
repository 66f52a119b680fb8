"""osvl.models"""
