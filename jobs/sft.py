"""Supervised fine-tuning on agent trajectories: Ray Train + DeepSpeed ZeRO (see osvl/sft/job.py).

    python jobs/sft.py                         # demo: tiny model on the demo teacher trajectories, 2 workers, ZeRO-2
    python jobs/sft.py --profile=production    # a released VLM on GPUs, ZeRO-3, bf16
    python jobs/sft.py --zero_stage=3 --workers=1 --max_steps=20

Rerunning the same command resumes from the newest checkpoint of its run folder
(<run.root>/sft/<config hash>/). Output: <run_dir>/model (a Hugging Face directory that
osvl.models.load loads), train_log.jsonl (one line per step), report.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osvl.config import cli  # noqa: E402
from osvl.logs import start_job  # noqa: E402
from osvl.recipe import run_sft  # noqa: E402
from osvl.sft.job import JOB, SftConfig  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    cfg = start_job(SftConfig, JOB, argv)
    report = run_sft(cfg)
    print(json.dumps({k: v for k, v in report.items() if k != "config"}), flush=True)
    return report


if __name__ == "__main__":
    cli(main)
