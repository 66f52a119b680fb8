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
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIRST_ORDINARY = 300  # ids below are bytes, special tokens and the most frequent merges


def copy_row(rng: random.Random, vocab: list[int], marker: list[int]) -> tuple[list[int], int]:
    """One synthetic row and the index where the copied span starts."""
    span = [rng.choice(vocab) for _ in range(rng.randint(3, 8))]
    a, b = ([rng.choice(vocab) for _ in range(rng.randint(5, 30))] for _ in range(2))
    head = a + marker + span + b + marker
    return head + span, len(head)


def run(model, steps: int, batch: int, vocab: list[int], marker: list[int], seed: int, log) -> dict:
    import torch

    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    pad = int(model.config.text_config.pad_token_id)
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        rows = [copy_row(rng, vocab, marker) for _ in range(batch)]
        width = max(len(r) for r, _ in rows)
        ids = torch.full((batch, width), pad)
        target = torch.full((batch, width), -100)
        for i, (r, start) in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            target[i, start:len(r)] = torch.tensor(r[start:])
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if (step + 1) % 250 == 0:
            log(f"  step {step + 1}: copy loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    copied, total = 0, 0.0
    with torch.no_grad():
        for _ in range(100):
            r, start = copy_row(rng, vocab, marker)
            logits = model(input_ids=torch.tensor([r]), use_cache=False).logits[0, start - 1:-1]
            want = torch.tensor(r[start:])
            copied += bool((logits.argmax(-1) == want).all())
            total += float(torch.nn.functional.cross_entropy(logits, want))
    return {"copy_loss": round(total / 100, 4), "copied": copied, "of": 100,
            "seconds": round(time.perf_counter() - t0, 1)}


def tie_and_scale(base: Path, out: Path, scale: float) -> Path:
    """A copy of ``base`` whose output embeddings are its input embeddings, scaled by ``scale``."""
    import torch

    from osvl.models.load import load_model

    shutil.copytree(base, out)
    model = load_model(base, dtype="float32", device="cpu")
    emb = model.get_input_embeddings()
    with torch.no_grad():
        emb.weight.mul_(scale)
    model.config.tie_word_embeddings = True
    model.config.text_config.tie_word_embeddings = True
    model.get_output_embeddings().weight = emb.weight
    model.save_pretrained(out)
    return out


def main() -> None:
    import torch

    from osvl.models.load import load_model, load_processor
    from osvl.models.tiny import tiny_checkpoint

    flag = {a.split("=", 1)[0][2:]: a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--") and "=" in a}
    steps, n_vocab = int(flag.get("steps", 1500)), int(flag.get("vocab", 3700))
    batch, scale = int(flag.get("batch", 32)), float(flag.get("scale", 5))
    torch.set_num_threads(2)
    base = tiny_checkpoint("qwen3_vl")
    tok = load_processor(base).tokenizer
    vocab = list(range(FIRST_ORDINARY, FIRST_ORDINARY + n_vocab))
    if vocab[-1] >= len(tok):
        raise SystemExit(f"--vocab={n_vocab} reaches past the tokenizer's {len(tok)} tokens")
    marker = tok.encode(' "query":', add_special_tokens=False)
    out = {}
    with tempfile.TemporaryDirectory(prefix="osvl-bench-induction-") as tmp:
        variants = {"as_built": base, "tied_scaled": tie_and_scale(base, Path(tmp) / "tied", scale)}
        for name, path in variants.items():
            print(f"{name}: {steps} steps, batch {batch}, {n_vocab} tokens", flush=True)
            torch.manual_seed(0)
            model = load_model(path, dtype="float32", device="cpu")
            out[name] = run(model, steps, batch, vocab, marker, seed=0, log=lambda m: print(m, flush=True))
            print(f"{name}: {out[name]}", flush=True)
    ratio = out["as_built"]["copy_loss"] / max(out["tied_scaled"]["copy_loss"], 1e-6)
    print(json.dumps({"ratio": round(ratio, 3), "steps": steps, "vocab": n_vocab, "batch": batch, "scale": scale,
                      "chance_loss": round(math.log(n_vocab), 4), **out}))


if __name__ == "__main__":
    main()
