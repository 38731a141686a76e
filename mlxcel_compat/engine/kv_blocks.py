"""Shared KV blocks as the engine uses them: the pool, running sequences' leases, and the
payloads the prompt cache stores (docs/prompt-cache.md, "Shared KV blocks").

The pool's bookkeeping is ``cache/block_pool.py`` (pure Python), the arrays ``cache/kv.py``.
This module decides, on the engine thread, which blocks a running sequence holds (its *lease*:
the full blocks it adopted or pinned, from position 0) and builds what a sequence stores: a
block table that starts with its lease, or a whole payload where the state cannot be cut into
blocks. Every sequence ends through ``release`` (``Engine._release``, or its construction
failing), so a cancelled or failed sequence leaves no reference behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence as Seq

from mlxcel_compat.cache import kv
from mlxcel_compat.cache.block_pool import BlockIndex, BlockPool, BlockTable, block_keys
from mlxcel_compat.cache.key import Bucket, prompt_digest

if TYPE_CHECKING:
    from mlxcel_compat.engine.sequence import Sequence


@dataclass(slots=True)
class _Lease:
    seq: "Sequence"  # kept so that id(seq) cannot be reused while the lease lives
    block_ids: tuple[int, ...]
    layout: int  # layers the blocks hold: a table of other layers cannot share them


class SharedBlocks:
    """The block pool and the leases of the running sequences (engine thread only)."""

    def __init__(self, block_tokens: int) -> None:
        self.pool = BlockPool(block_tokens)
        self.index = BlockIndex(self.pool)  # full blocks by content: copies computed again fold into them
        self._leases: dict[int, _Lease] = {}

    @property
    def leased_blocks(self) -> int:
        """Blocks held by running sequences (each lease's blocks counted once per lease)."""
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def stats(self) -> dict[str, int]:
        """Who holds the pool's blocks, for ``/v1/cache/stats``: the leak check of issue 54.

        Between engine steps every reference on a live block belongs to a stored entry or to a
        running sequence's lease (a donation's own references last only inside ``donate``), so
        ``kv_block_stray_refs`` is 0 unless a path forgot a release; once the slots are idle and
        the cache is reset, ``kv_blocks`` is 0 too."""
        pool = self.pool
        leased = self.leased_blocks
        return {
            "kv_blocks_stored": pool.stored_blocks,
            "kv_block_leases": len(self._leases),
            "kv_blocks_leased": leased,
            "kv_block_stray_refs": pool.refs - pool.stored_refs - leased,
        }

    @staticmethod
    def empty_stats() -> dict[str, int]:
        """The same keys without a pool (blocks off, or the cache off)."""
        return {"kv_blocks_stored": 0, "kv_block_leases": 0, "kv_blocks_leased": 0, "kv_block_stray_refs": 0}

    def adopt(self, seq: "Sequence", table: BlockTable, n_tokens: int) -> list[Any]:
        """The sequence's cache made from ``table``'s first ``n_tokens`` positions without a copy
        (``kv.paged``: the blocks read in place by the CPU decode runtime, gathered on demand by
        the MLX path); the full blocks among them become the sequence's lease (the partly used
        last one is copied when the sequence first writes)."""
        cache = kv.paged(table, n_tokens)
        self.release(seq)
        ids = table.full_blocks(n_tokens)
        self.pool.retain(ids)
        self._leases[id(seq)] = _Lease(seq, ids, int(table.layout))  # type: ignore[call-overload]
        return cache

    def state(self, seq: "Sequence", layers: Seq[Any], n_tokens: int, bucket: Bucket) -> Any:
        """What ``seq`` stores in ``bucket`` for its first ``n_tokens`` positions of ``layers``: a
        block table sharing its lease and any live block bit-identical to one it computed again
        (:meth:`merged`; the caller holds one reference per block: pass it to ``donor_done``),
        or, when the layers cannot be cut into blocks, a whole copy as before: the evaluated views
        of a finished sequence's buffers, or a prefix cut into buffers of its own (a pin, a text
        prefix), so that it never keeps the longer buffer alive."""
        if not kv.blockable(layers, n_tokens):
            held = max((kv.layer_tokens(layer) for layer in layers), default=0)
            return kv.snapshot(layers) if held == n_tokens else kv.detached_prefix(layers, n_tokens)
        lease = self._leases.get(id(seq))
        shared = lease.block_ids if lease is not None and lease.layout == len(layers) else ()
        return self.merged(kv.to_blocks(self.pool, layers, n_tokens, shared), bucket, seq.cache_tokens[:n_tokens])

    def merged(self, table: BlockTable, bucket: Bucket, tokens: Seq[int]) -> BlockTable:
        """``table`` with its full blocks folded into the live blocks of the same bucket, layers and
        token prefix whose arrays are the very same bits (``cache/block_pool.py: BlockIndex``)."""
        keys = block_keys(prompt_digest(bucket, "", ()), tokens, self.pool.block_tokens, table.layout)
        return self.index.merge(table, keys, kv.blocks_equal)

    def keep(self, seq: "Sequence", table: BlockTable) -> None:
        """Extend ``seq``'s lease to ``table``'s full blocks (a pin it just stored), so the entry
        it donates later shares them too."""
        lease = self._leases.get(id(seq))
        ids = table.full_blocks(table.n_tokens)
        if lease is not None and (lease.layout != table.layout or len(lease.block_ids) >= len(ids)):
            return
        self.pool.retain(ids)
        self.release(seq)
        self._leases[id(seq)] = _Lease(seq, ids, int(table.layout))  # type: ignore[call-overload]

    def from_file(self, payload: list[Any], bucket: Bucket, tokens: Seq[int]) -> Any:
        """A state of ``tokens`` read back from disk or a slot file, as blocks where it can be cut
        (new ones, but for those RAM still holds the very bits of: an entry read back whose prefix
        another entry kept shares it again)."""
        if not kv.blockable(payload, len(tokens)):
            return payload
        return self.merged(kv.to_blocks(self.pool, payload, len(tokens)), bucket, tokens)

    def release(self, seq: "Sequence") -> None:
        """The sequence ended (or adopts anew): its lease goes."""
        lease = self._leases.pop(id(seq), None)
        if lease is not None:
            self.pool.release(lease.block_ids)


def donor_done(payload: Any) -> None:
    """Drop the references ``SharedBlocks.state`` gave its caller, once the table is stored (the
    store holds its own) or refused; a whole payload holds none."""
    if isinstance(payload, BlockTable):
        payload.pool.release(payload.block_ids)
