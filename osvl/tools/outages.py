"""Tool outages as a feature: a seeded injector that takes tools down for a burst of turns.

Why it exists: the paper masks post-fatal tokens and clamps fatal advantages because web
tools fail for reasons the policy does not cause (rate limits, dead endpoints, timeouts),
and vanilla GRPO then punishes a good prefix for the outage that killed it. osvl's tools
are local and rarely fail, so without this the claim cannot be tested where it should hold
(``bench/fatal_claim.py``, ``bench/ablation.py --outages=RATE``).

Model: each episode meets an outage with probability ``rate``; it starts at a turn drawn
uniformly from the episode's turn budget and lasts ``burst`` turns (K = 3 by default, so an
agent that keeps calling the downed tools is fatal), whatever the agent does. During it,
every call to one of ``tools`` (all when empty) fails with ``kind`` (``unavailable`` or
``timeout``, a typed tool error like any other) without reaching the tool; calls to other
tools and turns outside the window are untouched. An injected timeout returns at once: it
is the failure the agent sees, not the wait.

Determinism: the draw is a function of (``seed``, the episode's seed) alone, so the same
episode meets the same outage in every mode and on every rerun (common random numbers
across the ablation's modes). The loop records it in the trajectory: an ``outage:...``
event naming the window, kind and tools, and each injected failure's observation says so.

Off by default (``rate`` 0). ``OutageClient`` wraps a tool client where the other tool
settings build it; ``run_episode`` asks it for the episode's ``Outage``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Literal, get_args

from osvl.config import opt
from osvl.errors import ConfigError
from osvl.tools.base import ToolResult

OutageKind = Literal["unavailable", "timeout"]
OUTAGE_KINDS = get_args(OutageKind)


@dataclass
class OutageConfig:
    """Seeded tool outages (module docstring); ``rate`` 0 turns them off."""

    rate: float = opt(0.0, "Probability that an episode meets an outage (0 = off).")
    burst: int = opt(3, "Turns an outage lasts (K = 3 makes it fatal for an agent that keeps calling).")
    tools: list[str] = opt([], "Tools an outage takes down; empty = every tool.")
    kind: OutageKind = opt("unavailable", "The error kind injected: unavailable or timeout.")
    seed: int = opt(0, "Seed of the draws; with the episode's seed it fixes each episode's outage.")

    def check(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(f"outages.rate must be in [0, 1], got {self.rate}")
        if self.burst < 1:
            raise ConfigError(f"outages.burst must be >= 1, got {self.burst}")
        if self.kind not in OUTAGE_KINDS:
            raise ConfigError(f"outages.kind must be one of {OUTAGE_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Outage:
    """One episode's outage: turns [start, end) of ``tools`` (empty = all) fail with ``kind``."""

    start: int
    end: int
    kind: str
    tools: tuple[str, ...] = ()

    def covers(self, turn: int, tool: str) -> bool:
        return self.start <= turn < self.end and (not self.tools or tool in self.tools)

    def result(self, tool: str) -> ToolResult:
        return ToolResult.fail(self.kind, f"{tool}: outage (injected, turns {self.start}-{self.end - 1})")

    def event(self) -> str:
        return f"outage:turns {self.start}-{self.end - 1}:{self.kind}:{','.join(self.tools) or 'all'}"


def draw_outage(cfg: OutageConfig, episode_seed: int, turns: int) -> Outage | None:
    """The episode's outage or None: a function of (``cfg.seed``, ``episode_seed``) only."""
    cfg.check()
    if cfg.rate <= 0 or turns < 1:
        return None
    digest = hashlib.sha256(f"osvl-outage\x1f{cfg.seed}\x1f{episode_seed}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    if rng.random() >= cfg.rate:
        return None
    start = rng.randrange(turns)
    return Outage(start, start + cfg.burst, cfg.kind, tuple(cfg.tools))


class OutageClient:
    """A tool client with seeded outages: ``outage(seed, turns)`` gives the episode's window, which
    ``run_episode`` applies turn by turn; every other attribute is the wrapped client's."""

    def __init__(self, inner: Any, cfg: OutageConfig) -> None:
        cfg.check()
        self.inner, self.cfg = inner, cfg

    def __getattr__(self, name: str) -> Any:  # call, schemas, close, stats: the wrapped client's
        return getattr(self.inner, name)

    def outage(self, episode_seed: int, turns: int) -> Outage | None:
        return draw_outage(self.cfg, episode_seed, turns)


def with_outages(client: Any, cfg: OutageConfig | None) -> Any:
    """``client`` wrapped in an ``OutageClient`` when ``cfg`` injects outages, else ``client`` itself."""
    if cfg is None or cfg.rate <= 0:
        if cfg is not None:
            cfg.check()
        return client
    return OutageClient(client, cfg)
