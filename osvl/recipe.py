"""The recipe's stage chaining, in one place: questions -> expert trajectories -> SFT -> GRPO.

Each stage is a job of its own that takes its inputs as paths and knows nothing of the others:
``osvl.synth.job`` (questions), ``osvl.expert.job`` (expert trajectories of given questions),
``osvl.sft.job`` (SFT on given trajectories), ``osvl.rl.job`` (GRPO from given questions and policy).
RL, evaluation and SFT are siblings over the shared training kit (``osvl.train``); only this module
knows the order of the stages and what one hands the next. Every "build or reuse the upstream stage"
goes through it: an identical request resolves to the same config, so it lands in the same run
folder (``osvl.config.run_dir``) and is reused there.

A downstream job carries its upstream stages' configs as typed sections (``GRPOJobConfig.synth``,
``.trajectories``, ``.sft``): each starts from that job's demo profile (as ``python jobs/<job>.py``
would run it), the downstream profile and flags change it, and ``--help`` lists every field. What a
stage receives from the recipe (its run root and seed, the questions folder, the policy's tokenizer,
the offered tools, the search engine) is not set in its section: ``check`` says which key to set instead.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from osvl.agent.trajectory import read_trajectories
from osvl.config import (
    RunConfig,
    merge,
    normalize_args,
    opt,
    parse_args,
    run_dir,
    to_dict,
    upstream_config,
    usage_line,
)
from osvl.errors import ConfigError
from osvl.expert import job as expert
from osvl.logs import start_job
from osvl.models.job import JOB as PRETRAIN_JOB
from osvl.models.job import PretrainConfig
from osvl.models.job import run as run_pretrain
from osvl.models.pretrain import BASE_KIND
from osvl.rl.job import JOB as GRPO_JOB
from osvl.rl.job import GRPOConfig
from osvl.rl.job import run as run_grpo_stage
from osvl.rl.plan import run_check
from osvl.rl.report import Summary, verdict
from osvl.sft import job as sft
from osvl.synth import job as synth_job
from osvl.synth import pipeline

logger = logging.getLogger(__name__)
T = TypeVar("T")
Log = Callable[[str], None]


def demo_profile(cls: type[T], job: str) -> Callable[[], T]:
    """A section's default: job ``job``'s demo profile, what ``python jobs/<job>.py`` runs with no flags."""
    return lambda: parse_args(cls, job, [])


@dataclasses.dataclass
class GRPOJobConfig(GRPOConfig):
    """jobs/grpo.py: build or reuse questions, expert trajectories and the SFT'd policy, then GRPO."""

    synth: synth_job.SynthConfig = opt(
        demo_profile(synth_job.SynthConfig, synth_job.JOB),
        "The synthesize job that makes the questions when `questions` is empty (jobs/synthesize.py's demo profile, "
        "then this profile's entries). Its run section is this job's run.")
    trajectories: expert.TrajConfig = opt(
        demo_profile(expert.TrajConfig, expert.JOB),
        "The expert-trajectories job SFT trains on when `model` is empty (jobs/trajectories.py's demo profile, then "
        "this profile's entries). Set by the recipe, not here: run (this job's), questions (the synthesize run), "
        "model and tiny_kind (sft's), offer (rollout.offer) and text_search (rollout.text_search): the records "
        "must show the environment the policy meets in RL.")
    sft: sft.SftConfig = opt(
        demo_profile(sft.SftConfig, sft.JOB),
        "The SFT job that makes the policy when `model` is empty (jobs/sft.py's demo profile, then this profile's "
        "entries). Set by the recipe: run, data.trajectories and data.heldout.")


def stage_run(run: RunConfig) -> RunConfig:
    """An upstream stage's run section: the downstream root, seed and tracking; its own folder name (the hash)."""
    return dataclasses.replace(run, name="")


def _given(section: str, cfg: Any, default: Any, key: str, instead: str) -> None:
    """A ConfigError if the recipe's input ``key`` of a stage section was set (differs from the stage's demo
    profile): the recipe would overwrite it, so the user is told which key sets it."""
    got, base = cfg, default
    for part in key.split("."):
        got, base = getattr(got, part), getattr(base, part)
    if got != base:
        raise ConfigError(f"{section}.{key} is set by the recipe from {instead}; set that instead")


def check(cfg: GRPOJobConfig) -> None:
    """Fail at start, before any stage runs for an hour, on a stage input set in the wrong place."""
    synth, traj, tuned = (demo_profile(c, j)() for c, j in ((synth_job.SynthConfig, synth_job.JOB),
                                                            (expert.TrajConfig, expert.JOB),
                                                            (sft.SftConfig, sft.JOB)))
    for name, section, default in (("synth", cfg.synth, synth), ("trajectories", cfg.trajectories, traj),
                                   ("sft", cfg.sft, tuned)):
        for key in ("run.seed", "run.name"):
            _given(name, section, default, key, key)
    for key, instead in (("questions", "questions (or the synth section)"), ("model", "sft.model"),
                         ("tiny_kind", "sft.tiny_kind"), ("offer", "rollout.offer"),
                         ("text_search", "rollout.text_search")):
        _given("trajectories", cfg.trajectories, traj, key, instead)
    for key in ("data.trajectories", "data.heldout"):
        _given("sft", cfg.sft, tuned, key, "the trajectories section (or model)")


