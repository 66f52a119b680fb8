"""Forward+backward of the tiny Qwen3-VL over a 1,000-token multi-turn trajectory with one photo, on CPU.

    .venv/bin/python bench/tiny_model.py [--steps 5] [--threads 1]

The issue sizes the tiny model so that this step takes "well under a second" on CPU; the
headline ``ratio`` is that one-second budget over the measured CPU time per step (higher is
better, >1 means within budget). CPU time (``time.process_time``) is reported next to wall time
because the dev machine is shared and wall time there mostly measures the neighbours. The same
step with ``attn_implementation="eager"`` is measured in the same run as the baseline
implementation, since it is what transformers falls back to where SDPA is unavailable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from skimage.data import astronaut

from osvl import chat as fmt
from osvl.models.load import load_model, load_processor
from osvl.models.tiny import tiny_checkpoint

BUDGET_S = 1.0
TARGET_TOKENS = 1000


def trajectory(processor) -> dict:
    """Question with one photo, then search turns until the rendered episode reaches TARGET_TOKENS."""
    messages = [{"role": "user", "content": "Who is the person in the image?", "images": ["img_1"]}]
    while True:
        call = {"name": "text_search", "arguments": {"query": "astronaut portrait 1984 NASA"}}
        turn = fmt.assistant_text("Search for the portrait.", tool_call=call)
        messages.append({"role": "assistant", "content": turn})
        messages.append({"role": "tool", "content": "1. Bruce McCandless II — astronaut, first untethered spacewalk."})
        inputs = processor(images=[astronaut()], text=[fmt.render(messages)], return_tensors="pt")
        if inputs["input_ids"].shape[1] >= TARGET_TOKENS:
            return inputs


def measure(path, inputs: dict, attn: str, steps: int) -> dict:
    model = load_model(path, attn_implementation=attn).train()
    cpu, wall = [], []
    for i in range(steps + 2):  # two warm-up steps
        c, w = time.process_time(), time.perf_counter()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = tiny_checkpoint("qwen3_vl")
    inputs = trajectory(load_processor(path))
    model = load_model(path)
    sdpa = measure(path, inputs, "sdpa", args.steps)
    eager = measure(path, inputs, "eager", args.steps)
    print(json.dumps({
        "tokens": inputs["input_ids"].shape[1],
        "image_tokens": int((inputs["input_ids"] == model.config.image_token_id).sum()),
        "params": sum(p.numel() for p in model.parameters()),
        "threads": args.threads,
        "sdpa_cpu_s": round(sdpa["cpu_s"], 4), "sdpa_wall_s": round(sdpa["wall_s"], 4),
        "eager_cpu_s": round(eager["cpu_s"], 4), "eager_wall_s": round(eager["wall_s"], 4),
        "budget_s": BUDGET_S,
        "ratio": round(BUDGET_S / sdpa["cpu_s"], 3),
    }))


if __name__ == "__main__":
    main()
