"""Expert trajectories for SFT (jobs/trajectories.py): the job (``job.py``) and the teacher's rollouts
(``rollouts.py``)."""
