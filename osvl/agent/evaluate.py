"""The evaluator's per-item core: one question, one mode, one model -> one scored record.

Every place that measures a model goes through ``evaluate_item``: the eval job
(``osvl/eval/``), the GRPO job's held-out Pass@1, the SFT job's first-turn format check
and the difficulty filter's no-tools answer. It lives in the agent package, below
synthesis and training, so all of them can call it; it runs the one agent loop
(``osvl.agent.loop.run_episode``) in three modes:

- ``direct``: one turn, no tools offered; the system turn asks for a direct answer.
- ``rag``: a fixed workflow: one ``image_search`` on the question's first image and one
  ``text_search`` on the question, both results pasted under the question, then one
  answer turn with no tools (the RAG baseline of the recipe's tables).
- ``agentic``: the full tool loop with the given budgets and tools.

Scoring: an item is correct when the episode ended with a response (not fatal) and the
judge accepts it. The rule judge (``osvl.agent.judge.answer_reward``) always runs; an
``LLMJudge``, when given, decides instead, and an unreachable judge marks the item
``judge_failed`` (``correct`` None), never a silent 0, so the table can leave it out.

Released OpenSearch-VL checkpoints were trained with other tool names and a question
prefix: ``ALIASES`` maps their names to osvl's tools (``aliased``), so their calls run
the right tool and are not counted as unknown.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from osvl import chat as fmt
from osvl.agent.judge import answer_reward
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.trajectory import Trajectory
from osvl.errors import ConfigError, EndpointUnavailable

MODES = ("direct", "rag", "agentic")

NO_TOOLS_SYSTEM = "Answer the question about the image directly, in a few words. Write <think>…</think> then " \
                  "<response>your answer</response>."

# released name -> osvl tool. layout_parsing is the released OCR tool, web_search its text search.
ALIASES = {"opensearch-vl": {"web_search": "text_search", "layout_parsing": "ocr"}}
# the released checkpoints saw every question behind this prefix (one image, called image 1)
QUESTION_PREFIX = {"opensearch-vl": "image_id: 1 \n Question: "}

OBSERVATION_CHARS = 2000  # of each tool answer kept in a per-item record


@dataclass
class ItemResult:
    """What ``evaluate_item`` returns: the JSON-able record and the episode's trajectory."""

    record: dict[str, Any]
    trajectory: Trajectory | None  # None when the model's endpoint gave no answer


