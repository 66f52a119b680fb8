"""Eval throughput: agentic items/s with 1 item in flight vs 32, under a simulated 200 ms tool latency.

    python bench/eval.py [--items=32] [--concurrency=32] [--latency=0.2] [--threads=1]

What runs is the eval job's own actor code (``osvl.eval.job.EvalWorker.run``), here in this
process rather than in a Ray actor so the figure is the evaluator's, not Ray's start-up: the
tiny agent checkpoint on the HF engine, agentic mode, greedy, the real in-process tools
(BM25 text_search, no MiniLM re-rank: see bench/rollout.py for why), no tool cache, every tool
call ``--latency`` seconds slower (what a remote tool service costs). Items are the scripted
agent questions on their synthetic pictures. Baseline: ``concurrency=1`` on a quarter of the
items; then ``--concurrency`` at once, while the engine batches the turns of the episodes that
wait for it. The last stdout line is JSON with ``ratio`` = items/s in flight / one at a time
(goal >= 6).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from osvl.agent import scripted  # noqa: E402
from osvl.config import script_flags, to_dict  # noqa: E402
from osvl.eval.job import EvalConfig, EvalWorker  # noqa: E402


def items(n: int, folder: Path) -> list[tuple[str, str, dict]]:
    out = []
    for i in range(n):
        k = i % len(scripted.PLANS)
        path = folder / f"p{k}.png"
        if not path.exists():
            Image.fromarray(scripted.picture(k)).save(path)
        q, a = scripted.PLANS[k][:2]
        out.append(("bench", "agentic", {"id": f"b{i}", "question": q, "answer": a, "answer_aliases": [],
                                         "images": [str(path)]}))
    return out


def measure(worker: EvalWorker, chunk: list, concurrency: int) -> dict:
    worker.cfg.concurrency = concurrency
    t0 = time.perf_counter()
    recs = asyncio.run(worker.run(chunk))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "items": len(chunk), "seconds": round(wall, 2),
            "items_per_s": round(len(chunk) / wall, 3),
            "tool_calls_per_item": round(sum(r["tool_calls"] for r in recs) / len(recs), 2),
            "pass_at_1": round(sum(float(r["correct"]) for r in recs) / len(recs), 3)}


def main(argv: list[str] | None = None) -> None:
    args, _ = script_flags(sys.argv[1:] if argv is None else argv,
                           {"items": 32, "concurrency": 32, "latency": 0.2, "threads": 1})
    n, concurrency, latency = args["items"], args["concurrency"], args["latency"]
    torch.set_num_threads(args["threads"])
    cfg = EvalConfig(model="tiny-agent", modes=["agentic"], tool_cache="off",
                     tool_latency_s=latency, max_batch=32)
    cfg.agent.max_new_tokens = 96
    with tempfile.TemporaryDirectory() as tmp:
        worker = EvalWorker(to_dict(cfg), str(Path(tmp) / "cache"), str(scripted.tiny_agent_checkpoint()))
        work = items(n, Path(tmp))
        measure(worker, work[:2], 1)  # warm-up: the text_search index, the first generate
        serial = measure(worker, work[:max(4, n // 4)], 1)
        print(json.dumps(serial), flush=True)
        concurrent = measure(worker, work, concurrency)
        print(json.dumps(concurrent), flush=True)
    print(json.dumps({"serial_items_per_s": serial["items_per_s"], "inflight_items_per_s": concurrent["items_per_s"],
                      "concurrency": concurrency, "latency_s": latency,
                      "tool_calls_per_item": concurrent["tool_calls_per_item"],
                      "ratio": round(concurrent["items_per_s"] / serial["items_per_s"], 2)}), flush=True)


if __name__ == "__main__":
    main()
