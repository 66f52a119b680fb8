"""osvl.kg"""
