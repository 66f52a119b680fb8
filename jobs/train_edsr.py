"""Train the default EDSR x4 weights with Ray Train (see osvl/edsr/job.py).

    python jobs/train_edsr.py                        # demo profile: a few steps, proves the loop
    python jobs/train_edsr.py --profile=production   # the committed weights (docs/measurements.md: time)

Rerunning the same config resumes. Output: <run_dir>/edsr_x4.pth and report.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osvl.config import cli  # noqa: E402
from osvl.edsr.job import JOB, TrainEdsrConfig, run  # noqa: E402
from osvl.logs import start_job  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    report = run(start_job(TrainEdsrConfig, JOB, argv))
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    cli(main)
