"""Fatal-aware asynchronous GRPO: ``python jobs/grpo.py [--profile=NAME] [--section.key=value]``.

On the embedded default (the ``demo`` profile) it builds or reuses everything it needs
by calling the other jobs' library functions (questions: jobs/synthesize.py;
expert trajectories: jobs/trajectories.py; the SFT'd tiny model: jobs/sft.py), each
under its own ``<run root>/<job>/<config hash>/``, then runs GRPO with a per-step
table and a final summary (reward first vs last 10 steps, the clamp split, held-out
Pass@1 after SFT and after GRPO). Rerunning the same command resumes from the latest
checkpoint. On a cluster: ``ray job submit --working-dir . -- python jobs/grpo.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import dump, parse_args  # noqa: E402
from osvl.rl.trainer import JOB, GRPOConfig, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(GRPOConfig, JOB, argv)
    print(dump(cfg), flush=True)
    run(cfg, log=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    main()
