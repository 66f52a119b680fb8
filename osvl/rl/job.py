"""``jobs/grpo.py``: build or reuse questions, expert trajectories and the SFT'd model, then GRPO.

The pipeline DAG: synthesize -> trajectories -> SFT -> GRPO (``osvl.rl.trainer.train``), each
upstream job built or reused in its own run folder (``osvl.config.upstream_config``), with greedy
held-out Pass@1 after SFT and after GRPO and the summary (``osvl.rl.report``).
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

from osvl.config import RunConfig, opt
from osvl.errors import ConfigError
from osvl.logs import Progress
from osvl.plots import pass_at_1_bars
from osvl.rl import checkpoint as ckpt
from osvl.rl.learner import RLConfig
from osvl.rl.loss import MODES
from osvl.rl.report import HEADER, format_row, held_line, heldout_report, summarize
from osvl.rl.rollout import RolloutConfig
from osvl.rl.trainer import (
    JOB,
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


EVAL_MODES = ("agentic", "direct")  # direct: one turn, no tools (what the policy knows without searching)


@dataclass
class EvalConfig:
    n_heldout: int = opt(50, "Held-out questions for greedy Pass@1 after SFT and after GRPO (0 skips it), dealt "
                             "round-robin over seed entities (osvl.rl.trainer.heldout_questions).")
    concurrency: int = opt(16, "Evaluation episodes in flight, per worker.", hashed=False)
    workers: int = opt(0, "Evaluation tasks side by side, each with one rollout actor's resources and a contiguous "
                          "share of the questions; 0 = rollout.num_actors (no actor rolls out while held-out "
                          "questions are scored, so their resources are free).", hashed=False)


@dataclass
class GRPOConfig:
    """jobs/grpo.py: build or reuse questions, expert trajectories and the SFT'd model, then GRPO."""

    run: RunConfig = opt(RunConfig, "Run root and global seed.")
    questions: str = opt("", "Synthesize run folder (rl/heldout.parquet + images/); empty = build or reuse the "
                             "synthesize job's run with the synth section below.")
    model: str = opt("", "Policy to start from: an HF directory, a storage URI (s3://..., each node pulls its copy) "
                         "or a hub id in the local Hugging Face cache; empty = build or reuse expert trajectories "
                         "(trajectories section) and SFT (sft section) first.")
    max_questions: int = opt(0, "RL questions used (the first by id); 0 = all of rl.parquet.")
    synth: dict[str, Any] = opt({}, "Overrides of the synthesize job's config (same keys as jobs/synthesize.py).")
    trajectories: dict[str, Any] = opt({}, "Overrides of the trajectories job's config (keys of jobs/trajectories.py).")
    sft: dict[str, Any] = opt({}, "Overrides of the SFT job's config (same keys as jobs/sft.py).")
    rl: RLConfig = opt(RLConfig, "Fatal-aware GRPO knobs.")
    rollout: RolloutConfig = opt(RolloutConfig, "Rollout actors and agent budgets.")
    learner: LearnerConfig = opt(LearnerConfig, "Learner workers.")
    train: TrainConfig = opt(TrainConfig, "Steps, batch and staleness.")
    eval: EvalConfig = opt(EvalConfig, "Held-out Pass@1.")


def prepare(cfg: GRPOConfig, log: Callable[[str], None] = logger.info) -> tuple[Path, Path | str]:
    """(synthesize run folder, policy HF folder or its location): given, or built/reused by the other jobs' library
    functions. A given model may be a directory, a storage URI or a hub id (``model_location``)."""
    from osvl.config import upstream_config
    from osvl.synth import pipeline

    if cfg.questions:
        qdir = Path(cfg.questions)
    else:
        qdir, _ = pipeline.run(upstream_config(pipeline.SynthConfig, pipeline.JOB, cfg.run, cfg.synth), log=log)
    qdir = qdir.resolve()  # Ray Train workers and actors run in other folders
    if cfg.model:
        from osvl.models.load import model_location  # here: transformers takes seconds to import, and a config
        #                                              error at start must not wait for it
        return qdir, model_location(cfg.model)
    from osvl.sft import job as sft
    from osvl.synth import expert

    scfg = upstream_config(sft.SftConfig, sft.JOB, cfg.run, cfg.sft)
    tcfg = records_config(cfg, qdir, scfg)
    tdir, _ = expert.run(tcfg, log=log)
    scfg = merge_data(scfg, tdir, qdir)
    from osvl.config import run_dir

    done = run_dir(scfg, sft.JOB) / "report.json"
    if done.is_file():
        model = done.parent / "model"  # not the report's absolute path: the folder may be another node's mirror
        log(f"sft: reusing {model}")
        return qdir, model.resolve()
    return qdir, Path(sft.run(scfg, log=log)["model"]).resolve()


