"""The GPU code paths, measured on one GPU: run through ``bench/gpu_check.sh`` (which checks for CUDA first).

1. EDSR on CUDA (fp16, the device ``load_model`` picks): images/s of 64 inputs of 128x128 upscaled one
   per forward pass vs in batches of 16 (what a ``@serve.batch`` replica does). ``ratio`` = batched /
   unbatched.
2. The HF engine (``osvl.agent.engines.hf``, bf16 on CUDA): generated tokens/s of 16 concurrent turns
   of 64 tokens, on the tiny test model and on a random-initialised Qwen3-VL whose text model has
   Qwen2.5-0.5B's shape (24 layers, 896 wide, 14/2 heads, Qwen's 151,936-token embedding).
3. Weight update of that model from this process (the learner) into a child process that holds a
   copy and generates: through CUDA IPC (``osvl.rl.weights.cuda_ipc_handles``: handles, no copy, then
   one device-to-device copy in the child) vs a CPU copy (GPU -> host, pickled through a pipe, host ->
   GPU), each timed until the child reports the weights in place.

4. The learner on one GPU as a job runs it, without Ray Train (needs DeepSpeed: its wheel is small and
   pure Python until an op is built): a one-rank NCCL group, bf16 with fp32 master weights, ZeRO-3,
   the model built partitioned (``load_trainable``), gradient checkpointing. Two SFT steps and two GRPO
   learner steps (``Learner.step``, the reference model as a ZeRO-3 engine) of the tiny model, their
   losses printed; then one GRPO step of the Qwen-shaped 0.5B model on one micro-batch of
   ``rl.micro_tokens`` tokens, ``torch.cuda.max_memory_allocated`` beside what ``jobs/grpo.py --check``
   estimates for that rank (``osvl.rl.plan.learner_gpu_bytes``; the goal: within 25%).

Nothing else here needs Ray, vLLM or DeepSpeed; what would (vLLM's own update path, NCCL across nodes)
prints ``skipped: <reason>``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.learner import episode
from osvl.agent.engines.base import GenRequest, Sampling
from osvl.agent.engines.hf import HFEngine
from osvl.models.load import load_model, load_processor
from osvl.models.tiny import model_config, tiny_checkpoint, train_tokenizer
from osvl.rl.learner import Learner, RLConfig, learner_ds_config, make_engine
from osvl.rl.learner_loop import rank_share, reference_model, rl_batch
from osvl.rl.plan import learner_gpu_bytes, model_shape
from osvl.rl.weights import cuda_ipc_handles, from_cuda_ipc
from osvl.tools.super_resolution import edsr_device, upscale_batch
from osvl.tools.super_resolution import load_model as load_edsr
from osvl.train.batch import collate, masked_nll, token_logprobs
from osvl.train.deepspeed import ds_config, hidden_size, init_engine, init_process_group, load_trainable

# Qwen2.5-0.5B's text shape; mrope_section splits head_dim / 2 = 32 rotary frequencies (t, h, w)
QWEN_05B_TEXT = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936}


DEVICE = "cuda"  # a CPU dry run of this script's plumbing sets "cpu" (CUDA IPC then cannot run)


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


def edsr() -> dict:
    device = edsr_device()
    model = load_edsr()
    p = next(model.parameters())
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (128, 128, 3), dtype=np.uint8) for _ in range(64)]
    upscale_batch(model, images[:16])  # warm-up: cuDNN picks its kernels per shape
    upscale_batch(model, images[:1])
    t0 = time.perf_counter()
    for im in images:
        upscale_batch(model, [im])
    single = len(images) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(0, len(images), 16):
        upscale_batch(model, images[i:i + 16])
    batched = len(images) / (time.perf_counter() - t0)
    say(f"EDSR x4 128x128 on {device} ({p.dtype}): {single:.1f} images/s one by one, {batched:.1f} batched by 16")
    return {"edsr_device": device, "edsr_dtype": str(p.dtype), "edsr_single_img_s": round(single, 1),
            "edsr_batched_img_s": round(batched, 1)}


def qwen_05b_checkpoint(out: Path) -> Path:
    """A random-init Qwen3-VL with Qwen2.5-0.5B's text shape: the tiny checkpoint's tokenizer and processor."""
    tiny = tiny_checkpoint("qwen3_vl")
    for f in tiny.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = model_config("qwen3_vl", train_tokenizer())
    for k, v in QWEN_05B_TEXT.items():
        setattr(config.text_config, k, v)
    config.text_config.rope_parameters["mrope_section"] = [12, 10, 10]
    config.vision_config.out_hidden_size = QWEN_05B_TEXT["hidden_size"]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    say(f"built a random-init Qwen-shaped model of {n / 1e6:.0f}M parameters")
    del model
    return out


async def _turns(engine: HFEngine, n: int, new_tokens: int) -> int:
    ids = engine.tokenizer("Describe the picture of the animal shown and name its habitat.")["input_ids"]
    reqs = [GenRequest(list(ids) * 4, [], [], Sampling(temperature=1.0, max_new_tokens=new_tokens, seed=i))
            for i in range(n)]
    results = await asyncio.gather(*[engine.generate(r) for r in reqs])
    return sum(len(r.token_ids) for r in results)


def engine_tokens_s(path: Path, label: str) -> float:
    engine = HFEngine(path, dtype="bfloat16", device=DEVICE, max_batch=16)
    try:
        asyncio.run(_turns(engine, 2, 8))  # warm-up
        t0 = time.perf_counter()
        tokens = asyncio.run(_turns(engine, 16, 64))
        rate = tokens / (time.perf_counter() - t0)
    finally:
        engine.close()
    say(f"HF engine, {label}: {tokens} tokens in 16 concurrent turns, {rate:.0f} tokens/s")
    return rate


def _generator(path: str, device: str, conn) -> None:
    """The generating process: holds the model on the GPU, applies each update it is sent, says when done."""
    engine = HFEngine(path, dtype="bfloat16", device=device, max_batch=4)
    asyncio.run(_turns(engine, 1, 4))
    conn.send("ready")
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            break
        state = from_cuda_ipc(payload) if kind == "ipc" else {k: v.to(device) for k, v in payload.items()}
        engine.update_weights(state, 1)  # returns once the engine thread has copied every tensor in
        del state
        conn.send("done")
    engine.close()


def weight_update(path: Path, kinds: tuple[str, ...] = ("ipc", "cpu")) -> dict:
    learner = load_model(path, dtype="bfloat16", device=DEVICE)
    state = {k: v.detach() for k, v in learner.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_generator, args=(str(path), DEVICE, child))
    proc.start()
    try:
        assert parent.recv() == "ready"
        timings: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(3):
            for kind in kinds:
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                payload = cuda_ipc_handles(state) if kind == "ipc" else {k: v.to("cpu") for k, v in state.items()}
                parent.send((kind, payload))
                assert parent.recv() == "done"
                timings[kind].append(time.perf_counter() - t0)
        parent.send(("stop", None))
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    best = {kind: min(t) for kind, t in timings.items()}
    say(f"weight update of {nbytes / 2**20:.0f} MiB into a generating process (best of 3): "
        + ", ".join(f"{'CUDA IPC' if k == 'ipc' else 'CPU copy'} {v:.3f} s" for k, v in best.items()))
    return {"update_mib": round(nbytes / 2**20), **{f"update_{k}_s": round(v, 3) for k, v in best.items()}}


def _learner(path: Path, cfg, groups) -> tuple[object, object]:
    """A one-rank GRPO learner built as ``osvl.rl.learner_loop.train_loop`` builds it (bf16, ZeRO-3, on GPU)."""
    ds = learner_ds_config(cfg, zero_stage=3, world=1, bf16=True, hidden_size=hidden_size(path), on_gpu=True)
    model = load_trainable(path, ds, grad_checkpointing=True)
    ref = reference_model(path, cfg, ds, policy=model)
    learner = Learner(make_engine(model, cfg, config=ds), cfg, ref_model=ref)
    processor = load_processor(path)
    return learner, [(rl_batch(c, "", processor, cfg), live) for c, live in rank_share(groups, 0, 1, cfg)]


def learner_steps(path05b: Path) -> dict:
    """Part 4 (module docstring)."""
    try:
        import deepspeed  # noqa: F401, PLC0415 (a) optional: the GPU machine may lack it
    except ImportError:
        say("learner steps: skipped: deepspeed is not installed here")
        return {}

    init_process_group()  # one rank: NCCL on CUDA (DeepSpeed's choice for the accelerator)
    tiny = tiny_checkpoint("qwen3_vl")
    rng = random.Random(0)
    rows = [episode(rng, 0, i, 600 + 40 * i, float(i % 2)) for i in range(4)]
    out: dict = {}
    # SFT: the loss of sft_loop's micro-batch (gen-token NLL), two optimiser steps
    ds = ds_config(3, micro_batch=2, grad_accum=1, world_size=1, bf16=True, hidden_size=hidden_size(tiny), on_gpu=True)
    model = load_trainable(tiny, ds, grad_checkpointing=True)
    engine = init_engine(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4),
                         None, ds)
    batch = collate(rows[:2], "", load_processor(tiny), 4096, "cut")
    losses = []
    for _ in range(2):
        nll, n = masked_nll(token_logprobs(engine, batch), batch["gen_mask"])
        engine.backward(nll / n)
        engine.step()
        losses.append(round(float((nll / n).detach()), 4))
    say(f"SFT, tiny model, 1 rank NCCL, bf16, ZeRO-3: losses {losses}")
    out["sft_losses"] = losses
    del engine, model
    # GRPO: two learner steps of one group
    cfg = RLConfig(beta=0.01, lr=1e-5, max_len=4096, micro_tokens=2048)
    learner, micro = _learner(tiny, cfg, [rows])
    steps = [learner.step(micro) for _ in range(2)]
    out["grpo_losses"] = [round(r.loss, 4) for r in steps]
    say(f"GRPO learner, tiny model, 1 rank NCCL, bf16, ZeRO-3: losses {out['grpo_losses']}, "
        f"grad norms {[round(r.grad_norm, 4) for r in steps]}")
    del learner, micro
    # the 0.5B model: one step of one micro-batch at the budget, measured against --check's estimate
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = RLConfig(beta=0.01, lr=1e-5, max_len=4096, micro_tokens=4096)
    group = [episode(rng, 1, i, 1000, float(i % 2)) for i in range(4)]
    learner, micro = _learner(path05b, cfg, [group])
    learner.step(micro)
    used = torch.cuda.max_memory_allocated()
    tokens = max(len(b["input_ids"][0]) * len(b["input_ids"]) for b, _ in micro)
    want = sum(learner_gpu_bytes(model_shape(path05b / "config.json"), tokens, 1, 3, bf16=True,
                                 grad_checkpointing=True, reference=True).values())
    say(f"GRPO learner, 0.5B shape, one micro-batch of {tokens} tokens: max_memory_allocated "
        f"{used / 2**30:.2f} GiB, --check estimate {want / 2**30:.2f} GiB ({used / want:.2f} of it)")
    out.update(learner_peak_gib=round(used / 2**30, 2), check_estimate_gib=round(want / 2**30, 2),
               measured_over_estimate=round(used / want, 2))
    return out


def main() -> None:
    t_start = time.perf_counter()
    say(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    figures = edsr()
    figures["tiny_tokens_s"] = round(engine_tokens_s(tiny_checkpoint("qwen3_vl"), "tiny Qwen3-VL"))
    with tempfile.TemporaryDirectory(prefix="osvl-gpu-check-") as tmp:
        path = qwen_05b_checkpoint(Path(tmp))
        figures["qwen05b_tokens_s"] = round(engine_tokens_s(path, "Qwen-shaped 0.5B"))
        figures.update(weight_update(path))
        figures.update(learner_steps(path))
    for part, module in (("vLLM engine update_weights", "vllm"), ("Ray-placed NCCL broadcast", "ray")):
        try:
            __import__(module)
            say(f"{part}: not measured by this script")
        except ImportError:
            say(f"{part}: skipped: {module} is not installed here")
    figures["ratio"] = round(figures["edsr_batched_img_s"] / figures["edsr_single_img_s"], 2)
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
