"""The two engine interfaces: token engines (ids + images in, ids + log-probs out) and chat engines.

Token engines (Hugging Face ``generate``, vLLM) serve the policy: the agent loop hands them
the exact token ids of the episode so far, with image pads already expanded, and records
exactly the ids they return, so training replays what the model saw. Their log-probs are of
exactly the sampling distribution: ``log_softmax(logits / temperature)`` of the sampled
token, no top-p or top-k (RL needs the behaviour probability, and truncating the
distribution would make the importance ratio lie). Temperature 0 means greedy decoding,
with log-probs of ``logits / 1.0``.

Chat engines (OpenAI-compatible endpoints, the offline oracle teacher) take messages and
return text; the loop renders their turns once with the student's tokenizer into a
"teacher" record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class Sampling:
    """How to sample one turn. RL: temperature 1.0 and nothing else; 0 = greedy."""

    temperature: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends after emitting any of them


@dataclass
class GenRequest:
    """One turn to generate: the episode's ids so far (pads expanded) and its images in order."""

    prompt_ids: list[int]
    images: list[np.ndarray]
    image_max_pixels: list[int]
    sampling: Sampling


@dataclass
class GenResult:
    """The sampled ids (including the stop token when one ended the turn), their log-probs, and the policy
    version of the weights that sampled them (set by the engine under its weight lock: reading
    ``engine.version`` after ``generate`` returns races with a weight update)."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "stop" | "length"
    version: int = -1


@runtime_checkable
class TokenEngine(Protocol):
    version: int  # policy version of the weights in use

    async def generate(self, req: GenRequest) -> GenResult: ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ChatEngine(Protocol):
    name: str

    async def chat(self, messages: list[dict], images: Mapping[str, np.ndarray], sampling: Sampling) -> str: ...


def _set_result(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def resolve_future(target: tuple[asyncio.AbstractEventLoop, asyncio.Future], value: Any,
                   error: BaseException | None) -> None:
    """Answer an ``asyncio`` future from an engine's own thread (``target`` = its event loop and the future)."""
    loop, fut = target
    try:
        loop.call_soon_threadsafe(_set_result, fut, value, error)
    except RuntimeError:  # that event loop is closed: nobody is waiting any more
        pass
