"""The train_edsr job (jobs/train_edsr.py): the default EDSR x4 weights of the super_resolution tool."""
