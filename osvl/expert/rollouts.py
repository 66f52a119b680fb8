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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from osvl import storage
from osvl.agent.env import build_env
from osvl.agent.loop import run_episode
from osvl.agent.reward import mark_failed_groups, score_trajectory
from osvl.agent.teacher import PathOracle
from osvl.agent.trajectory import write_trajectories
from osvl.config import input_path
from osvl.errors import ConfigError, EndpointUnavailable
from osvl.models.tiny import tiny_checkpoint
from osvl.tools.registry import all_tools

if TYPE_CHECKING:
    from osvl.expert.job import TrajConfig

logger = logging.getLogger(__name__)


def load_questions(path: Path, split: str, max_questions: int) -> list[dict[str, Any]]:
    rows = sorted(pq.read_table(path / f"{split}.parquet").to_pylist(), key=lambda r: r["id"])
    return rows[:max_questions] if max_questions > 0 else rows


def _load_rgb(path: Path) -> np.ndarray:
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

    def __init__(self, cfg: TrajConfig, qdir: str, out_dir: str) -> None:
        from osvl.models.load import load_processor  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

        self.cfg = cfg
        # locations, not paths: this node may hold no copy of either folder yet
        self.qdir, self.out = storage.attach(qdir), storage.attach(out_dir)
        model = str(input_path(self.cfg.model)) if self.cfg.model else ""
        if not model:
            model = str(tiny_checkpoint(self.cfg.tiny_kind))
        self.processor = load_processor(model)
        # one env for the worker's life: its search index is loaded once; endpoint clients are closed after each
        # shard (each runs on an event loop of its own) and reopen on the next one's first request
        cfg = self.cfg
        self.env = build_env(chat=cfg.teacher.endpoint if cfg.teacher.kind == "openai" else None,
                             cache=cfg.tools.cache, cache_root=cfg.tools.cache_dir, timeout_s=120.0,
                             text_search=cfg.text_search, outages=cfg.tools.outages,
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
        cfg, env = self.cfg, self.env
        teacher, client, llm_judge, process_judge = env.engine, env.client, env.llm_judge, env.process_judge
        counts: Counter[str] = Counter()
        sem = asyncio.Semaphore(cfg.concurrency)
        store: dict[str, np.ndarray] = {}

        async def rollout(row: dict[str, Any], image: np.ndarray, k: int) -> Any:
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


def merge_shards(out: Path, n_shards: int) -> None:
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
