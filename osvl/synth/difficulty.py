"""The two-stage difficulty filter: keep questions that need the tools.

1. **no_tools**: a given model (any token engine, or a chat engine behind an OpenAI-compatible
   endpoint) sees the image and the question with no tools offered and answers greedily;
   a question it answers right (the rule judge, ``answer_reward``) is dropped: it tests
   what the model already knows, not search.
2. **one_image_search**: one ``image_search`` on the *undegraded* image (the KG anchor
   photo the question was made from); a question whose answer or an alias appears in
   that result is dropped: one lookup gives it away, there is nothing multi-hop left.

The pipeline runs it in its ``--filter.stage=osvl.synth.difficulty:DifficultyFilter``
slot, a Ray Data callable class constructed without arguments, so its settings come from
the environment variable ``OSVL_DIFFICULTY`` (a JSON object of ``DifficultyConfig``
fields; Ray workers inherit the driver's environment). Without a ``model`` stage 1 is
skipped and counted as such. Drops are counted per stage and reason, printed by each
actor and, with ``report``, appended as one JSON line per batch to that file.
``filter_table`` is the same filter as a plain function.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from osvl.agent.judge import answer_reward, normalize_answer
from osvl.errors import ConfigError

STAGES = ("no_tools", "one_image_search")
ENV = "OSVL_DIFFICULTY"

NO_TOOLS_SYSTEM = "Answer the question about the image directly, in a few words. Write <think>…</think> then " \
                  "<response>your answer</response>."


@dataclass
class DifficultyConfig:
    stages: list[str] = field(default_factory=lambda: list(STAGES))  # which stages run, in this order
    engine: str = "hf"  # hf | vllm | openai: the stage-1 model
    model: str = ""  # checkpoint directory (hf, vllm) or model name (openai); empty = skip stage 1
    base_url: str = ""  # openai: endpoint
    api_key_env: str = ""
    max_new_tokens: int = 64
    kg_dir: str = ""  # KG folder whose images/ hold the undegraded anchor photos; empty = the committed sample
    top_k: int = 5  # of the stage-2 image search
    report: str = ""  # append per-batch drop counts (JSON lines) to this file

    @classmethod
    def from_env(cls) -> DifficultyConfig:
        raw = os.environ.get(ENV, "")
        data = json.loads(raw) if raw.strip() else {}
        known = {f.name for f in fields(cls)}
        if set(data) - known:
            raise ConfigError(f"{ENV}: unknown keys {sorted(set(data) - known)}; known: {sorted(known)}")
        cfg = cls(**data)
        if set(cfg.stages) - set(STAGES):
            raise ConfigError(f"{ENV}: stages must be a subset of {STAGES}, got {cfg.stages}")
        return cfg


def answer_in(text: str, answer: str, aliases: list[str]) -> bool:
    """The answer or an alias occurs in ``text`` (SQuAD-normalised, as whole words)."""
    hay = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(g)} " in hay for g in [answer, *aliases] if g and normalize_answer(g))


def _parse_answer(text: str) -> str:
    """The ``<response>`` of a reply, or the whole reply when the model ignored the format."""
    from osvl.agent.format import RESPONSE_CLOSE, RESPONSE_OPEN

    if RESPONSE_OPEN in text:
        return text.split(RESPONSE_OPEN, 1)[1].split(RESPONSE_CLOSE, 1)[0].strip()
    return text.split("</think>")[-1].strip()


class NoToolsModel:
    """Stage 1's model: greedy, no tools offered, one turn."""

    def __init__(self, cfg: DifficultyConfig) -> None:
        self.cfg = cfg
        if cfg.engine == "openai":
            from osvl.agent.engines.openai import EndpointConfig, OpenAIChatEngine

            self.chat = OpenAIChatEngine(EndpointConfig(base_url=cfg.base_url, model=cfg.model,
                                                        api_key_env=cfg.api_key_env), cut=False)
            self.engine = None
        else:
            from osvl.agent.engines import make_engine
            from osvl.models.load import load_processor

            self.chat = None
            self.engine = make_engine(cfg.engine, cfg.model)
            self.processor = load_processor(cfg.model)

    async def answer(self, question: str, image: np.ndarray) -> str:
        from osvl.agent import format as fmt
        from osvl.agent.engines.base import GenRequest, Sampling

        messages = [{"role": "system", "content": NO_TOOLS_SYSTEM},
                    {"role": "user", "content": question, "images": ["img_1"]}]
        sampling = Sampling(temperature=0.0, max_new_tokens=self.cfg.max_new_tokens)
        if self.chat is not None:
            return _parse_answer(await self.chat.chat(messages, {"img_1": image}, sampling))
        from osvl.agent.loop import stop_token_ids
        from osvl.agent.trajectory import TrajectoryBuilder

        b = TrajectoryBuilder(self.processor)
        b.add_image(image)
        b.add_text(fmt.render(messages, add_generation_prompt=True))
        sampling.stop_token_ids = stop_token_ids(self.processor.tokenizer)
        res = await self.engine.generate(GenRequest(list(b.input_ids), list(b.images), list(b.image_max_pixels),
                                                    sampling))
        return _parse_answer(self.processor.tokenizer.decode(res.token_ids, skip_special_tokens=True))


