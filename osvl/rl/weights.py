"""Versioned policy weights from the learner to the rollout engines: streamed bucket by bucket, in the
rollout dtype, trainable parameters only.

A version is a sequence of *buckets*: consecutive trainable parameters, cast to the dtype the engines
run in and flattened into one tensor of at most ``bucket_bytes`` (a larger parameter is a bucket of its
own). Under ZeRO-3 every learner rank sends its partition of each parameter to rank 0 in pieces, which
rank 0 writes straight into the bucket: no rank ever holds the whole model, and rank 0 holds one bucket
and one piece at a time (``bench/weight_sync.py``: 1.1x the bucket, whatever the model).
A frozen vision tower (``learner.freeze_vision``) never travels: engines load it from the same
checkpoint the learner starts from.

Transports (``learner.weights``):

* ``collective`` (default): a broadcast from learner rank 0 into every engine over a ``WeightGroup``, a
  process group of its own (NCCL on GPUs, gloo on CPU: the same code). Membership lives in the
  ``WeightStore`` actor: each rollout actor joins it; before each version rank 0 checks who is alive and,
  when that changed, opens a new *epoch* (a fresh group on a fresh port) that everyone alive rebuilds. A
  broadcast that fails (an engine died in the middle) is retried on a rebuilt group; a new learner
  (Ray Train restarted it) simply opens the next epoch. Engines apply each bucket as it arrives between
  their engine steps (generation pauses for the version, the turns in flight are not drained: a turn
  that spans two versions records the oldest, each token keeps the log-prob it was sampled with).
* ``object_store``: rank 0 puts each bucket into Ray's object store and announces the references; actors
  fetch them one by one. It is the fallback (engines that cannot join a group) and the *catch-up* path:
  an actor that joins behind the newest version (a restarted one) asks for it, and the learner, which
  polls while it waits for groups, puts the newest version there once; the actor then joins the next
  rebuild. Without that, a run whose only actor restarted would wait forever: the actor for weights, the
  learner for its groups.
* CUDA IPC (learner and engine on one GPU): ``cuda_ipc_handles`` turns GPU tensors into picklable
  handles that another process on the same GPU maps without a copy (``from_cuda_ipc``);
  ``bench/gpu_check.py`` times it.

``bench/weight_sync.py`` measures the streamed versions against the whole-state-dict path they replace.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from osvl.cluster import free_port
from osvl.errors import ConfigError, EngineError
from osvl.train import device as train_device  # all_reduce looked up at each call: the GPU rehearsal replaces it
from osvl.train.device import on_group, world

TRANSPORTS = ("collective", "object_store")
BUCKET_BYTES = 256 * 2**20
"""Bytes per bucket in the rollout dtype: fewer, larger collectives than one per tensor, and a bounded
extra buffer on both sides."""

Meta = list[tuple[str, tuple[int, ...]]]  # (name, shape) per tensor of a bucket, in order


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ConfigError(f"learner.weights must be one of {TRANSPORTS}, got {transport!r}")


# ---------------------------------------------------------------------------
# what a version is: buckets


def _full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned parameter's own shape is empty


def plan_buckets(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES) -> list[Meta]:
    """The trainable parameters of ``model`` (a module or a DeepSpeed engine) in buckets of at most
    ``bucket_bytes`` in ``dtype`` (a larger tensor goes alone). Every learner rank computes the same plan
    from shapes alone, and receivers get it before any byte: it is the version's metadata."""
    size = torch.tensor([], dtype=dtype).element_size()
    buckets: list[Meta] = []
    used = 0
    for name, p in _module(model).named_parameters():
        if not p.requires_grad:
            continue
        shape = _full_shape(p)
        n = math.prod(shape) * size
        if not buckets or used + n > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((name, shape))
        used += n
    return buckets


def _module(model: Any) -> torch.nn.Module:
    return getattr(model, "module", model)  # a DeepSpeed engine wraps the model


