"""The KV buffers of the CPU decode runtime (``cpu_decode.CpuDecoder``): which MLX arrays a
sequence's step may write, how they are made and grown, and how a step reads shared ones in place.

The KV cache stays mlx-lm's (``KVCache``, and ``RotatingKVCache`` for a sliding-window layer):
the step writes the new position into the cache's own MLX buffers (NumPy views of them) at the
slot mlx-lm's own update would use, and advances ``offset`` (and a ring's ``_idx``), so prefill,
batching, the prompt cache and slot files see the cache exactly as MLX's step would have left it.
MLX arrays are immutable to everything else, so the step writes only into buffers it made itself
for this sequence (:class:`OwnedCache`): at its first step, and whenever someone else replaced a
layer's arrays (a merged MLX batch, MLX's own step), it copies the layer into a fresh buffer
first; the arrays others hold (prompt-cache entries, a sibling completion's prefix) are never
written. One exception to the copy: the first step on a cache the decoder does not own (a
prompt-cache hit's) reads the shared arrays in place and keeps its new key and value apart
(:class:`KeptApart`), so a hit's first token costs no copy of the adopted KV; the copy is made at
the next step, after that token has gone out (a hit's first token is its time to first token).
A hit on shared prompt-cache blocks copies nothing at all (:func:`paged`): its layers keep the
blocks, which the kernels read in place through a table of their addresses, and the buffers the
decoder makes hold only the positions past them.

The buffers hold the layer's storage type (``-ctk``/``-ctv``: ``runtime/kv_precision.py``):
float32, float16 or bfloat16, the type the cache's arrays already have, or the model's stamp for
an empty cache (:attr:`KvLayout.dtypes`). NumPy has no bfloat16: such a buffer is seen through
a uint16 view of the same memory (:func:`host_view`), and the C kernels round and widen it.
At q8_0 and q4_0 a row is ggml's blocks in uint8 (:attr:`KvLayout.widths` bytes: ``kv_blocks.py``),
which the C kernels quantize and read. Keys and values may be of different types (``-ctk q8_0
-ctv f16``): each side has its own dtype and row width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime import kv_blocks

# Positions the decoder's own KV buffers are allocated in (:func:`buffer_capacity`): mlx-lm's caches
# grow by 256, which left a short sequence's buffers up to 255 positions too long (24 KiB a position on
# the small llama: four streams of ~160 tokens held 24 MiB where 16 are used).
KV_STEP = 16
KV_HEADROOM = 64  # positions allocated beyond the one needed where the request sets no bound
# The storage types the runtime's attention reads, by the code the native decode pass takes (MLXCEL_KV_*).
KV_CODES = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
BLOCK_CODES = {"q8_0": 3, "q4_0": 4}  # ggml's blocks, stored as uint8 rows (kv_blocks.py)


def paged(c: Any) -> bool:
    """Whether a layer starts with shared prompt-cache blocks read in place (``cache/kv.py``'s
    ``PagedKVCache``, known here by its ``blocks``: the runtime room does not import the cache
    room). Its pass writes its own buffer (``own_keys``/``own_values``: positions from
    ``n_blocked`` on); reading its ``keys`` would gather it into one buffer."""
    return "blocks" in vars(c)


def written(c: Any) -> tuple[Any, Any]:
    """The arrays a pass writes into: a paged layer's own buffer, else its keys and values."""
    return (c.own_keys, c.own_values) if paged(c) else (c.keys, c.values)


def paged_fits(c: Any, n_kv_heads: int, widths: tuple[int, int], dtypes: tuple[Any, Any]) -> bool:
    """Whether the kernels can read a paged layer as it is: every block's keys and values
    ``(1, kv_heads, block_tokens, width)`` of the storage types and row widths (contiguous: the
    pool's blocks are), the own buffer (if any) rows of those types."""
    blocks_fit = all(a.shape == (1, n_kv_heads, c.block_tokens, w) and a.dtype == t
                     for pair in c.blocks for a, t, w in zip(pair, dtypes, widths))
    own = (c.own_keys, c.own_values)
    return blocks_fit and c.offset >= c.n_blocked and (own[0] is None or all(
        a.ndim == 4 and a.shape[:2] == (1, n_kv_heads) and a.shape[3] == w and a.dtype == t
        for a, t, w in zip(own, dtypes, widths)))