def records_config(cfg: GRPOConfig, qdir: Path, scfg: Any) -> Any:
    """The trajectories job's config for the records the policy is SFT'd on: the environment the policy will
    meet in RL and evaluation. Every SFT row starts with the system prompt, which lists the offered tools,
    so the records offer ``rollout.offer``; the records' observations must be the ones the rollouts' tools
    return for the same queries, so they search with ``rollout.text_search``."""
    from osvl.config import upstream_config
    from osvl.sft import job as sft
    from osvl.synth import expert

    if "text_search" in cfg.trajectories.get("tools", {}):
        raise ConfigError("set rollout.text_search, not trajectories.tools.text_search: the records and the "
                          "rollouts must show one search engine, so the GRPO job hands the rollouts' to its records")
    tcfg = upstream_config(expert.TrajConfig, expert.JOB, cfg.run,
                           {"questions": str(qdir), "offer": list(cfg.rollout.offer), **sft.student(scfg),
                            **cfg.trajectories})
    tcfg.tools.text_search = dataclasses.replace(cfg.rollout.text_search)
    return tcfg


def merge_data(scfg: Any, tdir: Path, qdir: Path) -> Any:
    from osvl.config import merge

    return merge(scfg, {"data": {"trajectories": str(tdir), "heldout": str(qdir / "heldout.parquet")}})


@tracked(JOB)
def run(cfg: GRPOConfig, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """The whole job (see GRPOConfig); prints a per-step table and a final summary, returns the summary."""
    from osvl.config import run_dir
    from osvl.rl.rollout import heldout_scores

    t0 = time.perf_counter()
    qdir, model = prepare(cfg, log)
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

        res = train(parts, model, questions, qdir / "images", out, log=log, print_row=show)
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
    summary.update(held, seconds=time.perf_counter() - t0, train_s=res["seconds"],
                   issued=st["issued_total"], consumed=st["consumed"], dropped=st["dropped"], resampled=st["resampled"],
                   restarts=res["restarts"], resumed_from=res["resumed_from"], mode=cfg.rl.mode, out=str(out))
    drops = [e for e in res["events"] if e.startswith("dropped")]
    log(f"\ngrpo summary ({cfg.rl.mode}): {summary['steps']} steps in {res['seconds']:.0f} s "
        f"({3600 * summary['steps'] / max(res['seconds'], 1e-9):.0f} steps/hour)")
    log(f"  mean reward, first 10 steps: {summary['first_mean']:.4f} ± {summary['first_se']:.4f} (SE); "
        f"last 10: {summary['last_mean']:.4f} ± {summary['last_se']:.4f}; "
        f"{'higher by more than 2 SE' if summary['improved'] else 'NOT higher by more than 2 SE'}")
    clamps = MODES[cfg.rl.mode].clamp_fatal
    applied = "" if clamps else f" ({cfg.rl.mode} does not clamp)"
    log(f"  clamp split{applied}: of {summary['clamped'] + summary['kept_positive']} fatal trajectories with a "
        f"non-zero advantage, {summary['clamped']} negative{' -> clamped to 0' if clamps else ''}, "
        f"{summary['kept_positive']} positive kept"
        + (f" ({summary['clamped_share']:.1%} / {1 - summary['clamped_share']:.1%})"
           if summary["clamped"] + summary["kept_positive"] else "")
        + f"; mean fatal rate {summary['fatal_rate']:.2f}")
    log(f"  groups: {st['issued_total']} issued, {st['consumed']} trained, {st['dropped']} dropped, "
        f"{st['resampled']} flat ones re-drawn"
        + (f" ({'; '.join(drops[:3])})" if drops else "") + f"; staleness of trained groups {st['staleness']}; "
        f"{len(res['restarts'])} rollout-actor restarts; {summary['skipped']} non-finite steps skipped")
    log(held_line(held))
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    publish(out)
    return summary
