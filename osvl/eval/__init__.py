"""osvl.eval"""
