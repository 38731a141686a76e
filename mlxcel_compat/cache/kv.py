"""The one module of ``cache/`` that knows mlx-lm cache objects (and imports MLX).

The bookkeeping stores opaque payloads; for the prompt cache a payload is a list of mlx-lm
per-layer cache objects, or, for dense KV, a ``BlockTable`` of shared blocks
(``cache/block_pool.py``) whose data this adapter makes (``to_blocks``) and gathers back into
``KVCache`` objects (``gather``), or hands a running sequence without a copy (``paged``:
``PagedKVCache`` layers over the very block arrays). This adapter copies, truncates and measures them.

Why copies are cheap and safe: MLX arrays are immutable values, but ``a[i] = x`` rebinds the
*Python object* ``a`` to a new value, so two caches must never share array objects. A copy
therefore builds new cache objects whose arrays are fresh views (``x[...]``) of the stored ones:
no data moves until one side writes, and a write never reaches the other side.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

from mlxcel_compat.cache.block_pool import BlockPool, BlockTable, build_table

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

Payload = list[Any]


def _fresh(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value


class PagedKVCache(KVCache):
    """A running sequence's KV layer that starts with shared prompt-cache blocks, read in place:
    positions ``[0, n_blocked)`` are the leased full blocks' own arrays (``blocks``: per block its
    keys and values, ``(1, kv_heads, block_tokens, head_dim)`` each, never written), the positions
    from ``n_blocked`` on are the sequence's own buffer (``own_keys``/``own_values``, row
    ``t - n_blocked``; None while it holds none). Adopting so copies no tensor
    (docs/prompt-cache.md, "The CPU decode runtime reads the blocks in place"): the CPU decode
    runtime hands the kernels a pointer per block (``runtime/decode_kv.py``).

    Everything else reads ``keys`` and ``values`` as mlx-lm's ``KVCache`` has them (the MLX path's
    ``update_and_fetch``, a batch merge, a snapshot, a slot save, a context shift): the first such
    read gathers the blocks and the own rows into one buffer per layer (bit for bit) and turns the
    layer into a plain ``KVCache`` for good, so that every ``type(layer) is KVCache`` check and
    the disk format see mlx-lm's own class. The sequence then pays the copy; the blocks are
    untouched."""

    def __init__(self, blocks: tuple[tuple[Any, Any], ...], block_tokens: int, own_keys: Any, own_values: Any,
                 offset: int) -> None:
        # not KVCache.__init__: it would assign ``keys``, which is this class's gathering property
        self.blocks, self.block_tokens = blocks, block_tokens
        self.own_keys, self.own_values = own_keys, own_values
        self.offset = offset

    @property
    def n_blocked(self) -> int:
        """Positions read from the shared blocks."""
        return len(self.blocks) * self.block_tokens

    @property
    def keys(self) -> Any:  # type: ignore[override]
        return self.gather().keys

    @keys.setter
    def keys(self, value: Any) -> None:
        self.gather().keys = value

    @property
    def values(self) -> Any:  # type: ignore[override]
        return self.gather().values

    @values.setter
    def values(self, value: Any) -> None:
        self.gather().values = value

    def rows(self, start: int, stop: int) -> tuple[Any, Any]:
        """Keys and values of positions ``[start, stop)`` (``start >= n_blocked``: read from the own
        buffer, no gather)."""
        nb = self.n_blocked
        if start < nb:
            return self.gather().keys[..., start:stop, :], self.values[..., start:stop, :]
        return self.own_keys[..., start - nb:stop - nb, :], self.own_values[..., start - nb:stop - nb, :]

    def gather(self) -> KVCache:
        """Become a plain ``KVCache`` holding the same positions in one buffer per layer."""
        if type(self) is not PagedKVCache:  # gathered already (a reference kept across the change)
            return self
        own = max(self.offset - self.n_blocked, 0)
        parts = [[b[0] for b in self.blocks], [b[1] for b in self.blocks]]
        if own:
            parts[0].append(self.own_keys[..., :own, :])
            parts[1].append(self.own_values[..., :own, :])
        keys, values = (mx.concatenate(p, axis=2) if len(p) > 1 else p[0][...] for p in parts)
        if self.offset < self.n_blocked:
            keys, values = keys[..., :self.offset, :], values[..., :self.offset, :]
        offset = self.offset
        extra = {k: v for k, v in vars(self).items() if k not in ("blocks", "block_tokens", "own_keys", "own_values")}
        self.__dict__.clear()
        self.__class__ = KVCache  # type: ignore[assignment]
        self.__dict__.update(extra)  # a storage-type stamp (runtime/kv_precision.py)
        self.keys, self.values, self.offset = keys, values, offset
        return self

    def copy(self) -> "PagedKVCache":
        """A copy sharing the blocks (never written) and fresh views of the own buffer."""
        new = PagedKVCache(self.blocks, self.block_tokens, _fresh(self.own_keys), _fresh(self.own_values), self.offset)
        new.__dict__.update((k, v) for k, v in vars(self).items() if k not in vars(new))
        return new

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        own = sum(a.nbytes for a in (self.own_keys, self.own_values) if a is not None)
        return sum(k.nbytes + v.nbytes for k, v in self.blocks) + own

    def trim(self, n: int) -> int:
        if self.offset - n < self.n_blocked:  # into the blocks: the layer becomes one buffer first
            return self.gather().trim(n)
        n = min(self.offset, n)
        self.offset -= n
        return n


def _copy_layer(layer: Any, exact: bool, share_state: bool = False) -> Any:
    if type(layer) is PagedKVCache:
        return layer.copy()
    if isinstance(layer, CacheList):
        return CacheList(*(_copy_layer(c, exact, share_state) for c in layer.caches))
    if type(layer) is KVCache:
        new = KVCache()
        new.__dict__.update((k, v) for k, v in vars(layer).items() if k not in vars(new))  # a storage-type stamp
        if layer.keys is not None:
            n = layer.offset
            # Exact copies drop the preallocated slack so the entry holds only its logical bytes.
            new.keys = layer.keys[..., :n, :] if exact else layer.keys[...]
            new.values = layer.values[..., :n, :] if exact else layer.values[...]
            new.offset = n
        return new
    if isinstance(layer, ArraysCache):
        # Recurrent state is copied for real: the CPU decode runtime updates a sequence's own
        # state arrays in place (runtime/decode_delta.py), and a copy (a snapshot, an entry)
        # must keep the state it was taken with. A restore (share_state: a stored entry's arrays,
        # which nothing writes in place) shares them.
        new = copy.copy(layer)
        new.cache = list(layer.cache) if share_state else [mx.array(a) if isinstance(a, mx.array) else a for a in layer.cache]
        return new
    new = copy.copy(layer)
    new.__dict__.update({k: _fresh(v) for k, v in layer.__dict__.items()})
    return new


def copy_cache(cache: Sequence[Any], exact: bool = False) -> Payload:
    """A copy-on-write copy of a whole model cache; ``exact`` trims KV buffers to their content."""
    return [_copy_layer(layer, exact) for layer in cache]


def restore(payload: Sequence[Any]) -> Payload:
    """A sequence's cache to start from a stored entry (a session snapshot): copy-on-write like
    :func:`copy_cache`, and the recurrent state arrays shared with the entry too instead of
    copied. Nothing writes a stored array in place: MLX's passes make new arrays, and the CPU
    decode runtime writes only arrays it made for its sequence, copying any other first
    (``runtime/decode_delta.own_states``). Sharing them saves the hit a copy of its state (a
    Qwen3.5-0.8B-shaped hybrid: 6 MiB, then copied again into the runtime's own buffers)."""
    return [_copy_layer(layer, False, share_state=True) for layer in payload]


def snapshot(cache: Sequence[Any]) -> Payload:
    """An exact copy, evaluated now, so the stored entry owns materialized, slack-free arrays."""
    payload = copy_cache(cache, exact=True)
    mx.eval([layer.state for layer in payload])
    return payload


def detached_prefix(cache: Sequence[Any], n_tokens: int) -> Payload:
    """An exact copy of the first ``n_tokens`` tokens that owns its own buffers.

    A plain copy is a view that keeps the source's whole buffer alive; a pinned breakpoint
    must outlive the longer entry it was cut from without holding that entry's memory.
    """
    cut = copy_cache(cache)
    truncate(cut, n_tokens)
    payload = copy_cache(cut, exact=True)
    for layer in payload:
        if type(layer) is KVCache and layer.keys is not None:
            layer.keys = mx.contiguous(layer.keys)
            layer.values = mx.contiguous(layer.values)
    mx.eval([layer.state for layer in payload])
    return payload


def layer_tokens(layer: Any) -> int:
    if isinstance(layer, CacheList):
        return max(layer_tokens(c) for c in layer.caches)
    return int(getattr(layer, "offset", 0))


def can_truncate(cache: Sequence[Any]) -> bool:
    """Can every layer drop tokens from its end (dense KV; sliding windows not yet wrapped)?"""
    return all(layer.is_trimmable() for layer in cache)


def truncate(cache: Sequence[Any], n_tokens: int) -> None:
    """Trim every layer in place so it holds exactly the first ``n_tokens`` tokens."""
    for layer in cache:
        excess = layer_tokens(layer) - n_tokens
        if excess > 0:
            layer.trim(excess)


def nbytes(cache: Sequence[Any]) -> int:
    """Logical bytes: what the arrays hold (exact copies have no preallocated slack)."""
    return int(sum(layer.nbytes for layer in cache))


def has_recurrent_state(cache: Sequence[Any]) -> bool:
    """True when a layer's state is not a token-indexed KV table (SSM / linear attention)."""

    def recurrent(layer: Any) -> bool:
        if isinstance(layer, CacheList):
            return any(recurrent(c) for c in layer.caches)
        return isinstance(layer, ArraysCache)

    return any(recurrent(layer) for layer in cache)


def has_sliding_window(cache: Sequence[Any]) -> bool:
    def sliding(layer: Any) -> bool:
        if isinstance(layer, CacheList):
            return any(sliding(c) for c in layer.caches)
        return isinstance(layer, RotatingKVCache)

    return any(sliding(layer) for layer in cache)


def untruncatable_layers(cache: Sequence[Any]) -> list[str]:
    """Class names of the layers that cannot be cut at every length (sorted, unique).

    Judged on a fresh cache: recurrent state (``ArraysCache``) never truncates, and a sliding
    window (``RotatingKVCache``) truncates only until it wraps, which any long prompt makes it do,
    so both count even though a fresh rotating cache still reports itself trimmable.
    """
    names: set[str] = set()

    def visit(layer: Any) -> None:
        if isinstance(layer, CacheList):
            for inner in layer.caches:
                visit(inner)
        elif isinstance(layer, (ArraysCache, RotatingKVCache)) or not layer.is_trimmable():
            names.add(type(layer).__name__)

    for layer in cache:
        visit(layer)
    return sorted(names)


def layer_kinds(cache: Sequence[Any]) -> list[Any]:
    """Class names per layer (a ``CacheList`` as the list of its children's kinds)."""

    def kind(layer: Any) -> Any:
        if isinstance(layer, CacheList):
            return [kind(c) for c in layer.caches]
        return type(layer).__name__

    return [kind(layer) for layer in cache]


def state_bytes_at(one_token_cache: Sequence[Any], n_tokens: int) -> int:
    """Bytes one sequence's state takes at ``n_tokens`` tokens, from a cache that holds one.

    Token-indexed layers (KV, rotating windows: counted at full length, as the spec asks for
    sliding layers) grow linearly; recurrent layers keep a constant state.
    """

    def layer_bytes(layer: Any) -> int:
        if isinstance(layer, CacheList):
            return sum(layer_bytes(c) for c in layer.caches)
        exact = _copy_layer(layer, exact=True)
        if isinstance(layer, (KVCache, RotatingKVCache)) and layer_tokens(layer) > 0:
            if isinstance(layer, RotatingKVCache):
                per_token = exact.nbytes // max(exact.keys.shape[2], 1)
            else:
                per_token = exact.nbytes // layer_tokens(layer)
            return per_token * n_tokens
        return int(exact.nbytes)

    return sum(layer_bytes(layer) for layer in one_token_cache)


# ---------------------------------------------------------------------- shared KV blocks


def blockable(cache: Sequence[Any], n_tokens: int) -> bool:
    """Whether a state can be stored as shared blocks: every layer a plain ``KVCache`` holding
    at least ``n_tokens`` positions (recurrent state, sliding-window rings, cache lists and
    quantized caches stay whole: docs/prompt-cache.md, "Shared KV blocks")."""
    return n_tokens > 0 and bool(cache) and all(
        (type(layer) is PagedKVCache or type(layer) is KVCache and layer.keys is not None) and layer.offset >= n_tokens
        for layer in cache
    )


def to_blocks(pool: BlockPool, cache: Sequence[Any], n_tokens: int, lease: tuple[int, ...] = ()) -> BlockTable:
    """The first ``n_tokens`` positions of ``cache`` as a block table: the ``lease``'s blocks
    (the same positions, already in the pool) shared, the rest copied into new blocks that own
    their buffers (evaluated here, so they never keep the sequence's buffer alive). Blocks hold
    the arrays' own dtype. The caller holds one reference on each block (``build_table``)."""

    def rows(layer: Any, start: int, stop: int) -> tuple[Any, Any]:
        if type(layer) is PagedKVCache:  # past its blocks: from its own buffer, no gather
            return layer.rows(start, stop)
        return layer.keys[..., start:stop, :], layer.values[..., start:stop, :]

    def make(start: int, stop: int) -> tuple[object, int]:
        data = tuple((mx.contiguous(k), mx.contiguous(v)) for k, v in (rows(layer, start, stop) for layer in cache))
        mx.eval(data)
        return data, sum(k.nbytes + v.nbytes for k, v in data)

    return build_table(pool, n_tokens, lease, make, layout=len(cache))


def blocks_equal(a: Any, b: Any) -> bool:
    """Whether two blocks' arrays (``to_blocks``' data) hold the same bits: same layers, dtypes and
    shapes, and equal as unsigned words (so -0.0 and 0.0 differ, and a NaN equals its own bits)."""
    if len(a) != len(b):
        return False
    for (ka, va), (kb, vb) in zip(a, b):
        for x, y in ((ka, kb), (va, vb)):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            word = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size]
            if not mx.array_equal(x.view(word), y.view(word)).item():
                return False
    return True