def stream_buckets(model: Any, plan: list[Meta], dtype: torch.dtype, rank: int) -> Iterator[torch.Tensor | None]:
    """Each bucket of ``plan`` as one flat ``dtype`` tensor on the parameters' device (rank 0; ``None``
    elsewhere). Under ZeRO-3 every learner rank must iterate in step.

    A ZeRO-3 parameter is not gathered: each rank sends its partition to rank 0 in pieces of at most
    ``PIECE`` elements, which rank 0 casts straight into the bucket. So rank 0 holds the bucket and one
    piece, never a whole parameter in the training dtype beside it (a gather would also copy it to every
    rank, and gloo's all-gather holds it twice); a parameter larger than the bucket is a bucket of its own."""
    params = dict(_module(model).named_parameters())
    for bucket in plan:
        flat = None
        if rank == 0:
            flat = torch.empty(bucket_numel(bucket), dtype=dtype, device=params[bucket[0][0]].device)
        offset = 0
        for name, shape in bucket:
            p, n = params[name], math.prod(shape)
            if getattr(p, "ds_tensor", None) is not None:
                _collect(p.ds_tensor, n, flat[offset:offset + n] if flat is not None else None, rank)
            elif flat is not None:
                flat[offset:offset + n].copy_(p.detach().reshape(-1))
            offset += n
        yield flat
        del flat


PIECE = 2**24
"""Elements per point-to-point piece of a ZeRO-3 partition (64 MB in fp32)."""


def _collect(part: torch.Tensor, n: int, out: torch.Tensor | None, rank: int) -> None:
    """A ZeRO-3 parameter of ``n`` elements into ``out`` on rank 0, from every rank's partition ``part``
    (rank r holds elements [r P, r P + P) of the flattened parameter, P = the partition's size, the last
    one padded)."""
    size = part.ds_numel if hasattr(part, "ds_numel") else part.numel()
    local = part.reshape(-1)
    for r in range(world()):
        count = max(0, min(size, n - r * size))
        for a in range(0, count, PIECE):
            b = min(count, a + PIECE)
            if r == rank == 0:
                out[r * size + a:r * size + b].copy_(local[a:b])
            elif rank == r:
                dist.send(on_group(local[a:b].contiguous()), dst=0)
            elif rank == 0:
                piece = on_group(torch.empty(b - a, dtype=local.dtype, device=local.device))
                dist.recv(piece, src=r)
                out[r * size + a:r * size + b].copy_(piece)


def unflatten(flat: torch.Tensor, meta: Meta) -> dict[str, torch.Tensor]:
    """The bucket's tensors by name: views into ``flat``, no copy."""
    out, offset = {}, 0
    for name, shape in meta:
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def digest(named: Iterator[tuple[str, torch.Tensor]] | list[tuple[str, torch.Tensor]], h: Any = None) -> Any:
    """sha256 over each tensor's name and bytes, in the order given (a version's plan order, which both ends
    know): equal on both ends only if every byte arrived and was applied. ``h``: a hash to go on with
    (returned); without one, the hex digest. Once a run (the last version), not per version."""
    out = h if h is not None else hashlib.sha256()
    for name, t in named:
        out.update(name.encode())
        out.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out if h is not None else out.hexdigest()


def bucket_numel(meta: Meta) -> int:
    return sum(math.prod(shape) for _, shape in meta)


# ---------------------------------------------------------------------------
# the collective group


class WeightGroup:
    """A process group of learner rank 0 (rank 0) and ``world_size - 1`` engines, apart from any other.

    Why its own group: learner rank 0 is already in Ray Train's default group; a stand-alone group (its own
    ``TCPStore``, hosted by rank 0 on a fresh port per epoch) lets engines, which are no Train workers,
    join without touching it, and be rebuilt without it. ``backend``: ``nccl`` for CUDA tensors, ``gloo``
    for CPU ones. ``timeout_s`` bounds the rendezvous and every broadcast: a member that died makes the
    others fail within it instead of hanging.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 30.0, bind: str = "") -> None:
        """``host``/``port``: rank 0's store; ``bind``: the address this member's gloo connections use (its
        node's, as Ray knows it; by default gloo picks one from the hostname, which on a multi-homed node
        may be one the others cannot reach)."""
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
            if bind:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
                self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``flat`` into every member's (same size and dtype, on this group's device)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()
        return flat

    def recv(self, meta: Meta, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Ranks > 0: one bucket, by name."""
        return unflatten(self.broadcast(torch.empty(bucket_numel(meta), dtype=dtype, device=self.device)), meta)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ---------------------------------------------------------------------------
# the coordinator


