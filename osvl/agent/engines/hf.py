"""Hugging Face token engine: continuous batching of concurrent episodes' turns, reusing cached K/V.

Many episodes run on one event loop (``asyncio``); each awaits ``generate(req)`` for its
next turn while others wait on tools. Turns go to one engine thread that owns the model,
so the event loop keeps serving tool calls while the model runs.

Why not ``model.generate``: every turn re-ran the whole prompt (system prompt with the tool
schemas, images, history), so on CPU generation was compute-bound, and a batch ran until
its longest turn ended while finished episodes waited: batching 32 episodes bought 1.5x.
Qwen3-VL checkpoints run this engine's own loop instead, as serving engines do:
- a prefix KV cache (``kv.py``): a turn runs only the tokens after the longest prefix the
  engine has already computed (its episode's previous turn; the shared system prompt);
  prompts that several new turns share (the G samples of a GRPO group, the system prompt
  on a cold start) are computed once first. Cleared on ``update_weights``.
- continuous batching: between decoding steps, waiting turns are prefilled together (their
  uncached tokens only; images encoded once, when first placed) and join the running batch
  in its spare rows; each step decodes one token for every live row, each with its own
  temperature, stop tokens, token budget and sampling generator; a row that stops is
  answered at once and its row freed. The slot layout and masks: ``kv.SlotCache``.
Positions are exactly what a training forward computes (``get_rope_index``'s 3-D M-RoPE),
so the log-probs re-score; a test checks cached and uncached generation agree.

Sampling is exactly the distribution the log-probs describe: ``softmax(logits /
temperature)`` over the whole vocabulary (no top-k/top-p or other processors), log-probs
``log_softmax(logits / temperature)`` of the raw float32 logits; temperature 0 is greedy
with log-probs of the unscaled logits. A request's ``seed`` seeds its own generator, so its
tokens do not depend on what else shares its batch.

Other model types (Qwen2.5-VL, ...) are refused with a ``ConfigError`` that names the vLLM
engine: a ``model.generate`` fallback could not honour per-request seeds inside a shared
batch, and one generation path per engine is the one the tests exercise.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from osvl.agent.engines.base import GenRequest, GenResult, Sampling, resolve_future
from osvl.agent.engines.kv import Entry, PrefixStore, Seq, SlotCache, common_length, image_key, image_runs
from osvl.agent.trajectory import processor_inputs
from osvl.errors import ConfigError, DataError, EngineError
from osvl.models.load import load_model, load_processor

CACHED_TYPES = ("qwen3_vl",)  # model types whose positions this engine's own loop computes
ADMIT_AFTER = 2  # decoding steps a turn may wait for others to arrive before it is admitted anyway
MIN_SHARED = 16  # tokens a shared prompt prefix must save before it is computed on its own first
MARGIN_SLOTS = 256  # spare slots on each side of a re-laid-out batch, so turns can join in place for a while


def _mask(valid: torch.Tensor, q0: int, q: int, lo: int = 0) -> torch.Tensor:
    """``(B, 1, q, q0 + q - lo)`` boolean attention mask for queries at slots ``q0..q0+q-1`` over slots from
    ``lo``: causal over the valid slots; every query also sees itself, so padding rows never attend to nothing
    (NaN)."""
    kv = torch.arange(lo, q0 + q)
    qs = torch.arange(q0, q0 + q)
    allowed = valid[:, None, lo: q0 + q] & (kv[None, :] <= qs[:, None])[None]
    allowed |= (kv[None, :] == qs[:, None])[None]
    return allowed[:, None]


@dataclass
class _Row:
    """One request in the running batch (``sampling`` None: a shared prefix computed only to be cached)."""

    seq: Seq
    sampling: Sampling | None
    future: tuple | None  # (event loop, asyncio future) to resolve
    version: int
    entry: Entry | None = None  # the cached prefix it starts from, and that prefix's length
    n: int = 0
    new_pos: torch.Tensor | None = None  # (3, L) M-RoPE positions of the tokens it ran in prefill
    next_pos: int = 0  # M-RoPE position of its first generated token
    gen: torch.Generator | None = None
    toks: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    finish: str = ""

    def headroom(self) -> int:
        """Slots it may still need: every further sampled token but the last is fed back."""
        return max(self.sampling.max_new_tokens - len(self.toks) - 1, 0) if self.sampling else 0


@dataclass
class _Batch:
    """The running batch: rows, their K/V in slot layout (``kv.SlotCache``), and each row's next-token logits."""

    rows: list[_Row]
    cache: SlotCache
    valid: torch.Tensor  # (B, slots) bool: which slots hold a token of that row
    logits: torch.Tensor | None  # (B, V) float32 on CPU

    def live(self) -> int:
        return sum(1 for r in self.rows if not r.finish)


