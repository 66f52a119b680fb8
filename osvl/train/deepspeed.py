"""DeepSpeed under Ray Train: ZeRO configs, the engine set-up, checkpoints, the trainer.

SFT (``osvl/sft/job.py``) and the GRPO learner share every function here, so both train the
same way on a laptop (gloo, fp32, a handful of CPU cores) and on a GPU cluster (NCCL, bf16).

Choices and why:

* **A torch optimizer, not DeepSpeed's.** ``DeepSpeedCPUAdam``/``FusedAdam`` are C++/CUDA ops
  compiled on first use (minutes); ``torch.optim.AdamW`` needs nothing, so it is passed in with
  ``zero_allow_untested_optimizer: true``. ZeRO still partitions its moments (stage >= 1).
* **fp32 on CPU, bf16 on GPU.** CPU bf16 autocast is faster on some CPUs, but exact-resume and
  ZeRO-2 == ZeRO-3 checks need fp32, and fp32 is what a laptop run should default to.
* **gloo on CPU, NCCL on GPU.** Ray Train's ``TorchConfig`` creates the process group; DeepSpeed
  then finds it initialised and uses it (its CPU accelerator reports ``gloo``; the shared-memory
  all-reduce op it JIT-compiles is built once by ``make setup``).
* **Checkpoints through Ray Train.** Every rank writes its DeepSpeed shard files (distinct names
  per rank) and rank 0 the Hugging Face directory into one local folder each; ``ray.train.report``
  merges them into one checkpoint in the run's storage and keeps the last N, and a rerun of the
  same command (same storage path and name) or a restarted worker group gets it back from
  ``ray.train.get_checkpoint()``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from osvl.cluster import free_port, role_resources
from osvl.storage import train_storage

CHECKPOINT_TAG = "ds"  # one DeepSpeed tag per Ray checkpoint folder: the folder itself is the step
HF_SUBDIR = "hf"


def ds_config(stage: int, *, micro_batch: int, grad_accum: int, world_size: int, grad_clip: float = 1.0,
              bf16: bool = False, hidden_size: int = 0, on_gpu: bool = False) -> dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` with an external torch optimizer and scheduler.

    ``train_batch_size`` is spelled out (micro x accumulation x world) because DeepSpeed checks
    the three against each other. ZeRO-3 gathers the 16-bit (here: the training dtype) weights on
    save so that ``hf_state_dict`` can write a loadable Hugging Face directory.

    ZeRO-3 tuning (the values Hugging Face's "auto" picks, and OpenRLHF runs), from the model's
    ``hidden_size`` h: a parameter under 10 h elements (norms, biases) stays whole on every rank
    (gathering it costs more than it saves), the next layers' weights are prefetched in buckets of
    0.9 h^2 elements and gradients reduced in buckets of h^2. ``overlap_comm`` runs the reductions
    on their own CUDA stream during backward: on with GPUs; the CPU accelerator has no streams to
    overlap on, so it stays off there. ``hidden_size`` 0 (a test's tiny model): nothing persistent,
    so the stage-3 gather/release path runs on every parameter.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        h = hidden_size
        zero.update(stage3_gather_16bit_weights_on_model_save=True,
                    stage3_param_persistence_threshold=10 * h,
                    **({"stage3_prefetch_bucket_size": int(0.9 * h * h), "reduce_bucket_size": h * h} if h else {}))
    if stage >= 2:
        zero.update(overlap_comm=on_gpu, contiguous_gradients=True)
    return {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,  # the job prints its own progress line
        "wall_clock_breakdown": False,
    }


def hidden_size(model_dir: str | Path) -> int:
    """The language model's hidden size from the checkpoint's config.json (ZeRO-3's bucket sizes)."""
    from osvl.models.load import read_config  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    cfg = read_config(model_dir)
    return int(cfg.get("text_config", cfg).get("hidden_size", 0))


def use_venv_ninja() -> None:
    """Put the interpreter's own bin first on PATH when it holds a ``ninja``.

    DeepSpeed builds its CPU ops (shm_comm) with the first `ninja` on PATH into one cache per user. A
    system ninja 1.11 and the venv's 1.13 write incompatible build logs, so processes that find
    different ones (a test run vs a Ray job's workers) rebuilt the op every time, 1-2 min each.
    """
    venv_bin = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(venv_bin, "ninja")) and not os.environ.get("PATH", "").startswith(venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")


def build_comm_op() -> None:
    """Build (or find built) DeepSpeed's CPU shared-memory comm op with the ninja ``init_engine`` uses:
    ``make setup`` calls this, so no timed test pays the ~60 s JIT build."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 (b) deepspeed is not in the vLLM env

    use_venv_ninja()
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()


def init_process_group() -> None:
    """The process group DeepSpeed (and ``zero.Init``) runs on: Ray Train's (gloo on CPU, NCCL on GPU) inside
    a Ray Train worker; outside one (a plain script, a test), a one-process group."""
    import deepspeed  # noqa: PLC0415 (b) deepspeed is not in the vLLM env

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    use_venv_ninja()
    deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized() else None)


class _Zero3:
    """What transformers asks of a registered DeepSpeed config: is it ZeRO-3, and the dict itself."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return True


@contextmanager
def _zero3_build(config: dict[str, Any]) -> Iterator[None]:
    """Models built inside are partitioned as they are created (transformers' ``zero.Init`` path).

    transformers finds the config through a module-level weak reference (what its HfDeepSpeedConfig
    registers, which also demands accelerate; the two methods it reads are ``_Zero3``'s); it is unset on
    the way out, so a later load in this process (a ZeRO-2 engine, an evaluation) is not partitioned.

    Meanwhile glibc hands large freed blocks back to the OS. Its mmap threshold rises (up to 32 MiB) each
    time an mmapped block is freed, after which blocks of that size come from the heap; a build that
    creates each layer whole and frees it once split leaves that heap full of holes its partitions never
    fill. A rank of ``bench/learner_memory.py`` (263M parameters, 2 ranks) peaked at 1.45 GiB with its
    models built in 32 s with the rising threshold, at 1.15 GiB in 14 s with it fixed at 128 KiB (the
    whole-model build's 2.83 GiB did not move). Fixed at 128 KiB for training too, its first step took
    12 -> 17 s (every mid-sized activation mapped and faulted in afresh), so on the way out it is fixed at
    the rising threshold's ceiling. On a GPU the layers are device memory; this is the host's share
    (checkpoint reads, CPU runs). ``mallopt`` is glibc's; elsewhere (musl, macOS) nothing changes."""
    # lazy: (d) keeps transformers out of jobs/grpo.py --help
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config  # noqa: PLC0415

    mallopt = _glibc_mallopt()
    mallopt(_M_MMAP_THRESHOLD, 128 * 1024)  # fixed, which also stops the rise
    marker = _Zero3(config)  # held here: transformers keeps only a weak reference
    set_hf_deepspeed_config(marker)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)


