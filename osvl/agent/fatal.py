"""Fatal steps: where a multi-turn trajectory stops deserving credit, the one home of that rule.

Definitions (docs/design.md, "Fatal-aware GRPO"): a *failed step* is an assistant
turn whose tool result is an error of a counted kind, or a turn that does not
parse (``invalid_call``). A trajectory is *fatal* when K consecutive steps fail;
the K-th failure is the fatal step. The *mask start* is the first turn outside the
pre-fatal prefix: by default the first failed step of that cascade (the released
code), optionally the K-th failure itself (the paper's formula).

Why it lives in the agent package: the loop that detects the fatal step serves RL,
evaluation and teachers alike, and the reward (r_fmt, r_query on the prefix) and the
learner (no gradient from the mask start on) must agree on the same turn, so all
three call ``find_fatal`` / ``mask_start`` here. The learner only turns the mask
start into a token mask (``osvl.rl.loss.token_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from osvl.errors import ConfigError

MaskStart = Literal["cascade", "kth"]
"""Where the pre-fatal prefix ends: the cascade's first failure (released code) or the K-th (paper)."""

NOT_FATAL = 1 << 30
"""Mask start of a non-fatal trajectory: larger than any turn index."""


@dataclass(frozen=True)
class Fatal:
    """Where a cascade of K consecutive failures starts and where it became fatal (0-based turns)."""

    cascade_start: int
    kth_failure: int


def find_fatal(failed: Sequence[bool], k: int = 3) -> Fatal | None:
    """The first run of ``k`` consecutive failed turns, or None; a success resets the count."""
    if k < 1:
        raise ConfigError(f"K must be >= 1, got {k}")
    run = 0
    for t, bad in enumerate(failed):
        run = run + 1 if bad else 0
        if run == k:
            return Fatal(cascade_start=t - k + 1, kth_failure=t)
    return None


def mask_start(cascade_start: int, kth_failure: int, at: MaskStart) -> int:
    """The first turn outside the pre-fatal prefix (``NOT_FATAL`` when the trajectory is not fatal).

    Takes the two indices a ``Trajectory`` records (-1 when not fatal), so the reward and
    the learner read the same fields the same way.
    """
    if at not in get_args(MaskStart):
        raise ConfigError(f"mask start must be one of {get_args(MaskStart)}, got {at!r}")
    if kth_failure < 0:
        return NOT_FATAL
    return cascade_start if at == "cascade" else kth_failure
