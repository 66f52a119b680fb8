"""The synthesize job (``jobs/synthesize.py``): its config and ``run``; the pipeline's stages are
``osvl.synth.pipeline``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from osvl import storage
from osvl.cluster import init_ray
from osvl.config import RunConfig, opt, run_dir
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError
from osvl.synth.degrade import UNDO_TOOL
from osvl.synth.difficulty import DifficultyConfig
from osvl.synth.pipeline import ShardWorker, check_same_kg, finalize, plan, run_shards, shard_path
from osvl.synth.walks import Graph
from osvl.tracking import tracked

logger = logging.getLogger(__name__)

JOB = "synthesize"


@dataclass
class WalkOptions:
    hops: list[int] = opt([2, 3, 4], "Hop counts a walk may take.")
    hop_probs: list[float] = opt([0.4, 0.4, 0.2], "Probability of each entry of walk.hops.")
    hub_in_degree: int = opt(300, "Skip entities with more in-links than this (10000 for full Wikipedia; "
                             "300 is about the sample's 99th percentile).")
    max_retries: int = opt(10, "Walk+rewrite retries for one question before giving up on it.")
    max_answer_words: int = opt(6, "Longest answer, in words.")
    entity_answers: bool = opt(True, "A walk may end by asking for the entity its last relation points to (\"the "
                                     "country of ...\", answered with that entity's name and aliases) where that "
                                     "relation has one target; off: every answer is an attribute's value.")


@dataclass
class RewriterOptions:
    kind: Literal["template", "llm"] = opt("template", "template (default, deterministic) or llm (an OpenAI-compatible "
                                                      "endpoint).")
    endpoint: EndpointConfig = opt(EndpointConfig(timeout_s=30.0, max_concurrency=8),
                                   "llm: the chat endpoint (max_concurrency is per synthesis worker).")
    temperature: float = opt(0.7, "llm: sampling temperature.")
    key_case: Literal["lower", "kg"] = opt(
        "lower", "How the question spells the answer key: lower (\"the field of ...\", English) or kg (as the KG "
        "stores it, \"the Field of ...\": the same tokens as the \"Field: ...\" line the answer is read from, for a "
        "policy that copies by token).")


@dataclass
class DegradeOptions:
    share: float = opt(0.1, "Share of questions whose image is degraded.")
    kinds: list[str] = opt(["blur", "downsample", "perspective"], "Degradations drawn uniformly.")


@dataclass
class FilterOptions:
    RENAMED: ClassVar[dict[str, str]] = {"concurrency": "workers"}

    stage: str = opt("", "Difficulty filter stage as module:Class: a Ray Data map_batches callable class, "
                     "constructed with this job's config, taking and returning a pyarrow.Table; empty = no "
                     "filter. osvl.synth.difficulty:DifficultyFilter is osvl's (settings: filter.difficulty).")
    workers: int = opt(1, "Ray Data actors of the filter stage.", hashed=False)
    num_gpus: float = opt(0.0, "GPUs per filter worker.", hashed=False)
    difficulty: DifficultyConfig = opt(DifficultyConfig, "Settings of osvl.synth.difficulty:DifficultyFilter.")


@dataclass
class SynthConfig:
    run: RunConfig = opt(RunConfig, "Run root and global seed.")
    kg_dir: str = opt("", "KG folder (entities/links/anchors Parquet + images/); empty = the committed sample.")
    questions_per_seed: int = opt(100, "Most questions made from one seed entity.")
    attempts_per_seed: int = opt(300, "Most question attempts per seed (each up to walk.max_retries walks).")
    patience: int = opt(30, "Give up on a seed after this many attempts in a row made no new question (a "
                        "seed of a tree-shaped KG has only a few distinct walks; retrying them all "
                        "attempts_per_seed times only finds duplicates).")
    min_grounding_score: float = opt(0.0, "Use only anchors scoring at least this.")
    num_shards: int = opt(16, "Shards (groups of seeds); the unit of parallelism and of resume.")
    workers: int = opt(2, "Ray Data actors synthesizing shards in parallel.", hashed=False)
    role_units: float = opt(0.0, "Units of the 'data' custom resource (osvl.cluster.ROLE_RESOURCES, declared on data "
                                 "nodes by cluster.yaml and deploy/) each worker requests; 0 = none.", hashed=False)
    split_fractions: list[float] = opt([0.6, 0.3, 0.1], "sft/rl/heldout[/dev] share of seeds (so of questions); "
                                                        "a fourth share makes a development split, dev.parquet, "
                                                        "disjoint from heldout (tune on dev, report on heldout).")
    entity_split_fractions: list[float] = opt(
        [0.5, 0.3, 0.2], "sft/rl/heldout[/dev] share of non-seed entities; small splits get a little more room "
        "because their walks run in a thinner subgraph.")
    max_answer_share: float = opt(0.025, "Most questions one answer string may have (share of all).")
    max_seed_share: float = opt(0.08, "Most questions one seed may have (share of all).")
    walk: WalkOptions = opt(WalkOptions, "Random walks.")
    rewriter: RewriterOptions = opt(RewriterOptions, "Question rewriting.")
    degrade: DegradeOptions = opt(DegradeOptions, "Image degradation.")
    filter: FilterOptions = opt(FilterOptions, "Difficulty filter stage slot and osvl's filter's settings.")


def validate(cfg: SynthConfig) -> None:
    w = cfg.walk
    if len(w.hops) != len(w.hop_probs) or not w.hops or min(w.hops) < 1:
        raise ConfigError("walk.hops and walk.hop_probs must be equally long, with hops >= 1")
    if abs(sum(w.hop_probs) - 1) > 1e-6 or min(w.hop_probs) < 0:
        raise ConfigError(f"walk.hop_probs must be non-negative and sum to 1, got {w.hop_probs}")
    for name in ("split_fractions", "entity_split_fractions"):
        f = getattr(cfg, name)
        if len(f) not in (3, 4) or abs(sum(f) - 1) > 1e-6 or min(f) < 0:
            raise ConfigError(f"{name} needs three or four non-negative shares (sft, rl, heldout[, dev]) summing "
                              f"to 1, got {f}")
    if (len(cfg.split_fractions) == 4) != (len(cfg.entity_split_fractions) == 4) or (
            len(cfg.split_fractions) == 4 and (cfg.split_fractions[3] > 0) != (cfg.entity_split_fractions[3] > 0)):
        raise ConfigError("split_fractions and entity_split_fractions must both give dev a share, or neither")
    if not 0 <= cfg.degrade.share <= 1:
        raise ConfigError(f"degrade.share must be in [0, 1], got {cfg.degrade.share}")
    unknown = set(cfg.degrade.kinds) - set(UNDO_TOOL)
    if unknown or (cfg.degrade.share > 0 and not cfg.degrade.kinds):
        raise ConfigError(f"degrade.kinds must be a non-empty subset of {sorted(UNDO_TOOL)}, got {cfg.degrade.kinds}")
    if cfg.rewriter.kind not in ("template", "llm"):
        raise ConfigError(f"rewriter.kind must be template or llm, got {cfg.rewriter.kind!r}")
    if cfg.rewriter.kind == "llm":
        cfg.rewriter.endpoint.check("rewriter.endpoint")
    cfg.filter.difficulty.check()
    if cfg.num_shards < 1 or cfg.workers < 1 or cfg.questions_per_seed < 1 or cfg.patience < 1:
        raise ConfigError("num_shards, workers, questions_per_seed and patience must be >= 1")


@tracked(JOB)
def run(cfg: SynthConfig, *, log: Callable[[str], None] = logger.info) -> tuple[Path, dict[str, Any]]:
    """Synthesize (resuming committed shards), finalize; returns the run folder and the data card."""
    validate(cfg)
    t0 = time.perf_counter()
    out = run_dir(cfg, JOB)
    graph = Graph.load(cfg.kg_dir or None, max_answer_words=cfg.walk.max_answer_words)
    shards = plan(graph, cfg)[0]
    n_seeds = sum(len(s) for s in shards)
    if n_seeds == 0:
        raise ConfigError(f"the KG at {graph.root} has no seed entity (no anchor scoring >= "
                          f"{cfg.min_grounding_score}); nothing to synthesize")
    check_same_kg(graph, out / "shards")
    todo = [k for k in range(cfg.num_shards) if not shard_path(out / "shards", k).exists()]
    log(f"synthesize: {len(graph.entities)} entities, {n_seeds} seeds in {cfg.num_shards} shards; "
        f"{cfg.num_shards - len(todo)} already done, {len(todo)} to run with {cfg.workers} workers -> {out}")
    del graph, shards  # the workers map their own; the driver keeps no share of the pages they touch
    if todo:
        init_ray()
        run_shards(ShardWorker, {"cfg": cfg, "out_dir": storage.location(out), "job": JOB}, todo, cfg.num_shards,
                   workers=cfg.workers, role_units=cfg.role_units, desc=JOB,
                   line=lambda row: f"{int(row['questions'])} questions in {float(row['seconds']):.1f} s", log=log)
        storage.refresh(out)  # shards the workers on other nodes published
    card = finalize(cfg, out, cfg.num_shards, time.perf_counter() - t0, n_seeds, JOB)
    storage.publish(out)
    log(f"synthesize: {card['questions']} questions {card['splits']} in {card['seconds']} s -> {out}")
    return out, card
