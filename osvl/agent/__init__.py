"""osvl.agent"""