class WeightStore:
    """The newest version, who receives it, and how (an async Ray actor on the driver's node).

    Collective: ``join`` (actors), ``roster`` / ``open_epoch`` / ``announce`` (learner rank 0), ``wait``
    (actors, long-polled: no busy loop, no push fan-out from the learner's critical path). Object store:
    ``publish`` (the learner's buckets' references) and the same ``wait``.
    """

    def __init__(self) -> None:
        self.version = -1
        self.published_at = 0.0
        self.members: dict[str, dict[str, Any]] = {}  # actor id -> {"handle", "dtype", "version"}
        self.group: dict[str, Any] = {"epoch": 0, "host": "", "port": 0, "members": []}
        self.announced: dict[str, Any] = {"version": -1, "epoch": 0, "seq": 0, "plan": [], "dtype": ""}
        self.stored: dict[str, Any] = {"version": -1, "plan": [], "refs": []}  # the object store's version
        self.catchup = False  # an actor asked for the newest version through the object store
        self.finished = False  # the stored version is the run's last: no learner builds another group
        self._cond: asyncio.Condition | None = None

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _changed(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    # -- actors --

    async def join(self, actor_id: str, handle: Any, dtype: str, version: int) -> None:
        """An actor asks to be in the next epoch; behind the newest version, it also asks for a catch-up."""
        self.members[actor_id] = {"handle": handle, "dtype": dtype, "version": version}
        if version < self.version:
            self.catchup = True
        await self._changed()

    async def wait(self, actor_id: str, epoch: int, seq: int, version: int, timeout: float = 30.0) -> dict[str, Any]:
        """What ``actor_id`` (in ``epoch``, having taken announcement ``seq``, at ``version``) must do next:
        ``{"kind": "epoch", ...}`` build a newer group that lists it; ``{"kind": "version", ...}`` receive
        the version announced on its group (every member takes part in every broadcast, even of a version
        it holds: a retry after another member died); ``{"kind": "stored", ...}`` fetch the object store's
        newer version; ``{"kind": "rejoin"}`` it was dropped (it did not answer) and must join again;
        ``{"kind": "none"}`` nothing within ``timeout``."""

        def next_thing() -> dict[str, Any] | None:
            g, a, st = self.group, self.announced, self.stored
            if actor_id not in self.members:
                return {"kind": "rejoin"}
            if self.finished:
                # the learner is done: an epoch that lists this actor has no one at its other end (building it
                # would only wait out the rendezvous timeout), and every member of the last group took part
                # in its broadcast; an actor still behind (one that joined during the last step) fetches it
                return {"kind": "stored", **st} if st["version"] > version else None
            if g["epoch"] > epoch and actor_id in g["members"]:
                return {"kind": "epoch", **g}
            if a["epoch"] == epoch > 0 and a["seq"] > seq:
                return {"kind": "version", **a}
            if st["version"] > version:
                return {"kind": "stored", **st}
            return None

        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: next_thing() is not None), timeout)
            except TimeoutError:
                return {"kind": "none"}
            return next_thing()

    async def received(self, actor_id: str, version: int) -> None:
        if actor_id in self.members:
            self.members[actor_id]["version"] = version

    # -- learner rank 0 --

    async def roster(self) -> tuple[list[str], str | None]:
        """The members that answer (a dead actor is dropped) and the dtype they run in."""
        async def alive(actor_id: str, m: dict) -> bool:
            try:
                await asyncio.wait_for(m["handle"].pid.remote(), 10)
                return True
            except Exception:  # noqa: BLE001 - dead, or too busy to answer: left out of this epoch
                return False

        ids = list(self.members)
        live = await asyncio.gather(*(alive(i, self.members[i]) for i in ids))
        for i, ok in zip(ids, live, strict=True):
            if not ok:
                self.members.pop(i, None)
        dtypes = {m["dtype"] for m in self.members.values()}
        if len(dtypes) > 1:
            raise ConfigError(f"rollout engines run in different dtypes {sorted(dtypes)}: one version cannot serve all")
        return sorted(self.members), (dtypes.pop() if dtypes else None)

    async def open_epoch(self, host: str, port: int, members: list[str]) -> int:
        self.finished = False  # a learner that took over after the last version trains on
        self.group = {"epoch": self.group["epoch"] + 1, "host": host, "port": port, "members": list(members)}
        await self._changed()
        return self.group["epoch"]

    async def announce(self, version: int, epoch: int, plan: list[Meta], dtype: str) -> None:
        """``version`` follows on ``epoch``'s group (a new learner may announce an older version than the
        last: the version it resumed from is the one that trains on)."""
        self.announced = {"version": version, "epoch": epoch, "seq": self.announced["seq"] + 1, "plan": plan,
                          "dtype": dtype}
        self.finished = False
        self.version, self.published_at = version, time.time()
        receiving = set(self.group["members"]) if epoch == self.group["epoch"] > 0 else set()
        if any(m["version"] < version for i, m in self.members.items() if i not in receiving):
            self.catchup = True  # one joined after the roster was taken: the object store serves it
        await self._changed()

    async def publish(self, version: int, plan: list[Meta], dtype: str, refs: list[Any], final: bool = False) -> None:
        """The object store's version: ``refs`` = one ``[ObjectRef]`` per bucket (in a list, so Ray passes the
        reference, not the value). Only the newest is kept: an old version is freed once no actor holds it.
        ``final``: the run's last version; from then on every actor behind it fetches it from here."""
        if version < self.stored["version"]:
            return  # a restarted learner republishing an old version must not roll the actors back
        self.stored = {"version": version, "plan": plan, "dtype": dtype, "refs": refs}
        self.version, self.published_at = max(self.version, version), time.time()
        self.catchup, self.finished = False, final
        await self._changed()

    def wants_catchup(self) -> bool:
        return self.catchup

    def latest_version(self) -> int:
        return self.version


