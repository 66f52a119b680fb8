"""osvl.synth"""
