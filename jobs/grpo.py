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

from osvl.config import cli, normalize_args, parse_args  # noqa: E402
from osvl.logs import start_job  # noqa: E402
from osvl.recipe import GRPOJobConfig, check, run_grpo  # noqa: E402
from osvl.rl.job import JOB  # noqa: E402
from osvl.rl.plan import run_check  # noqa: E402
from osvl.rl.report import verdict  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    # "--check DIR" and "--check=DIR" name the model; a lone "--check" (read as "--check=true") plans without one
    args = ["--check" if a == "--check=true" else a for a in normalize_args(list(sys.argv[1:] if argv is None
                                                                                 else argv))]
    flags = [a for a in args if a == "--check" or a.startswith(("--check=", "--cluster=", "--gpu_memory_gb="))]
    if any(a.startswith("--check") for a in flags):  # the plan only (osvl/rl/plan.py): nothing starts
        cfg = parse_args(GRPOJobConfig, JOB, [a for a in args if a not in flags])
        given = dict(a.removeprefix("--").partition("=")[::2] for a in flags)
        raise SystemExit(run_check(cfg, given.get("check", ""), given.get("cluster") or "cluster.yaml",
                                   float(given.get("gpu_memory_gb") or 80)))

    def finish(cfg: GRPOJobConfig) -> GRPOJobConfig:
        check(cfg)  # before the upstream stages, which may run for an hour
        cfg.rollout.check()
        return cfg

    cfg = start_job(GRPOJobConfig, JOB, args, finish)
    s = run_grpo(cfg)
    # `make demo` runs this job; its last line says whether the whole chain ran (the test greps it)
    label = "demo" if not any(a.startswith("--profile=") and a != "--profile=demo" for a in args) else "grpo"
    ok, line = verdict(label, s, cfg.train.steps, cfg.eval.n_heldout)
    print(line, flush=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    cli(main)
