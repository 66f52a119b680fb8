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

from osvl.logs import start_job  # noqa: E402
from osvl.rl.job import JOB, GRPOConfig, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = start_job(GRPOConfig, JOB, [a for a in args if not a.startswith(SUB_JOBS)])
    cfg = sub_job_overrides(cfg, [a for a in args if a.startswith(SUB_JOBS)])
    s = run(cfg)
    # `make demo` runs this job; its last line says whether the whole chain ran (the test greps it)
    label = "demo" if not any(a.startswith("--profile=") and a != "--profile=demo" for a in args) else "grpo"
    evals = cfg.eval.n_heldout == 0 or (s["pass1_sft"] is not None and s["pass1_grpo"] is not None)
    if s["steps"] < cfg.train.steps or not evals:
        print(f"{label}: FAILED — {s['steps']} of {cfg.train.steps} GRPO steps trained, held-out evaluation "
              f"{'done' if evals else 'missing'}; see {s['out']}", flush=True)
        raise SystemExit(1)
    print(f"{label}: OK — questions, expert trajectories, SFT and {s['steps']} GRPO steps ({s['mode']}) in "
          f"{s['seconds'] / 60:.1f} min; mean reward first 10 steps {s['first_mean']:.3f} ± {s['first_se']:.3f}, "
          f"last 10 {s['last_mean']:.3f} ± {s['last_se']:.3f} ({'up' if s['improved'] else 'NOT up'} by > 2 SE); "
          f"held-out Pass@1 after SFT {_num(s['pass1_sft'])}, after GRPO {_num(s['pass1_grpo'])}", flush=True)


SUB_JOBS = ("--synth.", "--trajectories.", "--sft.")


def sub_job_overrides(cfg: GRPOConfig, args: list[str]) -> GRPOConfig:
    """``--sft.max_len=1024`` and the like: dotted keys into the other jobs' override dicts, values
    read as YAML (the sub-job's own config checks their types when it is built)."""
    import dataclasses

    import yaml

    subs = {"synth": dict(cfg.synth), "trajectories": dict(cfg.trajectories), "sft": dict(cfg.sft)}
    for arg in args:
        key, _, text = arg[2:].partition("=")
        section, *path = key.split(".")
        node = subs[section]
        for part in path[:-1]:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[path[-1]] = yaml.safe_load(text)
    return dataclasses.replace(cfg, **subs)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
