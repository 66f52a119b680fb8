"""The trajectories job (``jobs/trajectories.py``): its config and ``run``; the teacher's rollouts, the
filters, the shards and the run folder's layout are ``osvl.expert.rollouts``'.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from osvl import storage
from osvl.agent.loop import AgentConfig
from osvl.agent.reward import RewardConfig
from osvl.agent.teacher import OracleConfig
from osvl.cluster import init_ray
from osvl.config import RunConfig, opt, run_dir
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError, DataError
from osvl.expert.rollouts import ShardWorker, load_questions, merge_shards, report
from osvl.models.tiny import TinyKind, checkpoint_name
from osvl.synth import pipeline
from osvl.synth.walks import Split
from osvl.tools.cache import CacheMode
from osvl.tools.outages import OutageConfig
from osvl.tools.text_search import TextSearchConfig
from osvl.tracking import tracked

logger = logging.getLogger(__name__)

JOB = "trajectories"
Teacher = Literal["oracle", "openai"]
TEACHERS = get_args(Teacher)


@dataclass
class TeacherOptions:
    kind: Teacher = opt("oracle", "Teacher: the offline path oracle, or a chat model at the endpoint.")
    oracle: OracleConfig = opt(OracleConfig, "The offline path-oracle teacher.")
    endpoint: EndpointConfig = opt(EndpointConfig, "openai teacher: the chat model's endpoint.")


@dataclass
class ToolOptions:
    cache: CacheMode = opt("replay", "Tool record/replay cache mode (osvl.tools.cache): the rollouts of one question "
                               "run one after another, so the later ones replay the first one's image search.",
                     hashed=False)
    cache_dir: str = opt("", "Tool-cache recordings folder; empty = <OSVL_CACHE or run root>/cache/tool_calls.",
                         hashed=False)
    outages: OutageConfig = opt(OutageConfig, "Seeded tool outages (osvl/tools/outages.py); off by default. Records "
                                "with an injected failure show how the teacher recovers, or die as the policy's would.")


def _agent_defaults() -> AgentConfig:
    # a 4-hop question needs restore + image search + 4 hops + answer lookup + response = 8 turns
    # without a single retry; teacher turns are short, tool answers are not
    return AgentConfig(max_turns=16, max_new_tokens=512, max_episode_tokens=8192)


@dataclass
class TrajConfig:
    run: RunConfig = opt(RunConfig, "Run root and global seed.")
    questions: str = opt("", "Synthesize run folder with <split>.parquet and images/; empty = the synthesize "
                             "job's default profile (built, or reused when it exists).")
    split: Split = opt("sft", "Which split's questions to answer.")
    max_questions: int = opt(0, "Answer at most this many questions (the first by id); 0 = all.")
    model: str = opt("", "Student checkpoint whose tokenizer and processor render the records; empty = the "
                         "tiny model of tiny_kind.")
    tiny_kind: TinyKind = opt("qwen3_vl", "osvl.models.tiny kind whose tokenizer renders the records when model is "
                                     "empty (the SFT job passes its own).", hash_as=checkpoint_name)
    offer: list[str] = opt([], "Tools offered to the teacher, by name (rendered in every record's system prompt, "
                               "so the policy trained on the records must be offered the same); empty = all.")
    n_teacher_rollouts: int = opt(2, "Teacher episodes per question.")
    keep_per_question: int = opt(1, "Most filtered trajectories kept per question.")
    min_r_query: float = opt(0.5, "Process-judge filter: keep rollouts with r_query >= this.")
    teacher: TeacherOptions = opt(TeacherOptions, "Which teacher writes the turns.")
    agent: AgentConfig = field(default_factory=_agent_defaults,
                               metadata={"doc": "Episode budgets (recorded in every trajectory).", "hashed": True})
    reward: RewardConfig = opt(RewardConfig, "Answer judge and r_query scorer.")
    judge: EndpointConfig = opt(EndpointConfig, "Endpoint of the LLM answer/process judge (when reward asks).")
    judge_cache: bool = opt(True, "Keep LLM verdicts in <run>/judge_cache.jsonl (reused by reruns).", hashed=False)
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings: the search engine the records show, which the policy's rollouts "
        "and evaluation must use too (the GRPO job passes its rollout.text_search here).")
    tools: ToolOptions = opt(ToolOptions, "Tool-environment settings.")
    shard_size: int = opt(100, "Questions per shard (the unit of resume).")
    workers: int = opt(2, "Ray actors running shards in parallel.", hashed=False)
    role_units: float = opt(0.0, "Units of the 'data' custom resource (osvl.cluster.ROLE_RESOURCES, declared on data "
                                 "nodes by cluster.yaml and deploy/) each worker requests; 0 = none.", hashed=False)
    concurrency: int = opt(16, "Episodes in flight per actor.", hashed=False)


def validate(cfg: TrajConfig) -> None:
    if cfg.teacher.kind not in TEACHERS:
        raise ConfigError(f"teacher.kind must be one of {TEACHERS}, got {cfg.teacher.kind!r}")
    if cfg.teacher.kind == "openai" and not (cfg.teacher.endpoint.base_url and cfg.teacher.endpoint.model):
        raise ConfigError("teacher.kind=openai needs teacher.endpoint.base_url and teacher.endpoint.model")
    if cfg.n_teacher_rollouts < 1 or cfg.keep_per_question < 1 or cfg.shard_size < 1 or cfg.workers < 1:
        raise ConfigError("n_teacher_rollouts, keep_per_question, shard_size and workers must be >= 1")
    cfg.reward.check()
    cfg.agent.check()
    cfg.teacher.oracle.recall_pattern()
    if cfg.reward.uses_llm():  # an LLM judge (reward.judge / reward.query_scorer) needs its endpoint
        cfg.judge.check("judge")


def questions_dir(cfg: TrajConfig, questions: Path | None) -> Path:
    """The synthesize run to read: ``cfg.questions``, else ``questions`` (the one the recipe built or reused:
    ``osvl.recipe.run_trajectories``; given apart, so that the run's hash is the config's as written)."""
    path = Path(cfg.questions) if cfg.questions else questions
    if path is None:
        raise ConfigError("questions is empty: name a synthesize run folder (jobs/trajectories.py builds the demo "
                          "one: osvl.recipe.run_trajectories)")
    if not (path / f"{cfg.split}.parquet").is_file():
        raise DataError(f"{path} has no {cfg.split}.parquet (run jobs/synthesize.py first)")
    return path


@tracked(JOB)
def run(cfg: TrajConfig, *, log: Callable[[str], None] = logger.info,
        questions: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Answer the split's questions (``cfg.questions``, else ``questions``) with the teacher, filter, keep, write
    (resuming shards)."""
    validate(cfg)
    t0 = time.perf_counter()
    qdir = questions_dir(cfg, questions)
    out = run_dir(cfg, JOB)
    n_questions = len(load_questions(qdir, cfg.split, cfg.max_questions))
    n_shards = -(-n_questions // cfg.shard_size)
    shard_dir = out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    merged = (out / "report.json").is_file()
    todo = [] if merged else [k for k in range(n_shards) if not (shard_dir / f"shard-{k:05d}.json").is_file()]
    log(f"trajectories: {n_questions} {cfg.split} questions from {qdir} in {n_shards} shards; "
        f"{n_shards - len(todo)} done, {len(todo)} to run with {cfg.workers} workers -> {out}")
    if todo:
        init_ray(num_cpus=max(cfg.workers, 1))
        pipeline.run_shards(ShardWorker, {"cfg": cfg, "qdir": storage.location(qdir),
                                          "out_dir": storage.location(out)}, todo, n_shards,
                            workers=cfg.workers, role_units=cfg.role_units, desc=JOB,
                            line=lambda row: f"kept {int(row['kept'])} in {float(row['seconds']):.1f} s", log=log)
        storage.refresh(out)  # shards the workers on other nodes published
    counts: Counter[str] = Counter()
    for k in range(n_shards):
        counts.update(json.loads((shard_dir / f"shard-{k:05d}.json").read_text()))
    if not merged:
        merge_shards(out, n_shards)
    rep = report(counts, time.perf_counter() - t0)
    if merged:
        rep["seconds"] = json.loads((out / "report.json").read_text())["seconds"]
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    storage.publish(out)
    log(f"trajectories: kept {rep['kept']} of {rep['rollouts']} rollouts ({rep['questions_kept']} questions), "
        f"{rep['correct_rate']:.1%} judged correct, in {rep['seconds']} s -> {out}")
    return out, rep
