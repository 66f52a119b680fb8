"""Hugging Face token engine: batches the turns of concurrent episodes into one ``generate``.

Many episodes run on one event loop (``asyncio``); each awaits ``generate(req)`` for its
next turn while others wait on tools. Requests land in a queue; one worker takes every
request pending at that moment (up to ``max_batch``), left-pads them into one batch and
runs a single ``model.generate`` in a worker thread, so the event loop keeps serving tool
calls while the model runs. Requests that need different sampling (temperature, stop
tokens) go in separate batches, since ``generate`` takes one configuration per call.

Sampling is exactly the distribution the log-probs describe: ``do_sample`` with
``temperature``, top-k disabled (``top_k=0``: transformers' default is 50) and
``top_p=1.0``; every other logits processor a checkpoint's generation config might switch
on (repetition penalty, min-p, ...) is neutralised. Log-probs are computed from the raw
logits ``generate`` returns (``output_logits``, before any processor) as
``log_softmax(logits / temperature)``; temperature 0 is greedy with log-probs of the
unscaled logits. Per-request seeds cannot be honoured token for token inside a shared
batch (``generate`` draws from one global RNG), so a batch is seeded from the seeds of its
requests: a rerun with the same concurrency and seeds reproduces it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from osvl.agent.engines.base import GenRequest, GenResult, Sampling
from osvl.agent.trajectory import mm_token_type_ids, processor_inputs
from osvl.errors import ConfigError
from osvl.models.load import load_model, load_processor

# Processors a checkpoint's generation_config.json may switch on, set to their no-op values:
# generate() fills every field we leave None from the checkpoint's config, then from its global
# defaults (top_k=50), which would silently truncate the sampling distribution.
NEUTRAL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
           "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0,
           "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "num_beams": 1, "renormalize_logits": False}


class HFEngine:
    """``TokenEngine`` over ``transformers`` ``generate`` (CPU or one GPU); fp32 by default for exact re-scoring."""

    def __init__(self, model: str | Path, *, max_batch: int = 32, dtype: str = "float32", device: str = "cpu",
                 attn_implementation: str | None = "sdpa", version: int = 0) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.path = str(model)
        self.model = load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation)
        self.processor = load_processor(model)
        self.tokenizer = self.processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.version = version
        self.stats = {"batches": 0, "requests": 0, "max_batch_seen": 0}
        self._lock = threading.Lock()  # generate and update_weights never overlap
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None

    # -- async side ---------------------------------------------------------

    async def generate(self, req: GenRequest) -> GenResult:
        """Queue one turn; resolves when the batch that took it has finished."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._worker is None or self._worker.done():
            # one queue and worker per event loop (tests and jobs may call asyncio.run more than once)
            self._loop, self._queue = loop, asyncio.Queue()
            self._worker = loop.create_task(self._serve())
        future = loop.create_future()
        await self._queue.put((req, future))
        return await future

    async def _serve(self) -> None:
        queue = self._queue
        while True:
            pending = [await queue.get()]
            await asyncio.sleep(0)  # let episodes that are ready this tick enqueue their turns too
            while not queue.empty() and len(pending) < self.max_batch:
                pending.append(queue.get_nowait())
            groups: dict[tuple, list] = {}
            for req, fut in pending:
                s = req.sampling
                groups.setdefault((float(s.temperature), tuple(sorted(s.stop_token_ids))), []).append((req, fut))
            for group in groups.values():
                live = [(r, f) for r, f in group if not f.cancelled()]
                if not live:
                    continue
                try:
                    results = await asyncio.to_thread(self._generate_batch, [r for r, _ in live])
                except Exception as e:  # noqa: BLE001 - hand the failure to every waiting episode
                    for _, f in live:
                        if not f.done():
                            f.set_exception(e)
                    continue
                for (_, f), res in zip(live, results, strict=True):
                    if not f.done():
                        f.set_result(res)

    # -- the model ------------------------------------------------------------

    def _generate_batch(self, reqs: list[GenRequest]) -> list[GenResult]:
        """One left-padded ``generate`` over requests that share temperature and stop tokens."""
        from transformers import GenerationConfig

        s0: Sampling = reqs[0].sampling
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids):] = 1
        # the vision tower takes every image of the batch in row order, matching the pads' order
        images = [im for r in reqs for im in r.images]
        caps = [mp for r in reqs for mp in r.image_max_pixels]
        vision = processor_inputs(images, caps, self.processor) if images else {}
        if images:
            vision["mm_token_type_ids"] = mm_token_type_ids(ids, self.model.config.image_token_id)
        greedy = s0.temperature <= 0
        stop = list(s0.stop_token_ids) or [self.tokenizer.eos_token_id]
        gc = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else float(s0.temperature),
            max_new_tokens=max(r.sampling.max_new_tokens for r in reqs), eos_token_id=stop,
            pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True, **NEUTRAL)
        if greedy:
            gc.top_k, gc.top_p = None, None  # greedy ignores them; unset avoids transformers' warning
        seeds = [r.sampling.seed for r in reqs if r.sampling.seed is not None]
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[]):
            if seeds:
                torch.manual_seed(hash(tuple(seeds)) & 0x7FFF_FFFF)
            kwargs = {k: v.to(self.device) for k, v in vision.items()}
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=gc, **kwargs)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (B, steps, V), raw: before any processor
        scale = 1.0 if greedy else float(s0.temperature)
        logp = torch.log_softmax(logits / scale, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        stop_set = set(stop)
        results = []
        for i, r in enumerate(reqs):
            toks = new[i].tolist()
            n, finish = min(len(toks), r.sampling.max_new_tokens), "length"
            for j in range(n):
                if toks[j] in stop_set:
                    n, finish = j + 1, "stop"
                    break
            results.append(GenResult(token_ids=toks[:n], logprobs=logp[i, :n].tolist(), finish=finish))
        self.stats["batches"] += 1
        self.stats["requests"] += len(reqs)
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(reqs))
        return results

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model in place (a subset is fine; unknown names are an error)."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = sorted(k for k in state_dict if k not in params)
        if unknown:
            raise ConfigError(f"update_weights: names not in the model: {unknown[:5]}")
        with self._lock, torch.no_grad():
            for k, v in state_dict.items():
                params[k].copy_(v.to(params[k].device, params[k].dtype))
            self.version = int(version)

    def close(self) -> None:
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self._worker = None

    def __repr__(self) -> str:
        return f"HFEngine({self.path!r}, version={self.version}, max_batch={self.max_batch})"

