"""Fatal-aware asynchronous GRPO: ``python jobs/grpo.py [--profile=NAME] [--section.key=value]``.

On the embedded default (the ``demo`` profile) it builds or reuses everything it needs
by calling the other jobs' library functions (questions: jobs/synthesize.py;
expert trajectories: jobs/trajectories.py; the SFT'd tiny model: jobs/sft.py), each
under its own ``<run root>/<job>/<config hash>/``, then runs GRPO with a per-step
table and a final summary (reward first vs last 10 steps, the clamp split, held-out
Pass@1 after SFT and after GRPO). Rerunning the same command resumes from the latest
checkpoint. On a cluster: ``ray job submit --working-dir . -- python jobs/grpo.py``.

``--check=MODEL_DIR [--cluster=cluster.yaml] [--gpu_memory_gb=80]`` prints the run's plan on that
cluster and one line per inconsistency, then exits (``osvl/rl/plan.py``); nothing starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import cli  # noqa: E402
from osvl.recipe import grpo_main as main  # noqa: E402

if __name__ == "__main__":
    cli(main)
