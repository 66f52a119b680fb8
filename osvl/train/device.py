"""Where the learner's tensors live: one function moves a batch to the model, one reduces over the ranks.

On a GPU cluster a CUDA model refuses host inputs ("Expected all tensors to be on the same device")
and NCCL refuses host tensors ("No backend type associated with device type cpu"); on a laptop (gloo,
a host model) both mistakes pass silently. So SFT and the GRPO learner hand every model input and
every collective they issue themselves to the two functions here, and the GPU rehearsal
(``osvl/train/rehearsal.py``) checks on CPU that nothing went around them: each tensor these functions
return carries a mark, and under the rehearsal an unmarked model input or collective argument fails
the way the GPU would.

The target is the DeepSpeed accelerator's current device (``cuda:<local rank>`` under Ray Train with
GPUs, ``cpu`` otherwise) for collectives, and the model's own parameters' device for its inputs,
so one code path runs on both.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

PLACED = "_osvl_placed"  # attribute set on the tensors placed here (read by osvl/train/rehearsal.py)


def group_device() -> torch.device:
    """The device the process group's collectives take tensors on (DeepSpeed's accelerator)."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 (b) deepspeed is not in the vLLM env

    return torch.device(get_accelerator().current_device_name())


def model_device(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of ``model``'s weights (a DeepSpeed engine or a plain module; under
    ZeRO-3 a partitioned parameter's placeholder still has both)."""
    p = next(model.parameters())
    return p.device, p.dtype


def _mark(t: torch.Tensor) -> torch.Tensor:
    setattr(t, PLACED, True)
    return t


def to_model(batch: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``model``'s device; the pixels also in its dtype (a bf16 model takes
    bf16 pixels), everything else in its own dtype (the loss math keeps fp32 log-probs and rewards)."""
    dev, dtype = model_device(model)
    out: dict[str, torch.Tensor] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(dev, dtype=dtype if k == "pixel_values" else v.dtype, non_blocking=True)
            _mark(v)
        out[k] = v
    return out


def on_group(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the group's device (no copy when it is there already), for a point-to-point send or
    receive osvl issues itself (``osvl.rl.weights`` collects ZeRO-3 partitions on rank 0 so)."""
    return _mark(t.to(group_device()))


def world() -> int:
    """Ranks in the process group (1 without one: tests, a single-process learner)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced over the ranks (``sum`` or ``max``), as a new tensor on the group's device; ``t``
    itself (detached) without a process group."""
    if world() == 1:
        return t.detach()
    out = _mark(t.detach().to(group_device(), copy=True))
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return out
