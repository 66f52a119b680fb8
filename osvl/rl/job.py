"""The GRPO stage of ``jobs/grpo.py``: GRPO (``osvl.rl.trainer.train``) from given questions and policy, with
greedy held-out Pass@1 after SFT and after GRPO and the summary (``osvl.rl.report``).

Where the questions and the SFT'd policy come from (built or reused upstream stages) is the recipe's
business (``osvl.recipe``): this module knows nothing of synthesis, trajectories or SFT.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osvl.config import RunConfig, opt, run_dir
from osvl.logs import Progress
from osvl.plots import pass_at_1_bars
from osvl.rl import checkpoint as ckpt
from osvl.rl.learner import RLConfig
from osvl.rl.report import HEADER, Summary, format_row, heldout_report, summarize, summary_lines
from osvl.rl.rollout import RolloutConfig, heldout_scores
from osvl.rl.trainer import (
    GRPOParts,
    LearnerConfig,
    TrainConfig,
    heldout_questions,
    read_questions,
    start_cluster,
    train,
)
from osvl.storage import publish
from osvl.tracking import tracked

logger = logging.getLogger(__name__)

JOB = "grpo"

EVAL_MODES = ("agentic", "direct")  # direct: one turn, no tools (what the policy knows without searching)


@dataclass
class EvalConfig:
    n_heldout: int = opt(50, "Held-out questions for greedy Pass@1 after SFT and after GRPO (0 skips it), dealt "
                             "round-robin over seed entities (osvl.rl.trainer.heldout_questions).")
    concurrency: int = opt(16, "Evaluation episodes in flight, per worker.", hashed=False)
    workers: int = opt(0, "Evaluation tasks side by side, each with one rollout actor's resources and a contiguous "
                          "share of the questions; 0 = rollout.workers (no actor rolls out while held-out "
                          "questions are scored, so their resources are free).", hashed=False)


@dataclass
class GRPOConfig:
    """jobs/grpo.py: build or reuse questions, expert trajectories and the SFT'd model, then GRPO."""

    run: RunConfig = opt(RunConfig, "Run root and global seed.")
    questions: str = opt("", "Synthesize run folder (rl/heldout.parquet + images/); empty = jobs/grpo.py builds or "
                             "reuses the synthesize job's run of its synth section (osvl.recipe).")
    model: str = opt("", "Policy to start from: an HF directory, a storage URI (s3://..., each node pulls its copy) "
                         "or a hub id in the local Hugging Face cache; empty = jobs/grpo.py builds or reuses expert "
                         "trajectories (trajectories section) and SFT (sft section) first (osvl.recipe).")
    max_questions: int = opt(0, "RL questions used (the first by id); 0 = all of rl.parquet.")
    rl: RLConfig = opt(RLConfig, "Fatal-aware GRPO knobs.")
    rollout: RolloutConfig = opt(RolloutConfig, "Rollout actors and agent budgets.")
    learner: LearnerConfig = opt(LearnerConfig, "Learner workers.")
    train: TrainConfig = opt(TrainConfig, "Steps, batch and staleness.")
    eval: EvalConfig = opt(EvalConfig, "Held-out Pass@1.")


@tracked(JOB)
def run(cfg: GRPOConfig, qdir: Path, model: Path | str, log: Callable[[str], None] = logger.info) -> Summary:
    """GRPO from the policy ``model`` on the questions of synthesize run ``qdir`` (``osvl.recipe.grpo_inputs``
    resolves both); prints a per-step table and a final summary, returns the summary. ``cfg`` names the run
    folder: the recipe passes its whole config, upstream sections included, so another recipe is another run."""
    t0 = time.perf_counter()
    questions = sorted(read_questions(qdir / "rl.parquet"), key=lambda r: r["id"])
    if cfg.max_questions:
        questions = questions[:cfg.max_questions]
    heldout = heldout_questions(qdir / "heldout.parquet", cfg.eval.n_heldout)
    out = run_dir(cfg, JOB).resolve()
    start_cluster(cfg.rollout, cfg.learner)  # the evaluations run on the cluster too
    log(f"grpo: mode {cfg.rl.mode}, {cfg.train.steps} steps x {cfg.train.groups_per_step} groups x G="
        f"{cfg.rl.group_size}, max_staleness {cfg.train.max_staleness}, {len(questions)} RL questions, "
        f"policy {model} -> {out}")
    before = None
    sft_eval = out / "pass1_sft.json"  # kept, so that a resumed run still reports it
    if heldout and sft_eval.is_file():
        before = json.loads(sft_eval.read_text()).get("scores")  # None: a run folder of an older version
    elif heldout and not (out / "checkpoints").is_dir():
        before = heldout_scores(model, heldout, qdir / "images", cfg.rollout, cfg.eval.concurrency, EVAL_MODES,
                                cfg.eval.workers)
        agentic, direct = (sum(before[m]) / len(heldout) for m in EVAL_MODES)
        log(f"grpo: held-out Pass@1 after SFT (greedy, {len(heldout)} questions): {agentic:.3f} "
            f"(direct, no tools: {direct:.3f})")
        sft_eval.write_text(json.dumps({"scores": before}))
        publish(out, sft_eval.name)
    parts = GRPOParts(run=cfg.run, rl=cfg.rl, rollout=cfg.rollout, learner=cfg.learner, train=cfg.train)
    log(HEADER)
    done = ckpt.latest(out / "checkpoints")  # a resumed run's bar starts at its checkpoint's step
    with Progress(cfg.train.steps, "grpo", "steps", initial=int(done.name.removeprefix(ckpt.PREFIX)) if done else 0
                  ) as bar:
        def show(row: dict[str, Any]) -> None:
            log(format_row(row))
            bar.update(1, reward=row["reward"], fatal=row["fatal_rate"])

        res = train(parts, model, questions, qdir / "images", out, log=log, print_row=show, job=JOB)
    summary = summarize(res["rows"])
    after = None
    grpo_eval = out / "pass1_grpo.json"  # of one checkpoint: a resubmitted finished run does not score it again
    if heldout and res["checkpoint"]:
        name = Path(res["checkpoint"]).name
        kept = json.loads(grpo_eval.read_text()) if grpo_eval.is_file() else {}
        if kept.get("checkpoint") == name and "scores" in kept:
            after = kept["scores"]
        else:
            after = heldout_scores(Path(res["checkpoint"]) / "hf", heldout, qdir / "images", cfg.rollout,
                                   cfg.eval.concurrency, EVAL_MODES, cfg.eval.workers)
            grpo_eval.write_text(json.dumps({"checkpoint": name, "scores": after}))
    held = heldout_report(heldout, before, after)
    if before or after:  # the held-out figures as bars beside the curves (the README's picture of the demo)
        pass_at_1_bars({label: {"agentic": held[f"pass1_{side}"], "direct": held[f"direct_{side}"]}
                        for label, side in (("after SFT", "sft"), ("after GRPO", "grpo"))
                        if held[f"pass1_{side}"] is not None},
                       out / "pass_at_1.png", title=f"Held-out Pass@1 ({len(heldout)} questions, greedy)")
    st = res["buffer"]
    summary = dataclasses.replace(
        summary, **held, seconds=time.perf_counter() - t0, train_s=res["seconds"], issued=st["issued_total"],
        consumed=st["consumed"], dropped=st["dropped"], resampled=st["resampled"], restarts=res["restarts"],
        resumed_from=res["resumed_from"], mode=cfg.rl.mode, out=str(out))
    for line in summary_lines(summary, st, res["events"]):
        log(line)
    (out / "report.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1, default=str))
    publish(out)
    return summary
