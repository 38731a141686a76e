"""A sequence's KV as the CPU decode runtime's pass reads it (``cpu_decode.CpuDecoder``): which
layers hold KV, the buffers a step or a prompt chunk writes (its own, a prompt-cache entry's
shared arrays, a sliding layer's ring laid out for a chunk), the ``struct mlxcel_kv`` table of
every row and layer, and the caches' positions after the pass.

Why apart from the decoder: the decoder is the model's weights and the pass; this is the
bookkeeping between mlx-lm's caches and the pass's addresses, which every family shares and the
hybrids (delta-net layers hold recurrent state, not KV) and the sliding-window families (rings:
``ring_chunks.py``, ``decode_kv.ring_plan``) bend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxcel_compat.runtime import decode_delta, ring_chunks
from mlxcel_compat.runtime.decode_kv import KvLayout, OwnedCache
from mlxcel_compat.runtime.native import decode_pass


class SequenceKv:
    """``kv``: the attention layers' layout (indices among ``attn_layers``); ``n_layers`` all the
    model's layers; ``delta_layers`` a hybrid's delta-net ones and ``deltas`` their weights
    (``decode_delta.DeltaWeights``)."""

    def __init__(self, kv: KvLayout, n_layers: int, attn_layers: list[int], delta_layers: list[int],
                 deltas: list[Any]) -> None:
        self.kv, self.n_layers = kv, n_layers
        self.attn_layers, self.delta_layers, self.deltas = attn_layers, delta_layers, deltas
        self._bases: dict[int, tuple[list[tuple[int, ...]], np.ndarray]] = {}  # by id of a views list

    def offset(self, cache: list[Any]) -> int:
        """The sequence's position: its first attention layer's (a delta-net layer keeps none)."""
        return cache[self.attn_layers[0]].offset

    def attention(self, cache: list[Any]) -> list[Any]:
        """The attention layers' caches (the KV layout's), all of them but a hybrid's delta-net ones."""
        return [cache[i] for i in self.attn_layers] if self.delta_layers else cache

    def borrow(self, cache: list[Any], owned: OwnedCache, pos: int, n: int = 1) -> Any:
        """``KvLayout.borrow``; never for a hybrid, whose recurrent state a step updates in place."""
        return None if self.delta_layers else self.kv.borrow(cache, owned, pos, n)

    def own(self, cache: list[Any], owned: OwnedCache, pos: int, last: int | None = None) -> list[tuple[int, ...]]:
        """``KvLayout.own``, and a hybrid's delta-net states (conv, state, 0 for every delta-net layer
        between the attention layers' views: ``struct mlxcel_kv``'s keys and values point at them)."""
        views = self.kv.own(self.attention(cache), owned, pos, last)
        if not self.delta_layers:
            return views
        if owned.recurrent is None:
            owned.recurrent = decode_delta.OwnedStates()
        states = decode_delta.own_states([cache[i] for i in self.delta_layers], self.deltas, owned.recurrent)
        return owned.recurrent.merged(views, states, self.delta_layers)

    def chunk_views(self, cache: list[Any], owned: OwnedCache, start: int, rows: int) -> list[tuple[int, ...]]:
        """A prompt chunk's KV views: this sequence's own buffers with room for it, and with
        sliding-window layers each ring laid out in order ahead of the chunk (``ring_chunks``)."""
        if self.kv.rings:
            return ring_chunks.chunk_views(self.kv, cache, owned, start, rows)
        return self.own(cache, owned, start, last=start + rows - 1)

    def table(self, views: list[list[tuple[int, ...]]], positions: list[int], caches: list[list[Any]],
              segments: list[int] | None = None) -> np.ndarray:
        """``struct mlxcel_kv`` of every row and layer: its keys, values and capacity (``views``),
        where the row writes and how many slots it sees (a growing cache: its position, and
        everything up to it; a ring: mlx-lm's slot and at most its capacity), and for shared
        arrays (a view of 5: :meth:`KvLayout.borrow`) the buffers its new keys and values go to
        instead. ``segments``: prompt chunks, a ring's valid slots and window (``ring_chunks``)."""
        kv = np.empty((len(views), self.n_layers, decode_pass.KV_FIELDS), np.int64)
        rings = self.kv.rings
        for r, (row_views, pos) in enumerate(zip(views, positions)):
            kv[r] = self._base(row_views)
            kv[r, :, 5], kv[r, :, 6] = pos, pos + 1
            for i in rings:  # the ring's slot (ring_plan left _idx where mlx-lm's update has it)
                ring = caches[r][i]
                kv[r, i, 5] = 0 if ring._idx == ring.max_size else ring._idx
                kv[r, i, 6] = min(pos + 1, int(kv[r, i, 4]))  # what mlx-lm's keys_and_values hands its attention
        if segments is not None and rings:  # a ring's chunk: its valid slots, windowed
            for j, pos in enumerate(positions):
                kv[j, rings, 6] = min(pos, self.kv.window)
            kv[:, rings, 7] = self.kv.window
        return kv

    def _base(self, row_views: list[tuple[int, ...]]) -> np.ndarray:
        """The addresses and capacities of ``row_views`` as ``struct mlxcel_kv`` fields, made once
        per views list (a sequence's own buffers keep theirs from step to step)."""
        held = self._bases.get(id(row_views))
        if held is not None and held[0] is row_views:
            return held[1]
        a = np.array(row_views, np.int64)
        base = np.zeros((self.n_layers, decode_pass.KV_FIELDS), np.int64)
        base[:, 0:2], base[:, 4] = a[:, 0:2], a[:, 2]
        if a.shape[1] >= 5:  # shared arrays read in place: the new rows' buffers (KvLayout.borrow)
            base[:, 2:4] = a[:, 3:5]
        if a.shape[1] == 8:  # shared blocks read in place (KvLayout._own_paged): their table
            base[:, 8:11] = a[:, 5:8]
        if len(self._bases) >= 64:  # sequences come and go: forget the old ones
            self._bases.clear()
        self._bases[id(row_views)] = (row_views, base)
        return base

    def advance(self, caches: list[list[Any]], counts: list[int], chunk: bool) -> None:
        """After a pass: each cache ``counts[j]`` positions on, a ring's ``_idx`` where mlx-lm's
        update leaves it (a step: the slot after the one written; a chunk left the newest slots in
        order from slot 0)."""
        for cache, n in zip(caches, counts):
            for i in self.kv.rings:
                ring = cache[i]
                if chunk:
                    ring._idx = min(ring.max_size, ring.offset + n)
                else:
                    ring._idx = (0 if ring._idx == ring.max_size else ring._idx) + n
            for i in self.attn_layers:  # a delta-net layer's ArraysCache has no position
                cache[i].offset += n


__all__ = ["SequenceKv"]
