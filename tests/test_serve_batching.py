"""The EDSR batch path of serve/app.py without a cluster: one forward pass per input size per batch."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import osvl.tools.super_resolution as sr
import serve.app as app
from osvl.tools.base import REGISTRY, ToolContext, call_tool


@pytest.mark.slow
def test_coalescer_merges_a_batch_into_one_forward_per_shape_and_matches_single_calls():
    torch.manual_seed(0)
    model = sr.build_model(num_feat=8, num_block=1).eval()
    with torch.no_grad():  # leave the bicubic-start init so outputs are not trivially bicubic
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    forwards = []
    model.register_forward_hook(lambda m, inp, out: forwards.append(tuple(inp[0].shape)))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (24, 32, 3), dtype=np.uint8) for _ in range(4)]
    images += [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(2)]
    tool = REGISTRY["super_resolution"]
    calls = [{"image": "img_1"} for _ in images] + [{"image": "img_1", "scale": float("nan")}]
    images.append(images[0])
    coalescer = app._Coalescer(model, parties=len(calls))
    results = [None] * len(calls)

    def run(i: int) -> None:
        try:
            ctx = ToolContext({"img_1": images[i]}, options={"edsr": coalescer})
            results[i] = call_tool(tool, calls[i], ctx)
        finally:
            coalescer.leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(forwards) == [(2, 3, 16, 16), (4, 3, 24, 32)]  # two forwards for seven calls
    assert results[-1].error.kind == "invalid_call"  # the bad call left without blocking the batch
    for img, res in zip(images[:-1], results[:-1], strict=True):
        single = call_tool(tool, {"image": "img_1"}, ToolContext({"img_1": img}, options={"edsr": model}))
        assert res.ok and res.images["img_2"].shape == (img.shape[0] * 4, img.shape[1] * 4, 3)
        # batched and single convolutions may round differently by one grey level at most
        assert np.abs(res.images["img_2"].astype(int) - single.images["img_2"]).max() <= 1