def gather(table: BlockTable, n_tokens: int) -> Payload:
    """Fresh ``KVCache`` layers holding the table's first ``n_tokens`` positions, bit for bit.

    The MLX path's attention reads one buffer per layer, so the blocks are concatenated (one copy
    of the adopted positions; the partly used last block is cut first, so its tail is never read).
    Every array is a new object: a write into the sequence's cache never reaches a block."""
    size = table.pool.block_tokens
    n_tokens = min(n_tokens, table.n_tokens)
    n_blocks = -(-n_tokens // size)
    blocks = [table.pool.data(i) for i in table.block_ids[:n_blocks]]
    tail = n_tokens - (n_blocks - 1) * size
    layers: Payload = []
    for i in range(int(table.layout)):  # type: ignore[call-overload]
        keys = [b[i][0] for b in blocks]  # type: ignore[index]
        values = [b[i][1] for b in blocks]  # type: ignore[index]
        keys[-1], values[-1] = keys[-1][..., :tail, :], values[-1][..., :tail, :]
        layer = KVCache()
        layer.keys = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0][...]
        layer.values = mx.concatenate(values, axis=2) if len(values) > 1 else values[0][...]
        layer.offset = n_tokens
        layers.append(layer)
    return layers


def paged(table: BlockTable, n_tokens: int) -> Payload:
    """``PagedKVCache`` layers holding the table's first ``n_tokens`` positions without a copy: the
    full blocks among them by reference (the very arrays the pool holds), the adopted part of the
    next block as a lazy slice (copied when the sequence first writes). Read ``keys``/``values``
    and a layer gathers (:meth:`PagedKVCache.gather`), which is :func:`gather`'s result."""
    size = table.pool.block_tokens
    n_tokens = min(n_tokens, table.n_tokens)
    full = n_tokens // size
    ids = table.block_ids[: -(-n_tokens // size)]
    blocks = [table.pool.data(i) for i in ids]
    tail = n_tokens - full * size
    layers: Payload = []
    for i in range(int(table.layout)):  # type: ignore[call-overload]
        own_keys = own_values = None
        if tail:
            own_keys = blocks[full][i][0][..., :tail, :]  # type: ignore[index]
            own_values = blocks[full][i][1][..., :tail, :]  # type: ignore[index]
        shared = tuple(b[i] for b in blocks[:full])  # type: ignore[index]
        layers.append(PagedKVCache(shared, size, own_keys, own_values, n_tokens))
    return layers


def materialize(payload: Any) -> Payload:
    """A payload as mlx-lm cache objects (a table's blocks gathered; a list as it is)."""
    if isinstance(payload, BlockTable):
        return gather(payload, payload.n_tokens)
    return payload


def payload_nbytes(payload: Any) -> int:
    """Logical bytes of a payload: a table's blocks as if it held them alone."""
    if isinstance(payload, BlockTable):
        return sum(payload.pool.block(i).nbytes for i in payload.block_ids)
    return nbytes(payload)


# ---------------------------------------------------------------------- context shift


def can_shift(cache: Sequence[Any]) -> bool:
    """Whether every layer is a plain KV table whose positions can be dropped from the middle
    (llama.cpp's ``seq_rm`` + ``seq_add``): no recurrent state, no sliding-window ring."""
    return all(type(layer) is KVCache or type(layer) is PagedKVCache for layer in cache)  # the latter gathers


def shift(cache: Sequence[Any], n_keep: int, n_discard: int, rotate: Callable[[int, Any, int], Any]) -> None:
    """Drop positions ``n_keep .. n_keep + n_discard`` of every layer and move the rest down.

    Keys are stored rotated by their position (RoPE), so the moved keys are rotated back by
    ``n_discard`` positions: ``rotate(layer_index, keys, -n_discard)`` returns them as a key
    computed at its new position would be. Values move as they are. Every layer gets new arrays
    (never written in place): a prompt-cache entry or a sibling sharing the old ones keeps them.
    """
    for i, layer in enumerate(cache):
        n = layer.offset
        start = min(n_keep + n_discard, n)
        moved_keys = rotate(i, layer.keys[..., start:n, :], -n_discard).astype(layer.keys.dtype)  # the stored type
        layer.keys = mx.concatenate([layer.keys[..., :n_keep, :], moved_keys], axis=2)
        layer.values = mx.concatenate([layer.values[..., :n_keep, :], layer.values[..., start:n, :]], axis=2)
        layer.offset = n_keep + (n - start)
    mx.eval([(layer.keys, layer.values) for layer in cache])


# ---------------------------------------------------------------------- undoing a failed forward pass


def checkpoint(cache: Sequence[Any]) -> list[Any]:
    """What it takes to put a (batch) cache back as it is now, should the next forward pass fail,
    without copying any KV data.

    A forward pass changes a layer in three ways: it rebinds attributes (a grown buffer, a new
    recurrent state), updates small bookkeeping arrays in place (``offset += 1``), and writes the
    new token's keys and values in place into the buffer, past the positions in use. Saving the
    attributes themselves undoes the first, a view of each small array (which keeps its old
    value) the second, and restoring the position counters makes the third invisible.
    """
    return [_mark(layer) for layer in cache]


def _mark(layer: Any) -> Any:
    if isinstance(layer, CacheList):
        return [_mark(c) for c in layer.caches]
    saved: dict[str, Any] = {"__class__": type(layer)}  # a PagedKVCache the pass gathered goes back to paged
    for name, value in vars(layer).items():
        if isinstance(value, mx.array) and name not in ("keys", "values", "own_keys", "own_values"):
            saved[name] = value[...]
        elif isinstance(value, list):
            saved[name] = list(value)  # recurrent states: entries are replaced, never written into
        else:
            saved[name] = value
    return saved


def rollback(cache: Sequence[Any], marks: list[Any]) -> bool:
    """Put every layer back as :func:`checkpoint` saw it. Returns False when that cannot be exact:
    a sliding window that was full writes the new token over its oldest one."""
    return all([_restore(layer, mark) for layer, mark in zip(cache, marks)])


def _restore(layer: Any, mark: Any) -> bool:
    if isinstance(layer, CacheList):
        return all([_restore(c, m) for c, m in zip(layer.caches, mark)])
    exact = not (mark.get("rotated") or ("max_size" in mark and mark.get("_idx", 0) >= mark["max_size"]))
    layer.__dict__.clear()
    if type(layer) is not mark["__class__"]:
        layer.__class__ = mark["__class__"]
    layer.__dict__.update((k, v) for k, v in mark.items() if k != "__class__")
    return exact
