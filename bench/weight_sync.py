"""Seconds per weight version, learner to engine: the whole consolidated state dict through the object store
in the training dtype (the path before issue 48) against streamed buckets in the rollout dtype over the
weight group (``osvl.rl.weights``, the default), and the same buckets through the object store.

The model: Qwen3-VL-8B's tensor names and number of tensors (``configs/models/qwen3-vl-8b``: 36 decoder
layers, untied embeddings, a 27-block vision tower with deepstack mergers: 750 tensors) at shrunk widths
(text 768 wide, MLP 2048, 8/4 heads of 128; vision 384 wide), random init under ``zero.Init`` on 2 learner
ranks (gloo, one thread each, Ray actors): 552M parameters, 2.2 GB in fp32, the CPU learner's training dtype.
The engine: one Ray actor holding the model's trainable tensors in bf16 (the rollout dtype) and copying
each received tensor into them, as an engine's ``update_weights`` does; the HF or vLLM engine's own
bookkeeping is not part of the figure, the transport is. Both paths deliver to the same receiver code
(``osvl.rl.weights.Receiver`` for the new ones).

Today's path, as the learner ran it: every rank takes part in DeepSpeed's
``_zero3_consolidated_16bit_state_dict`` (rank 0 ends up with the whole state dict on the host), rank 0
``ray.put``s it, the engine fetches and copies it. The new default: ``Publisher.push`` (every rank
gathers bucket by bucket; rank 0 casts each to bf16 and broadcasts it), the engine receives and copies
each bucket. A version counts as delivered once the engine reports it applied.

Peak extra resident memory of learner rank 0 while a version goes out: ``VmRSS`` sampled every 5 ms less
its value just before (``RssAnon``, the process's private memory, beside it: what ``ray.put`` writes is
the object store's shared memory, mapped into the process).

    .venv/bin/python bench/weight_sync.py [--versions=3] [--bucket_mb=256] [--train_dtype=float32|bfloat16]

(``--train_dtype``: the learner's; float32 is the CPU learner's, bfloat16 the GPU learner's, in which the
new path sends a tensor as gathered when it is a bucket on its own, without a cast copy.)

Measured (2026-12-06, docs/measurements.md): fp32 learner, 3 runs: today 12.1-13.9 s a version, the group
2.06-2.58 s, ``ratio`` 5.40-5.90, object store 4.2-5.1 s; bf16 learner: 6.27 against 1.87 s (3.36); bytes
per version = trainable parameters x 2 every run; rank 0's peak extra RSS 254-281 MiB with 256 MiB buckets
(today's path 6.3-6.5 GiB).

Last stdout line: JSON with ``ratio`` = today's median seconds per version / the new default's (higher is
better), each path's seconds per version and per GB sent, bytes sent per version beside the trainable
parameters' element count times 2 (bf16), and rank 0's peak extra RSS per path beside the bucket size.
The engine's weights after each path are hashed: the bench fails unless all three delivered the same bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import deepspeed
import ray
import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from osvl.cluster import free_port, init_ray  # noqa: E402
from osvl.config import script_flags  # noqa: E402
from osvl.rl.weights import Publisher, Receiver, WeightStore, digest  # noqa: E402
from osvl.train.deepspeed import ds_config, init_process_group  # noqa: E402

WORLD = 2
GB = 1e9
TEXT = {"hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 128}
VISION = {"hidden_size": 384, "intermediate_size": 1536, "num_heads": 6, "out_hidden_size": 768}


def model_config():
    cfg = json.loads((Path(__file__).resolve().parents[1] / "configs/models/qwen3-vl-8b/config.json").read_text())
    cfg["text_config"].update(TEXT)
    cfg["vision_config"].update(VISION)
    return transformers.Qwen3VLConfig.from_dict(cfg)


class _Sampler(threading.Thread):
    """Peak ``VmRSS`` and ``RssAnon`` of this process (bytes) while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop, self.peak = threading.Event(), {"VmRSS": 0, "RssAnon": 0}

    @staticmethod
    def now() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(line.split()[1]) * 1024
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            for k, v in self.now().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.005)


