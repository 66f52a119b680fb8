"""The four GRPO modes compared: same SFT'd model, same questions, same steps, N seeds each.

Every run is the GRPO job's own machinery (``osvl.recipe.grpo_inputs`` builds or reuses the
questions and the SFT'd model once, as ``jobs/grpo.py`` does; ``train`` runs each mode and
seed; ``pass_at_1`` scores the held-out questions greedily), so the modes share one
environment (rollout budgets, fatal rule, reward and judges, buffer) and differ only in
``rl.mode`` (docs/training.md, "Fatal-aware asynchronous GRPO"). Seed s is the same for every mode: the
same question order and sampling seeds, and the model they all start from is the one the
demo's seed builds.

Per mode, over seeds (mean and standard error; a single seed has no error):

- ``reward_last10``: mean reward of the last 10 learner steps;
- ``pass1``: held-out Pass@1 (greedy, rule judge) after GRPO, beside the SFT model's (``pass1_sft``,
  measured once: greedy, so the same for every mode and seed);
- ``fatal_rate``: mean share of fatal trajectories per step;
- ``fatal_positive``: of the fatal trajectories with a non-zero advantage, the share whose advantage
  was positive (before any clamp: counted in every mode, docs/training.md's "clamp split").

Against ``vanilla`` (``vs_vanilla``, when it ran): each mode's paired difference per seed with a t-based
95% interval (``osvl.rl.report.paired_interval``: seed s of two modes shares its questions, sampling
seeds and outages), and for Pass@1 a question-level bootstrap interval of the same difference (2,000
resamples of the held-out questions, the seeds' differences averaged in each): the seed interval leaves
out the error of having these questions, the bootstrap the error of these seeds.

``--outages=RATE`` turns on the rollouts' seeded tool outages (``rollout.outages``, osvl/tools/outages.py:
an episode meets one with probability RATE, 3 turns of every tool failing ``unavailable``); seed s
meets the same outages in every mode. Held-out Pass@1 is measured without them.

    .venv/bin/python bench/ablation.py [--steps=25] [--seeds=3] [--modes=vanilla,fatal_mask_clamp]
                                       [--outages=0.3] [--scripted] [--section.key=value ...]

The outage run docs/measurements.md reports ("The four modes with tool outages") was fixed in this
docstring and committed before it ran, after ``make demo`` in the same clone (so ``grpo_inputs`` reuses the
demo's SFT'd policy): the demo profile as committed (no planted teacher behaviour, the process filter on),
outages at the controlled experiment's rate, 5 seeds, 15 steps and 200 held-out questions so that the 20
runs fit 150 minutes on the 2 cores::

    .venv/bin/python bench/ablation.py --outages=0.3 --seeds=5 --steps=15 --eval.n_heldout=200

(First committed with 20 steps. That run, started 2026-12-07, was stopped after three runs of seed 0: with
outages on, a 20-step run took 496-698 s, partly beside other work, so the 20 runs would not have fitted 150
minutes. The 15 steps come from those times. Those three runs' figures were printed and read; no other seed
ran.)

25 steps by default, not the demo's 40: 12 runs of 40 steps do not fit the 120 minutes the
benchmark is given on a 2-core machine (docs/measurements.md has the timings).

``--scripted`` starts from the tiny agent checkpoint of ``osvl.agent.scripted`` on its own picture
questions (no data or SFT to build: the smoke run); other flags are the GRPO job's (``jobs/grpo.py
--help``), e.g. ``--eval.n_heldout=100``. Writes ``ablation_rewards.png`` (reward per step, mean ±
SE per mode) into the run root's ``ablation/`` folder. Last stdout line: JSON with every figure and
``ratio`` = Pass@1 of ``fatal_mask_clamp`` over ``vanilla`` (null, with a note, when vanilla's is 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from osvl.agent.scripted import question_folder, tiny_agent_checkpoint  # noqa: E402
from osvl.cluster import init_ray  # noqa: E402
from osvl.config import parse_args, run_dir, script_flags  # noqa: E402
from osvl.plots import reward_curves  # noqa: E402
from osvl.recipe import GRPOJobConfig, grpo_inputs  # noqa: E402
from osvl.rl.job import JOB  # noqa: E402
from osvl.rl.report import paired_interval, summarize  # noqa: E402
from osvl.rl.rollout import heldout_scores  # noqa: E402
from osvl.rl.trainer import GRPOParts, heldout_questions, read_questions, train  # noqa: E402

MODES = ("vanilla", "hard_mask", "fatal_mask", "fatal_mask_clamp")


def mean_se(xs: list[float]) -> dict[str, float | None]:
    xs = [x for x in xs if x == x]  # a seed without a figure (nan) is left out
    if not xs:
        return {"mean": None, "se": None, "n": 0}
    m = sum(xs) / len(xs)
    se = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5 if len(xs) > 1 else None
    return {"mean": m, "se": se, "n": len(xs)}


def one_run(cfg, mode: str, seed: int, model: Path, qdir: Path, questions: list[dict], heldout: list[dict],
            root: Path) -> dict:
    run = dataclasses.replace(cfg.run, seed=seed)
    rl = dataclasses.replace(cfg.rl, mode=mode)
    parts = GRPOParts(run=run, rl=rl, rollout=cfg.rollout, learner=cfg.learner, train=cfg.train)
    out = root / f"{mode}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = train(parts, model, questions, qdir / "images", out, log=lambda m: None, job=JOB)
    s = summarize(res["rows"])
    pass1, scores = float("nan"), []
    if heldout and res["checkpoint"]:
        scores = heldout_scores(Path(res["checkpoint"]) / "hf", heldout, qdir / "images", cfg.rollout,
                                cfg.eval.concurrency, workers=cfg.eval.workers)["agentic"]
        pass1 = statistics.fmean(scores)
    split = s.clamped + s.kept_positive
    return {"mode": mode, "seed": seed, "rewards": [r["reward"] for r in res["rows"]], "reward_last10": s.last_mean,
            "pass1": pass1, "scores": scores, "fatal_rate": s.fatal_rate,
            "fatal_positive": s.kept_positive / split if split else float("nan"),
            "dropped": res["buffer"]["dropped"], "seconds": time.perf_counter() - t0}


def main() -> None:
    flag, job_args = script_flags(sys.argv[1:], {"steps": 25, "seeds": 3, "modes": ",".join(MODES),
                                                 "outages": 0.0, "scripted": False}, rest=True)
    steps, seeds, modes = flag["steps"], flag["seeds"], flag["modes"].split(",")
    tmp = tempfile.TemporaryDirectory(prefix="osvl-bench-ablation-")
    extra = [f"--train.steps={steps}", "--train.ckpt_every=100000", f"--rollout.outages.rate={flag['outages']}"]
    if flag["scripted"]:
        qdir = Path(tmp.name) / "questions"
        schemas = question_folder(qdir) / "schemas.json"
        extra += [f"--questions={qdir}", f"--model={tiny_agent_checkpoint()}", "--rollout.offer=crop,text_search",
                  f"--rollout.schemas={schemas}", "--rollout.agent.max_turns=3", "--rollout.agent.max_new_tokens=64",
                  "--rollout.agent.max_episode_tokens=2048", "--rl.group_size=2"]
    cfg = parse_args(GRPOJobConfig, JOB, extra + job_args)
    cfg.rollout.check()
    init_ray(num_cpus=max(3, int(cfg.rollout.workers * cfg.rollout.cpus_per_worker) + 2))
    qdir, model = grpo_inputs(cfg, log=lambda m: print(m, flush=True))  # built once, reused by every mode and seed
    questions = sorted(read_questions(qdir / "rl.parquet"), key=lambda r: r["id"])
    if cfg.max_questions:
        questions = questions[:cfg.max_questions]
    heldout = heldout_questions(qdir / "heldout.parquet", cfg.eval.n_heldout)
    out = run_dir(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name="")), "ablation")
    pass1_sft = None
    if heldout:
        scores = heldout_scores(model, heldout, qdir / "images", cfg.rollout, cfg.eval.concurrency,
                                workers=cfg.eval.workers)["agentic"]
        pass1_sft = statistics.fmean(scores)
    print(f"ablation: {len(modes)} modes x {seeds} seeds x {steps} steps, {len(questions)} RL questions, "
          f"{len(heldout)} held-out; policy {model}; held-out Pass@1 after SFT {pass1_sft}", flush=True)
    runs = []
    for seed in range(seeds):
        for mode in modes:
            r = one_run(cfg, mode, seed, model, qdir, questions, heldout, Path(tmp.name) / "runs")
            runs.append(r)
            print(f"  {mode:17s} seed {seed}: reward last 10 {r['reward_last10']:.4f}, Pass@1 {r['pass1']:.3f}, "
                  f"fatal rate {r['fatal_rate']:.3f}, fatal with A>0 {r['fatal_positive']:.3f}, "
                  f"{r['dropped']} groups dropped, {r['seconds']:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    table = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        table[mode] = {k: mean_se([r[k] for r in mine])
                       for k in ("reward_last10", "pass1", "fatal_rate", "fatal_positive")}
        row = ", ".join(f"{k} {_fmt(v)}" for k, v in table[mode].items())
        print(f"{mode:17s} {row}", flush=True)
    if "vanilla" in modes:
        for mode in modes:
            if mode != "vanilla":
                table[mode]["vs_vanilla"] = versus(runs, mode, "vanilla")
                print(f"{mode:17s} - vanilla: {json.dumps(table[mode]['vs_vanilla'])}", flush=True)
    png = reward_curves({m: [r["rewards"] for r in runs if r["mode"] == m] for m in modes},
                        out / "ablation_rewards.png", title=f"GRPO reward per step ({seeds} seeds per mode)")
    print(f"reward curves: {png}", flush=True)
    van = table.get("vanilla", {}).get("pass1", {}).get("mean")
    clamp = table.get("fatal_mask_clamp", {}).get("pass1", {}).get("mean")
    ratio, note = None, ""
    if van is None or clamp is None:
        note = "ratio needs held-out Pass@1 of both vanilla and fatal_mask_clamp"
    elif van == 0:
        note = f"vanilla's held-out Pass@1 is 0 (fatal_mask_clamp's: {clamp:.3f}): the ratio is undefined"
    else:
        ratio = round(clamp / van, 3)
    tmp.cleanup()
    print(json.dumps({"ratio": ratio, "note": note, "steps": steps, "seeds": seeds, "outages": flag["outages"],
                      "pass1_sft": pass1_sft,
                      "heldout": len(heldout), "modes": table, "png": str(png), "load": os.getloadavg()[0]}))


def versus(runs: list[dict], mode: str, base: str, resamples: int = 2000) -> dict:
    """``mode`` - ``base`` paired by seed (t interval), and Pass@1's question-level bootstrap interval."""
    by_seed = {r["seed"]: r for r in runs if r["mode"] == base}
    pairs = [(r, by_seed[r["seed"]]) for r in runs if r["mode"] == mode and r["seed"] in by_seed]
    out = {k: paired_interval([a[k] for a, _ in pairs], [b[k] for _, b in pairs]) for k in ("reward_last10", "pass1")}
    diffs = np.array([np.asarray(a["scores"], float) - np.asarray(b["scores"], float) for a, b in pairs
                      if a["scores"] and len(a["scores"]) == len(b["scores"])])
    if len(diffs):
        rng = np.random.default_rng(0)
        boot = [diffs[:, rng.integers(0, diffs.shape[1], diffs.shape[1])].mean() for _ in range(resamples)]
        out["pass1_bootstrap"] = {"diff": float(diffs.mean()), "lo": float(np.percentile(boot, 2.5)),
                                  "hi": float(np.percentile(boot, 97.5)), "questions": int(diffs.shape[1])}
    return out


def _fmt(v: dict) -> str:
    if v["mean"] is None:
        return "n/a"
    return f"{v['mean']:.4f}" + (f" ± {v['se']:.4f}" if v["se"] is not None else " (1 seed)")


if __name__ == "__main__":
    main()
