"""Fatal steps and token masks: where a multi-turn trajectory stops deserving gradient.

Definitions (docs/design.md, "Fatal-aware GRPO"): a *failed step* is an assistant
turn whose tool result is an error of a counted kind, or a turn that does not
parse (``invalid_call``). A trajectory is *fatal* when K consecutive steps fail;
the K-th failure is the fatal step. Tokens from the *mask start* on get no
gradient: by default the first failed step of that cascade (the released code),
optionally the K-th failure itself (the paper's formula).

Everything here is pure Python / torch on plain tensors so it runs in
milliseconds in tests; the agent loop records the per-turn failures, the learner
calls ``token_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NOT_FATAL = 1 << 30
"""Mask start used for non-fatal trajectories: larger than any step index."""


@dataclass(frozen=True)
class Fatal:
    """Where a cascade of K consecutive failures starts and where it became fatal (0-based turns)."""

    cascade_start: int
    kth_failure: int

    def mask_start(self, at: str = "cascade") -> int:
        if at == "cascade":
            return self.cascade_start
        if at == "kth":
            return self.kth_failure
        raise ValueError(f"mask start must be 'cascade' or 'kth', got {at!r}")


def find_fatal(failed: Sequence[bool], k: int = 3) -> Fatal | None:
    """The first run of ``k`` consecutive failed turns, or None; a success resets the count."""
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    run = 0
    for t, bad in enumerate(failed):
        run = run + 1 if bad else 0
        if run == k:
            return Fatal(cascade_start=t - k + 1, kth_failure=t)
    return None


def token_mask(gen_mask: torch.Tensor, step_ids: torch.Tensor, mask_start: torch.Tensor) -> torch.Tensor:
    """M = M_gen · 1[step(t) < f]: model tokens of turns before the mask start.

    gen_mask: (B, T) 1 on model-generated tokens; step_ids: (B, T) the assistant-turn
    index each token belongs to (any value on prompt/tool tokens, which gen_mask
    zeroes anyway); mask_start: (B,) the turn index from which gradient stops
    (``NOT_FATAL`` for trajectories without a fatal step).
    """
    keep = step_ids < mask_start.unsqueeze(1)
    return gen_mask.to(torch.float32) * keep.to(torch.float32)


def prefix_turn_mask(n_turns: int, mask_start: int) -> list[bool]:
    """Which assistant turns count for r_fmt and r_query: the pre-fatal prefix."""
    return [t < mask_start for t in range(n_turns)]
