"""Peak host memory of a GRPO learner rank, at load and at its first step: the whole fp32 model on every rank
(the learner before issue 47) against the partitioned bf16 build ``train_loop`` now uses.

Before, every learner rank loaded the whole policy in fp32 and a whole fp32 copy of it as the frozen KL
reference, and only then handed the policy to a ZeRO-3 engine, which partitioned it: a rank's peak held
two full fp32 models, 8 bytes a parameter (64 GB per rank at 8B, 8 ranks a node) whatever ZeRO-3 saves
later. Now (``osvl.rl.learner_loop.train_loop``) the policy is built in bf16 under ``zero.Init``
(``osvl.train.deepspeed.load_trainable``: each layer split over the ranks as it is created), the reference
is copied from it partition by partition into an optimiser-less ZeRO-3 engine (``reference_model``), and
decoder layers recompute their activations in backward (gradient checkpointing). This bench runs both
builds, as two ranks (gloo, one thread each), each build in its own fresh pair of processes, and records
every rank's peak resident set (``ru_maxrss``, what ``osvl.train.rehearsal`` records) with its models built,
with its engine built, and after one GRPO step.

The model: Qwen3-VL's architecture and layer names (``Qwen3VLForConditionalGeneration``: 28 decoder layers,
a 24-block vision tower with deepstack mergers at blocks 5/11/17, as the released 2B) at shrunk widths
(text 768 wide, GQA 6/3 heads of 128; vision 384 wide), random init, ~263M parameters, 1.05 GB in fp32; saved
in bf16 safetensors as released checkpoints are, with the tiny checkpoint's tokenizer and processor
(``osvl.models.tiny``), and cached under ``$OSVL_CACHE/bench`` (built once, ~15 s). The step: two groups
of two text-only records of 150-200 tokens (one group per rank), ``beta=0.01`` so the reference runs.
Rows are short on purpose: the bench measures what the weights, the reference and the optimiser state
cost, not activations.

What both builds hold alike: the libraries (~0.4 GiB a rank before any model), and what the ZeRO-3 engine
allocates when it is built, an fp32 master copy and an fp32 gradient buffer of the rank's partition
(8 bytes a parameter over the ranks: at 2 ranks as much as a whole fp32 model, at 8 ranks a quarter of it).

The children are started by a parent that never imports torch: a process's ``ru_maxrss`` starts at its
parent's peak when it is spawned (Linux keeps the exec'ing mm's high-water mark), so a parent that had
built the checkpoint would leak its peak into the figures. ``VmHWM`` (this process image's own peak) is
recorded beside it as a check.

    .venv/bin/python bench/learner_memory.py [--timeout=480] [--force]

(``--timeout``: seconds each pair of ranks may take before the bench gives up on a hang; ``--force``: run even
when the machine has less memory available than the old path needs, about 16 times the fp32 model.)

Where "at load" is measured, and why: a rank's peak once its models (policy and reference) are built, before
the ZeRO-3 engine. That is what a GPU machine's host holds at load: there the engine's fp32 master weights
and gradient partitions, and the partitioned bf16 weights themselves, are device memory, while the old path
built both whole fp32 models in host memory first. On this CPU-only machine the device *is* the host, so the
new build's partitions count here too (the figure overstates the new path's host memory) and the engine's
fp32 state lands in the same resident set: with it, at 2 ranks, both builds hold about a whole fp32 model of
engine state, and the two paths' peaks are closer (``engine_ratio``; at 8 ranks the engine's share is a
quarter of that).

Measured (2026-12-06, 263M parameters, 3 runs with nothing else on the 2 cores; load 2.2-2.4, the bench's
own two ranks): with the models built, old 2.83 GiB per rank every run, new 1.155 GiB on rank 0 and 0.924 on
rank 1 every run: ``ratio`` 2.453, 2.454, 2.454; with the engine 1.96 GiB (``engine_ratio`` 1.90-1.97);
after step 1 ``step1_ratio`` 1.48-1.70. Rank 0 reads the checkpoint for every rank (transformers' ZeRO-3
load: the mapped bf16 file, 2 bytes a parameter, is resident while it loads); the reference is copied from
the policy's partitions (``osvl.train.deepspeed.partitioned_copy``) instead of read again. glibc's
allocator matters here: with its mmap threshold left to rise, the layers each build frees once split
stayed resident as heap holes and the new build peaked at 1.23-1.60 GiB (ratio 1.77-2.00), so
``_zero3_build`` fixes the threshold while it builds (docs/measurements.md); the old build's 2.83 GiB does not
move under the same setting.

Last stdout line: JSON with ``ratio`` = the largest rank's peak with its models built on the old path over the
same on the new (higher is better; ``ratio_above_base`` the same less each rank's peak before it built
anything; ``engine_ratio`` with the engine built; ``step1_ratio`` after the first step), every rank's peaks
before building, with the models, with the engine (``peak_load``) and after step 1 in both builds (bytes and
GiB), the model's size and the seconds taken.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 2
BUILD = 1  # bump when the checkpoint build changes in a way SPEC does not show
GIB = 1024 ** 3
# Qwen3-VL-2B's depths and head layout, widths shrunk: ~262M parameters (configs/models/qwen3-vl-2b/config.json)
SPEC = {
    "text_config": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 28, "num_attention_heads": 6,
                    "num_key_value_heads": 3, "head_dim": 128,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 24, "hidden_size": 384, "intermediate_size": 1536, "num_heads": 6,
                      "out_hidden_size": 768, "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17]},
}
TINY_ONLY = ("config.json", "generation_config.json", "model.safetensors", "README.md")  # not copied from tiny


def build_checkpoint() -> None:
    """(Child) The bench model's checkpoint directory, built first if missing; its path on the last stdout line."""
    import shutil

    import torch
    import transformers

    from osvl.models.tiny import build_once, tiny_checkpoint
    from osvl.storage import cache_root

    tiny = tiny_checkpoint("qwen3_vl")  # tokenizer, processor and token ids (vocab sized to the tokenizer)
    key = hashlib.sha256(json.dumps({"spec": SPEC, "tiny": tiny.name, "build": BUILD,
                                     "versions": [torch.__version__, transformers.__version__]},
                                    sort_keys=True).encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        cfg = json.loads((tiny / "config.json").read_text())
        for part in ("text_config", "vision_config"):
            cfg[part].update(SPEC[part])
        config = transformers.Qwen3VLConfig.from_dict(cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.Qwen3VLForConditionalGeneration(config)
        model.to(torch.bfloat16)  # as released checkpoints are saved
        model.generation_config = transformers.GenerationConfig.from_pretrained(tiny)
        model.save_pretrained(out)
        for f in tiny.iterdir():
            if f.is_file() and f.name not in TINY_ONLY:
                shutil.copy(f, out / f.name)
        (out / "README.md").write_text(f"Random-init Qwen3-VL at shrunk widths for bench/learner_memory.py "
                                       f"(key {key}); tokenizer and processor from {tiny.name}.\n")

    print(build_once(cache_root() / "bench" / f"qwen3_vl-memory-{key}", build), flush=True)


def peaks() -> tuple[int, int]:
    """This process's peak resident set: ``ru_maxrss`` and ``VmHWM``, in bytes."""
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, hwm * 1024


def rank_main(path_kind: str, rank: int, port: int, model_dir: str, out: str, timeout: float) -> None:
    """(Child) One learner rank built the ``old`` or the ``new`` way, then one step; its figures into ``out``."""
    import faulthandler
    import random
    import warnings

    import torch
    import torch.distributed as dist

    from bench.learner import episode
    from osvl.models.load import load_model, load_processor
    from osvl.rl.learner import Learner, RLConfig, learner_ds_config, make_engine
    from osvl.rl.learner_loop import rank_share, reference_model, rl_batch
    from osvl.train.deepspeed import hidden_size, load_trainable

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(1.0, timeout - 15))  # where a hang hangs, before the parent kills it
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notice at every collective
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cfg = RLConfig(beta=0.01, lr=1e-5, max_len=512, truncation="drop")
    rng = random.Random(0)  # the same groups on both ranks and in both builds
    groups = [[episode(rng, gid, i, rng.randrange(150, 200), float(i), prompt=40, turn_len=30, tool=20)
               for i in range(2)] for gid in range(WORLD)]
    processor = load_processor(model_dir)
    base_rss, _ = peaks()  # the libraries, the process group and the processor: what any build starts from
    t0 = time.perf_counter()
    if path_kind == "old":  # the learner before issue 47: whole fp32 model and reference on every rank
        model = load_model(model_dir, dtype="float32")
        ref = load_model(model_dir, dtype="float32").eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        models_rss, _ = peaks()
        engine = make_engine(model, cfg, zero_stage=3, world=WORLD)
    else:  # train_loop's: partitioned under zero.Init in bf16, partitioned reference engine, checkpointing
        ds = learner_ds_config(cfg, zero_stage=3, world=WORLD, bf16=True, hidden_size=hidden_size(model_dir))
        model = load_trainable(model_dir, ds, grad_checkpointing=True)
        ref = reference_model(model_dir, cfg, ds, policy=model)
        models_rss, _ = peaks()
        engine = make_engine(model, cfg, config=ds)
    learner = Learner(engine, cfg, ref_model=ref)
    load_s, (load_rss, load_hwm) = time.perf_counter() - t0, peaks()
    print(f"  [{path_kind}] rank {rank}: built in {load_s:.0f} s, peak {models_rss / GIB:.2f} GiB with the models, "
          f"{load_rss / GIB:.2f} GiB with the engine", flush=True)
    t0 = time.perf_counter()
    res = learner.step([(rl_batch(chunk, "", processor, cfg), live) for chunk, live in rank_share(groups, rank,
                                                                                                   WORLD, cfg)])
    step_s, (step_rss, step_hwm) = time.perf_counter() - t0, peaks()
    print(f"  [{path_kind}] rank {rank}: step 1 in {step_s:.0f} s (loss {res.loss:.4f}, grad norm "
          f"{res.grad_norm:.3f}), peak {step_rss / GIB:.2f} GiB", flush=True)
    Path(out, f"{path_kind}_rank{rank}.json").write_text(json.dumps({
        "base": base_rss, "models": models_rss, "load": load_rss, "step1": step_rss,
        "vm_hwm_load": load_hwm, "vm_hwm_step1": step_hwm,
        "load_s": load_s, "step_s": step_s, "loss": res.loss, "grad_norm": res.grad_norm, "skipped": res.skipped}))
    dist.destroy_process_group()


def run_children(args: list[list[str]], timeout: float, logs: list[Path]) -> list[str]:
    """This script again, once per argument list (``build``, or ``rank ...``), each child's output into its log;
    their progress lines printed and their outputs returned. A failure or a hang (``timeout`` seconds, the
    children dump their stacks just before) exits with the logs' tails."""
    files = [log.open("w") for log in logs]
    procs = [subprocess.Popen([sys.executable, __file__, *a], stdout=f, stderr=subprocess.STDOUT)
             for a, f in zip(args, files, strict=True)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))  # a hang in a collective ends here
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    outs = [log.read_text() for log in logs]
    if any(p.returncode != 0 for p in procs):
        sys.exit(f"a child failed or hung (codes {[p.returncode for p in procs]}):\n"
                 + "\n".join(f"--- {log}\n{o[-4000:]}" for log, o in zip(logs, outs, strict=True)))
    for out in outs:
        print("\n".join(line for line in out.splitlines() if line.startswith("  [")), flush=True)
    return outs