_M_MMAP_THRESHOLD = -3


def _glibc_mallopt() -> Callable[[int, int], int]:
    """glibc's ``mallopt``, or a function that does nothing where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return lambda option, value: 0


def load_trainable(model_dir: str | Path, config: dict[str, Any], *, grad_checkpointing: bool = False,
                   frozen: bool = False) -> Any:
    """The model as ``config`` will run it: bf16 when its ``bf16`` is on (DeepSpeed keeps fp32 master weights
    and moments beside it), else fp32; under ZeRO-3 built *partitioned* (``zero.Init`` through transformers'
    ``HfDeepSpeedConfig``): each layer is created, filled from the checkpoint (read by rank 0 alone) and
    split over the ranks at once, so no rank ever holds the whole model. Built whole, an 8B model is
    32 GB of fp32 per rank, 8 ranks a node (64 GB with the reference); partitioned over 8 GPUs, 2 GB of bf16
    each (``bench/learner_memory.py`` measures both builds' host memory at 263M parameters).

    ``grad_checkpointing``: every decoder layer recomputes its activations in backward, so a step
    keeps one layer's activations instead of every layer's. ``frozen``: no parameter needs a
    gradient (the reference model).
    """
    from osvl.models.load import load_model  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    dtype = "bfloat16" if config.get("bf16", {}).get("enabled") else "float32"
    if config["zero_optimization"]["stage"] == 3:
        init_process_group()
        with _zero3_build(config):
            model = load_model(model_dir, dtype=dtype, device=None)
    else:
        model = load_model(model_dir, dtype=dtype)
    model.config.use_cache = False
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if frozen:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def partitioned_copy(model: Any, config: dict[str, Any]) -> Any:
    """A frozen copy of the ZeRO-3 partitioned ``model`` (built by ``load_trainable`` with ``config``, before its
    engine), made without reading the checkpoint again: the same architecture built empty under ``zero.Init``,
    then each rank's partition of each weight copied from ``model``'s (the two split every weight the same
    way). The reference model starts as the policy: a second read would hold the checkpoint's mapped file
    on rank 0 a second time beside both models' partitions (``bench/learner_memory.py``), and cost the read."""
    with _zero3_build(config):
        copy = type(model)._from_config(model.config, dtype=next(model.parameters()).dtype)
    theirs = dict(copy.named_parameters())
    for name, p in model.named_parameters():
        q = theirs.pop(name)
        if p.ds_tensor.shape != q.ds_tensor.shape:
            raise RuntimeError(f"{name}: partitions differ ({tuple(p.ds_tensor.shape)} vs {tuple(q.ds_tensor.shape)})")
        q.ds_tensor.data.copy_(p.ds_tensor.data)
        q.requires_grad_(False)
    if theirs:
        raise RuntimeError(f"the copy has parameters the model lacks: {sorted(theirs)[:5]}")
    buffers = dict(model.named_buffers())
    for name, b in copy.named_buffers():
        b.data.copy_(buffers[name].data)
    copy.config.use_cache = False
    return copy.eval()


def init_engine(model, optimizer, lr_scheduler, config: dict[str, Any]):
    """``deepspeed.initialize`` inside a Ray Train worker (the process group already exists); with no
    optimizer (``None``) an inference engine (the partitioned reference model)."""
    import deepspeed  # noqa: PLC0415 (b) deepspeed is not in the vLLM env

    init_process_group()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           config=config)
    return engine


