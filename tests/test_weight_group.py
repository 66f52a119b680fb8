"""Learner -> engine weight versions (``osvl.rl.weights``): streamed buckets over a weight group that is
rebuilt when an engine or the learner dies, and the object store as the catch-up path.

Real Ray actors, gloo (the code path NCCL takes on GPUs), real HF engines of the tiny model.
"""

from __future__ import annotations

import time

import pytest

from osvl.rl.weights import Receiver, digest

TIMEOUT_S = 10.0  # the weight group's rendezvous and broadcast limit in this test: no wait may exceed 3x it


def _digest(named) -> str:
    """sha256 of (name, bytes) in name order: the learner's and an engine's parameters list alike."""
    return digest(sorted(named, key=lambda item: item[0]))


class _DiesInBroadcast(Receiver):
    """A receiver whose process exits after the first bucket of the next version over the group."""

    die = False

    def _from_group(self, msg):
        import os

        for i, bucket in enumerate(super()._from_group(msg)):
            if self.die and i == 1:
                os._exit(1)  # the process is gone in the middle of a broadcast, sockets and all
            yield bucket


class _Engine:
    def __init__(self, model_dir: str, store, actor_id: str) -> None:
        import ray

        from osvl.agent.engines.hf import HFEngine

        self.engine = HFEngine(model_dir, max_batch=2, version=-1)
        self.receiver = _DiesInBroadcast(store, actor_id, ray.get_runtime_context().current_actor, self.engine,
                                         poll_s=2.0, timeout_s=TIMEOUT_S)

    async def start(self) -> None:
        import asyncio

        self.task = asyncio.create_task(self.receiver.run(lambda seconds: None))

    async def die_in_next_broadcast(self) -> None:
        self.receiver.die = True

    async def state(self) -> dict:
        return {"version": self.engine.version, "digest": _digest(self.engine.model.named_parameters()),
                "stats": dict(self.receiver.stats), "failed": repr(self.task.exception()) if self.task.done() else ""}

    async def generate_version(self) -> int:
        from osvl.agent.engines.base import GenRequest, Sampling

        ids = self.engine.tokenizer("The animal shown lives in")["input_ids"]
        res = await self.engine.generate(GenRequest(list(ids), [], [], Sampling(max_new_tokens=4, seed=0)))
        return res.version

    def pid(self) -> int:
        import os

        return os.getpid()