class HFEngine:
    """``TokenEngine`` over ``transformers`` (CPU or one GPU); fp32 by default for exact re-scoring.

    One engine thread owns the model: it admits queued turns into the running batch between
    decoding steps (continuous batching), decodes one token for every live row per step,
    and resolves each turn's future as soon as that row stops. Weight updates are applied by the same thread
    between two decoding steps (turns in flight pause, then go on with the new weights); a turn's
    ``GenResult`` carries the version it started with, the oldest that sampled it. ``cache_tokens`` bounds the
    prefix cache (2 KB a token for the tiny model, ~57 KB for a 7B one in bf16): 65,536 tokens hold about two
    turns of 32 episodes of 1,000 tokens.
    """

    def __init__(self, model: str | Path, *, max_batch: int = 32, dtype: str = "float32", device: str = "cpu",
                 attn_implementation: str | None = "sdpa", version: int = 0, prefix_cache: bool = True,
                 cache_tokens: int = 65_536) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.path = str(model)
        kind = json.loads((Path(model) / "config.json").read_text()).get("model_type")
        if kind not in CACHED_TYPES:
            raise ConfigError(f"the HF engine runs {', '.join(CACHED_TYPES)} checkpoints (its own cached loop); "
                              f"{self.path} is {kind!r}: use the vLLM engine (--engine vllm) for it")
        self.model = load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation)
        self.processor = load_processor(model)
        self.tokenizer = self.processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.version = version
        # transformers renamed past_key_values to cache (5.2x); the vLLM environment pins an older one
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.store = PrefixStore(cache_tokens) if prefix_cache else None
        self.stats = {"batches": 0, "requests": 0, "max_batch_seen": 0, "steps": 0, "row_steps": 0,
                      "prefill_tokens": 0, "cached_tokens": 0, "aborted": 0, "running": 0}
        self._inbox: queue.Queue = queue.Queue()
        self._broken = ""  # why generation is paused (a version that broke part way), else ""
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    # -- callers' side ----------------------------------------------------------

    async def generate(self, req: GenRequest) -> GenResult:
        """Queue one turn; resolves when its row stops (the stop token, or its token budget). Cancelling the
        awaiting task aborts the turn: the engine drops its row before its next decoding step (a client that
        went away costs no more tokens; ``stats["aborted"]`` counts them, ``stats["running"]`` the live rows)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._start()
        self._inbox.put(("generate", (req, (loop, fut))))
        return await fut

    @property
    def weight_dtype(self) -> str:
        """The dtype a weight version must arrive in (``osvl.rl.weights``)."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
                       version: int) -> None:
        """Copy a state dict, or a stream of partial ones (buckets), into the model in place. Blocks until the
        engine thread has applied it, between two decoding steps: turns in flight pause meanwhile and go
        on with the new weights (each keeps the version it started with, the oldest); the prefix cache
        (K/V of the old weights) is emptied. A name the model does not have is a ``ConfigError``; a stream
        that breaks part way leaves the engine paused, generating nothing, until a version arrives whole."""
        done: dict = {"event": threading.Event()}
        self._start()
        self._inbox.put(("update", ([state_dict] if isinstance(state_dict, Mapping) else state_dict, int(version),
                                    done)))
        done["event"].wait()
        if "error" in done:
            raise done["error"]

    def close(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(("stop", None))
            thread.join(timeout=60)
        self._thread = None
        if self.store is not None:
            self.store.clear()

    def __repr__(self) -> str:
        return f"HFEngine({self.path!r}, version={self.version}, max_batch={self.max_batch})"

    # -- the engine thread ----------------------------------------------------------

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._main, name="hf-engine", daemon=True)
                self._thread.start()

    def _main(self) -> None:
        batch: _Batch | None = None
        waiting: list[tuple] = []  # (GenRequest, future) not admitted yet
        updates: list[tuple] = []
        held = 0  # steps the oldest waiting turn has waited
        with torch.no_grad():  # grad mode is per thread
            while True:
                live = batch.live() if batch is not None else 0
                self.stats["running"] = live
                # idle, or paused by a version that broke part way: block until something arrives
                items = [] if (live or waiting or updates) and not self._broken else [self._inbox.get()]
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for kind, payload in items:
                    if kind == "stop":
                        err = EngineError("the HF engine was closed")
                        for row in batch.rows if batch is not None else []:
                            if not row.finish:
                                resolve_future(row.future, None, err)
                        for _, fut in waiting:
                            resolve_future(fut, None, err)
                        for *_, done in updates:
                            done["error"] = err
                            done["event"].set()
                        return
                    (updates if kind == "update" else waiting).append(payload)
                if updates:  # between two decoding steps; the turns in flight wait meanwhile
                    for buckets, version, done in updates:
                        try:
                            self._apply(buckets, version)
                        except Exception as e:  # noqa: BLE001 - the caller of update_weights gets it
                            done["error"] = e
                        done["event"].set()
                    updates.clear()
                    if not live:
                        batch = None
                if self._broken:
                    continue
                aborted = [w for w in waiting if w[1][1].cancelled()]
                if aborted:
                    waiting = [w for w in waiting if not w[1][1].cancelled()]
                for row in batch.rows if batch is not None else []:
                    if not row.finish and row.future is not None and row.future[1].cancelled():
                        row.finish = "aborted"
                        aborted.append(row)
                self.stats["aborted"] += len(aborted)
                # admitting costs a prefill and a re-layout of the running batch: gather a few arrivals first
                # (a quarter of the live rows, or ADMIT_AFTER steps of waiting), never hold anyone when idle
                held = held + 1 if waiting and live else 0
                if (waiting and not updates and live < self.max_batch
                        and (not live or 4 * len(waiting) >= live or held > ADMIT_AFTER)):
                    held = 0
                    admit, waiting = waiting[: self.max_batch - live], waiting[self.max_batch - live:]
                    try:
                        batch = self._admit(batch, admit)
                    except Exception as e:  # noqa: BLE001 - the admitted turns fail, the running ones go on
                        for _, fut in admit:
                            resolve_future(fut, None, e)
                if batch is not None and not batch.live() and batch.rows:
                    self._drop_finished(batch)
                self.stats["running"] = batch.live() if batch is not None else 0
                if batch is not None and batch.live():
                    try:
                        self._step(batch)
                    except Exception as e:  # noqa: BLE001 - hand the failure to every turn in the batch
                        for row in batch.rows:
                            if not row.finish:
                                row.finish = "error"
                                resolve_future(row.future, None, e)
                        batch = None

    def _targets(self) -> dict[str, torch.Tensor]:
        """Every name a state dict of this model can hold, tied aliases included: a model with tied
        embeddings lists lm_head.weight in its state dict (what a learner sends) but not, by default, among
        its parameters."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers()))
        return params

    def _apply(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        params = self._targets()
        self._broken = f"version {version} is arriving"
        for i, state_dict in enumerate(buckets):
            unknown = sorted(k for k in state_dict if k not in params)
            if unknown:
                if i == 0:  # nothing copied: the weights are still the last version's
                    self._broken = ""
                raise ConfigError(f"update_weights: names not in the model: {unknown[:5]}")
            for k, v in state_dict.items():
                params[k].copy_(v.to(params[k].device, params[k].dtype))
        if self.store is not None:
            self.store.clear()
        self.version = int(version)
        self._broken = ""

    def _admit(self, batch: _Batch | None, admit: list[tuple]) -> _Batch | None:
        reqs = [r for r, _ in admit]
        self.stats["batches"] += 1
        self.stats["requests"] += len(reqs)
        seqs = [self._seq(r) for r in reqs]
        if self.store is not None and len(seqs) > 1:
            self._fill_shared(seqs)
        rows = [_Row(s, r.sampling, fut, self.version) for s, (r, fut) in zip(seqs, admit, strict=True)]
        new = self._prefill(rows)
        for r in rows:
            if r.finish:  # a budget of 0 tokens: nothing to generate
                resolve_future(r.future, GenResult(token_ids=[], logprobs=[], finish=r.finish, version=r.version),
                               None)
        return self._place(batch, new)

    def _place(self, batch: _Batch | None, new: _Batch) -> _Batch | None:
        """Join ``new`` rows to the running batch: copied into its spare rows, ending at its current slot, when
        they fit; else both are laid out afresh (``_merge``)."""
        if batch is None or not batch.rows:
            return self._merge(None, new)
        cache, n, k = batch.cache, len(batch.rows), len(new.rows)
        used = new.valid.any(0).nonzero()
        lo = int(used[0]) if len(used) else new.cache.length
        width = new.cache.length - lo
        start = cache.length - width
        room = max(r.headroom() for r in batch.rows + new.rows)
        if n + k > cache.k[0].shape[0] or start < 0 or cache.length + room > cache.slots:
            return self._merge(batch, new)
        for dst, src in ((cache.k, new.cache.k), (cache.v, new.cache.v)):
            for layer in range(len(dst)):
                dst[layer][n:n + k, :, start:cache.length] = src[layer][:, :, lo:new.cache.length]
        batch.valid[n:n + k] = False
        batch.valid[n:n + k, start:cache.length] = new.valid[:, lo:new.cache.length]
        cache.lo = min(cache.lo, start)
        cache.rows = n + k
        batch.rows += new.rows
        batch.logits = torch.cat([batch.logits, new.logits])
        return batch

    def _drop_finished(self, batch: _Batch) -> None:
        """Remove finished rows, each replaced by the batch's last row (one row copied, the rest stay put)."""
        cache, i = batch.cache, 0
        while i < len(batch.rows):
            if not batch.rows[i].finish:
                i += 1
                continue
            last = len(batch.rows) - 1
            if i != last:
                for kv in (cache.k, cache.v):
                    for layer in range(len(kv)):
                        kv[layer][i, :, cache.lo:cache.length] = kv[layer][last, :, cache.lo:cache.length]
                batch.valid[i] = batch.valid[last]
                batch.logits[i] = batch.logits[last]
                batch.rows[i] = batch.rows[last]
            batch.rows.pop()
            batch.logits = batch.logits[:last]
            cache.rows = last

    def _seq(self, req: GenRequest) -> Seq:
        ids = np.asarray(req.prompt_ids, dtype=np.int64)
        runs = image_runs(ids, self.model.config.image_token_id)
        if len(runs) != len(req.images) or len(req.images) != len(req.image_max_pixels):
            raise DataError(f"request has {len(runs)} image pad runs, {len(req.images)} images and "
                            f"{len(req.image_max_pixels)} max_pixels values")
        keys = [image_key(a, mp) for a, mp in zip(req.images, req.image_max_pixels, strict=True)]
        return Seq(ids, list(req.images), [int(mp) for mp in req.image_max_pixels], keys, runs)

    def _fill_shared(self, seqs: list[Seq]) -> None:
        """Compute once the prompt prefixes that several new requests share and no cache entry holds (the
        system prompt on a cold start, the identical first prompts of a GRPO group), shortest first."""
        hits = [self.store.lookup(s)[1] for s in seqs]
        shared: dict[tuple, Seq] = {}
        for i, a in enumerate(seqs):
            for j in range(i + 1, len(seqs)):
                b = seqs[j]
                n = common_length(a, b.ids, b.keys, min(len(a.ids), len(b.ids)) - 1)
                if n >= max(hits[i], hits[j]) + MIN_SHARED:
                    p = a.prefix(n)
                    shared.setdefault(p.tag(), p)
        todo = sorted(shared.values(), key=lambda p: len(p.ids))
        while todo:  # waves: a prefix waits until every shorter shared prefix of it is cached
            wave = [p for p in todo if not any(len(q.ids) < len(p.ids) and common_length(
                p, q.ids, q.keys, len(q.ids)) == len(q.ids) for q in todo)]
            filled = self._prefill([_Row(p, None, None, self.version) for p in wave])
            for i in range(len(wave)):
                self._store(filled, i)
            todo = [p for p in todo if all(p is not w for w in wave)]

    def _positions(self, length: int, runs: np.ndarray, grids: torch.Tensor, start: int) -> torch.Tensor:
        """``(3, length)`` M-RoPE positions of new tokens starting at ``start``, exactly as ``get_rope_index``
        numbers them in a full sequence: text +1 per token, an image its 3-D grid, then ``start + max(h, w)``."""
        merge = self.model.config.vision_config.spatial_merge_size
        pos = torch.empty((3, length), dtype=torch.long)
        cur, j = start, 0
        for (a, b), grid in zip(runs.tolist(), grids, strict=True):
            pos[:, j:a] = torch.arange(cur, cur + a - j)
            cur += a - j
            vision = self.model.model.get_vision_position_ids(cur, grid, 1, merge)
            if vision.shape[1] != b - a:
                raise DataError(f"an image has {b - a} pads but its grid {grid.tolist()} needs {vision.shape[1]}")
            pos[:, a:b] = vision
            cur += max(int(grid[1]), int(grid[2])) // merge
            j = b
        pos[:, j:] = torch.arange(cur, cur + length - j)
        return pos

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """One forward over every row's uncached tokens. Row i's cached prefix sits right-aligned before slot
        P, its new tokens right-aligned before P + S (images: only those not in its prefix are encoded)."""
        store, dev = self.store, self.device
        for r in rows:
            r.entry, r.n = store.lookup(r.seq) if store is not None else (None, 0)
        B = len(rows)
        P = max(r.n for r in rows)
        S = max(len(r.seq.ids) - r.n for r in rows)
        tc = self.model.config.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        slots = P + S + max(r.sampling.max_new_tokens - 1 if r.sampling else 0 for r in rows)
        cache = SlotCache(tc.num_hidden_layers, B, tc.num_key_value_heads, slots, head_dim, self.model.dtype, dev)
        valid = torch.zeros((B, slots), dtype=torch.bool)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        pos = torch.zeros((4, B, S), dtype=torch.long)
        pos[0] = torch.arange(P, P + S)  # text row: the slot (attention ordering); rows 1-3: M-RoPE
        new_images, new_caps, firsts = [], [], []
        for i, r in enumerate(rows):
            for layer in range(len(cache.k)):
                cache.k[layer][i, :, :P - r.n] = 0  # gaps must hold finite values (masked, x0)
                cache.v[layer][i, :, :P - r.n] = 0
                if r.entry is not None:
                    cache.k[layer][i, :, P - r.n:P] = r.entry.k[layer][:, :r.n]
                    cache.v[layer][i, :, P - r.n:P] = r.entry.v[layer][:, :r.n]
            valid[i, P - r.n:P] = True
            length = len(r.seq.ids) - r.n
            ids[i, S - length:] = torch.from_numpy(r.seq.ids[r.n:])
            valid[i, P + S - length:P + S] = True
            first = int((r.seq.runs[:, 0] < r.n).sum())  # images already in the cached prefix
            new_images += r.seq.images[first:]
            new_caps += r.seq.max_pixels[first:]
            firsts.append(first)
        vision = processor_inputs(new_images, new_caps, self.processor) if new_images else {}
        grids = vision.get("image_grid_thw")
        g = 0
        for i, r in enumerate(rows):
            runs = r.seq.runs[firsts[i]:] - r.n
            r.new_pos = self._positions(len(r.seq.ids) - r.n, runs, grids[g:g + len(runs)] if len(runs) else [],
                                        r.entry.next_position(r.n) if r.entry is not None else 0)
            g += len(runs)
            pos[1:, i, S - r.new_pos.shape[1]:] = r.new_pos
            r.next_pos = int(r.new_pos.max()) + 1
            if r.sampling is not None:
                seed = r.sampling.seed if r.sampling.seed is not None else int(torch.randint(2**62, ()))
                r.gen = torch.Generator().manual_seed(int(seed))  # its own: tokens independent of batch mates
                if r.sampling.max_new_tokens < 1:
                    r.finish = "length"
        self.stats["prefill_tokens"] += sum(r.new_pos.shape[1] for r in rows)
        self.stats["cached_tokens"] += sum(r.n for r in rows)
        cache.length = P
        kwargs = {k: v.to(dev) for k, v in vision.items()}
        out = self.model(input_ids=ids.to(dev), attention_mask=_mask(valid, P, S).to(dev), position_ids=pos.to(dev),
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache}, **kwargs)
        cache.length = P + S
        return _Batch(rows, cache, valid, out.logits[:, -1].float().cpu())

    def _merge(self, a: _Batch | None, b: _Batch | None) -> _Batch | None:
        """The live rows of ``a`` and ``b`` as one batch: each right-aligned to the later end, slots no live row
        uses dropped, room for every row's remaining tokens. Finished rows leave here."""
        parts = [(x, [i for i, r in enumerate(x.rows) if not r.finish]) for x in (a, b) if x is not None]
        parts = [(x, keep) for x, keep in parts if keep]
        if not parts:
            return None
        end = max(x.cache.length for x, _ in parts)
        # first slot any kept row uses, in the merged layout
        lo = min(int(x.valid[keep].any(0).nonzero()[0]) + end - x.cache.length for x, keep in parts)
        lo -= MARGIN_SLOTS  # free slots before the first used one: longer prompts can join in place
        rows = [x.rows[i] for x, keep in parts for i in keep]
        slots = end - lo + max(r.headroom() for r in rows) + MARGIN_SLOTS
        first = parts[0][0].cache
        heads, head_dim = first.k[0].shape[1], first.k[0].shape[3]
        capacity = max(self.max_batch, len(rows))
        cache = SlotCache(len(first.k), capacity, heads, slots, head_dim, first.k[0].dtype, first.k[0].device,
                          zero=True)  # spare rows and slots must hold finite values: turns join in place later
        cache.rows = len(rows)
        valid = torch.zeros((capacity, slots), dtype=torch.bool)
        logits, at = [], 0
        for x, keep in parts:
            off = end - x.cache.length - lo  # where source slot 0 lands (negative: its first slots are dropped)
            src, dst = max(0, -off), max(0, off)
            width = x.cache.length - src
            idx = torch.tensor(keep)
            # kept rows as runs of consecutive indices: slices copy once, an index_select would copy twice
            spans, start = [], 0
            for j in range(1, len(keep) + 1):
                if j == len(keep) or keep[j] != keep[j - 1] + 1:
                    spans.append((at + start, keep[start], j - start))
                    start = j
            for new_kv, old_kv in ((cache.k, x.cache.k), (cache.v, x.cache.v)):
                for layer in range(len(new_kv)):
                    for d, sidx, count in spans:
                        new_kv[layer][d:d + count, :, dst:dst + width] = \
                            old_kv[layer][sidx:sidx + count, :, src:x.cache.length]
            valid[at:at + len(keep), dst:dst + width] = x.valid[idx, src:x.cache.length]
            logits.append(x.logits[idx])
            at += len(keep)
        cache.length, cache.lo = end - lo, MARGIN_SLOTS
        return _Batch(rows, cache, valid, torch.cat(logits))

    def _step(self, batch: _Batch) -> None:
        """Sample one token for every live row; rows that stop are cached and answered; the others are fed back
        in one forward."""
        rows, B = batch.rows, len(batch.rows)
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], batch.live())
        temps = torch.tensor([float(r.sampling.temperature) if not r.finish else 1.0 for r in rows])
        scale = torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]
        logp = torch.log_softmax(batch.logits / scale, dim=-1)
        # inverse-CDF sampling, vectorised over rows, one uniform per row from that row's own generator
        cdf = logp.double().exp().cumsum(-1)
        u = torch.cat([torch.rand(1, generator=r.gen, dtype=torch.float64) if not r.finish
                       else torch.zeros(1, dtype=torch.float64) for r in rows])
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        picks = torch.where(temps <= 0, batch.logits.argmax(-1), drawn)
        picked = logp.gather(1, picks[:, None]).squeeze(1)
        for i, (r, t, lp) in enumerate(zip(rows, picks.tolist(), picked.tolist(), strict=True)):
            if r.finish:
                continue
            r.toks.append(t)
            r.lps.append(lp)
            if t in (r.sampling.stop_token_ids or [self.tokenizer.eos_token_id]):
                r.finish = "stop"
            elif len(r.toks) >= r.sampling.max_new_tokens:
                r.finish = "length"
            else:
                continue
            self._store(batch, i)
            resolve_future(r.future, GenResult(token_ids=r.toks, logprobs=r.lps, finish=r.finish,
                                               version=r.version), None)
        self._drop_finished(batch)
        rows, B, cur = batch.rows, len(batch.rows), batch.cache.length
        self.stats["steps"] += 1
        self.stats["row_steps"] += B
        if not B:
            return
        feed = torch.tensor([[r.toks[-1]] for r in rows], dtype=torch.long)
        dpos = torch.empty((4, B, 1), dtype=torch.long)
        dpos[0] = cur
        dpos[1:, :, 0] = torch.tensor([r.next_pos + len(r.toks) - 1 for r in rows])
        batch.valid[:B, cur] = True
        out = self.model(input_ids=feed.to(self.device),
                         attention_mask=_mask(batch.valid[:B], cur, 1, batch.cache.lo).to(self.device),
                         position_ids=dpos.to(self.device), use_cache=True, **{self._cache_kw: batch.cache})
        batch.cache.length = cur + 1
        batch.logits = out.logits[:, -1].float().cpu()

    def _store(self, batch: _Batch, i: int) -> None:
        """Cache row i's K/V: its prompt and every token it fed back (not the last one sampled)."""
        if self.store is None:
            return
        r = batch.rows[i]
        fed = r.toks[:-1]
        slot_idx = batch.valid[i].nonzero().squeeze(1).to(self.device)
        ids = np.concatenate([r.seq.ids, np.asarray(fed, dtype=np.int64)])
        if len(slot_idx) != len(ids):
            raise DataError(f"kv cache: {len(slot_idx)} slots hold {len(ids)} tokens")
        before = r.entry.positions[:, :r.n] if r.entry is not None else torch.zeros((3, 0), dtype=torch.long)
        positions = torch.cat([before, r.new_pos, torch.arange(r.next_pos, r.next_pos + len(fed)).expand(3, -1)], 1)
        layers = range(len(batch.cache.k))
        self.store.add(Entry(ids, list(r.seq.keys), [batch.cache.k[x][i].index_select(1, slot_idx) for x in layers],
                             [batch.cache.v[x][i].index_select(1, slot_idx) for x in layers], positions))