def questions(run: RunConfig, synth: synth_job.SynthConfig, log: Log = logger.info) -> Path:
    """The synthesize run folder (``<split>.parquet`` + ``images/``), built or reused."""
    qdir, _ = synth_job.run(dataclasses.replace(synth, run=stage_run(run)), log=log)
    return qdir.resolve()  # Ray Train workers and actors run in other folders


def records_config(cfg: GRPOJobConfig, qdir: Path) -> expert.TrajConfig:
    """The trajectories job's config for the records the policy is SFT'd on: the environment the policy will
    meet in RL and evaluation. Every SFT row starts with the system prompt, which lists the offered tools,
    so the records offer ``rollout.offer``; the records' observations must be the ones the rollouts' tools
    return for the same queries, so they search with ``rollout.text_search``; they are rendered with the
    SFT student's tokenizer (``sft.student``)."""
    return merge(dataclasses.replace(cfg.trajectories, run=stage_run(cfg.run), questions=str(qdir),
                                     offer=list(cfg.rollout.offer),
                                     text_search=dataclasses.replace(cfg.rollout.text_search)),
                 sft.student(cfg.sft))


def sft_policy(scfg: sft.SftConfig, tdir: Path, qdir: Path | None, log: Log = logger.info) -> Path:
    """The SFT'd policy's HF folder for trajectories ``tdir`` (format-checked on ``qdir``'s held-out questions),
    reused when that run finished."""
    data = {"trajectories": str(tdir), **({"heldout": str(qdir / "heldout.parquet")} if qdir else {})}
    scfg = merge(scfg, {"data": data})
    done = run_dir(scfg, sft.JOB) / "report.json"
    if done.is_file():
        model = done.parent / "model"  # not the report's absolute path: the folder may be another node's mirror
        log(f"sft: reusing {model}")
        return model.resolve()
    return Path(sft.run(scfg, log=log)["model"]).resolve()


def grpo_inputs(cfg: GRPOJobConfig, log: Log = logger.info) -> tuple[Path, Path | str]:
    """(synthesize run folder, policy HF folder or its location): given, or built or reused. A given model may
    be a directory, a storage URI or a hub id (``model_location``)."""
    qdir = Path(cfg.questions).resolve() if cfg.questions else questions(cfg.run, cfg.synth, log)
    if cfg.model:
        # lazy, (d): transformers takes seconds to import, and a config error at start must not wait for it
        from osvl.models.load import model_location  # noqa: PLC0415
        return qdir, model_location(cfg.model)
    scfg = dataclasses.replace(cfg.sft, run=stage_run(cfg.run))
    tdir, _ = run_trajectories(records_config(cfg, qdir), log)
    return qdir, sft_policy(scfg, tdir, qdir, log)


def run_grpo(cfg: GRPOJobConfig, log: Log = logger.info) -> Summary:
    """jobs/grpo.py: the upstream stages built or reused, then GRPO (``osvl.rl.job.run``); the summary."""
    check(cfg)
    t0 = time.perf_counter()
    qdir, model = grpo_inputs(cfg, log)
    return dataclasses.replace(run_grpo_stage(cfg, qdir, model, log), chain_s=time.perf_counter() - t0)


def run_sft(cfg: sft.SftConfig, log: Log = logger.info) -> dict[str, Any]:
    """jobs/sft.py: with no ``data.trajectories`` (nor ``data.sharegpt``), the demo trajectories job's records,
    rendered with this run's tokenizer, built or reused first."""
    tdir = None
    if not (cfg.data.trajectories or cfg.data.sharegpt):
        tdir, _ = run_trajectories(upstream_config(expert.TrajConfig, expert.JOB, cfg.run, sft.student(cfg)), log)
    return sft.run(cfg, log=log, trajectories=tdir)


def run_trajectories(cfg: expert.TrajConfig, log: Log = logger.info) -> tuple[Path, dict[str, Any]]:
    """jobs/trajectories.py: with no ``questions``, the synthesize job's demo run built or reused first."""
    qdir = None if cfg.questions else questions(cfg.run, demo_profile(synth_job.SynthConfig, synth_job.JOB)(), log)
    return expert.run(cfg, log=log, questions=qdir)


# --help's first lines: the plan flags are the job's own, outside its config (osvl/rl/plan.py)
GRPO_USAGE = (usage_line(GRPO_JOB) + "\n"
              "       python jobs/grpo.py --check[=MODEL_DIR] [--cluster=cluster.yaml] [--gpu_memory_gb=80] "
              "[--profile=...] [--section.key=value ...]\n"
              "  --check: print the run's plan (memory per GPU rank, placement on the cluster's node types, the "
              "rollout environment) for MODEL_DIR's config.json (default: model) and exit 1 on any problem; nothing "
              "starts (docs/gpus.md)")


