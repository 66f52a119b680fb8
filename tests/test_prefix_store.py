"""osvl.agent.engines.kv.PrefixStore: evicting the least recently used prefix, wherever it sits in the store."""

from __future__ import annotations

import numpy as np
import torch

from osvl.agent.engines.kv import Entry, PrefixStore, Seq


def _entry(ids: list[int]) -> Entry:
    n = len(ids)
    return Entry(np.array(ids), [], [torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)], torch.zeros(3, n))


def test_the_least_recently_used_entry_is_evicted_even_when_it_is_not_the_first():
    """The eval of 100 held-out questions crashed here: ``list.remove`` compared entries with the dataclass
    ``==``, which compares their token arrays element-wise, and arrays of two lengths do not broadcast."""
    store = PrefixStore(max_tokens=12)
    a, b, c = _entry([1, 2, 3, 4]), _entry([5, 6, 7, 8, 9]), _entry([10, 11, 12, 13, 14, 15])
    store.add(a)
    store.add(b)
    seq = Seq(np.array([1, 2, 3, 4, 99]), [], [], [], np.zeros(0))
    assert store.lookup(seq) == (a, 4)  # a is now the most recently used: b, second in the list, goes first
    store.add(c)
    assert store.entries == [a, c] and store.tokens() == 10
