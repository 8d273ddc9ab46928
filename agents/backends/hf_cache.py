"""A transformers KV-cache layer that grows in place, for the hf backend's decode loop.

transformers' ``DynamicLayer`` appends each decode step's keys and values with ``torch.cat``:
every step copies the whole cache of every row, so a step costs time in proportion to the
context. Measured in a 192-chunk evaluation (64 rows, ~190 cached positions, tiny preset), the
copies were a quarter of the decode time. :class:`GrowingLayer` keeps the keys and values in a
buffer with room for the tokens still to come and writes each step into it; ``keys`` and
``values`` are views of the filled part, so attention reads the same numbers as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose appends write into a preallocated buffer.

    Args:
        room: positions to reserve after the first update (the tokens a call may still add);
            an update past the buffer reallocates it with this much room again.
    """

    def __init__(self, room: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.room = max(0, int(room))
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, s = self._n, key_states.shape[-2]
        if self._k is None or n + s > self._k.shape[-2]:
            self._reserve(key_states, value_states, n + s + self.room)
        self._k[..., n:n + s, :] = key_states
        self._v[..., n:n + s, :] = value_states
        self._n = n + s
        self._expose()
        return self.keys, self.values

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, size: int) -> None:
        k = key_states.new_empty((*key_states.shape[:-2], size, key_states.shape[-1]))
        v = value_states.new_empty((*value_states.shape[:-2], size, value_states.shape[-1]))
        if self._k is not None and self._n:
            k[..., :self._n, :] = self._k[..., :self._n, :]
            v[..., :self._n, :] = self._v[..., :self._n, :]
        self._k, self._v = k, v

    def _expose(self) -> None:
        self.keys, self.values = self._k[..., :self._n, :], self._v[..., :self._n, :]

    def get_seq_length(self) -> int:
        return self._n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k[indices, ...], self._v[indices, ...]
            self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self._k is not None and tokens_to_remove:
            self._n = max(0, self._n + tokens_to_remove)
            self._expose()

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        super().reset()


def growing_cache(config: Any, room: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers are :class:`GrowingLayer` (call it only for
    models whose cache layers are all plain ``DynamicLayer``)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) for _ in cache.layers]
    return cache


def plain_layers(config: Any) -> bool:
    """Whether every cache layer of ``config`` is a plain ``DynamicLayer`` (no sliding window,
    no recurrent state): only then may its keys and values be kept, moved or grown in place."""
    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class PrefixCache:
    """Keys/values of prompt heads, keyed by the head's token ids and position offset: episode
    prefixes (instructions + question: every call of an episode and every sample of its question
    begin with it), so that each is prefilled once per policy rather than once per call, and the
    longer heads of :mod:`agents.backends.hf_prefill` (one per episode prefix, see
    :meth:`put_head`). LRU within a byte budget.

    An entry is only valid for the weights that computed it: the cache empties itself when the
    backend's ``policy_version`` changes or any parameter is replaced or modified in place
    (tensor identity and autograd version counter), whichever a trainer's update does."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[Any, tuple[list[tuple[torch.Tensor, torch.Tensor]], int]] = OrderedDict()
        self.bytes = 0
        self.heads: dict[Any, Any] = {}  # episode prefix key -> the key of its longer head
        self._stamp: Any = None

    def check(self, policy_version: int, model: Any) -> None:
        """Empty the cache unless the policy and its weights are the ones its entries came from."""
        stamp = (policy_version, tuple((p.data_ptr(), p._version) for p in model.parameters()))
        if stamp != self._stamp:
            self.clear()
            self._stamp = stamp

    def clear(self) -> None:
        self.entries.clear()
        self.heads.clear()
        self.bytes = 0

    def get(self, key: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]
        return None

    def put(self, key: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if size > self.max_bytes:
            return
        self.drop(key)
        self.entries[key] = (layers, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1][1]

    def drop(self, key: Any) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]

    def put_head(self, owner: Any, key: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep a longer head of episode ``owner`` in place of its previous one (the episode's next
        call can only begin with its newest), where it fits without evicting anything: heads
        never push out the episode prefixes every call needs."""
        previous = self.heads.pop(owner, None)
        if previous is not None:
            self.drop(previous)
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if self.bytes + size <= self.max_bytes:
            self.heads[owner] = key
            self.put(key, layers)
