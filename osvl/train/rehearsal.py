"""The GPU rehearsal: SFT and the GRPO learner on CPU, failing where a GPU cluster would.

On CPU with gloo a host tensor in a collective and a host batch fed to the model both work; with
NCCL and CUDA both fail at the first step. Every model input and every collective that osvl code
issues must therefore go through ``osvl/train/device.py``, which marks what it places. With
``learner.rehearsal`` (GRPO) or ``rehearsal`` (SFT) set to ``on``, each Ray Train worker installs:

* a wrapper around ``torch.distributed``'s tensor collectives: called from osvl code with a tensor
  the placement helper did not return, it raises ``OffDevice`` with NCCL's own message (DeepSpeed's
  and transformers' collectives are not checked: they place their tensors on the accelerator
  themselves);
* a check on every call of a ``*ForConditionalGeneration`` model: an input tensor the placement
  helper did not return raises ``OffDevice``, as CUDA's "Expected all tensors to be on the same
  device" would;
* a record of the rank's peak host memory (``ru_maxrss``) once the models are loaded and after the
  first optimiser step, written to ``rehearsal_rank<r>.json`` in the run folder, so a test can bound
  what each rank held (a rank that builds the whole fp32 model shows it here).

The ``plant_host_batch`` and ``plant_host_collective`` values are the rehearsal's self-test: they put
back, in the worker only, the two mistakes the rehearsal exists for (the batch fed to the model as
collate made it; a host tensor all-reduced directly), and the run must then fail with ``OffDevice``.
"""

from __future__ import annotations

import functools
import json
import resource
import sys
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from osvl.train import device
from osvl.train.device import PLACED

Rehearsal = Literal["off", "on", "plant_host_batch", "plant_host_collective"]
NCCL_REFUSAL = "No backend type associated with device type cpu"
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "send", "recv")

_state: dict[str, Any] = {"mode": "off", "peaks": {}, "out": None, "rank": 0}


class OffDevice(RuntimeError):
    """A tensor reached the model or a collective without the placement helpers (``osvl/train/device.py``)."""


def _placed(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.device.type != "cpu" or getattr(t, PLACED, False)


def _from_osvl(depth: int = 2) -> bool:
    """Whether the collective's caller is osvl code (the placement helper itself marks what it sends)."""
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("osvl.")


def _check_collective(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if _from_osvl():
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
            if not all(_placed(t) for t in tensors):
                raise OffDevice(f"torch.distributed.{name} from osvl code on a host tensor: {NCCL_REFUSAL} "
                                "(NCCL's refusal; collectives go through osvl.train.device.all_reduce)")
        return fn(*args, **kwargs)

    checked._osvl_rehearsal = True  # type: ignore[attr-defined]
    return checked


def _check_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if not type(module).__name__.endswith("ForConditionalGeneration"):
        return
    bad = [k for k, v in kwargs.items() if not _placed(v)] + [str(i) for i, v in enumerate(args) if not _placed(v)]
    if bad:
        raise OffDevice(f"{type(module).__name__} got host tensors {bad} that never went through "
                        "osvl.train.device.to_model: on a GPU, 'Expected all tensors to be on the same device'")


def install(mode: Rehearsal, out_dir: str | Path | None, rank: int) -> None:
    """Turn the rehearsal on in this worker (``mode`` ``off``: nothing); idempotent."""
    if mode == "off":
        return

    _state.update(mode=mode, out=Path(out_dir) if out_dir is not None else None, rank=rank, peaks={})
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_osvl_rehearsal", False):
            setattr(dist, name, _check_collective(name, fn))
    from transformers import PreTrainedModel  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    if not getattr(PreTrainedModel.__call__, "_osvl_rehearsal", False):
        PreTrainedModel.__call__ = _checked_call  # every Hugging Face model, DeepSpeed's wrapped module too
    if mode == "plant_host_batch":
        _plant_host_batch()
    elif mode == "plant_host_collective":
        _plant_host_collective()


def _checked_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    _check_inputs(self, args, kwargs)
    return torch.nn.Module.__call__(self, *args, **kwargs)


_checked_call._osvl_rehearsal = True  # type: ignore[attr-defined]


def _plant_host_batch() -> None:
    """The batch reaches the model as collate made it (the learner before ``to_model``)."""
    device.to_model = lambda batch, model: dict(batch)  # type: ignore[assignment]


def _plant_host_collective() -> None:
    """A host tensor all-reduced directly (the learner's and SFT's collectives before ``all_reduce``)."""
    def host_all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if device.world() == 1:
            return t.detach()
        out = t.detach().clone()
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return out

    device.all_reduce = host_all_reduce  # type: ignore[assignment]


def note_peak(stage: str) -> None:
    """Record this rank's peak host memory so far under ``stage`` (``load``, ``step1``) and write the
    rank's record; nothing when the rehearsal is off."""
    if _state["mode"] == "off" or stage in _state["peaks"]:
        return
    _state["peaks"][stage] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if _state["out"] is not None:
        _state["out"].mkdir(parents=True, exist_ok=True)
        rec = {"rank": _state["rank"], "mode": _state["mode"], "peak_rss_bytes": _state["peaks"]}
        (_state["out"] / f"rehearsal_rank{_state['rank']}.json").write_text(json.dumps(rec))
