"""PrefixStore: the KV of recent request prefixes, kept for requests that start the same way.

The decode engine's sequence per slot is [system prefix] [image tokens] [prompt]. A request
may name a reusable prefix: its image (by a caller-given key, e.g. a digest of the pixels)
plus its first `prefix_tokens` prompt tokens (for the planner: the scene's object line). The
first request with a key is prefilled in full and the KV of positions [0, L) of its slot
(L = system prefix + image tokens + prefix_tokens) is copied here; a later request with the
same key copies it back into its slot and prefills only the rest of its prompt. Causal
attention makes positions < L depend on the prefix alone, so the tokens are the same with and
without the store (up to float rounding of a differently shaped prefill).

Entries: per layer k, v [n_kv_heads, L, head_dim] (the cache dtype and device); at most
`capacity`, least recently used evicted first. Not thread-safe (the engine's one caller).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from torch import Tensor

__all__ = ["PrefixStore", "PrefixEntry"]


@dataclass
class PrefixEntry:
    k: list[Tensor]  # per layer [n_kv_heads, length, head_dim]
    v: list[Tensor]
    length: int  # positions covered: system prefix + image tokens + prefix tokens


class PrefixStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"parameter 'prefix_entries' = {capacity}: must be >= 0")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, PrefixEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> PrefixEntry | None:
        """The entry of key (now the most recently used), or None; counts a hit or a miss."""
        e = self._entries.get(key)
        if e is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: Hashable, k: list[Tensor], v: list[Tensor]) -> None:
        """Keep k, v (owned by the store from now on); evicts the least recently used."""
        if self.capacity == 0:
            return
        self._entries[key] = PrefixEntry(k, v, int(k[0].shape[1]))
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
