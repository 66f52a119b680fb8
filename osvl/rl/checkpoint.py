"""GRPO checkpoints: everything a resumed run needs to continue exactly where the checkpoint stands.

One folder per checkpoint, ``<run>/checkpoints/step_<NNNNNN>/``:

* ``ds/`` — DeepSpeed's model and optimizer state (every rank's ZeRO shard: Adam
  moments included) and ``client_state``: step, skipped steps, policy version and
  every rank's RNG states (torch, NumPy, Python);
* ``hf/`` — the policy as a Hugging Face directory (evaluation, serving, and the
  rollout actors' starting weights on resume);
* ``buffer.pkl`` — the trajectory buffer's state: the data cursor, the ledger, the
  ready groups; slots that were in flight are re-issued on resume (their actors are
  gone), so no group is lost and none trains twice;
* ``probe.json`` — digests of rank 0's weights and Adam moments (a test compares them after a resume);
* ``COMPLETE`` — the marker, written last: ``{"step", "world", "files"}`` (every file of the
  checkpoint, relative to its folder). A folder without it is incomplete and never used.

Learner ranks may sit on different nodes, and a run root in object storage is seen through a
node-local mirror per node (``osvl.storage``), so no rank can rename another node's files.
Each node's ranks write into a hidden staging folder ``.step_<NNNNNN>.tmp`` of their own run
folder; every rank then uploads the files it wrote itself (DeepSpeed names them per rank:
``*zero_pp_rank_<r>_*``; rank 0 also every file that names no rank) straight to
``<run root>/checkpoints/step_<NNNNNN>/``, in the background (``storage.UploadQueue``: the next
learner step starts while they upload; a rank with a checkpoint still waiting to upload waits
before saving another), and then stores a receipt ``.uploaded/rank_<r>.json`` naming them. Rank 0's
uploader writes the marker once every rank's receipt is there (read by name: no collective runs
off the training thread), so a checkpoint never counts as done before its last byte is stored.
With a local run root, nothing is uploaded: rank 0 writes the marker
into the staging folder and renames it to ``step_<NNNNNN>``. Either way a run killed while
saving leaves the previous checkpoint as the latest. With a remote run root the staging folders
are deleted once the marker is stored (the node-local copies are only caches), and resuming
pulls the newest marked checkpoint, every rank's shards, from the run root into each node's
mirror (``resume_point``). The launcher reads the latest one *before* starting anything (the
buffer is rebuilt from it before any rollout actor asks for work).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from osvl import storage
from osvl.train import deepspeed as ds  # looked up at each call (tests/test_checkpoint_marker.py fakes them)

PREFIX = "step_"
MARKER = "COMPLETE"  # in a checkpoint folder: written last, after every rank's files are stored
RECEIPTS = ".uploaded"  # in a remote checkpoint folder: rank_<r>.json, each rank's files, once it stored them
RECEIPT_POLL_S = 0.2
RECEIPT_TIMEOUT_S = 6 * 3600.0  # a rank that never reports (it died): the checkpoint stays unmarked
_uploads: storage.UploadQueue | None = None  # this process's background uploader, made at its first remote save
# a file of DeepSpeed's that belongs to one data-parallel rank (model states under ZeRO-3, optimizer states)
RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_")


def folder(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def _staging(root: Path, name: str) -> Path:
    return root / f".{name}.tmp"


def _remote(root: Path) -> str | None:
    """The URI ``root`` mirrors when the run root is remote storage, else None (a local run root)."""
    uri = storage.location(root)
    return uri if uri != str(root) and storage.is_remote(uri) else None


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path) -> bool:
    """A checkpoint folder with its marker and every file the marker lists."""
    marker = read_marker(path)
    return marker is not None and all((path / rel).is_file() for rel in marker.get("files", []))


def _step_folders(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.startswith(PREFIX) and n.removeprefix(PREFIX).isdigit())


def latest(root: Path, fetch: bool = False) -> Path | None:
    """The newest complete checkpoint under ``root`` (unmarked and staging folders are ignored).

    ``fetch``: when ``root`` mirrors remote storage, the newest one *at the run root*, pulled whole
    (every rank's shards) into this node's mirror first; without it, what this node holds.
    """
    uri = _remote(root) if fetch else None
    if uri is not None:
        name = _latest_remote(uri)
        return None if name is None else pull(root, name)
    if not root.is_dir():
        return None
    done = [n for n in _step_folders([p.name for p in root.iterdir() if p.is_dir()]) if is_complete(root / n)]
    return root / done[-1] if done else None


def _latest_remote(uri: str) -> str | None:
    for name in reversed(_step_folders(storage.listdir(uri))):
        if storage.exists(storage.join(uri, name, MARKER)):
            return name
    return None


def pull(root: Path, name: str) -> Path:
    """The checkpoint ``name`` of a remote run root, copied whole into this node's mirror ``root / name``
    (downloaded under a temporary name, then renamed: a half-copied folder is never seen)."""
    uri = _remote(root)
    final = root / name
    if uri is None:
        return final
    tmp = root / f".{name}.pull-{uuid.uuid4().hex[:8]}.tmp"
    try:
        if not storage.download(storage.join(uri, name), tmp) or not is_complete(tmp):
            raise FileNotFoundError(f"checkpoint {storage.join(uri, name)} is incomplete or missing")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resume_point(root: Path, rank: int, local_rank: int, world: int) -> Path | None:
    """The checkpoint every learner rank resumes from (a collective: every rank calls it), with every
    rank's files on every node: rank 0 picks the newest complete one (at the run root when it is
    remote), and the first rank of each other node pulls the same one into its node's mirror
    (DeepSpeed's loader reads every rank's optimizer file)."""
    resume = latest(root, fetch=rank == 0)
    if world == 1:
        return resume
    name = [resume.name if resume is not None else None]
    dist.broadcast_object_list(name, src=0)
    if name[0] is not None and rank != 0 and local_rank == 0:
        pull(root, name[0])
    dist.barrier()
    return None if name[0] is None else root / name[0]


def drop_local(root: Path) -> None:
    """Delete this node's copies of checkpoints (and staging folders) when the run root is remote: the
    run root holds them, and ``resume_point`` pulls what a resume needs. A no-op for a local run root."""
    if _remote(root) is None or not root.is_dir():
        return
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(PREFIX) or p.name.startswith(f".{PREFIX}")):
            shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def owned_files(path: Path, rank: int) -> list[str]:
    """The files under ``path`` (relative, sorted) that ``rank`` wrote: DeepSpeed's files naming that rank;
    for rank 0 also every file naming no rank (model states below ZeRO-3, ``latest``, ``hf/``, ...)."""
    out = []
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        m = RANK_FILE.search(f.name)
        if (int(m.group(1)) if m else 0) == rank:
            out.append(f.relative_to(path).as_posix())
    return out


def _buffer_state(buffer: Any) -> Any:
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    return ray.get(buffer.state.remote())


def save(engine: Any, root: Path, step: int, learner: Any, buffer: Any, processor: Any, rank: int, world: int,
         keep: int = 2, local_rank: int | None = None) -> Path:
    """Write the checkpoint of ``step`` (a collective: every learner rank calls it).

    ``local_rank``: this rank's index on its node (Ray Train's local rank); the first rank of each node
    clears and, for a remote run root, finally deletes that node's staging folder. None: ``rank``
    (every rank on one node). Returns ``root / step_<NNNNNN>``, which exists locally only for a local
    run root (a remote one holds the checkpoint at the run root; ``latest(root, fetch=True)`` pulls it).
    """
    local_rank = rank if local_rank is None else local_rank
    name = f"{PREFIX}{step:06d}"
    final, stage = root / name, _staging(root, name)
    uri = _remote(root)
    rngs = [rng_state()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state())
    client = {"step": learner.step_count, "skipped": learner.skipped, "version": learner.step_count + learner.skipped,
              "rng": rngs}
    if local_rank == 0:
        shutil.rmtree(stage, ignore_errors=True)  # left by a save that died: no stale file gets into this one
    if rank == 0 and uri is not None:
        storage.delete(storage.join(uri, name, MARKER))  # a stale folder of this step: unmarked first, then gone
        storage.delete(storage.join(uri, name))
    if world > 1:
        dist.barrier()
    stage.mkdir(parents=True, exist_ok=True)
    ds.save_checkpoint(engine, stage, client, processor)
    if world > 1:
        dist.barrier()  # ranks that share a node share the staging folder: it is whole before anyone lists it
    if rank == 0:
        storage.atomic_write(stage / "buffer.pkl", pickle.dumps(_buffer_state(buffer)))
        write_probe(engine, stage / "probe.json", step)
    mine = owned_files(stage, rank)
    if world > 1:
        dist.barrier()  # every rank has listed its files: the staging folder is read-only from here on
    if uri is not None:
        global _uploads
        if _uploads is None:
            _uploads = storage.UploadQueue(max_pending=1)
        _uploads.submit(lambda: _upload(root, stage, uri, name, step, mine, rank, world, local_rank, keep))
        return final
    files = [mine]
    if world > 1:  # a collective: when it returns, every rank has written its files
        files = [None] * world
        dist.all_gather_object(files, mine)
    if rank == 0:
        marker = {"step": step, "world": world, "files": sorted(f for fs in files for f in fs)}
        storage.atomic_write(stage / MARKER, json.dumps(marker))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(stage, final)
        prune(root, keep, name)
    if world > 1:
        dist.barrier()
    return final


def _upload(root: Path, stage: Path, uri: str, name: str, step: int, mine: list[str], rank: int, world: int,
            local_rank: int, keep: int) -> None:
    """One rank's part of storing a checkpoint at a remote run root, on the background uploader: its files, then
    its receipt; on rank 0 the marker once every rank's receipt is there, then pruning. The first rank of each
    node finally drops its node's staging folder, once the marker says every rank is done reading it."""
    for rel in mine:
        storage.upload(stage / rel, storage.join(uri, name, rel))
    receipt = stage.parent / f".{name}.receipt-{rank}.json"
    storage.atomic_write(receipt, json.dumps(mine))
    storage.upload(receipt, storage.join(uri, name, RECEIPTS, f"rank_{rank}.json"))
    receipt.unlink()
    if rank == 0:
        files = [json.loads(_wait_for(storage.join(uri, name, RECEIPTS, f"rank_{r}.json"))) for r in range(world)]
        marker = {"step": step, "world": world, "files": sorted(f for fs in files for f in fs)}
        storage.atomic_write(stage / MARKER, json.dumps(marker))
        storage.upload(stage / MARKER, storage.join(uri, name, MARKER))
        prune(root, keep, name)
    if local_rank == 0:
        _wait_for(storage.join(uri, name, MARKER))
        shutil.rmtree(stage, ignore_errors=True)  # stored at the run root: the node-local copy is only a cache


