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

from osvl.config import cli, normalize_args  # noqa: E402
from osvl.logs import start_job  # noqa: E402
from osvl.rl.job import JOB, GRPOConfig, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    # "--check DIR" and "--check=DIR" name the model; a lone "--check" (read as "--check=true") plans without one
    args = ["--check" if a == "--check=true" else a for a in normalize_args(list(sys.argv[1:] if argv is None
                                                                                 else argv))]
    check = [a for a in args if a == "--check" or a.startswith(("--check=", "--cluster=", "--gpu_memory_gb="))]
    if any(a.startswith("--check") for a in check):  # the plan only (osvl/rl/plan.py): nothing starts
        from osvl.config import parse_args
        from osvl.rl.plan import run_check

        flags = dict(a.removeprefix("--").partition("=")[::2] for a in check)
        cfg = sub_job_overrides(parse_args(GRPOConfig, JOB, [a for a in args if a not in check and
                                                             not a.startswith(SUB_JOBS)]),
                                [a for a in args if a.startswith(SUB_JOBS)])
        raise SystemExit(run_check(cfg, flags.get("check", ""), flags.get("cluster") or "cluster.yaml",
                                   float(flags.get("gpu_memory_gb") or 80)))

    def finish(cfg: GRPOConfig) -> GRPOConfig:
        cfg = sub_job_overrides(cfg, [a for a in args if a.startswith(SUB_JOBS)])
        cfg.rollout.check()  # before the sub-jobs, which may run for an hour
        return cfg

    cfg = start_job(GRPOConfig, JOB, [a for a in args if not a.startswith(SUB_JOBS)], finish)
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
          f"held-out Pass@1 after SFT {_num(s['pass1_sft'], s['pass1_sft_se'])}, after GRPO "
          f"{_num(s['pass1_grpo'], s['pass1_grpo_se'])} (GRPO - SFT {_num(s['pass1_diff'], s['pass1_diff_se'])}, "
          f"{'>' if s['better'] else 'not >'} 2 paired SE), direct mode after GRPO "
          f"{_num(s['direct_grpo'], s['direct_grpo_se'])}", flush=True)


SUB_JOBS = ("--synth.", "--trajectories.", "--sft.")


def sub_job_configs() -> dict[str, type]:
    """The config class of each sub-job whose overrides GRPOConfig carries (its synth/trajectories/sft dicts)."""
    from osvl.sft.job import SftConfig
    from osvl.synth.expert import TrajConfig
    from osvl.synth.pipeline import SynthConfig

    return {"synth": SynthConfig, "trajectories": TrajConfig, "sft": SftConfig}


def sub_job_overrides(cfg: GRPOConfig, args: list[str]) -> GRPOConfig:
    """``--sft.max_len=1024`` and the like: dotted keys into the sub-jobs' override dicts, each value read
    by the type of that field in the sub-job's config, as every other flag is. Then the dicts as a whole,
    the profile's entries included, are checked against those configs: a wrong key or type fails here,
    at start, with a ``ConfigError`` naming it (``synth.walk.hopz``), not when the sub-job is built."""
    import copy
    import dataclasses

    from osvl.config import merge, parse_value

    classes = sub_job_configs()
    subs = {name: copy.deepcopy(getattr(cfg, name)) for name in classes}
    for arg in args:
        key, _, text = arg[2:].partition("=")
        section, _, dotted = key.partition(".")
        value = parse_value(classes[section], dotted, text, prefix=section + ".")
        *path, last = dotted.split(".")
        node = subs[section]
        for part in path:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[last] = value
    for name, cls in classes.items():
        merge(cls(), subs[name], prefix=name + ".")
    return dataclasses.replace(cfg, **subs)


def _num(x: float | None, se: float | None = None) -> str:
    return "n/a" if x is None else f"{x:.3f}" + (f" ± {se:.3f}" if se is not None and se == se else "")


if __name__ == "__main__":
    cli(main)
