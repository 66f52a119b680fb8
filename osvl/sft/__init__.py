"""Supervised fine-tuning on trajectory records (jobs/sft.py): the job, its data, its Ray Train loop."""