def _free_port() -> int:
    return free_port()


def hf_state_dict(engine) -> dict | None:
    """The full model state dict on rank 0 (``None`` elsewhere); a collective under ZeRO-3."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def save_hf(engine, out: Path, processor=None) -> None:
    """Write a Hugging Face directory (config, safetensors, processor) that ``osvl.models.load`` loads."""
    state = hf_state_dict(engine)
    if dist.get_rank() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    engine.module.save_pretrained(out, state_dict=state, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(out)
        processor.image_processor.save_pretrained(out)


def save_checkpoint(engine, folder: Path, client_state: dict, processor=None) -> None:
    """DeepSpeed state (every rank's shard) + the HF directory (rank 0) into ``folder``."""
    engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state=client_state)
    save_hf(engine, folder / HF_SUBDIR, processor)


def load_checkpoint(engine, folder: Path) -> dict:
    """Restore model, optimizer and scheduler state; returns the ``client_state`` saved with it."""
    _, client = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {folder}")
    return client


def worker_bundle(threads_per_worker: int, use_gpu: bool, role_units: float = 0.0,
                  role: str = "learner") -> dict[str, float]:
    """What each Ray Train worker of ``make_trainer`` reserves: its CPUs, one GPU when ``use_gpu``, and
    ``role_units`` of its role's custom resource (``jobs/grpo.py --check`` prints and checks the same)."""
    return {"CPU": float(threads_per_worker), **({"GPU": 1.0} if use_gpu else {}), **role_resources(role, role_units)}


def make_trainer(train_fn: Callable[[dict], None], loop_config: dict, *, num_workers: int,
                 threads_per_worker: int, use_gpu: bool, storage: Path | str, name: str,
                 keep: int, max_failures: int, resources: dict[str, float] | None = None,
                 placement_strategy: str = "PACK"):
    """A ``TorchTrainer`` running ``train_fn`` on ``num_workers`` workers (gloo on CPU, NCCL on GPU).

    Each worker reserves ``threads_per_worker`` CPUs (plus ``resources``, e.g. its role's custom
    resource); the loop should ``torch.set_num_threads`` to the same number so that workers do not
    oversubscribe the cores. Rerunning with the same
    ``storage`` and ``name`` resumes from the latest of the ``keep`` checkpoints. ``storage`` is a run
    folder; when it mirrors remote storage (``osvl.storage``) the checkpoints go straight there, from
    every node (Ray Train refuses a local ``storage_path`` once its workers span nodes).
    ``placement_strategy`` is the Ray placement-group strategy of the workers' bundles (PACK,
    STRICT_PACK, SPREAD).
    """
    import ray.train  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    storage_path, storage_fs = train_storage(storage)

    return TorchTrainer(
        train_fn,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker={
            **worker_bundle(threads_per_worker, use_gpu), **(resources or {})}, placement_strategy=placement_strategy),
        run_config=ray.train.RunConfig(name=name, storage_path=storage_path, storage_filesystem=storage_fs,
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep),
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures)),
    )
