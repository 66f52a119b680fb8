"""osvl.rl"""