class _Learner:
    """A plain model (no DeepSpeed: the buckets are the same code) publishing versions."""

    def __init__(self, model_dir: str, store, weights=None) -> None:
        import torch

        from osvl.models.load import load_model
        from osvl.rl.weights import Publisher

        self.model = load_model(model_dir, dtype="float32")
        if weights is not None:  # a new learner takes over from the last version
            self.model.load_state_dict(weights)
        self.publisher = Publisher(store, "collective", 0, bucket_bytes=2 * 2**20, timeout_s=TIMEOUT_S)
        self.gen = torch.Generator().manual_seed(len(weights or {}))

    def step_and_push(self, version: int) -> float:
        """A "training step" (every parameter moves), then the version; the push's seconds."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=self.gen))
        return self.publisher.push(self.model, version)

    def catch_up(self, version: int) -> bool:
        return self.publisher.catch_up(self.model, version)

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def digest(self) -> str:
        return _digest(self.model.named_parameters())

    def stats(self) -> dict:
        return dict(self.publisher.stats)


@pytest.mark.slow  # five engines and two learners on the tiny model
def test_versions_survive_engines_and_a_learner_dying(ray_cluster):
    """Three engines; one dies in the middle of a broadcast, another between versions, then the learner
    (a new one takes over from the last version). Each dead engine is replaced, as the trainer's monitor
    does. No push waits longer than 3x the group's timeout; every live engine ends on the newest version,
    bit-equal to the learner's weights; the replacements catch up through the object store, then join
    the next rebuild and receive the rest over the group."""
    import sys

    import ray
    from ray import cloudpickle

    from osvl.models.tiny import tiny_checkpoint
    from osvl.rl.weights import WeightStore

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    model_dir = str(tiny_checkpoint("qwen3_vl"))
    store = ray.remote(WeightStore).options(num_cpus=0).remote()
    engine_cls, learner_cls = ray.remote(_Engine).options(num_cpus=0), ray.remote(_Learner).options(num_cpus=0)

    def engine(name: str):
        e = engine_cls.remote(model_dir, store, name)
        ray.get(e.start.remote())
        return e

    engines = {f"e{i}": engine(f"e{i}") for i in range(3)}
    learner = learner_cls.remote(model_dir, store)
    waits = []

    def push(version: int) -> None:
        t0 = time.monotonic()
        ray.get(learner.step_and_push.remote(version), timeout=300)
        waits.append(round(time.monotonic() - t0, 1))

    def settle(version: int) -> dict:
        """Every live engine's state once all hold ``version`` (the learner polls for catch-ups meanwhile)."""
        deadline = time.monotonic() + 6 * TIMEOUT_S
        while True:
            ray.get(learner.catch_up.remote(version))
            states = {n: ray.get(e.state.remote()) for n, e in engines.items()}
            if all(s["version"] == version for s in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(0.5)

    try:
        deadline = time.monotonic() + 60
        while len(ray.get(store.roster.remote())[0]) < 3 and time.monotonic() < deadline:  # all joined
            time.sleep(0.2)
        push(1)
        assert {s["version"] for s in settle(1).values()} == {1}

        # 1. e0 dies in the middle of version 2's broadcast; its replacement starts at once
        ray.get(engines["e0"].die_in_next_broadcast.remote())
        push(2)
        engines.pop("e0")
        engines["e0~1"] = engine("e0~1")
        states = settle(2)
        assert {s["version"] for s in states.values()} == {2}, states
        assert states["e0~1"]["stats"]["versions_stored"] == 1  # caught up from the object store
        push(3)  # the rebuild that takes the replacement in
        assert settle(3)["e0~1"]["stats"]["versions_group"] >= 1

        # 2. e1 is killed between versions
        ray.kill(engines.pop("e1"))
        engines["e1~1"] = engine("e1~1")
        push(4)
        settle(4)

        # 3. the learner dies; a new one takes over from the last version
        last = ray.get(learner.weights.remote())
        ray.kill(learner)
        learner = learner_cls.remote(model_dir, store, last)
        push(5)
        states = settle(5)
        want = ray.get(learner.digest.remote())
        assert {n: s["version"] for n, s in states.items()} == dict.fromkeys(engines, 5), states
        assert {n: s["digest"] for n, s in states.items()} == dict.fromkeys(engines, want), "weights differ"
        assert not any(s["failed"] for s in states.values()), states
        for name in ("e0~1", "e1~1"):  # replacements: the newest version, over the group after one rebuild
            assert states[name]["stats"]["versions_group"] >= 1, states[name]
        assert states["e2"]["stats"]["versions_stored"] == 0  # an engine that never left never fetched
        assert ray.get(engines["e2"].generate_version.remote()) == 5
        assert max(waits) < 3 * TIMEOUT_S, waits
        assert ray.get(learner.stats.remote())["rebuilds"] >= 1
    finally:
        for a in [*engines.values(), learner, store]:
            ray.kill(a)


def test_buckets_round_trip_through_a_group(monkeypatch):
    """Two ranks in threads of this process: the plan splits by bytes in the target dtype (a tensor over
    the limit goes alone, frozen parameters stay out), each bucket arrives exact after the cast."""
    import threading

    import torch

    from osvl.cluster import free_port
    from osvl.rl.weights import WeightGroup, plan_buckets, stream_buckets

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(10, 30, generator=g))
    model.b = torch.nn.Parameter(torch.randn(2000, generator=g))  # alone: over the limit
    model.c = torch.nn.Parameter(torch.randn(7, generator=g))
    model.frozen = torch.nn.Parameter(torch.randn(5, generator=g), requires_grad=False)
    plan = plan_buckets(model, torch.bfloat16, bucket_bytes=2000)  # 1000 bf16 elements
    assert [[n for n, _ in b] for b in plan] == [["a"], ["b"], ["c"]]
    port, got, errors = free_port(), {}, []

    def rank(r: int) -> None:
        try:
            group = WeightGroup("127.0.0.1", port, r, 2, backend="gloo", timeout_s=60)
            if r == 0:
                for flat in stream_buckets(model, plan, torch.bfloat16, 0):
                    group.broadcast(flat)
            else:
                for meta in plan:
                    got.update(group.recv(meta, torch.bfloat16))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert list(got) == ["a", "b", "c"]
    for k in got:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], getattr(model, k).detach().to(torch.bfloat16)), k


def test_after_the_runs_last_version_an_actor_behind_fetches_it_instead_of_building_a_group():
    """An actor the learner listed in an epoch just before its last version (a replacement that joined during
    the last step) is told to build that group while a learner is there to meet it; once the last version is
    published as final, it is sent to the object store at once (building the group would only wait out the
    rendezvous timeout). A learner that takes over afterwards and opens an epoch makes groups count again."""
    import asyncio

    from osvl.rl.weights import WeightStore

    async def go() -> list[dict]:
        store = WeightStore()
        await store.join("late", None, "float32", -1)
        await store.open_epoch("127.0.0.1", 1, ["late"])
        answers = [await store.wait("late", 0, 0, -1, timeout=0.05)]
        await store.publish(7, [], "float32", [], final=True)
        answers += [await store.wait("late", 0, 0, -1, timeout=0.05), await store.wait("late", 0, 0, 7, timeout=0.05)]
        await store.open_epoch("127.0.0.1", 2, ["late"])
        answers.append(await store.wait("late", 1, 0, 7, timeout=0.05))
        return answers

    during, behind, holding, taken_over = asyncio.run(go())
    assert (during["kind"], during["epoch"]) == ("epoch", 1)
    assert (behind["kind"], behind["version"]) == ("stored", 7)
    assert holding == {"kind": "none"}  # holds the last version: nothing left to do, no group to build
    assert (taken_over["kind"], taken_over["epoch"]) == ("epoch", 2)
