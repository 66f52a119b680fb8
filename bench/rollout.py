"""Rollout throughput: trajectories/s with 1 vs N episodes in flight, under a simulated 200 ms tool latency.

    python bench/rollout.py [--episodes=32] [--concurrency=32] [--latency=0.2] [--max_batch=32] [--threads=1]
                           [--temperature=0.5]

One process, one HF token engine (the tiny agent checkpoint of ``osvl.agent.scripted``, which
calls crop, then text_search, then answers: >= 2 tool calls per episode), the real tools
in-process, each wrapped in a real ``Tool`` whose function first sleeps ``--latency``
seconds (what a remote tool service costs). Baseline: the same episodes one at a time. Then
``--concurrency`` episodes at once on one event loop: while some wait on tools, the engine
batches the others' turns into one ``generate``. Both runs sample at ``--temperature`` with the
same seeds: 0.5, because at 1.0 the tiny agent drifts off its script often enough that the mean
episode made fewer than 2 tool calls (docs/measurements.md), the workload this benchmark asks for;
``min_tool_calls`` in the output says whether every episode made them. The last stdout line
is JSON; ``ratio`` = trajectories/s in flight / one at a time (goal >= 8).

Torch runs on ``--threads`` threads (1, as rollout actors do with one CPU each): the tiny
model's ops are far too small to split, and on a shared, loaded machine two OpenMP threads
wait on each other at every op (many times slower: docs/measurements.md).

text_search runs BM25 only (no MiniLM re-rank): the re-rank costs CPU on every call,
serialised by the index's lock, which would measure the tool, not rollout;
remote tools cost this process only their latency, which ``--latency`` stands for.

The tool thread pool is sized to the number of episodes in flight, as a tool service would
scale its workers; the sleeps are what is overlapped, not CPU work.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from osvl.agent import scripted  # noqa: E402
from osvl.agent.engines.hf import HFEngine  # noqa: E402
from osvl.agent.loop import AgentConfig, run_episode  # noqa: E402
from osvl.config import script_flags  # noqa: E402
from osvl.tools import text_search  # noqa: E402
from osvl.tools.base import Tool  # noqa: E402
from osvl.tools.client import InProcessTransport, ToolClient  # noqa: E402


def slow(tool: Tool, latency: float) -> Tool:
    """The same tool, answering ``latency`` seconds later."""

    def fn(ctx, **arguments):
        time.sleep(latency)
        return tool.fn(ctx, **arguments)

    return Tool(tool.name, tool.description, tool.parameters, fn, backend=tool.backend, version=tool.version)


async def run(engine: HFEngine, n: int, concurrency: int, latency: float, temperature: float, search: object) -> dict:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=max(8, 2 * concurrency)))
    tools = {name: slow(t, latency) for name, t in scripted.agent_tools().items()}
    schemas = [t.schema for t in tools.values()]
    client = ToolClient(InProcessTransport(tools, options={"text_search": search}))
    cfg = AgentConfig(max_turns=6, max_new_tokens=96, max_episode_tokens=2048, temperature=temperature)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int):
        q, a = scripted.PLANS[i % len(scripted.PLANS)][:2]
        async with gate:
            return await run_episode(engine, {"id": f"b{i}", "question": q, "answer": a},
                                     [scripted.picture(i % len(scripted.PLANS))], client, cfg,
                                     processor=engine.processor, tools=schemas, seed=i)

    start = time.perf_counter()
    trajs = await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.perf_counter() - start
    calls = [sum(t.action == "tool_call" for t in tr.turns) for tr in trajs]
    return {"concurrency": concurrency, "episodes": n, "seconds": round(wall, 2), "traj_per_s": round(n / wall, 3),
            "tool_calls_per_episode": round(sum(calls) / n, 2), "min_tool_calls": min(calls),
            "responses": sum(tr.stop_reason == "response" for tr in trajs)}


def engine_figures(before: dict, after: dict) -> dict:
    """What the engine did in one run: rows per decoding step, and the share of prompt tokens served from cache."""
    d = {k: after[k] - before[k] for k in after}
    return {"decode_steps": d["steps"], "mean_rows_per_step": round(d["row_steps"] / max(1, d["steps"]), 2),
            "prompt_tokens_cached": round(d["cached_tokens"] / max(1, d["cached_tokens"] + d["prefill_tokens"]), 3)}


def main(argv: list[str] | None = None) -> None:
    args, _ = script_flags(sys.argv[1:] if argv is None else argv,
                           {"episodes": 32, "concurrency": 32, "latency": 0.2, "temperature": 0.5, "threads": 1,
                            "max_batch": 32})
    episodes, concurrency = args["episodes"], args["concurrency"]
    latency, temperature = args["latency"], args["temperature"]
    torch.set_num_threads(args["threads"])
    engine = HFEngine(scripted.tiny_agent_checkpoint(), max_batch=args["max_batch"])
    search = text_search.build_text_index(cfg=text_search.TextSearchConfig(dense_rerank=False))
    asyncio.run(run(engine, 2, 1, latency, temperature, search))  # warm-up: text_search index, first generate
    serial_n = max(4, episodes // 4)  # the baseline's rate settles after a few episodes; keep it short
    s0 = dict(engine.stats)
    serial = asyncio.run(run(engine, serial_n, 1, latency, temperature, search))
    serial.update(engine_figures(s0, engine.stats))
    print(json.dumps(serial), flush=True)
    s0 = dict(engine.stats)
    concurrent = asyncio.run(run(engine, episodes, concurrency, latency, temperature, search))
    concurrent.update(engine_figures(s0, engine.stats))
    print(json.dumps(concurrent), flush=True)
    ratio = concurrent["traj_per_s"] / serial["traj_per_s"]
    print(json.dumps({"serial_traj_per_s": serial["traj_per_s"], "inflight_traj_per_s": concurrent["traj_per_s"],
                      "concurrency": concurrency, "latency_s": latency,
                      "tool_calls_per_episode": concurrent["tool_calls_per_episode"],
                      "min_tool_calls": min(serial["min_tool_calls"], concurrent["min_tool_calls"]),
                      "ratio": round(ratio, 2)}), flush=True)


if __name__ == "__main__":
    main()
