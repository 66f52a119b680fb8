"""Expert trajectories for SFT: a teacher answers the synthesized questions through the real tools.

Per question of the chosen split, the teacher runs ``n_teacher_rollouts`` episodes in the
real tool environment (the in-process tools, the same functions the Serve app runs), each
through the one agent loop (``osvl.agent.loop.run_episode``), so a teacher record is
rendered exactly like a policy record, once, with the student's tokenizer and processor.
Then two filters, in order:

1. the answer judge (``reward.judge``: rule, LLM, or rule then LLM): r_acc must be 1;
2. the process judge (``reward.query_scorer``: the documented rule, or an LLM): r_query
   must reach ``min_r_query`` (a right answer reached by a wasteful search is not an
   example worth copying);

and at most ``keep_per_question`` survivors per question (highest reward first) are kept.
A judge that cannot be reached marks the rollout (``judge_status="failed"``): it is
dropped and counted under ``judge_failed``, never kept or scored as a silent 0. A teacher
endpoint that cannot be reached drops that rollout and counts it under ``teacher_failed``.

Teachers: ``oracle`` (default, offline: ``osvl.agent.teacher.PathOracle``) or ``openai``
(any chat model behind an OpenAI-compatible endpoint, e.g. a large VLM served by vLLM).

Parallelism and resume: questions are cut into shards of ``shard_size``; Ray Data runs
them on ``workers`` actors (each loads the tools' indexes once and keeps ``concurrency``
episodes in flight, so tool latency overlaps). A shard commits by writing its records to
``shards/shard-NNNNN/`` and then ``shards/shard-NNNNN.json`` (its counts); a rerun skips
committed shards and redoes the rest. When every shard is committed, the parts are moved
into ``trajectories.parquet/`` and the images into ``images/`` of the run folder:

    <run root>/trajectories/<config hash>/
        trajectories.parquet/part-NNNNN.parquet   (osvl.agent.trajectory.read_trajectories reads the folder)
        images/<sha256>.png                       (each image once)
        report.json                               (counts, rates, seconds)
        config.yaml
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from osvl import storage
from osvl.agent.env import build_env
from osvl.agent.loop import AgentConfig
from osvl.agent.reward import RewardConfig
from osvl.agent.teacher import OracleConfig
from osvl.config import RunConfig, from_dict, input_path, opt, run_dir, to_dict
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError, DataError, EndpointUnavailable
from osvl.models.tiny import TinyKind, checkpoint_name
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
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings: the search engine the records show, which the policy's rollouts "
        "and evaluation must use too (the GRPO job passes its rollout.text_search here).")
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


def load_questions(path: Path, split: str, max_questions: int) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows = sorted(pq.read_table(path / f"{split}.parquet").to_pylist(), key=lambda r: r["id"])
    return rows[:max_questions] if max_questions > 0 else rows


def _load_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def restored_before_search(traj: Any, question: dict[str, Any]) -> bool:
    """A degraded question's trajectory calls the undo tool before its first image_search."""
    if not question.get("degraded"):
        return True
    undo = json.loads(question["degradation"])["undo_tool"]
    for t in traj.turns:
        if t.tool == undo:
            return True
        if t.tool == "image_search":
            return False
    return True




