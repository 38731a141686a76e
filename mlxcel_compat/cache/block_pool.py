"""The pool of shared KV blocks: ids, reference counts, bytes. Pure Python, no MLX.

A dense-KV entry of the prompt cache is stored as a run of blocks of ``block_tokens``
positions (the last one holds the rest); entries and running sequences that hold the same
prefix point at the same blocks, so it is stored once (docs/prompt-cache.md, "Shared KV
blocks"). What a block holds (the K and V arrays of its positions, for every layer) is an
opaque object made by the adapter, ``cache/kv.py``; this module only counts.

Why two counts per block: the byte budget counts what the *store* holds, so a block counts
while a stored entry references it (``stored``); a running sequence's lease (``refs`` beyond
``stored``) keeps the arrays alive but is not the store's to evict. A block is freed, once,
when ``refs`` reaches zero; ids are never reused, so a stale id can never name another block.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

KV_BLOCK_TOKENS = 256  # positions per block: mlx-lm's KVCache growth step (docs/prompt-cache.md)


@dataclass(slots=True, eq=False)
class Block:
    """One block: the adapter's arrays for ``n_tokens`` consecutive positions."""

    id: int
    data: object
    n_tokens: int
    nbytes: int
    refs: int = 0  # every holder: stored entries, sequences' leases, a donation in progress
    stored: int = 0  # the part of ``refs`` held by stored entries