class LearnerRank:
    """One learner rank: the model partitioned under ZeRO-3 in a DeepSpeed engine (no optimiser)."""

    def __init__(self, rank: int, port: int, store, train_dtype: str) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                          LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        init_process_group()  # DeepSpeed's view of it
        self.rank, self.store = rank, store
        ds = ds_config(3, micro_batch=1, grad_accum=1, world_size=WORLD, bf16=train_dtype == "bfloat16")
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # today's consolidation
        cls, config = transformers.Qwen3VLForConditionalGeneration, model_config()  # imported outside zero.Init
        with deepspeed.zero.Init(config_dict_or_path=ds, dtype=getattr(torch, train_dtype)):
            model = cls(config)
        self.engine, *_ = deepspeed.initialize(model=model, config=ds)
        self.publishers = {}

    def info(self) -> dict:
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return {"trainable": sum(p.ds_numel for p in params), "tensors": len(params),
                "state_dict_tensors": len(self.engine.module.state_dict())}

    def _measured(self, fn):
        before = _Sampler.now()
        sampler = _Sampler()
        sampler.start()
        t0 = time.perf_counter()
        out = fn()
        secs = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        return {"seconds": secs, **out, **{f"extra_{k}": sampler.peak[k] - before[k] for k in before}}

    def push_old(self, version: int) -> dict:
        """Today's path: the consolidated state dict (a collective), put whole into the object store; rank 0
        returns its reference (``[ref]``) for the engine."""
        def go():
            sd = self.engine._zero3_consolidated_16bit_state_dict()
            if self.rank != 0:
                return {"bytes": 0, "ref": []}
            ref = ray.put({k: v.to("cpu") for k, v in sd.items()})
            return {"bytes": sum(v.numel() * v.element_size() for v in sd.values()), "ref": [ref]}
        return self._measured(go)

    def push_new(self, version: int, transport: str, bucket_mb: float) -> dict:
        if transport not in self.publishers:
            self.publishers[transport] = Publisher(self.store, transport, self.rank,
                                                   bucket_bytes=int(bucket_mb * 2**20), timeout_s=120)
        pub = self.publishers[transport]

        def go():
            before = pub.stats["bytes"]
            pub.push(self.engine, version)
            return {"bytes": pub.stats["bytes"] - before}
        return self._measured(go)


class Engine:
    """The receiving end: bf16 tensors of every trainable parameter, filled by ``update_weights``."""

    weight_dtype, device = "bfloat16", "cpu"

    def __init__(self, store, shapes: dict[str, tuple]) -> None:
        torch.set_num_threads(1)
        self.store, self.version = store, -1
        self.targets = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}

    def update_weights(self, buckets, version: int) -> None:
        for bucket in [buckets] if isinstance(buckets, Mapping) else buckets:
            for k, v in bucket.items():
                self.targets[k].copy_(v)
        self.version = version

    async def start(self, name: str) -> None:
        self.receiver = Receiver(self.store, name, ray.get_runtime_context().current_actor, self, poll_s=1.0,
                                 timeout_s=120)
        self.task = asyncio.create_task(self.receiver.run(lambda s: None))

    async def apply_old(self, ref: list, version: int) -> None:
        """Today's receiving end: fetch the whole state dict, copy (and cast) it in."""
        sd = await ref[0]
        await asyncio.to_thread(self.update_weights, {k: v for k, v in sd.items() if k in self.targets}, version)

    async def at(self, version: int) -> int:
        while self.version < version:
            if self.task.done():
                raise RuntimeError(f"receiver stopped: {self.task.exception()!r}")
            await asyncio.sleep(0.005)
        return self.version

    def digest(self) -> str:
        return digest(list(self.targets.items()))

    def pid(self) -> int:
        return os.getpid()