class ShardWorker:
    """One Ray actor: loads the processor and tools once, then answers whole shards."""

    def __init__(self, cfg: dict[str, Any], qdir: str, out_dir: str) -> None:
        from osvl.models.load import load_processor
        from osvl.tools.registry import all_tools

        self.cfg = from_dict(TrajConfig, cfg)
        # locations, not paths: this node may hold no copy of either folder yet
        self.qdir, self.out = storage.attach(qdir), storage.attach(out_dir)
        model = str(input_path(self.cfg.model)) if self.cfg.model else ""
        if not model:
            from osvl.models.tiny import tiny_checkpoint

            model = str(tiny_checkpoint(self.cfg.tiny_kind))
        self.processor = load_processor(model)
        # one env for the worker's life: its search index is loaded once; endpoint clients are closed after each
        # shard (each runs on an event loop of its own) and reopen on the next one's first request
        cfg = self.cfg
        self.env = build_env(chat=cfg.teacher.endpoint if cfg.teacher.kind == "openai" else None,
                             cache=cfg.tools.cache, cache_root=cfg.tools.cache_dir, timeout_s=120.0,
                             text_search=cfg.tools.text_search, outages=cfg.tools.outages,
                             judge=cfg.judge if cfg.reward.uses_llm() else None,
                             judge_cache=str(self.out / "judge_cache.jsonl") if cfg.judge_cache else "")
        tools = all_tools()
        unknown = sorted(set(self.cfg.offer) - set(tools))
        if unknown:
            raise ConfigError(f"offer: unknown tools {unknown}; registered: {sorted(tools)}")
        self.tools = [t.schema for name, t in tools.items() if not self.cfg.offer or name in self.cfg.offer]
        self.questions = load_questions(self.qdir, self.cfg.split, self.cfg.max_questions)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        done, kept, secs = [], [], []
        for shard in batch["shard"].tolist():
            t0 = time.perf_counter()
            lo = shard * self.cfg.shard_size
            counts = asyncio.run(self.run_shard(shard, self.questions[lo:lo + self.cfg.shard_size]))
            done.append(shard)
            kept.append(counts["kept"])
            secs.append(time.perf_counter() - t0)
        return {"shard": np.array(done), "kept": np.array(kept), "seconds": np.array(secs)}

    async def run_shard(self, shard: int, rows: list[dict[str, Any]]) -> Counter[str]:
        from osvl.agent.loop import run_episode
        from osvl.agent.reward import mark_failed_groups, score_trajectory
        from osvl.agent.trajectory import write_trajectories

        cfg, env = self.cfg, self.env
        teacher, client, llm_judge, process_judge = env.engine, env.client, env.llm_judge, env.process_judge
        counts: Counter[str] = Counter()
        sem = asyncio.Semaphore(cfg.concurrency)
        store: dict[str, np.ndarray] = {}

        async def rollout(row: dict[str, Any], image: np.ndarray, k: int) -> Any:
            from osvl.agent.teacher import PathOracle

            seed = cfg.run.seed * 1_000_003 + k
            engine = teacher or PathOracle(row, seed=seed, cfg=cfg.teacher.oracle)
            try:
                traj = await run_episode(engine, row, [image], client, cfg.agent, processor=self.processor,
                                         tools=self.tools, seed=seed, group_id=f"{row['id']}-teacher",
                                         sample=k, image_store=store)
            except EndpointUnavailable:
                counts["teacher_failed"] += 1
                return None
            return await score_trajectory(traj, row, cfg.reward, llm_judge=llm_judge,
                                          process_judge=process_judge)

        async def question(row: dict[str, Any]) -> list[Any]:
            async with sem:  # rollouts of one question in sequence: the later ones hit the tool cache
                image = _load_rgb(self.qdir / "images" / row["images"][0])
                trajs = [t for t in [await rollout(row, image, k) for k in range(cfg.n_teacher_rollouts)]
                         if t is not None]
            mark_failed_groups(trajs)
            keep = []
            for t in trajs:
                counts["rollouts"] += 1
                counts[f"stop_{t.stop_reason}"] += 1
                counts["correct"] += t.judge_status == "ok" and t.r_acc == 1.0
                if row.get("degraded"):
                    counts["degraded_rollouts"] += 1
                    counts["degraded_restored_first"] += restored_before_search(t, row)
                if t.judge_status != "ok":
                    counts["judge_failed"] += 1
                elif t.r_acc < 1.0:
                    counts["dropped_answer"] += 1
                elif t.r_query < cfg.min_r_query:
                    counts["dropped_process"] += 1
                else:
                    keep.append(t)
            keep.sort(key=lambda t: (-t.reward, t.seed))
            counts["dropped_over_cap"] += max(0, len(keep) - cfg.keep_per_question)
            return keep[:cfg.keep_per_question]

        try:
            kept = [t for group in await asyncio.gather(*(question(r) for r in rows)) for t in group]
        finally:
            await env.aclose()
        counts["questions"] += len(rows)
        counts["kept"] += len(kept)
        counts["questions_kept"] += len({t.question_id for t in kept})
        shard_dir = self.out / "shards" / f"shard-{shard:05d}"
        shutil.rmtree(shard_dir, ignore_errors=True)  # a shard killed half-way left no marker: redo it whole
        if kept:
            write_trajectories(shard_dir, kept, {sha: store[sha] for t in kept for sha in t.images})
        marker = self.out / "shards" / f"shard-{shard:05d}.json"
        storage.atomic_write(marker, json.dumps(dict(counts), sort_keys=True))
        storage.publish(self.out, f"shards/shard-{shard:05d}", marker.relative_to(self.out).as_posix())  # marker last
        return counts