def _load_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def filter_rows(rows: list[dict[str, Any]], cfg: DifficultyConfig, model: NoToolsModel | None = None,
                counts: Counter[str] | None = None) -> list[dict[str, Any]]:
    """The rows that survive every configured stage; ``counts`` gets ``<stage>:<reason>`` tallies."""
    from osvl.kg.schema import SAMPLE_DIR
    from osvl.tools.base import ToolContext, call_tool
    from osvl.tools.registry import all_tools

    counts = counts if counts is not None else Counter()
    kg_images = Path(cfg.kg_dir or SAMPLE_DIR) / "images"
    search = all_tools()["image_search"]
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

            async def ask_all(batch: list[dict[str, Any]]) -> list[str]:
                return await asyncio.gather(*(model.answer(r["question"], original(r)) for r in batch))

            replies = asyncio.run(ask_all(kept))
            for row, reply in zip(kept, replies, strict=True):
                if answer_reward(reply, row["answer"], row["answer_aliases"]):
                    counts["no_tools:answered_without_tools"] += 1
                else:
                    survivors.append(row)
        else:
            for row in kept:
                name = row["provenance"]["anchor_image"]
                if name not in searched:
                    result = call_tool(search, {"image": "img_1", "top_k": cfg.top_k},
                                       ToolContext({"img_1": original(row)}))
                    searched[name] = result.text if result.ok else ""
                if answer_in(searched[name], row["answer"], row["answer_aliases"]):
                    counts["one_image_search:answer_in_result"] += 1
                else:
                    survivors.append(row)
        kept = survivors
    counts["kept"] += len(kept)
    return kept


class DifficultyFilter:
    """The pipeline's filter-slot stage (``module:Class``): a pyarrow batch in, its surviving rows out."""

    def __init__(self) -> None:
        self.cfg = DifficultyConfig.from_env()
        self.model = NoToolsModel(self.cfg) if self.cfg.model and "no_tools" in self.cfg.stages else None

    def __call__(self, batch: pa.Table) -> pa.Table:
        counts: Counter[str] = Counter()
        rows = batch.to_pylist()
        kept = filter_rows(rows, self.cfg, self.model, counts)
        print(f"difficulty filter: {len(rows)} in, {len(kept)} kept; drops {dict(counts)}", flush=True)
        if self.cfg.report:
            with open(self.cfg.report, "a") as f:
                f.write(json.dumps({"rows": len(rows), **counts}) + "\n")
        return pa.Table.from_pylist(kept, schema=batch.schema)