def _wait_for(where: str) -> str:
    """The text stored at ``where``, once it is there (polled by name)."""
    deadline = time.monotonic() + RECEIPT_TIMEOUT_S
    while (text := storage.read_text(where)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{where} never appeared: a learner rank did not finish its checkpoint upload")
        time.sleep(RECEIPT_POLL_S)
    return text


def wait_uploads() -> None:
    """Block until this process's checkpoint uploads are stored (and, on rank 0, marked); raise the error one
    of them raised. The learner calls it after its last step: a run is done once its last checkpoint is."""
    if _uploads is not None:
        _uploads.wait()


def _prunable(names: list[str], marked: set[str], keep: int, current: str) -> list[str]:
    """Of the checkpoint folders ``names``, the ones to delete: marked ones older than the newest ``keep``
    marked, and every unmarked one older than ``current`` (a save that died; a newer one may be uploading)."""
    done = [n for n in _step_folders(names) if n in marked]
    old = set(done[:-keep]) if keep > 0 else set()
    return [n for n in _step_folders(names) if n != current and (n in old or (n not in marked and n < current))]


def prune(root: Path, keep: int, current: str) -> None:
    """Keep the newest ``keep`` complete checkpoints; delete older ones, incomplete ones and staging folders
    left by saves that died, here and, when the run root is remote, there (rank 0, after a save)."""
    if root.is_dir():
        names = [p.name for p in root.iterdir() if p.is_dir()]
        for n in _prunable(names, {n for n in names if is_complete(root / n)}, keep, current):
            shutil.rmtree(root / n, ignore_errors=True)
        for n in names:  # staging and pull folders of older steps (a newer save's may be uploading)
            if n.startswith(f".{PREFIX}") and n.endswith(".tmp") and n[1:len(current) + 1] < current:
                shutil.rmtree(root / n, ignore_errors=True)
    uri = _remote(root)
    if uri is not None:
        names = _step_folders(storage.listdir(uri))
        marked = {n for n in names if storage.exists(storage.join(uri, n, MARKER))}
        for n in _prunable(names, marked, keep, current):
            storage.delete(storage.join(uri, n, MARKER))
            storage.delete(storage.join(uri, n))


def load_learner(engine: Any, path: Path) -> dict[str, Any]:
    """Restore model and optimizer (Adam moments) into ``engine``; returns the saved client state."""
    return ds.load_checkpoint(engine, path)


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
    if not out:  # ZeRO-3 keys the state by its flat fp32 partitions, which param_groups do not hold between steps
        out = [st[key] for st in inner.state.values() if key in st]
    return out


def weight_tensors(engine: Any) -> list[torch.Tensor]:
    """This rank's weights: its fp32 partitions under ZeRO-3 (the module holds empty placeholders), else the
    module's state dict in name order."""
    flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flat:
        return list(flat)
    return [p for _, p in sorted(engine.module.state_dict().items())]


def write_probe(engine: Any, path: Path, step: int) -> None:
    """Digests of the weights and Adam moments (rank 0's partition): written when a checkpoint is saved
    and again right after it is loaded, so a test can check that the resumed state is the saved one."""
    inner = engine.optimizer
    probe = {"step": step,
             "weights": tensor_digest(weight_tensors(engine)),
             "exp_avg": tensor_digest(optimizer_tensors(inner, "exp_avg")),
             "exp_avg_sq": tensor_digest(optimizer_tensors(inner, "exp_avg_sq")),
             "exp_avg_abs_sum": float(sum(t.abs().sum() for t in optimizer_tensors(inner, "exp_avg")))}
    path.write_text(json.dumps(probe))
