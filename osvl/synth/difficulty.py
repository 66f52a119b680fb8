"""The two-stage difficulty filter: keep questions that need the tools.

1. **no_tools**: a given model (any token engine, or a chat engine behind an OpenAI-compatible
   endpoint) answers in the evaluator's ``direct`` mode (``osvl.agent.evaluate``: the image
   and the question, no tools, one greedy turn); a question it answers right (the rule
   judge) is dropped: it tests what the model already knows, not search.
2. **one_image_search**: one ``image_search`` on the *undegraded* image (the KG anchor
   photo the question was made from); a question whose answer or an alias appears in
   that result is dropped: one lookup gives it away, there is nothing multi-hop left.

The pipeline runs it in its ``--filter.stage=osvl.synth.difficulty:DifficultyFilter``
slot, a Ray Data callable class constructed with the synthesize job's config, whose
``filter.difficulty`` section (``DifficultyConfig``) holds its settings: they show in
``jobs/synthesize.py --help`` and are part of the run's config hash, so two settings make
two run folders. Without a stage-1 model stage 1 is skipped and counted as such. Drops are
counted per stage and reason, printed by each actor and, with ``report``, appended as one
JSON line per batch to that file.
``filter_rows`` is the same filter as a plain function.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa
from PIL import Image

from osvl.agent.env import build_env
from osvl.agent.evaluate import evaluate_item
from osvl.agent.judge import normalize_answer
from osvl.agent.loop import AgentConfig
from osvl.config import opt
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError
from osvl.kg.schema import SAMPLE_DIR
from osvl.logs import setup
from osvl.models.tiny import tiny_checkpoint
from osvl.tools.base import ToolContext, call_tool
from osvl.tools.registry import all_tools

logger = logging.getLogger(__name__)

STAGES = ("no_tools", "one_image_search")
Stage1Engine = Literal["hf", "vllm", "openai"]
ENGINES = get_args(Stage1Engine)


@dataclass
class DifficultyConfig:
    """Settings of ``DifficultyFilter`` (the synthesize job's ``filter.difficulty`` section)."""

    stages: list[str] = opt(list(STAGES), f"Stages to run, in this order; a subset of {STAGES}.")
    engine: Stage1Engine = opt("hf", "Stage 1's model: hf or vllm (a checkpoint in model) or openai (the endpoint "
                                     "below).")
    model: str = opt("", "hf/vllm: stage 1's checkpoint directory; empty = stage 1 is skipped (and counted).")
    endpoint: EndpointConfig = opt(EndpointConfig, "openai: stage 1's chat model; no endpoint.model = stage 1 "
                                                   "is skipped (and counted).")
    max_new_tokens: int = opt(64, "Stage 1: tokens of the model's one answer turn.")
    top_k: int = opt(5, "Stage 2: results of the one image search on the undegraded photo.")
    report: str = opt("", "Append per-batch drop counts (JSON lines) to this file; empty = printed only.",
                      hashed=False)

    def check(self) -> None:
        if set(self.stages) - set(STAGES):
            raise ConfigError(f"filter.difficulty.stages must be a subset of {STAGES}, got {self.stages}")
        if self.engine not in ENGINES:
            raise ConfigError(f"filter.difficulty.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "openai" and self.endpoint.model:
            self.endpoint.check("filter.difficulty.endpoint")
        if self.max_new_tokens < 1 or self.top_k < 1:
            raise ConfigError("filter.difficulty.max_new_tokens and top_k must be >= 1")

    def has_model(self) -> bool:
        """Whether stage 1 has a model to ask (else it is skipped)."""
        return bool(self.endpoint.model if self.engine == "openai" else self.model)


def answer_in(text: str, answer: str, aliases: list[str]) -> bool:
    """The answer or an alias occurs in ``text`` (SQuAD-normalised, as whole words)."""
    hay = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(g)} " in hay for g in [answer, *aliases] if g and normalize_answer(g))


class NoToolsModel:
    """Stage 1's model: the evaluator's ``direct`` mode (greedy, no tools offered, one turn)."""

    def __init__(self, cfg: DifficultyConfig) -> None:
        self.cfg = cfg
        if cfg.engine == "openai":
            # lazy: (d) keeps transformers out of jobs/grpo.py --help
            from osvl.models.load import load_processor  # noqa: PLC0415

            self.engine = build_env(chat=cfg.endpoint, lenient=True, transport=None).engine
            self.processor = load_processor(tiny_checkpoint("qwen3_vl"))  # renders the record only
        else:
            self.engine = build_env(model=cfg.model, engine=cfg.engine, transport=None).engine
            self.processor = self.engine.processor

    async def correct(self, row: dict[str, Any], image: np.ndarray) -> bool:
        """Whether the model answers ``row`` right with no tools (the evaluator's rule judge)."""
        agent = AgentConfig(max_turns=1, max_new_tokens=self.cfg.max_new_tokens, max_episode_tokens=32_768,
                            temperature=0.0)
        res = await evaluate_item(self.engine, row, [image], None, "direct", agent, processor=self.processor,
                                  tools=[])
        return bool(res.record["correct"])


def _load_rgb(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def filter_rows(rows: list[dict[str, Any]], cfg: DifficultyConfig, kg_dir: str = "", model: NoToolsModel | None = None,
                counts: Counter[str] | None = None, search: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows that survive every configured stage; ``counts`` gets ``<stage>:<reason>`` tallies.

    ``kg_dir``: the KG folder whose images/ hold the undegraded anchor photos; empty = the committed sample.
    ``search``: the search backends stage 2 calls (an ``AgentEnv``'s ``search``: the agent's own image search,
    default settings); None builds them here.
    """
    counts = counts if counts is not None else Counter()
    options = search if search is not None else build_env().search
    kg_images = Path(kg_dir or SAMPLE_DIR) / "images"
    image_search = all_tools()["image_search"]
    originals: dict[str, np.ndarray] = {}
    searched: dict[str, str] = {}  # anchor photo -> its search result text: many questions share a photo

    def original(row: dict[str, Any]) -> np.ndarray:
        name = row["provenance"]["anchor_image"]
        if name not in originals:
            originals[name] = _load_rgb(kg_images / name)
        return originals[name]

    kept = rows
    for stage in cfg.stages:
        survivors = []
        if stage == "no_tools":
            if model is None:
                counts["no_tools:skipped_no_model"] += len(kept)
                continue

            async def ask_all(batch: list[dict[str, Any]]) -> list[bool]:
                return await asyncio.gather(*(model.correct(r, original(r)) for r in batch))

            verdicts = asyncio.run(ask_all(kept))
            for row, right in zip(kept, verdicts, strict=True):
                if right:
                    counts["no_tools:answered_without_tools"] += 1
                else:
                    survivors.append(row)
        else:
            for row in kept:
                name = row["provenance"]["anchor_image"]
                if name not in searched:
                    result = call_tool(image_search, {"image": "img_1", "top_k": cfg.top_k},
                                       ToolContext({"img_1": original(row)}, options=options))
                    searched[name] = result.text if result.ok else ""
                if answer_in(searched[name], row["answer"], row["answer_aliases"]):
                    counts["one_image_search:answer_in_result"] += 1
                else:
                    survivors.append(row)
        kept = survivors
    counts["kept"] += len(kept)
    return kept


class DifficultyFilter:
    """The pipeline's filter-slot stage (``module:Class``): a pyarrow batch in, its surviving rows out.

    ``synth_cfg`` is the synthesize job's ``SynthConfig`` (the slot hands it to every stage class):
    the settings are its ``filter.difficulty``, the anchor photos those of its ``kg_dir``.
    """

    def __init__(self, synth_cfg: Any) -> None:
        setup()  # a Ray Data worker: its root logger is not configured yet
        self.cfg: DifficultyConfig = synth_cfg.filter.difficulty
        self.cfg.check()
        self.kg_dir = synth_cfg.kg_dir
        self.model = NoToolsModel(self.cfg) if self.cfg.has_model() and "no_tools" in self.cfg.stages else None
        self.search = build_env().search  # the agent's image search, its index loaded once per actor

    def __call__(self, batch: pa.Table) -> pa.Table:
        counts: Counter[str] = Counter()
        rows = batch.to_pylist()
        kept = filter_rows(rows, self.cfg, self.kg_dir, self.model, counts, self.search)
        logger.info(f"difficulty filter: {len(rows)} in, {len(kept)} kept; drops {dict(counts)}")
        if self.cfg.report:
            with open(self.cfg.report, "a") as f:
                f.write(json.dumps({"rows": len(rows), **counts}) + "\n")
        return pa.Table.from_pylist(kept, schema=batch.schema)
