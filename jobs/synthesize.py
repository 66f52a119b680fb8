"""Synthesize multi-hop visual questions from a KG: ``python jobs/synthesize.py [--profile=NAME] [--key=value]``.

Runs locally (starts a loopback Ray cluster) or on a cluster with
``ray job submit --working-dir . -- python jobs/synthesize.py --profile=production``.
A rerun with the same config resumes: finished shards are kept, the rest run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import cli  # noqa: E402
from osvl.logs import start_job  # noqa: E402
from osvl.synth.job import JOB, SynthConfig, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cfg = start_job(SynthConfig, JOB, argv)
    run(cfg)


if __name__ == "__main__":
    cli(main)
