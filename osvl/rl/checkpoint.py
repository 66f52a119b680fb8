"""GRPO checkpoints: everything a resumed run needs to continue exactly where the checkpoint stands.

One folder per checkpoint, ``<run>/checkpoints/step_<NNNNNN>/``:

* ``ds/`` — DeepSpeed's model and optimizer state (every rank's ZeRO shard: Adam
  moments included) and ``client_state``: step, skipped steps, policy version and
  every rank's RNG states (torch, NumPy, Python);
* ``hf/`` — the policy as a Hugging Face directory (evaluation, serving, and the
  rollout actors' starting weights on resume);
* ``buffer.pkl`` — the trajectory buffer's state: the data cursor, the ledger, the
  ready groups; slots that were in flight are re-issued on resume (their actors are
  gone), so no group is lost and none trains twice.

A checkpoint is written into a hidden temporary folder and renamed when complete,
so a run killed while saving leaves the previous checkpoint as the latest. The
launcher reads the latest one *before* starting anything (the buffer is rebuilt
from it before any rollout actor asks for work).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

PREFIX = "step_"


def folder(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (temporary folders are ignored)."""
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))
    return done[-1] if done else None


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save(engine: Any, root: Path, step: int, learner: Any, buffer: Any, processor: Any, rank: int, world: int,
         keep: int = 2) -> Path:
    """Write the checkpoint of ``step`` (a collective: every learner rank calls it)."""
    import ray
    import torch.distributed as dist

    from osvl.train.deepspeed import save_checkpoint

    tmp = root / f".{PREFIX}{step:06d}.tmp"
    rngs = [rng_state()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state())
    client = {"step": learner.step_count, "skipped": learner.skipped, "version": learner.step_count + learner.skipped,
              "rng": rngs}
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier()
    save_checkpoint(engine, tmp, client, processor)
    if world > 1:
        dist.barrier()
    final = folder(root, step)
    if rank == 0:
        state = ray.get(buffer.state.remote())
        (tmp / "buffer.pkl").write_bytes(pickle.dumps(state))
        write_probe(engine, tmp / "probe.json", step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return final


def load_learner(engine: Any, path: Path) -> dict[str, Any]:
    """Restore model and optimizer (Adam moments) into ``engine``; returns the saved client state."""
    from osvl.train.deepspeed import load_checkpoint

    return load_checkpoint(engine, path)


def load_buffer_state(path: Path) -> dict[str, Any]:
    return pickle.loads((path / "buffer.pkl").read_bytes())


def tensor_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the exact bytes of ``tensors`` (float32, CPU): equality of state, bit for bit."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(optimizer: Any, key: str) -> list[torch.Tensor]:
    """Every ``key`` (exp_avg, exp_avg_sq) tensor of a (possibly ZeRO-wrapped) torch optimizer, in group order."""
    inner = getattr(optimizer, "optimizer", optimizer)
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state.get(p, {})
            if key in st:
                out.append(st[key])
    return out


def write_probe(engine: Any, path: Path, step: int) -> None:
    """Digests of the weights and Adam moments (rank 0's partition): written when a checkpoint is saved
    and again right after it is loaded, so a test can check that the resumed state is the saved one."""
    inner = engine.optimizer
    probe = {"step": step,
             "weights": tensor_digest([p for _, p in sorted(engine.module.state_dict().items())]),
             "exp_avg": tensor_digest(optimizer_tensors(inner, "exp_avg")),
             "exp_avg_sq": tensor_digest(optimizer_tensors(inner, "exp_avg_sq")),
             "exp_avg_abs_sum": float(sum(t.abs().sum() for t in optimizer_tensors(inner, "exp_avg")))}
    path.write_text(json.dumps(probe))