@dataclass(slots=True, eq=False)
class BlockTable:
    """A dense-KV entry's payload: its blocks in position order.

    Every block is full (``pool.block_tokens`` positions) but the last, which holds the rest;
    ``layout`` is the adapter's description of the layers (opaque here). The table itself holds
    no reference: whoever keeps it (the store, a donation in progress) retains its blocks.
    """

    pool: "BlockPool"
    block_ids: tuple[int, ...]
    n_tokens: int
    layout: object = None

    def full_blocks(self, n_tokens: int) -> tuple[int, ...]:
        """The ids of the blocks that lie wholly inside the first ``n_tokens`` positions."""
        return self.block_ids[: min(n_tokens, self.n_tokens) // self.pool.block_tokens]


@dataclass(slots=True)
class PoolCounters:
    """Monotonic counters of the pool (never reset)."""

    allocated: int = 0  # blocks created
    freed: int = 0  # blocks whose last reference went
    shared: int = 0  # references taken on an existing block instead of storing it again
    merged: int = 0  # blocks computed again, found bit-identical to a live block and dropped for it


class BlockPool:
    """Reference-counted KV blocks. Not thread-safe: the engine thread owns it."""

    def __init__(self, block_tokens: int = KV_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.counters = PoolCounters()
        self._blocks: dict[int, Block] = {}
        self._ids = itertools.count(1)
        self._bytes = 0  # all live blocks
        self._stored_bytes = 0  # blocks with stored > 0
        self._stored_blocks = 0
        self._refs = 0  # references on live blocks, all holders
        self._stored_refs = 0  # the part of them held by stored entries

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    @property
    def nbytes(self) -> int:
        """Bytes of every live block (held by entries or by running sequences)."""
        return self._bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of the blocks stored entries hold, each counted once: the byte budget's part."""
        return self._stored_bytes

    @property
    def stored_blocks(self) -> int:
        return self._stored_blocks

    @property
    def refs(self) -> int:
        """References on live blocks, every holder's (stored entries, leases, donations)."""
        return self._refs

    @property
    def stored_refs(self) -> int:
        """The part of :attr:`refs` held by stored entries."""
        return self._stored_refs

    def allocate(self, data: object, n_tokens: int, nbytes: int) -> int:
        """A new block holding ``data``, with one reference, the caller's."""
        if not 0 < n_tokens <= self.block_tokens:
            raise ValueError(f"a block holds 1..{self.block_tokens} positions, got {n_tokens}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        block = Block(next(self._ids), data, n_tokens, nbytes, refs=1)
        self._blocks[block.id] = block
        self._bytes += nbytes
        self._refs += 1
        self.counters.allocated += 1
        return block.id

    def data(self, block_id: int) -> object:
        return self._block(block_id).data

    def block(self, block_id: int) -> Block:
        """The live block (read-only use: tests and stats)."""
        return self._block(block_id)

    def retain(self, block_ids: Iterable[int], stored: bool = False) -> None:
        """One more reference on each block (``stored``: held by a stored entry)."""
        for block_id in block_ids:
            block = self._block(block_id)
            block.refs += 1
            self._refs += 1
            if stored:
                if block.stored == 0:
                    self._stored_bytes += block.nbytes
                    self._stored_blocks += 1
                block.stored += 1
                self._stored_refs += 1

    def release(self, block_ids: Iterable[int], stored: bool = False) -> int:
        """Drop one reference on each block; returns how many blocks were freed by it."""
        freed = 0
        for block_id in block_ids:
            block = self._block(block_id)
            if stored:
                if block.stored < 1:
                    raise ValueError(f"block {block_id} has no stored reference to release")
                block.stored -= 1
                self._stored_refs -= 1
                if block.stored == 0:
                    self._stored_bytes -= block.nbytes
                    self._stored_blocks -= 1
            block.refs -= 1
            self._refs -= 1
            if block.refs < block.stored:
                raise ValueError(f"block {block_id}: more stored references than references")
            if block.refs == 0:
                del self._blocks[block_id]
                self._bytes -= block.nbytes
                block.data = None  # the arrays go now, whoever still has the Block object
                self.counters.freed += 1
                freed += 1
        return freed

    def share(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """Take a reference on existing blocks for a new table (counted as sharing)."""
        ids = tuple(block_ids)
        self.retain(ids)
        self.counters.shared += len(ids)
        return ids

    def referenced(self) -> dict[int, tuple[int, int]]:
        """``{block id: (refs, stored)}`` of every live block (for checks and tests)."""
        return {b.id: (b.refs, b.stored) for b in self._blocks.values()}

    def _block(self, block_id: int) -> Block:
        block = self._blocks.get(block_id)
        if block is None:
            raise KeyError(f"block {block_id} is not in the pool (freed, or never allocated)")
        return block


def build_table(
    pool: BlockPool,
    n_tokens: int,
    lease: tuple[int, ...],
    make_block: Callable[[int, int], tuple[object, int]],
    layout: object = None,
) -> BlockTable:
    """The table of a state of ``n_tokens`` positions: the lease's blocks first, shared, then new
    blocks made by ``make_block(start, stop) -> (data, nbytes)`` for the positions past them.

    The caller holds one reference on every block of the returned table (shared or new) and
    must release it once the table is stored, or not; a failure here releases what it took.
    """
    size = pool.block_tokens
    shared = pool.share(lease[: n_tokens // size])
    ids = list(shared)
    try:
        for start in range(len(ids) * size, n_tokens, size):
            stop = min(start + size, n_tokens)
            data, nbytes = make_block(start, stop)
            ids.append(pool.allocate(data, stop - start, nbytes))
    except BaseException:
        pool.release(ids)
        raise
    return BlockTable(pool, tuple(ids), n_tokens, layout)


def block_keys(seed: bytes, tokens: Sequence[int], block_tokens: int, layout: object) -> list[bytes]:
    """One content key per full block of a state of ``tokens``: a chain over the tokens of every
    block up to it, seeded with the bucket (``seed``) and the layer layout, so equal keys mean the
    same positions of the same token prefix, in the same bucket and layers."""
    key = hashlib.blake2b(seed + repr(layout).encode(), digest_size=16).digest()
    out = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        key = hashlib.blake2b(key + array("q", tokens[start : start + block_tokens]).tobytes(), digest_size=16).digest()
        out.append(key)
    return out


class BlockIndex:
    """Live full blocks by content key (:func:`block_keys`), to fold a block computed again into
    the copy the pool already holds (docs/prompt-cache.md, "Shared KV blocks": merging copies).

    Two sequences that prefill one prefix cold at the same time, or an entry read back from disk
    whose prefix RAM still holds, make such copies. A key only says the tokens are the same; the
    arrays are shared only when ``equal`` finds them bit-identical, so an entry never holds a bit
    its donor did not compute, and a hit still equals a cold run exactly where it did before.
    Stale keys (their block freed) are replaced when met and pruned as the index grows.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._ids: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def merge(self, table: BlockTable, keys: Sequence[bytes], equal: Callable[[object, object], bool]) -> BlockTable:
        """``table`` with each full block that is bit-identical to the live block its key names
        replaced by that block; the others are indexed. The caller's one reference per block
        moves with the swap (the dropped copy is freed unless someone else holds it)."""
        ids = list(table.block_ids)
        for k, key in enumerate(keys[: len(ids)]):
            new, old = ids[k], self._ids.get(key)
            if old is None or old not in self.pool:
                self._ids[key] = new
            elif old != new and _same(equal, self.pool.data(old), self.pool.data(new)):
                self.pool.retain((old,))
                self.pool.release((new,))
                ids[k] = old
                self.pool.counters.merged += 1
        if len(self._ids) > 2 * len(self.pool) + 64:
            self._ids = {key: i for key, i in self._ids.items() if i in self.pool}
        return table if tuple(ids) == table.block_ids else BlockTable(self.pool, tuple(ids), table.n_tokens, table.layout)


def _same(equal: Callable[[object, object], bool], a: object, b: object) -> bool:
    """``equal(a, b)``, where a comparison that fails keeps the copy (sharing is an optimisation:
    it must never fail a donation, nor leave its references half moved)."""
    try:
        return bool(equal(a, b))
    except Exception:
        return False

