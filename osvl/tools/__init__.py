"""osvl.tools"""
