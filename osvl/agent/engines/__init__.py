"""Generation engines behind two interfaces (``base.py``); ``make_engine`` builds a token engine by name.

vLLM is imported only when asked for: the default environment has no vLLM (the official
wheel is CUDA-only; the CPU build lives in its own test environment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from osvl.agent.engines.base import ChatEngine, GenRequest, GenResult, Sampling, TokenEngine
from osvl.config import opt
from osvl.errors import ConfigError

__all__ = ["ENGINES", "ChatEngine", "EngineKind", "GenRequest", "GenResult", "Sampling", "TokenEngine", "VLLMOptions",
           "make_engine", "vllm_args"]

EngineKind = Literal["hf", "vllm"]
ENGINES = get_args(EngineKind)


@dataclass
class VLLMOptions:
    """How a vLLM engine runs (``rollout.vllm``, eval's ``vllm``): on a GPU as OpenRLHF and verl run it
    (bf16, CUDA graphs, a share of the GPU's memory), on CPU exactly (fp32, eager: its log-probs are
    compared with the learner's). Here, not in ``vllm.py``, so configs parse where vLLM is not installed."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = opt(
        "auto", "Weights and activations: auto = bfloat16 on a GPU, float32 on CPU.")
    max_model_len: int = opt(0, "Longest sequence one engine takes, in tokens; 0 = the episode budget "
                                "(agent.max_episode_tokens). Below the budget fails at start: a longer episode's "
                                "next turn would be refused and its whole group dropped.")
    gpu_memory_utilization: float = opt(0.85, "GPU: the share of each GPU's memory vLLM may take (weights, "
                                              "activations, KV cache).", hashed=False)
    cuda_graphs: bool = opt(True, "GPU: capture CUDA graphs (vLLM's enforce_eager off); CPU always runs eager.",
                            hashed=False)
    tensor_parallel_size: int = opt(1, "GPUs one engine spans (its actor holds them: rollout.num_gpus equals it).",
                                    hashed=False)
    kv_cache_gb: int = opt(2, "CPU: the KV cache's size, GiB.", hashed=False)
    max_images: int = opt(16, "Most images in one prompt (vLLM's limit_mm_per_prompt).", hashed=False)

    def check(self, setting: str, episode_tokens: int) -> None:
        """Refuse, naming ``setting``, what would fail only once the engine runs."""
        if self.max_model_len and self.max_model_len < episode_tokens:
            raise ConfigError(f"{setting}.max_model_len={self.max_model_len} is below the episode budget "
                              f"agent.max_episode_tokens={episode_tokens}: a longer episode's turn would be refused "
                              "and its group dropped; raise it or leave it 0 (= the budget)")
        if self.tensor_parallel_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{setting}: tensor_parallel_size must be >= 1 and gpu_memory_utilization in (0, 1]")


def vllm_args(opts: VLLMOptions, episode_tokens: int, gpu: bool) -> dict[str, Any]:
    """``VLLMEngine`` keyword arguments for ``opts`` on a GPU machine (``gpu``) or a CPU one."""
    args: dict[str, Any] = {
        "dtype": opts.dtype if opts.dtype != "auto" else ("bfloat16" if gpu else "float32"),
        "enforce_eager": not (gpu and opts.cuda_graphs),
        "gpu_memory_utilization": opts.gpu_memory_utilization, "kv_cache_gb": opts.kv_cache_gb,
        "max_images": opts.max_images}
    if opts.max_model_len or episode_tokens:
        args["max_model_len"] = opts.max_model_len or episode_tokens
    if opts.tensor_parallel_size > 1:  # workers in processes of their own; updates reach each through collective_rpc
        args.update(tensor_parallel_size=opts.tensor_parallel_size, distributed_executor_backend="mp")
    return args


def make_engine(kind: str, model: str, *, max_batch: int = 32, version: int = 0, vllm: VLLMOptions | None = None,
                episode_tokens: int = 0, **kw: Any) -> TokenEngine:
    """A token engine over the checkpoint directory ``model``: ``"hf"`` (transformers) or ``"vllm"``.

    ``max_batch`` (most turns in one batch) and ``version`` (the policy version it starts at) are every
    engine's; ``vllm`` and ``episode_tokens`` (the agent's budget, vLLM's ``max_model_len`` by default)
    are vLLM's; ``kw`` goes to the engine's constructor as it is (tests).
    """
    if kind == "hf":
        from osvl.agent.engines.hf import HFEngine  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

        return HFEngine(model, max_batch=max_batch, version=version, **kw)
    if kind == "vllm":
        import torch  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

        from osvl.agent.engines.vllm import VLLMEngine  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

        opts = vllm or VLLMOptions()
        if episode_tokens:
            opts.check("vllm", episode_tokens)
        derived = vllm_args(opts, episode_tokens, torch.cuda.is_available()) if (vllm or episode_tokens) else {}
        return VLLMEngine(model, max_batch=max_batch, version=version, **{**derived, **kw})
    raise ConfigError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
