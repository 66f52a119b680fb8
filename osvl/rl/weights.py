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
* ``nccl`` (GPU): a broadcast from the learner's rank 0 into the vLLM workers over
  a NCCL group. Not implemented in this tree: selecting it fails fast with a
  ``ConfigError`` rather than silently falling back.

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


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ConfigError(f"weights.transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "nccl":
        raise ConfigError("weights.transport=nccl (GPU broadcast into vLLM) is not implemented yet; "
                          "use object_store, which also feeds vLLM's update_weights")


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