def aliased(tools: list[dict[str, Any]], alias_set: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The schemas renamed to ``alias_set``'s released names, and released name -> osvl name."""
    if not alias_set:
        return tools, {}
    if alias_set not in ALIASES:
        raise ConfigError(f"unknown tool alias set {alias_set!r}; known: {sorted(ALIASES)}")
    back = ALIASES[alias_set]
    forward = {v: k for k, v in back.items()}
    out = []
    for s in tools:
        name = s["function"]["name"]
        out.append({**s, "function": {**s["function"], "name": forward.get(name, name)}})
    return out, back


class AliasClient:
    """A tool client that runs a released name's osvl tool (``aliased``'s second result)."""

    def __init__(self, inner: Any, names: Mapping[str, str]) -> None:
        self.inner, self.names = inner, dict(names)

    async def call(self, name: str, arguments: Any, images: Any = None, new_image_name: str = "") -> Any:
        return await self.inner.call(self.names.get(name, name), arguments, images, new_image_name)


class LenientChat:
    """A chat engine whose plain-text replies count as the answer.

    API baselines (and the agent service, which returns only its final answer) often
    ignore osvl's tags; a reply with neither ``<tool_call>`` nor ``<response>`` is read as
    ``<response>reply</response>`` rather than as a broken turn.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "chat")

    async def chat(self, messages: list[dict], images: Mapping[str, np.ndarray], sampling: Any) -> str:
        text = await self.inner.chat(messages, images, sampling)
        if fmt.TOOL_CALL_OPEN in text or fmt.RESPONSE_OPEN in text:
            return text
        return fmt.assistant_text("", response=text.split(fmt.THINK_CLOSE)[-1].replace(fmt.RESPONSE_CLOSE, "").strip()
                                                   or "(empty)")

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


OFFER_FILE = "osvl_offer.json"  # written into a checkpoint by the SFT job: the tools its data offered


def trained_tools(path: str | Path) -> list[str]:
    """The tools the policy at ``path`` (a checkpoint or a trajectories folder) was trained with.

    Looked up in ``OFFER_FILE`` in ``path``, else ``rollout.offer`` (GRPO) or ``offer``
    (trajectories) of the nearest ``config.yaml`` at or above it; [] (= every tool) when none says.
    """
    p = Path(path).resolve()
    if (p / OFFER_FILE).is_file():
        return list(json.loads((p / OFFER_FILE).read_text()))
    for folder in [p, *p.parents][:4]:
        f = folder / "config.yaml"
        if f.is_file():
            data = yaml.safe_load(f.read_text()) or {}
            offer = (data.get("rollout") or {}).get("offer") or data.get("offer")
            if offer:
                return list(offer)
    return []


def item_seed(item_id: str) -> int:
    """A stable per-item seed (the same on every rerun and machine)."""
    return int(hashlib.sha256(item_id.encode()).hexdigest()[:8], 16)


async def _rag_question(client: Any, question: str, images: list[np.ndarray], top_k: int) -> tuple[str, list[dict]]:
    """The question with one image search and one text search pasted under it, and the two calls."""
    calls = []
    if images:
        calls.append(("image_search", {"image": "img_1", "top_k": top_k}))
    calls.append(("text_search", {"query": question, "top_k": top_k}))
    named = {f"img_{i + 1}": a for i, a in enumerate(images)}
    steps, parts = [], []
    for name, args in calls:
        res = await client.call(name, args, named, new_image_name=f"img_{len(images) + 1}")
        steps.append({"action": "tool_call", "tool": name, "arguments": args, "status": res.status,
                      "error_kind": res.error.kind if not res.ok else "", "observation": res.text[:OBSERVATION_CHARS],
                      "rag": True})
        parts.append(f"{name} results:\n{res.text if res.ok else '(failed: ' + res.text + ')'}")
    return question + "\n\nSearch results:\n" + "\n\n".join(parts), steps


def _failure(traj: Trajectory, correct: float | None, judge_status: str) -> str:
    if judge_status == "judge_failed":
        return "judge_failed"
    if traj.fatal_kth >= 0:
        return "fatal"
    if traj.stop_reason != "response":
        return traj.stop_reason or "no_answer"
    return "" if correct else "wrong_answer"


async def evaluate_item(engine: Any, item: Mapping[str, Any], images: list[np.ndarray], client: Any, mode: str,
                        cfg: AgentConfig, *, processor: Any, tools: list[dict[str, Any]],
                        judge: Any = None, rag_top_k: int = 3, question_prefix: str = "") -> ItemResult:
    """Run ``item`` (``id``, ``question``, ``answer``, optional ``answer_aliases``) in ``mode`` and score it.

    ``tools`` are the schemas offered in ``agentic`` mode (exactly those the policy was
    trained with); ``direct`` and ``rag`` offer none and allow one turn. Episode
    seeds derive from the item id, so a rerun with the same tool cache is the same run.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown eval mode {mode!r}; choose from {MODES}")
    qid = str(item.get("id", ""))
    question = str(item["question"])
    aliases = [str(a) for a in (item.get("answer_aliases") or [])]
    rag_steps: list[dict] = []
    if mode == "rag":
        question, rag_steps = await _rag_question(client, question, images, rag_top_k)
    one_turn = replace(cfg, max_turns=1) if mode != "agentic" else cfg
    row = {**item, "question": question_prefix + question}
    seed = item_seed(qid)
    error = ""
    try:
        traj = await run_episode(engine, row, images, client, one_turn, processor=processor,
                                 tools=tools if mode == "agentic" else [], seed=seed,
                                 system=None if mode == "agentic" else NO_TOOLS_SYSTEM)
    except EndpointUnavailable as e:  # the model's endpoint, not the judge: the item failed, the run goes on
        error = str(e)[:300]
        traj = None
    answered = traj is not None and traj.stop_reason == "response" and traj.fatal_kth < 0
    prediction = traj.final_answer if answered else None
    rule = answer_reward(prediction, str(item["answer"]), aliases) if answered else 0.0
    llm, judge_status = None, "rule"
    if judge is not None and answered:
        try:
            llm = await judge.judge(str(item["question"]), str(item["answer"]), aliases, prediction or "")
            judge_status = "llm"
        except EndpointUnavailable:
            judge_status = "judge_failed"
    elif judge is not None:
        llm, judge_status = 0.0, "llm"  # no answer: wrong for either judge, nothing to ask
    correct = None if judge_status == "judge_failed" else (llm if judge is not None else rule)
    steps = rag_steps + ([{"action": t.action, "tool": t.tool, "arguments": t.arguments, "status": t.status,
                           "error_kind": t.error_kind, "text": t.text,
                           "observation": (t.observation or "")[:OBSERVATION_CHARS]} for t in traj.turns]
                         if traj is not None else [])
    tool_calls = [s["tool"] for s in steps if s["action"] == "tool_call"]
    record = {
        "id": qid, "mode": mode, "question": str(item["question"]), "answer": str(item["answer"]),
        "answer_aliases": aliases, "prediction": prediction, "rule_correct": rule, "llm_correct": llm,
        "correct": correct, "judge_status": judge_status,
        "failure": ("engine_error" if traj is None else _failure(traj, correct, judge_status)),
        "error": error, "stop_reason": traj.stop_reason if traj is not None else "engine_error",
        "fatal": bool(traj is not None and traj.fatal_kth >= 0),
        "turns": len(traj.turns) if traj is not None else 0, "tool_calls": len(tool_calls), "tools": tool_calls,
        "events": list(traj.events) if traj is not None else [], "trajectory": steps, "seed": seed,
    }
    return ItemResult(record, traj)
