"""Prefix KV cache of the HF engine: keys and values of token prefixes it has already computed.

Why: an agent turn's prompt is the previous turn's prompt plus the tokens the model just
generated plus the tool's answer, and every episode starts with the same system prompt
(the tool schemas). Re-running the whole prompt each turn made generation compute-bound,
so batching episodes bought little. The engine keeps, per finished turn, the K/V of every
token it processed, and a new request only runs the tokens after its longest cached prefix.

What makes a prefix reusable: equal token ids *and* equal images behind its image pads
(two pictures of the same size expand to the same pads), so a prefix is keyed by its ids
plus a digest of each placed image and its ``max_pixels``. A cut never falls inside an
image's pad run: an image is encoded whole, in the request that first places it. K/V at
position t depend only on tokens <= t (causal attention; the vision tower encodes each
image on its own), so any prefix of a stored entry is itself a valid cache.

M-RoPE: each entry keeps the 3-D positions of its tokens; a continuation starts at
``max(positions) + 1``, which is where transformers' ``get_rope_index`` continues after
text and after an image (``start + max(h, w)`` for Qwen3-VL).

Entries are tied to one weight version: the engine clears the store on ``update_weights``.
Memory is bounded by ``max_tokens`` (least recently used entries go first); an entry that
is a prefix of a newer one is dropped at once, since the newer one serves it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch


def image_key(arr: np.ndarray, max_pixels: int) -> bytes:
    """Content digest of an image as the engine feeds it (pixels and cap decide its pads and features)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{arr.shape}|{arr.dtype}|{int(max_pixels)}".encode())
    h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.digest()


def image_runs(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """``(n, 2)`` start/end of each run of image pads: one run per image, in order of appearance."""
    pad = np.concatenate([[False], ids == pad_id, [False]])
    edges = np.flatnonzero(pad[1:] != pad[:-1])
    return edges.reshape(-1, 2)


@dataclass
class Seq:
    """A token sequence with its placed images (a request's prompt, or a prefix of one)."""

    ids: np.ndarray
    images: list[np.ndarray]
    max_pixels: list[int]
    keys: list[bytes]
    runs: np.ndarray

    def prefix(self, n: int) -> Seq:
        k = int((self.runs[:, 0] < n).sum())
        return Seq(self.ids[:n], self.images[:k], self.max_pixels[:k], self.keys[:k], self.runs[:k])

    def tag(self) -> tuple:
        return self.ids.tobytes(), tuple(self.keys)


def common_length(a: Seq, b_ids: np.ndarray, b_keys: list[bytes], limit: int) -> int:
    """Length of the longest prefix ``a`` shares with ``b`` (ids and images), at most ``limit``,
    never ending inside an image's pad run."""
    m = min(len(a.ids), len(b_ids), limit)
    diff = np.flatnonzero(a.ids[:m] != b_ids[:m])
    n = int(diff[0]) if len(diff) else m
    for k, (start, end) in enumerate(a.runs):
        if start >= n:
            break
        if end > n or k >= len(b_keys) or a.keys[k] != b_keys[k]:
            return int(start)
    return n


@dataclass(eq=False)  # an entry is itself: the generated == compares token arrays element-wise (list.remove)
class Entry:
    ids: np.ndarray
    keys: list[bytes]  # digests of the images placed in ids
    k: list[torch.Tensor]  # per layer (kv_heads, len, head_dim)
    v: list[torch.Tensor]
    positions: torch.Tensor  # (3, len) M-RoPE positions
    used: int = 0

    def next_position(self, n: int) -> int:
        return int(self.positions[:, :n].max()) + 1 if n else 0


@dataclass
class PrefixStore:
    """The engine's cached prefixes (see the module docstring); not thread-safe: the engine's lock guards it."""

    max_tokens: int
    entries: list[Entry] = field(default_factory=list)
    clock: int = 0
    hits: int = 0  # tokens served from the cache
    misses: int = 0  # tokens computed

    def lookup(self, seq: Seq) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``seq`` and that length (< len(seq): one token is left to run)."""
        best, best_n = None, 0
        for e in self.entries:
            n = common_length(seq, e.ids, e.keys, len(seq.ids) - 1)
            if n > best_n or (n == best_n and best is not None and n and e.used > best.used):
                best, best_n = e, n
        if best is not None and best_n:
            self.clock += 1
            best.used = self.clock
            return best, best_n
        return None, 0

    def add(self, entry: Entry) -> None:
        self.clock += 1
        entry.used = self.clock
        # entries that are prefixes of the new one are served by it
        self.entries = [e for e in self.entries
                        if not (len(e.ids) <= len(entry.ids) and np.array_equal(e.ids, entry.ids[:len(e.ids)])
                                and e.keys == entry.keys[:len(e.keys)])]
        self.entries.append(entry)
        total = self.tokens()
        for e in sorted(self.entries, key=lambda e: e.used):
            if total <= self.max_tokens:
                break
            self.entries.remove(e)
            total -= len(e.ids)

    def clear(self) -> None:
        self.entries.clear()

    def tokens(self) -> int:
        return sum(len(e.ids) for e in self.entries)


class SlotCache:
    """Preallocated K/V for one batch in a fixed slot layout, in the shape transformers' attention expects.

    Row i of the batch holds its cached prefix right-aligned before slot ``P``, its new tokens
    right-aligned before slot ``P + S``, then one slot per decoding step; an explicit 4-D mask
    hides the gaps. ``update`` (called by each attention layer) writes the new K/V of the
    first ``rows`` rows at ``length`` and returns their slots from ``lo`` (the first slot any
    row uses) to the end of them. Memory starts uninitialised unless ``zero``: every slot is
    written before attention reads it, except gaps, which must hold finite values (a masked
    slot gets weight 0, and 0 x NaN would still be NaN).
    """

    def __init__(self, layers: int, batch: int, heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, zero: bool = False) -> None:
        shape = (batch, heads, slots, head_dim)
        make = torch.zeros if zero else torch.empty
        self.k = [make(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [make(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0
        self.rows = batch
        self.lo = 0

    @property
    def slots(self) -> int:
        return self.k[0].shape[2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.k[layer_idx][:self.rows, :, self.length:end] = key_states
        self.v[layer_idx][:self.rows, :, self.length:end] = value_states
        return self.k[layer_idx][:self.rows, :, self.lo:end], self.v[layer_idx][:self.rows, :, self.lo:end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length