def main() -> None:
    flag, _ = script_flags(sys.argv[1:], {"versions": 3, "bucket_mb": 256.0, "train_dtype": "float32"})
    t_start = time.perf_counter()
    init_ray(num_cpus=4, include_dashboard=False)
    runtime = {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}}
    store = ray.remote(WeightStore).options(num_cpus=0).remote()
    port = free_port()
    ranks = [ray.remote(LearnerRank).options(num_cpus=1, runtime_env=runtime).remote(r, port, store,
                                                                                     flag["train_dtype"])
             for r in range(WORLD)]
    info = ray.get(ranks[0].info.remote())
    print(f"model: {info['trainable'] / 1e6:.0f}M trainable parameters in {info['tensors']} tensors "
          f"({info['state_dict_tensors']} in the state dict), {4 * info['trainable'] / GB:.2f} GB fp32", flush=True)

    with torch.device("meta"):  # the engine's shapes: no memory
        shapes = {k: tuple(p.shape) for k, p in transformers.Qwen3VLForConditionalGeneration(
            model_config()).named_parameters()}
    result, digests = {}, {}
    for path in ("old", "collective", "object_store"):
        engine = ray.remote(Engine).options(num_cpus=0, runtime_env=runtime).remote(store, shapes)
        if path != "old":
            ray.get(engine.start.remote(f"engine-{path}"))
            while not ray.get(store.roster.remote())[0]:
                time.sleep(0.1)
        runs = []
        for v in range(flag["versions"]):
            version = 1000 * (len(result) + 1) + v
            t0 = time.perf_counter()
            if path == "old":
                outs = ray.get([r.push_old.remote(version) for r in ranks])
                ray.get(engine.apply_old.remote(outs[0]["ref"], version))
            else:
                outs = ray.get([r.push_new.remote(version, path, flag["bucket_mb"]) for r in ranks])
                ray.get(engine.at.remote(version))
            secs = time.perf_counter() - t0
            runs.append({"seconds": secs, "bytes": outs[0]["bytes"], "extra_rss": outs[0]["extra_VmRSS"],
                         "extra_anon": outs[0]["extra_RssAnon"]})
            print(f"  {path} version {v}: {secs:.2f} s, {outs[0]['bytes'] / GB:.2f} GB, rank 0 +"
                  f"{outs[0]['extra_VmRSS'] / 2**20:.0f} MiB RSS (+{outs[0]['extra_RssAnon'] / 2**20:.0f} private)",
                  flush=True)
        digests[path] = ray.get(engine.digest.remote())
        ray.kill(engine)
        ray.get(store.roster.remote())  # the dead engine leaves the roster
        med = statistics.median(r["seconds"] for r in runs)
        result[path] = {"seconds": [round(r["seconds"], 3) for r in runs], "median_s": round(med, 3),
                        "bytes_per_version": runs[-1]["bytes"],
                        "s_per_gb": round(med / (runs[-1]["bytes"] / GB), 3),
                        "peak_extra_rss_mib": [round(r["extra_rss"] / 2**20, 1) for r in runs],
                        "peak_extra_anon_mib": [round(r["extra_anon"] / 2**20, 1) for r in runs]}
    # the weights do not change between versions here: every path must deliver the same bytes (today's
    # through DeepSpeed's own consolidation, cast by the engine; the new ones collected from the partitions)
    if len(set(digests.values())) != 1:
        sys.exit(f"the paths delivered different weights: {digests}")
    bucket = flag["bucket_mb"] * 2**20
    print(json.dumps({
        "ratio": round(result["old"]["median_s"] / result["collective"]["median_s"], 3),
        "ratio_object_store": round(result["old"]["median_s"] / result["object_store"]["median_s"], 3),
        "trainable_params": info["trainable"], "tensors": info["tensors"],
        "expected_bytes_bf16": 2 * info["trainable"], "bucket_mib": flag["bucket_mb"],
        "peak_extra_rss_over_bucket": round(max(result["collective"]["peak_extra_rss_mib"]) * 2**20 / bucket,
                                            2),
        "world": WORLD, "train_dtype": flag["train_dtype"], "sha256_equal": True, **result,
        "seconds": round(time.perf_counter() - t_start, 1)}))
    ray.shutdown()


if __name__ == "__main__":
    main()
