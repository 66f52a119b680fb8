"""SFT data-parallel scaling, tokens/s: 2 workers x 1 thread over 1 worker x 1 thread.

    .venv/bin/python bench/sft.py [--steps 8] [--rows 32]

Three runs on the same data (2,000-token teacher-style trajectories: system prompt with every
tool's schema, one photo, three tool turns, built with ``TrajectoryBuilder`` for the tiny model)
and the same global batch (4 trajectories per optimizer step): 1 worker x 1 thread (the
baseline), 2 workers x 1 thread and 1 worker x 2 threads. The headline ``ratio`` is
(2 workers x 1 thread) / (1 worker x 1 thread): data-parallel scaling at equal threads per
worker, the way users read it (2.0 is perfect scaling; Ray Train + DeepSpeed ZeRO-2 over gloo
pays for the gradient all-reduce). ``threads_ratio`` beside it is (1 worker x 2 threads) /
(1 worker x 1 thread): what the second core buys inside one process instead. Tokens/s is
measured over the optimizer steps only (``step_s`` in the train log; start-up, checkpoints and
the first two steps are left out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import ray
from skimage.data import astronaut

from osvl import chat as fmt
from osvl.agent.trajectory import TrajectoryBuilder, write_trajectories
from osvl.config import parse_args
from osvl.models.load import load_processor
from osvl.models.tiny import tiny_checkpoint
from osvl.sft.job import JOB, SftConfig, run
from osvl.tools.registry import all_tools


def make_data(out: Path, rows: int) -> None:
    """``rows`` trajectories of about 2,000 tokens with one photo each."""
    processor = load_processor(tiny_checkpoint("qwen3_vl"))
    tools = [t.schema for t in all_tools().values()]
    photo = np.ascontiguousarray(astronaut())
    trajs, images = [], {}
    for k in range(rows):
        b = TrajectoryBuilder(processor)
        b.add_image(photo)
        b.add_text(fmt.render([{"role": "user", "content": f"Who is pictured in img_1? ({k})", "images": ["img_1"]}],
                              tools=tools, add_generation_prompt=True))
        for t in range(3):
            call = {"name": "text_search", "arguments": {"query": f"astronaut portrait {k} {t}"}}
            b.add_model_text(fmt.assistant_text(f"Search for the portrait, attempt {t}.", tool_call=call), t)
            b.add_text(fmt.IM_END + "\n" + fmt.render([{"role": "tool", "content": "1. Bruce McCandless II — "
                                                        "astronaut, first untethered spacewalk. " * 3}])
                       + fmt.IM_START + "assistant\n")
        b.add_model_text(fmt.assistant_text("Found him.", response="Bruce McCandless II"), 3)
        b.add_text(fmt.IM_END + "\n")
        tr = b.build(kind="teacher", id=f"b{k}", question_id=f"q{k}", group_id="", question="", answer="",
                     answer_aliases=[], turns=[])
        trajs.append(tr)
        images[tr.images[0]] = photo
    write_trajectories(out, trajs, images)


def measure(data: Path, root: Path, workers: int, threads: int, steps: int) -> dict:
    argv = [f"--run.root={root}", f"--data.trajectories={data}", "--data.n_eval=0", "--data.val_fraction=0",
            f"--workers={workers}", f"--threads_per_worker={threads}", f"--micro_batch={4 // workers}",
            f"--max_steps={steps}", f"--ckpt_every={steps}", "--val_every=0", f"--log_every={steps}",
            "--max_len=4096"]
    report = run(parse_args(SftConfig, JOB, argv), log=lambda m: None)
    log = [json.loads(x) for x in Path(report["model"]).parent.joinpath("train_log.jsonl").read_text().splitlines()]
    timed = log[2:]
    tokens, secs = sum(r["tokens"] for r in timed), sum(r["step_s"] for r in timed)
    return {"workers": workers, "threads_per_worker": threads, "steps_timed": len(timed),
            "tokens": tokens, "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="osvl-bench-sft-") as tmp:
        data = Path(tmp) / "data"
        make_data(data, args.rows)
        runs = {}
        for workers, threads in ((1, 1), (2, 1), (1, 2)):
            runs[f"{workers}x{threads}"] = measure(data, Path(tmp) / f"w{workers}t{threads}", workers, threads,
                                                   args.steps)
            print(json.dumps(runs[f"{workers}x{threads}"]), flush=True)

    ray.shutdown()  # no worker log line may arrive after the headline
    rate = {k: r["tokens_per_s"] for k, r in runs.items()}
    print(json.dumps({"tokens_per_s": rate, "baseline": "1 worker x 1 thread",
                      "ratio": round(rate["2x1"] / rate["1x1"], 3),
                      "threads_ratio": round(rate["1x2"] / rate["1x1"], 3)}))


if __name__ == "__main__":
    main()
