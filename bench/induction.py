"""How fast the tiny policy learns to copy a span it has never seen: as built, and with tied, scaled embeddings.

Copying a name from a tool response into the next query is what the demo policy cannot do
(docs/design.md, "The demo policy"): it needs an induction head (attend to what followed the earlier
occurrence of the current token), and in the tiny Qwen3-VL of ``osvl.models.tiny`` (untied
embeddings, initializer std 0.02) that head does not form within the steps a CPU affords at the
tokenizer's full vocabulary. This bench trains, from the same random weights, two variants on
synthetic copy rows and scores each on fresh rows:

- ``as_built``: the checkpoint as ``tiny_checkpoint`` builds it;
- ``tied_scaled``: output embeddings tied to the input ones, those scaled by ``--scale`` (5: std 0.1).
  A copy circuit then needs no per-token output row: the logit of token x for a residual that carries
  x's embedding is |e_x|^2, the largest of all, for every token, seen in training or not.

A row: 5-30 random tokens, a marker (``"query":``), a span of 3-8 random tokens, 5-30 more random
tokens, the marker, the span again; the loss counts the second span only (the rest is unpredictable
by construction). Tokens are drawn from ``--vocab`` ordinary tokens of the tiny tokenizer.

    .venv/bin/python bench/induction.py [--steps=1500] [--vocab=3700] [--scale=5] [--batch=32]

Last stdout line: JSON with each variant's final copy loss and whole spans copied (of 100 fresh
rows), and ``ratio`` = the as-built copy loss over the tied-scaled one (chance is ln(vocab)).
About 8 minutes per variant at 1,500 steps on 2 cores.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from osvl.config import script_flags  # noqa: E402
from osvl.models.load import load_model, load_processor  # noqa: E402
from osvl.models.pretrain import FIRST_ORDINARY, copy_row, copy_score, copy_train, tie_and_scale  # noqa: E402
from osvl.models.tiny import tiny_checkpoint  # noqa: E402


def main() -> None:
    flag, _ = script_flags(sys.argv[1:], {"steps": 1500, "vocab": 3700, "batch": 32, "scale": 5.0})
    steps, n_vocab, batch, scale = flag["steps"], flag["vocab"], flag["batch"], flag["scale"]
    torch.set_num_threads(2)
    base = tiny_checkpoint("qwen3_vl")
    tok = load_processor(base).tokenizer
    vocab = list(range(FIRST_ORDINARY, FIRST_ORDINARY + n_vocab))
    if vocab[-1] >= len(tok):
        raise SystemExit(f"--vocab={n_vocab} reaches past the tokenizer's {len(tok)} tokens")
    marker = tok.encode(' "query":', add_special_tokens=False)

    def rows(rng: random.Random) -> tuple[list[int], int]:
        return copy_row(rng, vocab, marker)
    out = {}
    for name in ("as_built", "tied_scaled"):
        print(f"{name}: {steps} steps, batch {batch}, {n_vocab} tokens", flush=True)
        torch.manual_seed(0)
        model = load_model(base, dtype="float32", device="cpu")
        if name == "tied_scaled":
            tie_and_scale(model, scale)
        rng, t0 = random.Random(0), time.perf_counter()
        copy_train(model, steps, rows, rng, log=lambda m: print(m, flush=True), batch=batch)
        out[name] = {**copy_score(model, rows, rng), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name}: {out[name]}", flush=True)
    ratio = out["as_built"]["copy_loss"] / max(out["tied_scaled"]["copy_loss"], 1e-6)
    print(json.dumps({"ratio": round(ratio, 3), "steps": steps, "vocab": n_vocab, "batch": batch, "scale": scale,
                      "chance_loss": round(math.log(n_vocab), 4), **out}))


if __name__ == "__main__":
    main()
