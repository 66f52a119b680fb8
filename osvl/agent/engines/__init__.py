"""Generation engines behind two interfaces (``base.py``); ``make_engine`` builds a token engine by name.

vLLM is imported only when asked for: the default environment has no vLLM (the official
wheel is CUDA-only; the CPU build lives in its own test environment).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from osvl.agent.engines.base import ChatEngine, GenRequest, GenResult, Sampling, TokenEngine
from osvl.errors import ConfigError

__all__ = ["ENGINES", "ChatEngine", "EngineKind", "GenRequest", "GenResult", "Sampling", "TokenEngine", "make_engine"]

EngineKind = Literal["hf", "vllm"]
ENGINES = get_args(EngineKind)


def make_engine(kind: str, model: str, **kw: Any) -> TokenEngine:
    """A token engine over the checkpoint directory ``model``: ``"hf"`` (transformers) or ``"vllm"``."""
    if kind == "hf":
        from osvl.agent.engines.hf import HFEngine

        return HFEngine(model, **kw)
    if kind == "vllm":
        from osvl.agent.engines.vllm import VLLMEngine

        return VLLMEngine(model, **kw)
    raise ConfigError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
