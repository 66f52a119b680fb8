"""Synthesized questions for the agent tests: one shard of the sample KG, in-process (no Ray), cached per session."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def sample_questions(out_dir: str, questions_per_seed: int = 6, degrade_share: float = 0.5) -> Path:
    """``out_dir`` with ``sft.parquet`` (every question of shards 0-1, split ignored) and ``images/``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from osvl.synth.job import SynthConfig
    from osvl.synth.pipeline import ROW_SCHEMA, ImageStore, plan, synthesize_shard
    from osvl.synth.walks import Graph

    out = Path(out_dir)
    cfg = SynthConfig(questions_per_seed=questions_per_seed, attempts_per_seed=40)
    cfg.degrade.share = degrade_share
    graph = Graph.load(None, max_answer_words=cfg.walk.max_answer_words)
    shards, split_of = plan(graph, cfg)
    store = ImageStore(graph, out / "images")
    rows = []
    for k in (0, 1):
        rows += synthesize_shard(graph, cfg, k, shards[k], split_of, store)[0]
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), out / "sft.parquet")
    return out