def block_table(c: Any) -> np.ndarray:
    """A paged layer's block addresses as ``struct mlxcel_kv``'s ``blocks`` reads them: every
    block's keys, then every block's values (the arrays themselves: nothing is copied)."""
    views = [host_view(a) for a in [k for k, _ in c.blocks] + [v for _, v in c.blocks]]
    if not all(v.flags.c_contiguous for v in views):
        raise RuntimeError("a shared KV block is not one contiguous buffer")
    return np.array([v.ctypes.data for v in views], np.int64)


def host_view(a: Any) -> np.ndarray:
    """A NumPy view of an evaluated MLX array's own buffer (no copy): bfloat16 as its uint16 bits."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def mlx_rows(rows: np.ndarray, dtype: Any) -> Any:
    """An MLX array of ``rows`` (a :func:`host_view`'s type) as ``dtype``: a uint16 array's bits
    reinterpreted as bfloat16."""
    a = mx.array(rows)
    return a.view(dtype) if dtype == mx.bfloat16 else a


@dataclass
class KeptApart:
    """A step taken on shared arrays (:meth:`KvLayout.borrow`): per layer, NumPy views of the
    shared keys and values (read, never written), the step's new key and value ((kv_heads, d)
    each), and the lazy MLX concatenations of the two that the cache holds now. The next step
    builds its own buffers from the views and rows directly; anyone else evaluating the
    concatenations gets the same values (MLX arrays, immutable like their inputs)."""

    pos: int  # the first new row's position
    shared: list[tuple[np.ndarray, np.ndarray]]
    rows: list[tuple[np.ndarray, np.ndarray]]  # per layer: keys, values (kv_heads, n, d)
    arrays: list[tuple[Any, Any]]

    def holds(self, cache: list[Any]) -> bool:
        n = self.rows[0][0].shape[1]
        return len(self.arrays) == len(cache) and all(
            c.keys is a and c.values is b and c.offset == self.pos + n for c, (a, b) in zip(cache, self.arrays))


@dataclass
class Borrowed:
    """One row's step on shared arrays, before it runs: the kernels' views (with the two rows'
    addresses last) and what :meth:`keep_apart` turns into the cache's arrays after it."""

    pos: int
    shared: list[tuple[np.ndarray, np.ndarray]]
    rows: list[tuple[np.ndarray, np.ndarray]]
    views: list[tuple[int, int, int, int, int]]

    def keep_apart(self, cache: list[Any]) -> KeptApart:
        """After the step: every layer holds its shared positions and the new one (lazily)."""
        arrays = []
        for c, (k_row, v_row) in zip(cache, self.rows):
            c.keys, c.values = (mx.concatenate([a[:, :, : self.pos], mlx_rows(row, a.dtype)[None]], axis=2)
                                for a, row in ((c.keys, k_row), (c.values, v_row)))
            arrays.append((c.keys, c.values))
        return KeptApart(self.pos, self.shared, self.rows, arrays)


@dataclass
class OwnedCache:
    """The MLX arrays (keys, values per layer) the decoder made for one sequence: the only
    buffers it may write. A new sequence starts with none."""

    arrays: list[tuple[Any, Any]] = field(default_factory=list)
    views: list[tuple[int, int, int]] = field(default_factory=list)  # per layer: keys, values, capacity
    apart: KeptApart | None = None  # the last step's rows, kept apart from shared arrays
    reserve: int = 0  # positions the sequence may fill (prompt + n_predict): allocated at once
    recurrent: Any = None  # a hybrid's delta-net states made for the sequence (decode_delta.OwnedStates)
    block_tables: list[np.ndarray] = field(default_factory=list)  # paged layers' block addresses, kept alive

    def forget(self) -> None:
        """Give up the buffers made for the sequence: MLX wrote into its cache. MLX's slice update
        (mlx-lm's ``keys[..., prev:offset, :] = ...``) keeps the array object, so :meth:`holds`
        would still say yes, but it writes into the buffer in place only where nothing else
        shares it: with a snapshot's view of it, it writes a copy, and a step reading the buffer
        it made would miss MLX's rows. The next pass copies the cache into buffers of its own."""
        self.arrays, self.views, self.apart, self.recurrent = [], [], None, None

    def holds(self, cache: list[Any]) -> bool:
        """Whether every layer of ``cache`` still holds the arrays made for it."""
        return len(self.arrays) == len(cache) and all(
            w[0] is a and w[1] is b for w, (a, b) in zip(map(written, cache), self.arrays))


