"""Learner -> engine weight updates over a torch.distributed group (``osvl.rl.weights.WeightGroup``).

On CPU the group runs gloo, the same code path as nccl on GPUs: a learner actor (rank 0) broadcasts
a changed policy into an HF engine actor, which apply it and generate with it.
"""

from __future__ import annotations

import pytest


class _Learner:
    def __init__(self, model_dir: str) -> None:
        import torch

        from osvl.models.load import load_model

        self.model = load_model(model_dir, dtype="float32")
        with torch.no_grad():  # a "training step": every parameter moves
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn_like(p))

    def state(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def meta(self):
        from osvl.rl.weights import weight_meta

        return weight_meta(self.model.state_dict())

    def send(self, port: int, world: int) -> None:
        from osvl.rl.weights import WeightGroup

        WeightGroup("127.0.0.1", port, 0, world, backend="gloo").send(self.model.state_dict())


class _Engine:
    def __init__(self, model_dir: str) -> None:
        from osvl.agent.engines.hf import HFEngine

        self.engine = HFEngine(model_dir, max_batch=2)

    def receive(self, port: int, rank: int, world: int, meta, version: int) -> None:
        from osvl.rl.weights import WeightGroup

        state = WeightGroup("127.0.0.1", port, rank, world, backend="gloo").recv(meta)
        self.engine.update_weights(state, version)

    def weights(self):
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    def generate_version(self) -> int:
        import asyncio

        from osvl.agent.engines.base import GenRequest, Sampling

        ids = self.engine.tokenizer("The animal shown lives in")["input_ids"]
        res = asyncio.run(self.engine.generate(GenRequest(list(ids), [], [], Sampling(max_new_tokens=4, seed=0))))
        return res.version


@pytest.mark.slow  # two actors each loading the tiny model
def test_learner_broadcasts_weights_into_an_engine_over_gloo(ray_cluster):
    import sys

    import ray
    import torch
    from ray import cloudpickle

    from osvl.cluster import free_port
    from osvl.models.tiny import tiny_checkpoint

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    model_dir = str(tiny_checkpoint("qwen3_vl"))
    learner = ray.remote(_Learner).options(num_cpus=1).remote(model_dir)
    engines = [ray.remote(_Engine).options(num_cpus=1).remote(model_dir) for _ in range(1)]  # one: each costs ~30 s
    before = ray.get(engines[0].weights.remote())
    meta = ray.get(learner.meta.remote())
    port = free_port()
    world = 1 + len(engines)
    ray.get([learner.send.remote(port, world)]
            + [e.receive.remote(port, i + 1, world, meta, 7) for i, e in enumerate(engines)], timeout=180)
    sent = ray.get(learner.state.remote())
    for engine in engines:
        got = ray.get(engine.weights.remote())
        assert set(got) >= set(sent)
        assert all(torch.equal(got[k], sent[k]) for k in sent), "an engine holds weights the learner did not send"
        assert ray.get(engine.generate_version.remote()) == 7
    assert not all(torch.equal(before[k], sent[k]) for k in sent)  # the update changed something
    for actor in [learner, *engines]:
        ray.kill(actor)


def test_weight_group_buckets_mixed_dtypes_and_large_tensors(monkeypatch):
    """Two ranks in threads of this process: several buckets (small limit), three dtypes, exact tensors back."""
    import threading

    import torch

    from osvl.cluster import free_port
    from osvl.rl import weights
    from osvl.rl.weights import WeightGroup, weight_meta

    monkeypatch.setattr(weights, "PARAMS_PER_BROADCAST", 1000)
    g = torch.Generator().manual_seed(0)
    sent = {"a": torch.randn(10, 30, generator=g), "a2": torch.randn(400, generator=g),  # one bucket of 700
            "b": torch.randn(2000, generator=g),  # alone: over the limit
            "c": torch.randn(7, generator=g).to(torch.bfloat16), "d": torch.arange(12).view(3, 4),
            "e": torch.randn(5, 5, generator=g)}
    assert [len(b) for b in weights._buckets(weight_meta(sent))] == [2, 1, 1, 1, 1]
    port, got, errors = free_port(), {}, []

    def rank(r: int) -> None:
        try:
            group = WeightGroup("127.0.0.1", port, r, 2, backend="gloo", timeout_s=60)
            if r == 0:
                group.send(sent)
            else:
                got.update(group.recv(weight_meta(sent)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert list(got) == list(sent)
    for k, v in sent.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