def grpo_main(argv: list[str] | None = None) -> None:
    """``python jobs/grpo.py``: the plan (``--check``) or the whole chain, ending on ``verdict``'s line."""
    # "--check DIR" and "--check=DIR" name the model; a lone "--check" (read as "--check=true") plans without one
    args = ["--check" if a == "--check=true" else a for a in normalize_args(list(sys.argv[1:] if argv is None
                                                                                 else argv))]
    flags = [a for a in args if a == "--check" or a.startswith(("--check=", "--cluster=", "--gpu_memory_gb="))]
    if any(a.startswith("--check") for a in flags):  # the plan only (osvl/rl/plan.py): nothing starts
        cfg = parse_args(GRPOJobConfig, GRPO_JOB, [a for a in args if a not in flags])
        given = dict(a.removeprefix("--").partition("=")[::2] for a in flags)
        raise SystemExit(run_check(cfg, given.get("check", ""), given.get("cluster") or "cluster.yaml",
                                   float(given.get("gpu_memory_gb") or 80)))

    def finish(cfg: GRPOJobConfig) -> GRPOJobConfig:
        check(cfg)  # before the upstream stages, which may run for an hour
        cfg.rollout.check()
        return cfg

    cfg = start_job(GRPOJobConfig, GRPO_JOB, args, finish, usage=GRPO_USAGE)
    s = run_grpo(cfg)
    # `make demo` runs this job; its last line says whether the whole chain ran (the test greps it)
    label = "demo" if not any(a.startswith("--profile=") and a != "--profile=demo" for a in args) else "grpo"
    ok, line = verdict(label, s, cfg.train.steps, cfg.eval.n_heldout)
    print(line, flush=True)
    if not ok:
        raise SystemExit(1)


# ---------------------------------------------------------------------------
# the tiny policy's pretraining corpus: the demo's data recipe (jobs/pretrain_tiny.py)


def demo_trajectories(run: RunConfig, grpo: GRPOJobConfig, split: str, n: int,
                      synth: dict[str, Any] | None = None) -> tuple[Path, set[str]]:
    """The oracle's trajectories (one rollout each) of the first ``n`` (0: every) questions of ``split`` under the
    data recipe of ``grpo`` (a GRPO profile's config, ``grpo_recipe``: its ``synth`` and ``trajectories``
    sections; ``synth``, when given, is applied to the synthesize job's demo profile instead: a card's record
    of the recipe its policy was made with), built or reused under ``run.root``, and the titles of the held-out
    and dev splits' entities. The committed policy's test rebuilds its probe with it."""
    scfg = grpo.synth if synth is None else upstream_config(synth_job.SynthConfig, synth_job.JOB, run, synth)
    qdir = questions(run, scfg)
    tcfg = dataclasses.replace(grpo.trajectories, run=stage_run(run), questions=str(qdir),
                               offer=list(grpo.rollout.offer), split=split, max_questions=n, n_teacher_rollouts=1,
                               tiny_kind=BASE_KIND)
    # the corpus shows nothing of the entities questions are scored on: held-out, nor dev where settings are tuned
    return expert.run(tcfg)[0] / "trajectories.parquet", pipeline.split_titles(scfg, "heldout", "dev")


def grpo_recipe(grpo_profile: str) -> GRPOJobConfig:
    """The GRPO profile's config: its ``synth`` and ``trajectories`` sections are the demo's data recipe."""
    return parse_args(GRPOJobConfig, GRPO_JOB, [f"--profile={grpo_profile}"])


def recipe_entries(synth: Any) -> dict[str, Any]:
    """The entries of a GRPO profile's synth section that differ from the synthesize job's demo profile (its run
    aside): the data recipe as a card records it, small and free of this machine's paths."""
    def diff(got: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        return {k: (diff(v, base[k]) if isinstance(v, dict) else v) for k, v in got.items()
                if k != "run" and v != base[k]}

    return diff(to_dict(synth), to_dict(demo_profile(synth_job.SynthConfig, synth_job.JOB)()))


def pretrain_main(argv: list[str] | None = None) -> dict:
    """``python jobs/pretrain_tiny.py``: the demo's data recipe built or reused, then the tiny policy pretrained on it
    (``osvl.models.job``), and exported when asked."""
    cfg = start_job(PretrainConfig, PRETRAIN_JOB, argv)
    cfg.check()
    grpo = grpo_recipe(cfg.grpo_profile)
    tpath, held = demo_trajectories(cfg.run, grpo, "sft", 0)
    ppath = None
    if cfg.probe_questions:  # whole held-out trajectories, to read, never to train on
        ppath, _ = demo_trajectories(cfg.run, grpo, "heldout", cfg.probe_questions)
    # read only when the run trains (a finished run is reused without reading its corpus)
    return run_pretrain(cfg, lambda: read_trajectories(tpath), held,
                        lambda: read_trajectories(ppath) if ppath else [],
                        {"trajectories": str(tpath.parent), "synth": recipe_entries(grpo.synth)})