def buffer_capacity(last: int, current: int = 0, reserve: int = 0) -> int:
    """Positions for a layer's own KV buffer that must hold position ``last``: what the sequence
    may fill (``reserve``: its prompt and n_predict) if that is more, so that a bounded request
    allocates once; beyond that (no bound, or past it) ``KV_HEADROOM`` more and at least an
    eighth more than the ``current`` capacity it outgrows (each growth copies the cache, and
    the freed buffer stays in MLX's cache: growing by a fraction keeps both proportional to the
    length); a whole number of ``KV_STEP``."""
    need = max(last + 1, reserve)
    if need > reserve:
        need = max(need + KV_HEADROOM, current + current // 8)
    return -(-need // KV_STEP) * KV_STEP


def ring_plan(c: Any) -> tuple[int, int, int] | None:
    """What mlx-lm's ``RotatingKVCache._update_in_place`` does to the ring before it writes one
    token: ``(capacity, first slot kept, _idx)`` after it grows the buffer (by at most its
    ``step``, up to ``max_size``, with ``_idx`` set to ``offset``) or trims one that a prompt
    left longer than ``max_size`` (to its newest ``max_size`` slots, ``_idx = max_size``), or
    None for a state it could not write one token into (``keep`` other than 0, a slot outside
    the buffer)."""
    if c.keys is None or c.keep != 0:
        return None
    cap, prev, idx, size = c.keys.shape[2], c.offset, c._idx, c.max_size
    start, capacity = 0, cap
    if prev >= cap and cap < size:
        grow = min(c.step, size - prev)
        if grow <= 0:
            return None
        capacity, idx = cap + grow, prev
    elif cap > size:
        start, capacity, idx = cap - size, size, size
    write = 0 if idx == size else idx  # the ring wraps to its first slot (keep = 0)
    if not 0 <= write < capacity:
        return None
    return capacity, start, idx


@dataclass
class KvLayout:
    """The layout of a decoder's KV buffers and the two ways a pass gets a sequence's: its own,
    copied or grown first when needed (:meth:`own`), or the shared ones read in place (:meth:`borrow`)."""

    n_kv_heads: int
    head_dim: int
    window: int | None  # gemma3: a sliding layer's ring size, else None
    rings: list[int]  # RotatingKVCache layers
    plain: list[int]  # KVCache layers
    dtypes: tuple[Any, Any] = (mx.float32, mx.float32)  # the keys' and values' storage types
    # each side's block type (q8_0 or q4_0: stored as ggml's blocks, rows of uint8 in dtypes), or None
    blocks: tuple[str | None, str | None] = (None, None)
    value_dim: int | None = None  # a value row's width where it is not a key's (DeepSeek's MLA caches: decode_mla.py)

    @property
    def codes(self) -> tuple[int, int]:
        """The storage types as the native decode pass takes them (``KV_CODES``, ``BLOCK_CODES``)."""
        return tuple(BLOCK_CODES[b] if b else KV_CODES[t] for b, t in zip(self.blocks, self.dtypes))  # type: ignore[return-value]

    @property
    def widths(self) -> tuple[int, int]:
        """A stored key's and value's last dimension: ``head_dim`` values (a value's ``value_dim``
        where it has one: MLA's), or a block type's bytes for them."""
        dims = (self.head_dim, self.head_dim if self.value_dim is None else self.value_dim)
        return tuple(kv_blocks.row_width(b, d) if b else d for b, d in zip(self.blocks, dims))  # type: ignore[return-value]

    def own(self, cache: list[Any], owned: OwnedCache, pos: int, last: int | None = None) -> list[tuple[int, int, int]]:
        """Addresses of every layer's keys and values, and their capacity, with room for
        positions ``pos`` to ``last`` (default ``pos``): the buffers made for this sequence,
        copied first (their first ``pos`` positions) if the cache holds others now (or they are
        full, or a ring is due to grow or be trimmed). Raises, before anything is replaced, for
        a ring that mlx-lm's update could not write into either."""
        last = pos if last is None else last
        plans = []
        for i in self.rings:
            c = cache[i]
            plan = ring_plan(c) if c.max_size == self.window else None
            if plan is None:
                raise RuntimeError(f"layer {i}: a sliding-window cache the decoder cannot write into")
            plans.append(plan)
        apart, owned.apart = owned.apart, None
        if apart is not None and apart.holds(cache) and not self.rings:
            return self._own_apart(cache, owned, apart, last)
        if owned.holds(cache) and all(last < _first_own(owned.views[i]) + owned.views[i][2] for i in self.plain) and all(
                plan[:2] == (owned.views[i][2], 0) for i, plan in zip(self.rings, plans)):
            return owned.views
        mx.eval([w for w in map(written, cache) if w[0] is not None])
        owned.arrays, owned.views, owned.block_tables = [], [], []
        ring_plans = dict(zip(self.rings, plans))
        for i, c in enumerate(cache):
            if paged(c):
                owned.views.append(self._own_paged(c, owned, pos, last))
                owned.arrays.append((c.own_keys, c.own_values))
                continue
            if i in ring_plans:
                capacity, start, c._idx = ring_plans[i]
                keys, values = (_fresh_ring(a, start, capacity) for a in (c.keys, c.values))
            elif c.keys is None:  # an empty cache (can_prefill): buffers for positions 0 .. last
                capacity = buffer_capacity(last, reserve=owned.reserve)
                keys, values = (_writable((1, self.n_kv_heads, capacity, width), dtype)[0]
                                for dtype, width in zip(self.dtypes, self.widths))
            else:
                keys, values = (_fresh(a, pos, last, owned.reserve) for a in (c.keys, c.values))
            c.keys, c.values = keys, values
            owned.arrays.append((keys, values))
            owned.views.append((host_view(keys).ctypes.data, host_view(values).ctypes.data, keys.shape[2]))
        return owned.views

    def _own_paged(self, c: Any, owned: OwnedCache, pos: int, last: int) -> tuple[int, ...]:
        """A paged layer's view (keys, values, capacity, 0, 0, block table, n_blocked,
        block_tokens): its own buffer, made (the adopted partial block's rows copied) or grown
        for positions up to ``last``; the blocks read in place."""
        nb = c.n_blocked
        reserve = max(owned.reserve - nb, 0)
        if c.own_keys is None:
            capacity = buffer_capacity(last - nb, reserve=reserve)
            keys, values = (_writable((1, self.n_kv_heads, capacity, width), dtype)[0]
                            for dtype, width in zip(self.dtypes, self.widths))
        else:
            keys, values = (_fresh(a, pos - nb, last - nb, reserve) for a in (c.own_keys, c.own_values))
        c.own_keys, c.own_values = keys, values
        table = block_table(c)
        owned.block_tables.append(table)
        return (host_view(keys).ctypes.data, host_view(values).ctypes.data, keys.shape[2], 0, 0,
                table.ctypes.data if len(table) else 0, nb, c.block_tokens)

    def _own_apart(self, cache: list[Any], owned: OwnedCache, apart: KeptApart, last: int) -> list[tuple[int, int, int]]:
        """:meth:`own` after a step kept apart: the buffers made from the shared views and the
        kept rows (no evaluation of the cache's concatenations, which would copy once more)."""
        owned.arrays, owned.views = [], []
        pos = apart.pos
        for c, (keys_view, values_view), (k_row, v_row) in zip(cache, apart.shared, apart.rows):
            made = []
            n = k_row.shape[1]
            for view, row, dtype in ((keys_view, k_row, self.dtypes[0]), (values_view, v_row, self.dtypes[1])):
                b, h, _, d = view.shape
                fresh, out = _writable((b, h, buffer_capacity(max(pos + n - 1, last), reserve=owned.reserve), d), dtype)
                out[:, :, :pos] = view[:, :, :pos]
                out[0, :, pos:pos + n] = row
                made.append(fresh)
            c.keys, c.values = made
            owned.arrays.append((c.keys, c.values))
            owned.views.append((host_view(c.keys).ctypes.data, host_view(c.values).ctypes.data, c.keys.shape[2]))
        return owned.views

    def borrow(self, cache: list[Any], owned: OwnedCache, pos: int, n: int = 1) -> Borrowed | None:
        """Views for a step (or a prefill of ``n`` rows) that reads ``cache``'s arrays in place,
        when they are not this sequence's (a prompt-cache hit, a sibling's prefix) and the step
        can leave them unwritten: plain KV layers only (no ring), each layer's keys and values in
        the layout's storage types, laid out by head, then position, then dimension (an entry's slice of a larger
        buffer is), ``pos`` of them valid. None: the step copies them into its own buffers first
        (:meth:`own`)."""
        from mlx_lm.models.cache import KVCache

        if self.rings or pos < 1 or owned.holds(cache) or owned.apart is not None:
            return None
        if not all(type(c) is KVCache and c.keys is not None and c.offset == pos for c in cache):
            return None
        mx.eval([(c.keys, c.values) for c in cache])
        shared, views, rows = [], [], []
        for c in cache:
            pair = []
            for a, dtype, d in zip((c.keys, c.values), self.dtypes, self.widths):  # d: a stored row's elements
                if a.dtype != dtype or a.ndim != 4 or a.shape[0] != 1 or a.shape[3] != d or a.shape[2] < pos:
                    return None
                view = host_view(a)
                strides, item = view.strides, view.itemsize
                if strides[3] != item or strides[2] != d * item or strides[1] % (d * item) or strides[1] < a.shape[2] * d * item:
                    return None
                pair.append(view)
            capacities = [view.strides[1] // (d * view.itemsize) for view, d in zip(pair, self.widths)]
            if capacities[0] != capacities[1]:  # the kernels take one capacity for both
                return None
            shared.append((pair[0], pair[1]))
            k_row = np.empty((self.n_kv_heads, n, self.widths[0]), pair[0].dtype)
            v_row = np.empty((self.n_kv_heads, n, self.widths[1]), pair[1].dtype)
            rows.append((k_row, v_row))
            views.append((pair[0].ctypes.data, pair[1].ctypes.data, capacities[0], k_row.ctypes.data, v_row.ctypes.data))
        return Borrowed(pos, shared, rows, views)


def _first_own(view: tuple[int, ...]) -> int:
    """The first position a layer's own buffer holds: a paged layer's ``n_blocked``, else 0."""
    return view[6] if len(view) == 8 else 0


def _writable(shape: tuple[int, ...], dtype: Any) -> tuple[Any, np.ndarray]:
    """A new zero MLX array of ``shape`` and ``dtype`` and a writable NumPy view of its buffer."""
    fresh = mx.zeros(shape, dtype=dtype)
    mx.eval(fresh)
    view = host_view(fresh)
    if not (view.flags.c_contiguous and view.flags.writeable):  # e.g. a broadcast constant: not ours to write
        raise RuntimeError("MLX gave no writable buffer of its own for the KV cache")
    return fresh, view


def _fresh(a: Any, pos: int, last: int | None = None, reserve: int = 0) -> Any:
    """A new MLX array with ``a``'s first ``pos`` positions and room up to position ``last``
    (default ``pos``) and the ``reserve`` (:func:`buffer_capacity`; at least ``a``'s capacity): one
    buffer of MLX's, filled through a NumPy view of it."""
    b, h, cap, d = a.shape
    last = pos if last is None else last
    fresh, view = _writable((b, h, max(cap, buffer_capacity(last, cap, reserve)), d), a.dtype)
    view[:, :, :pos] = host_view(a)[:, :, :pos]
    return fresh


def _fresh_ring(a: Any, start: int, capacity: int) -> Any:
    """A ring's new buffer of ``capacity`` slots, as mlx-lm's update makes it: ``a``'s slots
    from ``start`` on (a trimmed ring keeps its newest ``capacity``), then zeros (a grown one)."""
    b, h, cap, d = a.shape
    fresh, view = _writable((b, h, capacity, d), a.dtype)
    kept = min(cap - start, capacity)
    view[:, :, :kept] = host_view(a)[:, :, start:start + kept]
    return fresh


__all__ = ["BLOCK_CODES", "KV_CODES", "KV_HEADROOM", "KV_STEP", "Borrowed", "KeptApart", "KvLayout", "OwnedCache",
           "block_table", "buffer_capacity", "host_view", "mlx_rows", "paged", "paged_fits", "ring_plan", "written"]
