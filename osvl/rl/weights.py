"""Versioned policy weights from the learner to the rollout actors.

The learner publishes after every optimiser step; rollout actors apply the newest
version between generation batches (``TokenEngine.update_weights``), so a turn's
``policy_version`` says exactly which weights sampled it.

Transport, by config (``transport``):

* ``object_store`` (default, CPU and any engine): rank 0 puts the full state dict
  into Ray's object store once per version; every actor fetches it by reference
  (zero-copy on the same node: Ray's plasma store is shared memory). The store
  keeps only the newest reference, so old versions are freed as soon as no actor
  holds them. This path feeds the HF engine and vLLM's ``update_weights`` alike.
* ``nccl`` (GPU): a broadcast from the learner's rank 0 into the engines over a
  ``WeightGroup``: a torch.distributed process group of its own (rank 0 the learner,
  ranks 1..n the engines), apart from the learner's training group, built from a
  ``TCPStore`` on rank 0's node, so it spans nodes. The same class runs on ``gloo``
  over CPU tensors, which is how a CPU test drives the real broadcast path. The
  trainer does not select it yet (rollout actors are restarted one by one, and a
  process group cannot take a new member): choosing it fails fast with a
  ``ConfigError`` rather than silently falling back.
* CUDA IPC (learner and engine on one GPU): ``cuda_ipc_handles`` turns GPU tensors
  into picklable handles that another process on the same GPU maps without a copy
  (``from_cuda_ipc``); ``bench/gpu_check.sh`` times it against a CPU copy.

``WeightStore`` is a small async Ray actor: ``publish`` from the learner,
``wait_newer`` long-polled by the actors (no busy polling, no push fan-out from
the learner's critical path).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from osvl.errors import ConfigError

TRANSPORTS = ("object_store", "nccl")
PARAMS_PER_BROADCAST = 2**26
"""Elements per flat broadcast (256 MB in fp32): fewer, larger collectives than one per tensor, and a
bounded extra buffer on both sides."""


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ConfigError(f"weights.transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "nccl":
        raise ConfigError("weights.transport=nccl: the broadcast (WeightGroup) exists but the trainer does not "
                          "use it yet (a restarted rollout actor cannot join a running group); use object_store, "
                          "which also feeds vLLM's update_weights")


class WeightStore:
    """Newest published (version, object ref) pair; actors long-poll for a newer one."""

    def __init__(self) -> None:
        self.version = -1
        self.ref: list[Any] = []   # [ObjectRef]: wrapped in a list so Ray passes the reference, not the value
        self.published_at = 0.0
        self._cond: asyncio.Condition | None = None

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def publish(self, version: int, ref: list[Any]) -> None:
        async with self.cond:
            if version <= self.version:
                return  # a restarted learner republishing an old version must not roll actors back
            self.version, self.ref, self.published_at = version, ref, time.time()
            self.cond.notify_all()

    async def wait_newer(self, version: int, timeout: float = 30.0) -> tuple[int, list[Any]]:
        """(version, [ref]) of the newest weights once newer than ``version``; (-1, []) on timeout."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.version > version), timeout)
            except TimeoutError:
                return -1, []
            return self.version, self.ref

    def latest_version(self) -> int:
        return self.version


def publish(store: Any, state_dict: dict, version: int) -> float:
    """Put ``state_dict`` into the object store and announce it; returns the seconds it took (a metric)."""
    import ray

    t0 = time.perf_counter()
    cpu = {k: v.detach().to("cpu") for k, v in state_dict.items()}
    ref = ray.put(cpu)
    ray.get(store.publish.remote(version, [ref]))
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------
# transports beside the object store


class WeightGroup:
    """A process group of the learner's rank 0 (rank 0) and ``world_size - 1`` engines, apart from any other.

    Why its own group and not ``torch.distributed.init_process_group``: the learner's rank 0 is already
    in Ray Train's default group; a second, stand-alone group (its own ``TCPStore``) lets the engines,
    which are no Train workers, join without touching it. ``backend``: ``nccl`` for CUDA tensors,
    ``gloo`` for CPU ones. Every member must call ``send``/``recv`` for every version, in order: the
    learner blocks until all engines have received.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 300.0) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        if backend not in ("nccl", "gloo"):
            raise ConfigError(f"WeightGroup backend must be nccl or gloo, got {backend!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def send(self, state_dict: dict) -> None:
        """Rank 0: broadcast ``state_dict`` (flat buckets per dtype); receivers pass ``weight_meta(state_dict)``."""
        meta = weight_meta(state_dict)
        for bucket in _buckets(meta):
            flat = _flatten([state_dict[k].detach().to(self.device) for k, _, _ in bucket])
            self._broadcast(flat)
        return meta

    def recv(self, meta: list[tuple[str, tuple, str]]) -> dict:
        """Ranks > 0: the tensors rank 0 is sending (on this group's device), by name."""
        import math

        import torch

        out = {}
        for bucket in _buckets(meta):
            dtype = getattr(torch, bucket[0][2])
            flat = torch.empty(sum(math.prod(s) for _, s, _ in bucket), dtype=dtype, device=self.device)
            self._broadcast(flat)
            offset = 0
            for name, shape, _ in bucket:
                n = math.prod(shape)
                out[name] = flat[offset:offset + n].view(shape)
                offset += n
        return out

    def _broadcast(self, flat: Any) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()
        if self.backend == "nccl":
            import torch

            torch.cuda.current_stream().synchronize()


def weight_meta(state_dict: dict) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype name) per tensor, in order: what receivers need to take part in ``send``.
    Small: it travels through the ``WeightStore`` (or any Ray call) ahead of the broadcast."""
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state_dict.items()]


def _buckets(meta: list[tuple[str, tuple, str]]) -> list[list[tuple[str, tuple, str]]]:
    """Consecutive tensors of one dtype, up to ``PARAMS_PER_BROADCAST`` elements a bucket (a larger tensor alone)."""
    import math

    buckets: list[list[tuple[str, tuple, str]]] = []
    size = 0
    for item in meta:
        n = math.prod(item[1])
        if not buckets or buckets[-1][0][2] != item[2] or size + n > PARAMS_PER_BROADCAST:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return buckets


def _flatten(tensors: list[Any]) -> Any:
    import torch

    return torch.cat([t.reshape(-1) for t in tensors])


def cuda_ipc_handles(state_dict: dict) -> dict[str, tuple]:
    """Picklable CUDA IPC handles of ``state_dict``'s GPU tensors: no copy. The caller keeps the tensors
    alive (and unchanged) until the receiver has copied them into its model."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = {}
    for name, tensor in state_dict.items():
        if not tensor.is_cuda:
            raise ConfigError(f"cuda_ipc_handles: {name} is on {tensor.device}; CUDA IPC shares GPU memory only")
        handles[name] = reduce_tensor(tensor.detach().contiguous())
    return handles


def from_cuda_ipc(handles: dict[str, tuple]) -> dict:
    """The tensors behind ``cuda_ipc_handles``, mapped into this process on its current CUDA device.

    The handle records the sender's device index; under Ray each worker sees its GPU as index 0 of its
    own ``CUDA_VISIBLE_DEVICES``, so the index is replaced by this process's current device.
    """
    import torch

    out = {}
    for name, (rebuild, args) in handles.items():
        args = list(args)
        args[6] = torch.cuda.current_device()  # rebuild_cuda_tensor's storage_device
        out[name] = rebuild(*args)
    return out
