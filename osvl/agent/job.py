"""The ask job (``jobs/ask.py``): one agent episode on one image, printed turn by turn.

``--model`` is a checkpoint directory, or ``tiny`` (the random-init tiny Qwen3-VL) or ``tiny-agent`` (the tiny
model fine-tuned on scripted crop -> text_search -> response episodes, built once and cached; the default).
Tools run in this process by default, searching with ``--text_search.*`` (set them to the training run's
``rollout.text_search``), or behind the tool API (``--tools http --url ...``); the engine, tool client and search
backend come from ``osvl.agent.env.build_env``, as in training. The printout shows
every turn, the tool calls and their results, new images, the stop reason, the fatal step if any, and token
counts; ``--out DIR`` also writes the trajectory record (Parquet + images) there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from PIL import Image

from osvl.agent.engines import EngineKind
from osvl.agent.env import build_env
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.scripted import agent_tools, tiny_agent_checkpoint
from osvl.agent.trajectory import write_trajectories
from osvl.config import opt
from osvl.errors import ConfigError
from osvl.models.tiny import tiny_checkpoint
from osvl.tools.text_search import TextSearchConfig

JOB = "ask"


@dataclass
class AskConfig:
    RENAMED: ClassVar[dict[str, str]] = {"tool_names": "offer"}

    image: str = opt("", "Image file (PNG/JPEG) the question is about.")
    question: str = opt("", "The question.")
    model: str = opt("tiny-agent", "Checkpoint directory, or 'tiny' / 'tiny-agent' (built and cached locally).")
    engine: EngineKind = opt("hf", "Token engine: hf (transformers generate) or vllm.")
    tools: Literal["inprocess", "http"] = opt("inprocess", "Tool transport: inprocess, or http (the tool API at "
                                                           "--url).")
    url: str = opt("", "Tool API base URL for --tools http, e.g. http://127.0.0.1:8000.")
    offer: list[str] = opt([], "Tools offered to the model, by name; empty = every tool the transport has.")
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings (--tools inprocess): the search engine the model was trained with "
        "(the GRPO job's rollout.text_search). With --tools http the tool API's settings apply.")
    seed: int = opt(0, "Sampling seed.")
    out: str = opt("", "If set, write the trajectory record (Parquet + images) into this directory.")
    agent: AgentConfig = opt(AgentConfig, "Episode budgets and fatal-step rules.")


def resolve_model(name: str) -> Path:
    if name == "tiny":
        return tiny_checkpoint("qwen3_vl")
    if name == "tiny-agent":
        return tiny_agent_checkpoint()
    return Path(name)


def show(traj) -> str:
    """The trajectory as readable text: one block per turn, then the outcome."""
    lines = [f"question: {traj.question}", f"model: {traj.model} ({traj.kind})"]
    for turn in traj.turns:
        n = sum(1 for s, g in zip(traj.step_ids, traj.gen_mask, strict=True) if s == turn.index and g)
        lines.append(f"--- turn {turn.index} [{turn.action}, {n} tokens, policy v{turn.policy_version}]")
        lines.append(turn.text.strip())
        if turn.action == "tool_call":
            lines.append(f">>> {turn.tool}({turn.arguments}) -> {turn.status}"
                         + (f" ({turn.error_kind})" if turn.error_kind else ""))
        if turn.observation:
            lines.append("<<< " + turn.observation.strip().replace("\n", "\n    "))
        if turn.new_images:
            lines.append(f"    new images: {', '.join(turn.new_images)}")
        if turn.failed:
            lines.append("    (failed step)")
    fatal = (f"turns {traj.fatal_cascade_start}..{traj.fatal_kth} (K-th failure at {traj.fatal_kth})"
             if traj.fatal else "none")
    lines += [
        "---",
        f"stop reason: {traj.stop_reason}",
        f"answer: {traj.final_answer if traj.final_answer is not None else '(none)'}",
        f"fatal: {fatal}",
        f"tokens: {len(traj.input_ids)} total, {sum(traj.gen_mask)} generated, {len(traj.images)} image(s)",
    ]
    if traj.events:
        lines.append(f"events: {'; '.join(traj.events)}")
    return "\n".join(lines)


async def ask(cfg: AskConfig) -> str:
    if not cfg.image or not cfg.question:
        raise ConfigError("give both --image FILE and --question TEXT")
    if not Path(cfg.image).is_file():
        raise ConfigError(f"--image: no file {cfg.image}")
    image = np.asarray(Image.open(cfg.image).convert("RGB"))
    # the tiny agent only knows the short tool schemas it was fine-tuned with (same tool functions)
    tools = agent_tools() if cfg.model == "tiny-agent" and cfg.tools == "inprocess" else None
    env = build_env(model=str(resolve_model(cfg.model)), engine=cfg.engine, transport=cfg.tools, url=cfg.url,
                    tools=tools, text_search=cfg.text_search)
    engine, client = env.engine, env.client
    try:
        schemas = await client.schemas() if cfg.tools == "http" else [
            t.schema for t in client.transport.tools.values()]
        if cfg.offer:
            unknown = sorted(set(cfg.offer) - {s["function"]["name"] for s in schemas})
            if unknown:
                raise ConfigError(f"--offer: no such tools {unknown}")
            schemas = [s for s in schemas if s["function"]["name"] in cfg.offer]
        store: dict = {}
        traj = await run_episode(engine, {"id": "ask", "question": cfg.question, "answer": ""}, [image], client,
                                 cfg.agent, processor=engine.processor, tools=schemas, seed=cfg.seed,
                                 image_store=store)
    finally:
        await env.aclose()
    text = show(traj)
    if cfg.out:
        text += f"\nwritten: {write_trajectories(cfg.out, [traj], store)}"
    return text


def run(cfg: AskConfig) -> str:
    """The whole job: the episode's printout (and where its record was written, with ``--out``)."""
    return asyncio.run(ask(cfg))