def checkpoint_size(model_dir: Path) -> tuple[int, int]:
    """Parameters and bytes of the checkpoint's safetensors files, from their headers (no torch here)."""
    params = size = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name != "__metadata__":
                n = 1
                for d in t["shape"]:
                    n *= d
                params += n
        size += f.stat().st_size
    return params, size


def main() -> None:
    from osvl.cluster import free_port
    from osvl.config import script_flags

    flag, _ = script_flags(sys.argv[1:], {"timeout": 480, "force": False})
    t_start = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix="learner_memory."))
    print("checkpoint: built once, then reused from $OSVL_CACHE/bench", flush=True)
    model_dir = run_children([["build"]], flag["timeout"], [out / "build.log"])[0].strip().splitlines()[-1]
    params, weights = checkpoint_size(Path(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    # the old path's two ranks peak together at about 8 times the fp32 model each (the step: Adam's moments,
    # fp32 gradients, DeepSpeed's default 500M-element reduce bucket; 15.6 GiB the pair at 263M parameters):
    # refuse on a machine without that free
    need = 2 * 8 * 4 * params
    available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    if available < need and not flag["force"]:
        sys.exit(f"{available / GIB:.1f} GiB available, the old path needs about {need / GIB:.1f} GiB (--force)")
    print(f"  {model_dir}: {weights / GIB:.2f} GiB of bf16 safetensors", flush=True)
    result: dict = {}
    for path_kind in ("old", "new"):
        print(f"{path_kind} path: {WORLD} ranks", flush=True)
        port, t0 = free_port(), time.perf_counter()
        run_children([["rank", path_kind, str(r), str(port), model_dir, str(out), str(flag["timeout"])]
                      for r in range(WORLD)], flag["timeout"], [out / f"{path_kind}_rank{r}.log" for r in range(WORLD)])
        ranks = [json.loads((out / f"{path_kind}_rank{r}.json").read_text()) for r in range(WORLD)]
        result[path_kind] = {
            "peak_base_bytes": [r["base"] for r in ranks], "peak_models_bytes": [r["models"] for r in ranks],
            "peak_load_bytes": [r["load"] for r in ranks],
            "peak_step1_bytes": [r["step1"] for r in ranks],
            "peak_base_gib": [round(r["base"] / GIB, 3) for r in ranks],
            "peak_models_gib": [round(r["models"] / GIB, 3) for r in ranks],
            "peak_load_gib": [round(r["load"] / GIB, 3) for r in ranks],
            "peak_step1_gib": [round(r["step1"] / GIB, 3) for r in ranks],
            "vm_hwm_load_gib": [round(r["vm_hwm_load"] / GIB, 3) for r in ranks],
            "vm_hwm_step1_gib": [round(r["vm_hwm_step1"] / GIB, 3) for r in ranks],
            "load_s": [round(r["load_s"], 1) for r in ranks], "step_s": [round(r["step_s"], 1) for r in ranks],
            "loss": ranks[0]["loss"], "grad_norm": ranks[0]["grad_norm"], "skipped": ranks[0]["skipped"],
            "seconds": round(time.perf_counter() - t0, 1)}
    old, new = result["old"], result["new"]

    def built(r: dict) -> int:  # a build's largest peak with its models less what that rank held before
        return max(x - b for x, b in zip(r["peak_models_bytes"], r["peak_base_bytes"], strict=True))

    def ratio(key: str) -> float:
        return round(max(old[key]) / max(new[key]), 3)

    print(json.dumps({
        "ratio": ratio("peak_models_bytes"),
        # the same, less what a rank holds before it builds anything (the libraries: the same in both builds)
        "ratio_above_base": round(built(old) / built(new), 3),
        # with the ZeRO-3 engine built, and after the first step: on CPU its fp32 master weights, gradients and
        # Adam moments are host memory too (on a GPU they are device memory)
        "engine_ratio": ratio("peak_load_bytes"), "step1_ratio": ratio("peak_step1_bytes"),
        "params": params, "checkpoint_bf16_bytes": weights, "fp32_bytes": 4 * params,
        "fp32_gib": round(4 * params / GIB, 3),
        "text_layers": config["text_config"]["num_hidden_layers"], "vision_blocks": config["vision_config"]["depth"],
        "world": WORLD, "old": old, "new": new, "seconds": round(time.perf_counter() - t_start, 1)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        build_checkpoint()
    elif sys.argv[1:2] == ["rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], float(sys.argv[7]))
    else:
        main()
