"""Expert trajectories for SFT: ``python jobs/trajectories.py [--profile=NAME] [--key=value]``.

A teacher (default: the offline path oracle) answers each SFT question through the real
tools ``n_teacher_rollouts`` times; the answer judge and then the process judge filter the
rollouts, and at most ``keep_per_question`` per question are written to
``<run root>/trajectories/<config hash>/trajectories.parquet`` with ``images/`` beside it.
A rerun with the same config resumes: committed shards are kept, the rest run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import cli  # noqa: E402
from osvl.expert.job import JOB, TrajConfig  # noqa: E402
from osvl.logs import start_job  # noqa: E402
from osvl.recipe import run_trajectories  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cfg = start_job(TrajConfig, JOB, argv)
    run_trajectories(cfg)


if __name__ == "__main__":
    cli(main)
