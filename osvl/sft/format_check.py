"""The SFT acceptance check: the share of greedy first turns on held-out questions that parse.

Each question runs through the evaluator's per-item core (``osvl.agent.evaluate``) in
agentic mode with a one-turn budget, offered exactly the tools the trajectories were
rendered with (``osvl.agent.evaluate.trained_tools`` of the trajectories' run), so the prompt is the
first prompt of a real episode of that policy. No tool runs: a first turn that calls one is
answered "not run" (``_NotRun``), since only the format of the turn is checked
(``osvl.chat.parse_turn``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from osvl import chat as fmt
from osvl.agent import evaluate as core  # core.evaluate_item at each call (tests/test_eval.py spies on it)
from osvl.agent.env import build_env
from osvl.agent.loop import AgentConfig
from osvl.agent.trajectory import question_images
from osvl.tools.base import ToolResult
from osvl.tools.registry import offered_tools


def heldout_path(explicit: str, data_dir: Path) -> Path | None:
    """``explicit``, else the newest ``synthesize/*/heldout.parquet`` in the run root above ``data_dir``."""
    if explicit:
        return Path(explicit)
    for root in Path(data_dir).resolve().parents:
        found = sorted((root / "synthesize").glob("*/heldout.parquet"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


class _NotRun:
    """A tool client for the first-turn check: a call parses, nothing runs."""

    async def call(self, name: str, arguments: Any, images: Any = None, new_image_name: str = "") -> Any:
        return ToolResult(status="ok", text=f"{name}: not run (first-turn format check)")


def first_turns(model_dir: str, heldout: Path, n: int, offer: list[str] | None = None,
                max_new_tokens: int = 128) -> list[str]:
    """Greedy first assistant turns of the model in ``model_dir`` on ``n`` held-out questions."""
    rows = pq.read_table(heldout, columns=["id", "question", "answer", "images"]).to_pylist()[:n]
    tools = offered_tools(list(offer or []))
    agent = AgentConfig(max_turns=1, max_new_tokens=max_new_tokens, max_episode_tokens=32_768, temperature=0.0)
    engine = build_env(model=model_dir, max_batch=16, transport=None).engine  # no tool runs: one turn
    try:
        async def go() -> list[Any]:
            client = _NotRun()
            return await asyncio.gather(*(core.evaluate_item(engine, r, question_images(heldout.parent / "images", r),
                                                             client, "agentic", agent, processor=engine.processor,
                                                             tools=tools) for r in rows))

        results = asyncio.run(go())
        return [r.trajectory.turns[0].text if r.trajectory and r.trajectory.turns else "" for r in results]
    finally:
        engine.close()


def format_check(model_dir: str, heldout: Path, n: int, offer: list[str] | None = None) -> float:
    """Share of greedy first turns that ``parse_turn`` accepts, with ``offer`` (empty = every tool) offered."""
    names = [t["function"]["name"] for t in offered_tools(list(offer or []))]
    texts = first_turns(model_dir, heldout, n, offer)
    return sum(fmt.format_score(t, names) for t in texts) / max(1, len(texts))