# ---------------------------------------------------------------------------
# learner side


class Publisher:
    """Learner side of every version (every rank makes one; rank 0 talks to the engines).

    ``push`` streams a version by the configured transport; under ZeRO-3 every rank must call it, since
    each bucket is a gather. On a failed broadcast rank 0 rebuilds the group and every rank streams the
    version again (they agree through one all-reduce of rank 0's verdict)."""

    def __init__(self, store: Any, transport: str, rank: int, bucket_bytes: int = BUCKET_BYTES,
                 timeout_s: float = 30.0, attempts: int = 5) -> None:
        check_transport(transport)
        self.store, self.transport, self.rank = store, transport, rank
        self.bucket_bytes, self.timeout_s, self.attempts = bucket_bytes, timeout_s, attempts
        self.group: WeightGroup | None = None
        self.members: list[str] = []
        self.epoch = 0
        self.stats: dict[str, Any] = {"versions": 0, "bytes": 0, "rebuilds": 0, "retries": 0, "stored": 0}
        self._hashed: Any = None  # the final version's running sha256

    def push(self, model: Any, version: int, final: bool = False) -> float:
        """Send ``version`` (``model``'s weights now); the seconds it took. ``final``: the run's last version,
        which rank 0 also hashes (``stats["sha256"]``, see ``digest``) and leaves in the object store, where an
        engine that joins after it (the learner no longer polls for catch-ups) still finds it."""
        t0 = time.perf_counter()
        self.stats.pop("sha256", None)  # only the version that was hashed carries one
        self._hashed = hashlib.sha256() if final else None
        members, dtype = self._roster(model)
        plan = plan_buckets(model, dtype, self.bucket_bytes)
        if self.transport == "object_store":
            self._store(model, plan, dtype, version, final=final)
        else:
            for _ in range(self.attempts):
                if self._broadcast(model, plan, dtype, version, members):
                    break
                self.stats["retries"] += 1
                members, _ = self._roster(model)
            else:
                raise EngineError(f"weight version {version}: the broadcast failed {self.attempts} times")
            if final:
                self._hashed, hashed = None, self._hashed  # hashed once, as broadcast
                self._store(model, plan, dtype, version, final=True)
                self._hashed = hashed
        self.stats["versions"] += 1
        if self._hashed is not None and self.rank == 0:
            self.stats["sha256"] = self._hashed.hexdigest()
        self._hashed = None
        return time.perf_counter() - t0

    def _sent(self, flat: torch.Tensor, meta: Meta) -> None:
        self.stats["bytes"] += flat.numel() * flat.element_size()
        if self._hashed is not None:
            digest(unflatten(flat, meta).items(), self._hashed)

    def catch_up(self, model: Any, version: int) -> bool:
        """Put ``version`` into the object store when an actor asked for it (every rank calls this; they act
        on rank 0's answer); whether it did."""
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        if not self._agree(self.rank == 0 and ray.get(self.store.wants_catchup.remote())):
            return False
        _, dtype = self._roster(model)
        self._store(model, plan_buckets(model, dtype, self.bucket_bytes), dtype, version)
        return True

    def _roster(self, model: Any) -> tuple[list[str], torch.dtype]:
        """(Rank 0) the live engines, and (every rank) the dtype they run in, else the training dtype."""
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        members, code = [], -1
        if self.rank == 0:
            members, name = ray.get(self.store.roster.remote())
            code = _DTYPES.index(name) if name in _DTYPES else -1
        code = int(train_device.all_reduce(torch.tensor([code]), op="max").item())
        return members, getattr(torch, _DTYPES[code]) if code >= 0 else next(_module(model).parameters()).dtype

    def _store(self, model: Any, plan: list[Meta], dtype: torch.dtype, version: int, final: bool = False) -> None:
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        refs = []
        for i, flat in _counted(stream_buckets(model, plan, dtype, self.rank)):
            if flat is not None:
                refs.append([ray.put(flat.cpu())])
                self._sent(flat, plan[i])
            del flat  # before the next bucket is made: one bucket at a time
        if self.rank == 0:
            ray.get(self.store.publish.remote(version, plan, _dtype_name(dtype), refs, final))
            self.stats["stored"] += 1

    def _broadcast(self, model: Any, plan: list[Meta], dtype: torch.dtype, version: int, members: list[str]) -> bool:
        """One try: (rank 0) the group made current, the version announced and broadcast; every rank
        gathers each bucket. Whether it reached every member."""
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        ok = True
        if self.rank == 0:
            try:
                self._ensure_group(members, next(_module(model).parameters()).device)
                # announced even to no one (epoch 0: no engine has joined yet), so that the store knows the
                # newest version and an engine that joins later asks for a catch-up
                ray.get(self.store.announce.remote(version, self.epoch if self.group is not None else 0, plan,
                                                   _dtype_name(dtype)))
            except Exception as e:  # noqa: BLE001 - a member that never came: rebuild without it
                self._drop_group(f"rendezvous: {e!r}")
                ok = False
        ok = self._agree(ok)
        if not ok:
            return False
        if self._hashed is not None:
            self._hashed = hashlib.sha256()  # a retry sends it all again
        for i, flat in _counted(stream_buckets(model, plan, dtype, self.rank)):
            # every rank collects every bucket, even after a failure: the collection is collective
            if flat is not None and self.group is not None and ok:
                try:
                    self.group.broadcast(flat.to(self.group.device))
                    self._sent(flat, plan[i])
                except Exception as e:  # noqa: BLE001 - a member died mid-version: rebuild and send it again
                    self._drop_group(f"broadcast: {e!r}")
                    ok = False
            del flat  # before the next bucket is made: one bucket at a time
        return self._agree(ok)

    def _ensure_group(self, members: list[str], device: torch.device) -> None:
        """Rank 0: a group of exactly ``members`` (a new epoch when they changed; none without members), on
        ``device``'s backend (the parameters': under DeepSpeed the accelerator's)."""
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        if self.group is not None and members == self.members:
            return
        self.group, self.members = None, members
        if not members:
            return
        host, port = ray.util.get_node_ip_address(), free_port()
        self.epoch = ray.get(self.store.open_epoch.remote(host, port, members))
        self.stats["rebuilds"] += 1
        self.group = WeightGroup(host, port, 0, 1 + len(members), backend_for(device), self.timeout_s, bind=host)

    def _drop_group(self, why: str) -> None:
        logging.getLogger(__name__).warning("weight group of epoch %d dropped (%s); rebuilding", self.epoch, why)
        self.group, self.members = None, []

    def _agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a no-op with one rank)."""
        return bool(train_device.all_reduce(torch.tensor([1 if (flag and self.rank == 0) else 0]), op="max").item())


def _counted(buckets: Iterator[torch.Tensor | None]) -> Iterator[tuple[int, torch.Tensor | None]]:
    """``enumerate``, minus its hold on the last bucket: ``zip`` and ``enumerate`` keep the previous item in
    their reused result tuple until the next one exists, so two buckets would be alive at once (measured:
    rank 0's extra memory 2x the bucket instead of 1x plus a piece)."""
    i = 0
    while True:
        flat = next(buckets, _END)
        if flat is _END:
            return
        yield i, flat
        del flat
        i += 1


_END = object()
_DTYPES = ["float32", "bfloat16", "float16"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------
# engine side


class TransportError(RuntimeError):
    """A version did not arrive whole (a member or the learner died, a fetch failed): the engine keeps
    waiting, paused, for the next try; an error of the engine itself (a name it does not know) is not one."""


class Receiver:
    """A rollout actor's side of every version: follows the ``WeightStore`` and applies each version into
    ``engine`` (``update_weights`` with the buckets as they arrive). ``handle`` is the actor's own, which
    the store pings before each epoch."""

    def __init__(self, store: Any, actor_id: str, handle: Any, engine: Any, poll_s: float = 30.0,
                 timeout_s: float = 30.0) -> None:
        self.store, self.id, self.handle, self.engine = store, actor_id, handle, engine
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.group: WeightGroup | None = None
        self.epoch = self.seq = 0
        self.newest_seen = -1
        self.names: list[str] = []  # the parameters the last version held
        self.stats = {"versions_group": 0, "versions_stored": 0, "rebuilds": 0, "failures": 0}

    async def run(self, on_version: Any) -> None:
        """Forever: apply every version sent to this actor; ``on_version(seconds)`` after each."""
        await self._join()
        while True:
            msg = await self.store.wait.remote(self.id, self.epoch, self.seq, self.engine.version, self.poll_s)
            kind = msg["kind"]
            if kind == "rejoin":
                self.group = None
                await self._join()
            elif kind == "epoch":
                await self._build(msg)
            elif kind == "version":
                self.seq = msg["seq"]
                await self._apply(msg, self._from_group(msg), "versions_group", on_version)
            elif kind == "stored":
                await self._apply(msg, self._from_store(msg), "versions_stored", on_version)

    async def _join(self) -> None:
        await self.store.join.remote(self.id, self.handle, self.engine.weight_dtype, self.engine.version)

    async def _build(self, msg: dict[str, Any]) -> None:
        self.group, self.epoch = None, msg["epoch"]
        device = torch.device(getattr(self.engine, "device", "cpu"))
        try:
            import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

            self.group = await asyncio.to_thread(WeightGroup, msg["host"], msg["port"],
                                                 1 + msg["members"].index(self.id), 1 + len(msg["members"]),
                                                 backend_for(device), self.timeout_s,
                                                 ray.util.get_node_ip_address())
            self.stats["rebuilds"] += 1
        except Exception:  # noqa: BLE001 - the learner gave up on this epoch (someone never came): the next one
            self.stats["failures"] += 1

    async def _apply(self, msg: dict[str, Any], buckets: Iterator[dict], counter: str, on_version: Any) -> None:
        self.newest_seen = max(self.newest_seen, msg["version"])
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self.engine.update_weights, buckets, msg["version"])
        except TransportError:
            self.stats["failures"] += 1
            self.group = None
            return
        self.stats[counter] += 1
        self.names = [name for meta in msg["plan"] for name, _ in meta]
        await self.store.received.remote(self.id, msg["version"])
        on_version(time.perf_counter() - t0)

    def _from_group(self, msg: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
        group, dtype = self.group, getattr(torch, msg["dtype"])
        for meta in msg["plan"]:
            if group is None:
                raise TransportError(f"no group for epoch {msg['epoch']}")
            try:
                yield group.recv(meta, dtype)
            except Exception as e:  # noqa: BLE001 - gloo/NCCL errors have no common type
                raise TransportError(f"broadcast of version {msg['version']} broke: {e!r}") from e

    def _from_store(self, msg: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        for meta, ref in zip(msg["plan"], msg["refs"], strict=True):
            try:
                flat = ray.get(ref[0])
            except Exception as e:  # noqa: BLE001 - the object was lost (its owner died): the next version
                raise TransportError(f"fetching version {msg['version']} failed: {e!r}") from e
            yield unflatten(flat, meta)
            del flat


def cuda_ipc_handles(state_dict: dict) -> dict[str, tuple]:
    """Picklable CUDA IPC handles of ``state_dict``'s GPU tensors: no copy. The caller keeps the tensors
    alive (and unchanged) until the receiver has copied them into its model."""
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
    out = {}
    for name, (rebuild, args) in handles.items():
        args = list(args)
        args[6] = torch.cuda.current_device()  # rebuild_cuda_tensor's storage_device
        out[name] = rebuild(*args)
    return out
