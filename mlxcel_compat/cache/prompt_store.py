"""The prompt-prefix KV store: two-stage longest-prefix lookup and APC partial reuse.

``PromptCacheStore`` is an ``EntryStore`` (``cache/store.py``: entries, LRU/TTL/byte budgets,
insert and supersede, pins) that adds the lookup and the APC block chains of its entries
(``cache/block_hash.py``).

Readings of the spec recorded here:

- ``min_prefix`` is applied to each candidate's match (before the clamp), so a short
  same-session match cannot hide a long enough cross-session one.
- Stage ranking uses the adoptable length (after the ``len(tokens) - 1`` clamp): a
  cross-session entry that is longer only before the clamp does not beat the session.
- A non-trimmable entry can be adopted only when it is a whole prefix of the request
  and at least one token shorter than it (its state cannot give the last token back).
- APC partial reuse needs: APC on and a trimmable entry that still has its chain. In a
  multimodal bucket (every entry holds the same images, by ``mm_digest``) a match is clipped
  so that it never ends inside an image's tokens (``lookup(spans=...)``, ``cache/media.py``).
- APC requires the prompt cache: a store built with ``enabled=False`` ignores its
  ``ApcConfig``, and stats say ``apc_enabled: false, apc_disabled_reason: "cache_off"``.
- ``--apc-num-blocks`` bounds the total length of all stored chains. Over the bound,
  chains of the least recently used entries are dropped: those entries lose partial
  reuse but stay eligible as whole prefixes.

The store is not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxcel_compat.cache.block_hash import (
    ApcConfig,
    BlockHasher,
    BlockIndex,
    agreed_block_len,
    block_chain,
    extend_token_granular,
)
from mlxcel_compat.cache.block_pool import BlockPool
from mlxcel_compat.cache.key import Bucket
from mlxcel_compat.cache.media import clip_to_media
from mlxcel_compat.cache.records import (
    STAGE_CROSS_SESSION,
    STAGE_SESSION,
    CacheEntry,
    CacheHit,
    LookupResult,
    Turndown,
)
from mlxcel_compat.cache.store import EntryStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Candidate:
    entry: CacheEntry
    usable: int  # adoptable length after the len - 1 clamp
    verified: int  # before the clamp
    common: int
    rank: tuple[int, bool, int]  # (usable, same session, recency): max wins
    block_len: int  # part of ``verified`` vouched for by agreeing full blocks


@dataclass(slots=True)
class _Selection:
    best: _Candidate | None = None
    short_len: int = 0  # longest eligible match below min_prefix
    short: Turndown | None = None  # the entry behind short_len
    turndown: Turndown | None = None  # the deepest overlapping entry that was not eligible


class PromptCacheStore(EntryStore):
    """The prompt-prefix KV store: two-stage longest-prefix lookup plus APC."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        max_entries: int = 1024,
        ttl_seconds: float = 3600.0,
        min_prefix: int = 32,
        apc: ApcConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        apc_disabled_reason: str | None = None,
        pin_max_entries: int = 0,
        pin_capacity_bytes: int = 0,
        pool: BlockPool | None = None,
    ) -> None:
        super().__init__(
            capacity_bytes=capacity_bytes, max_entries=max_entries, ttl_seconds=ttl_seconds,
            min_prefix=min_prefix, clock=clock, enabled=enabled,
            pin_max_entries=pin_max_entries, pin_capacity_bytes=pin_capacity_bytes, pool=pool,
        )
        # APC works on the entries of this store: with the store off it is inactive too.
        self.apc = apc if enabled else None
        # Reported while APC is off: "cache_off", else the caller's reason, else "flag".
        if self.apc is not None:
            self.apc_disabled_reason: str | None = None
        elif not enabled:
            self.apc_disabled_reason = "cache_off"
        else:
            self.apc_disabled_reason = apc_disabled_reason or "flag"
        self.apc_num_blocks = self.apc.resolve_num_blocks(max_entries) if self.apc is not None else 0
        self._blocks = BlockIndex()

    # --- public API ---

    def lookup(
        self, bucket: Bucket, session_key: str, tokens: Sequence[int], *, record: bool = True,
        spans: Sequence[tuple[int, int]] = (),
    ) -> LookupResult:
        """Find the state to adopt before prefilling ``tokens``.

        Stage 1 takes the best candidate of the request's session; stage 2 the best of
        the other sessions of the bucket, which wins only when strictly longer. Ties
        inside a stage go to the most recently used entry. A hit refreshes the entry's
        recency and TTL.

        Args:
            bucket: the request's bucket.
            session_key: the request's session key.
            tokens: the full rendered prompt.
            record: False for a probe (is the disk tier's match longer?): no counters and no
                recency change, so the stats describe the lookups that decide.
            spans: the request's image token spans ([start, end)); a match that would end
                inside one is cut back to its start (the whole-image rule).

        Returns:
            A ``LookupResult``. On a hit, ``hit.matched_len`` leaves at least one token
            to prefill. On a miss, ``reason`` is "no_candidate" (nothing eligible),
            "prefix_too_short" (the longest eligible match, in ``best_len``, is below
            ``min_prefix``) or "disabled"; ``candidate_id``, ``common_len`` and ``detail``
            name the entry that came closest and why it was turned down.
        """
        if not self.enabled:
            return LookupResult(hit=None, reason="disabled")
        toks = tokens if isinstance(tokens, tuple) else tuple(tokens)
        now = self._clock()
        self._sweep_helper(now)
        if record:
            self.counters.lookups += 1
        sel = self._select_helper(bucket, session_key, toks, tuple(spans))
        best = sel.best
        if best is None:
            if sel.short is not None:
                miss = ("prefix_too_short", sel.short_len, sel.short)
            else:
                miss = ("no_candidate", 0, sel.turndown or Turndown(None, 0, "no_overlap"))
            return self._record_miss(*miss) if record else self._miss_result(*miss)
        stage = STAGE_SESSION if best.entry.session_key == session_key else STAGE_CROSS_SESSION
        hit = CacheHit(best.entry, best.usable, stage, best.common, best.verified, best.block_len)
        if not record:
            return LookupResult(hit=hit, reason=None, best_len=hit.verified_len)
        logger.debug(
            "prompt cache hit: entry=%d stage=%s matched=%d common=%d verified=%d block=%d",
            best.entry.id, stage, best.usable, best.common, best.verified, best.block_len,
        )
        return self._record_hit(hit, now)

    def stats(self) -> dict[str, object]:
        """Counters and gauges for ``GET /v1/cache/stats`` (same keys as ``disabled_stats``)."""
        out = self._base_stats()
        out.update(
            apc_enabled=self.apc is not None,
            apc_disabled_reason=self.apc_disabled_reason,
            block_size=self.apc.block_size if self.apc is not None else 0,
            hash=self.apc.hash_name if self.apc is not None else None,
            apc_num_blocks=self.apc_num_blocks,
            total_blocks_stored=self._blocks.num_blocks,
            unique_block_hashes=self._blocks.num_unique,
            apc_active_entries=self._blocks.num_chains,
            apc_hits=self.counters.apc_hits,
            apc_block_tokens_total=self.counters.apc_block_tokens,
            apc_extended_tokens_total=self.counters.apc_extended_tokens,
            pinned_entries=len(self._pins),
            pinned_bytes=self.pinned_bytes,
            pin_max_entries=self.pin_max_entries,
            pin_capacity_bytes=self.pin_capacity_bytes,
            pins=self.counters.pins,
            pin_refreshes=self.counters.pin_refreshes,
            pin_hits=self.counters.pin_hits,
            unpins=dict(self.counters.unpins),
            **self.sharing_stats(),
        )
        return out

    def sharing_stats(self) -> dict[str, object]:
        """Shared KV blocks: what the entries would hold as whole copies against what the store
        holds (``bytes``), and the pool (blocks of entries and of running sequences)."""
        logical = self.logical_bytes
        pool = self.pool
        return {
            "logical_bytes": logical,
            "logical_tokens": self.logical_tokens,
            "sharing_ratio": round(logical / self.nbytes, 4) if self.nbytes else 0.0,
            "kv_block_tokens": pool.block_tokens if pool is not None else 0,
            "kv_blocks": len(pool) if pool is not None else 0,
            "kv_block_bytes": pool.nbytes if pool is not None else 0,
            "kv_blocks_merged": pool.counters.merged if pool is not None else 0,
        }

    @staticmethod
    def disabled_stats() -> dict[str, object]:
        """The stats shape when the cache is off: every key present, all zero."""
        out = PromptCacheStore(capacity_bytes=0, max_entries=1, ttl_seconds=0, min_prefix=0, enabled=False).stats()
        out.update(max_entries=0, ttl_seconds=0.0)
        return out

    # --- lookup helpers ---

    def _record_hit(self, hit: CacheHit, now: float) -> LookupResult:
        if hit.partial:
            self.counters.apc_hits += 1
            self.counters.apc_block_tokens += hit.block_len
            self.counters.apc_extended_tokens += hit.verified_len - hit.block_len
        return super()._record_hit(hit, now)

    def _select_helper(self, bucket: Bucket, session_key: str, toks: tuple[int, ...],
                       spans: tuple[tuple[int, int], ...] = ()) -> _Selection:
        """The winning candidate, or what explains the miss."""
        sel = _Selection()
        trie = self._tries.get(bucket)
        if trie is None or len(toks) < 2:
            return sel
        limit = len(toks) - 1  # the last prompt token is always prefilled for fresh logits
        hasher = None
        if self.apc is not None:
            hasher = BlockHasher(toks, self.apc.block_size, self.apc.hash_name, bucket.mm_digest)
        for group in trie.overlap_groups(toks):
            best = sel.best
            bound = min(group.common_len, limit)
            # Groups come deepest first: once none can reach the best, stop enumerating.
            if bound == 0 or (best is not None and bound < best.usable):
                break
            if group.common_len < self.min_prefix and (best is not None or sel.short is not None):
                break  # everything from here on is too short, and the miss reason is known
            for entry_id in group.entry_ids:
                cand = self._evaluate_helper(self._entries[entry_id], group.common_len, toks, limit, hasher, session_key, spans)
                if isinstance(cand, str):
                    if sel.turndown is None:  # the deepest overlap explains a miss best
                        sel.turndown = Turndown(entry_id, group.common_len, cand)
                elif cand.verified < self.min_prefix:
                    if sel.short is None or cand.verified > sel.short_len:
                        sel.short_len = cand.verified
                        sel.short = Turndown(entry_id, group.common_len, "below_min_prefix")
                elif best is None or cand.rank > best.rank:
                    sel.best = best = cand
        return sel

    def _evaluate_helper(
        self,
        entry: CacheEntry,
        common: int,
        toks: tuple[int, ...],
        limit: int,
        hasher: BlockHasher | None,
        session_key: str,
        spans: tuple[tuple[int, int], ...] = (),
    ) -> _Candidate | str:
        """How much of ``entry`` the request may adopt, or why it is not eligible."""
        length = len(entry.tokens)
        if common == length:  # the whole entry is a prefix of the request
            if not entry.trimmable and length > limit:
                return "not_trimmable_exact_repeat"  # the state would have to give a token back
            verified = block_len = length
        else:
            why = self._partial_blocker(entry, hasher)
            if why is not None:
                return why
            assert self.apc is not None and hasher is not None and entry.block_chain is not None
            bs = self.apc.block_size
            request_chain = hasher.chain(common // bs + 1)
            block_len = agreed_block_len(entry.block_chain, request_chain, length, len(toks), bs)
            # Entries with a chain are trimmable dense KV: extend token by token.
            verified = extend_token_granular(entry.tokens, toks, block_len, bs)
        usable = clip_to_media(min(verified, limit), spans)
        if usable <= 0:
            return "no_block_verified"
        if entry.tokens[:usable] != toks[:usable]:
            # Never adopt on the hashes' word alone: the state would be another prompt's.
            self.counters.adoption_rejects["token_mismatch"] += 1
            logger.warning("prompt cache: entry %d refused: its tokens differ from the request's within the %d tokens its block hashes vouched for", entry.id, usable)
            return "token_mismatch"
        rank = (usable, entry.session_key == session_key, entry.use_tick)
        return _Candidate(entry, usable, verified, common, rank, block_len)

    def _partial_blocker(self, entry: CacheEntry, hasher: BlockHasher | None) -> str | None:
        """Why a partly overlapping entry cannot be cut to the overlap (None: it can)."""
        if self.apc is None:
            return "partial_overlap_apc_off"
        if not entry.trimmable:
            return "partial_overlap_not_trimmable"
        if entry.block_chain is None:
            return "partial_overlap_no_chain"
        return None

    # --- APC block index ---

    def _after_insert(self, entry: CacheEntry) -> None:
        apc = self.apc
        if apc is None or not entry.trimmable:
            return  # such entries are only ever adopted whole: a chain would be dead weight
        entry.block_chain = block_chain(entry.tokens, apc.block_size, apc.hash_name, entry.bucket.mm_digest)
        self._blocks.add(entry.block_chain)
        # Over the bound, the least recently used entries give up their chains first.
        for older in self._entries.values():
            if self._blocks.num_blocks <= self.apc_num_blocks:
                break
            self._drop_chain(older)

    def _on_entry_removed(self, entry: CacheEntry) -> None:
        self._drop_chain(entry)

    def _on_reset(self) -> None:
        self._blocks.clear()

    def _drop_chain(self, entry: CacheEntry) -> None:
        """Forget an entry's chain: it stays adoptable as a whole prefix only."""
        if entry.block_chain is not None:
            self._blocks.discard(entry.block_chain)
            entry.block_chain = None