def _merge(out: Path, n_shards: int) -> None:
    """Move every shard's part and images into the run folder (once; a rerun finds them there)."""
    table = out / "trajectories.parquet"
    (out / "images").mkdir(parents=True, exist_ok=True)
    table.mkdir(exist_ok=True)
    for k in range(n_shards):
        shard_dir = out / "shards" / f"shard-{k:05d}"
        if not shard_dir.is_dir():
            continue
        for img in (shard_dir / "images").glob("*.png"):
            target = out / "images" / img.name
            if not target.exists():
                os.replace(img, target)
        for i, part in enumerate(sorted((shard_dir / "trajectories.parquet").glob("part-*.parquet"))):
            os.replace(part, table / f"part-{k:05d}-{i:02d}.parquet")
        shutil.rmtree(shard_dir)


def report(counts: Counter[str], seconds: float) -> dict[str, Any]:
    n = max(1, counts["rollouts"])
    return {
        "kept": counts["kept"], "questions": counts["questions"], "questions_kept": counts["questions_kept"],
        "rollouts": counts["rollouts"], "correct_rate": round(counts["correct"] / n, 4),
        "degraded_restored_first": f"{counts['degraded_restored_first']}/{counts['degraded_rollouts']}",
        "dropped": {k: counts[k] for k in ("dropped_answer", "dropped_process", "dropped_over_cap", "judge_failed",
                                           "teacher_failed")},
        "stop_reasons": {k[5:]: v for k, v in sorted(counts.items()) if k.startswith("stop_")},
        "seconds": round(seconds, 1),
    }


@tracked(JOB)
def run(cfg: TrajConfig, *, log: Callable[[str], None] = logger.info,
        questions: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Answer the split's questions (``cfg.questions``, else ``questions``) with the teacher, filter, keep, write
    (resuming shards)."""
    from osvl.cluster import init_ray
    from osvl.synth import pipeline

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
        pipeline.run_shards(ShardWorker, {"cfg": to_dict(cfg), "qdir": storage.location(qdir),
                                          "out_dir": storage.location(out)}, todo, n_shards,
                            workers=cfg.workers, role_units=cfg.role_units, desc=JOB,
                            line=lambda row: f"kept {int(row['kept'])} in {float(row['seconds']):.1f} s", log=log)
        storage.refresh(out)  # shards the workers on other nodes published
    counts: Counter[str] = Counter()
    for k in range(n_shards):
        counts.update(json.loads((shard_dir / f"shard-{k:05d}.json").read_text()))
    if not merged:
        _merge(out, n_shards)
    rep = report(counts, time.perf_counter() - t0)
    if merged:
        rep["seconds"] = json.loads((out / "report.json").read_text())["seconds"]
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    storage.publish(out)
    log(f"trajectories: kept {rep['kept']} of {rep['rollouts']} rollouts ({rep['questions_kept']} questions), "
        f"{rep['correct_rate']:.1%} judged correct, in {rep['seconds']} s -> {out}")
    return out, rep
