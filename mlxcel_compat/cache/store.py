"""The entry store: entries in LRU order, TTL, byte budgets, insert and supersede, pins.

Entries hold an opaque ``payload`` (the adapter's detached KV state) plus its logical
``nbytes`` and whether it can be cut to any shorter prefix (``trimmable``). Nothing
here imports mlx; the adapter that knows mlx-lm cache objects lives elsewhere.

Layout::

    EntryStore            entries in LRU order (OrderedDict, least recent first),
      |                   one RadixTrie per Bucket, digest index, byte total,
      |                   TTL sweep, eviction to caps, insert + supersede, counters
      +-- PromptCacheStore   two-stage lookup, APC block chains and block index
      |                      (cache/prompt_store.py)
      +-- SnapshotStore      whole-cache snapshots for recurrent families
                             (cache/snapshot.py)

How the snapshot store plugs in: subclass ``EntryStore`` with its own
``capacity_flag``/``store_label`` and write only ``lookup`` (same bucket *and* same
session; classify divergent snapshots with ``self._record_miss("snapshot_diverged")``
and the best common length). Insert, supersede per session *and* origin, eviction,
TTL, reset and the base stats are already shared; ``_after_insert``,
``_on_entry_removed`` and ``_on_reset`` are the hooks (APC uses them in
``cache/prompt_store.py``).

Readings of the spec recorded here:

- Eviction counters: ``lru`` counts every eviction made to get under ``max_entries``
  *or* ``capacity_bytes``; ``capacity`` is always reported (stable metric shape) but
  stays 0 because byte-budget evictions are folded into ``lru`` ("capacity is
  reported but folded into lru"). The three reasons therefore add up to the total.
- TTL: an entry expires once ``clock() - last_used >= ttl_seconds``; ``last_used``
  moves on insert and on a hit. ``ttl_seconds == 0`` disables expiry. Expired entries
  are swept on lookup (spec) and on insert (keeps the byte budget honest).
- Supersede: a new entry removes entries of the same bucket, session and origin whose
  tokens are a prefix of (or equal to) its tokens, whatever their trimmability, as the
  snapshot store must do. An identical key (same digest) is always replaced.
- Pins (explicit cache breakpoints, ``cache_control``): a pinned entry is skipped by the
  global TTL and evicted to meet the caps only once no unpinned entry is left. Pins are
  bounded on their own (count, bytes, a per-pin TTL refreshed by every hit or re-pin); a
  pin over a bound or past its TTL is *demoted*, oldest first: it becomes an ordinary
  entry again (still usable, evictable by LRU), so pins can never hold the budget.
  Pinned entries are never superseded; a duplicate insert keeps the pin.
- Shared KV blocks (``cache/block_pool.py``): an entry whose payload is a ``BlockTable`` holds
  one stored reference on each of its blocks while it is stored; the store's bytes are those
  blocks counted once (``pool.stored_bytes``) plus what entries hold outside the pool (whole
  payloads, final logits). An entry evicted to the caps keeps its blocks alive until
  ``on_evict`` (the disk tier's spill) has read them.

The store is not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar

from mlxcel_compat.cache.block_pool import BlockPool, BlockTable
from mlxcel_compat.cache.explain import Departure
from mlxcel_compat.cache.key import Bucket, prompt_digest
from mlxcel_compat.cache.radix import RadixTrie
from mlxcel_compat.cache.records import CacheEntry, CacheHit, InsertResult, LookupResult, StoreCounters, Turndown

DEPARTURES_KEPT = 64  # evicted or expired entries remembered to explain a miss

logger = logging.getLogger(__name__)


class EntryStore:
    """Entries, budgets and insert policy shared by the KV store and the snapshot store."""

    capacity_flag: ClassVar[str] = "--prompt-cache-capacity-bytes"
    store_label: ClassVar[str] = "prompt cache"

    def __init__(
        self,
        *,
        capacity_bytes: int,
        max_entries: int,
        ttl_seconds: float,
        min_prefix: int,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        pin_max_entries: int = 0,
        pin_capacity_bytes: int = 0,
        pool: BlockPool | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if ttl_seconds < 0:
            raise ValueError(f"ttl_seconds must be >= 0 (0 = never expire), got {ttl_seconds}")
        if min_prefix < 0:
            raise ValueError(f"min_prefix must be >= 0, got {min_prefix}")
        self.enabled = enabled
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self.min_prefix = min_prefix
        self.counters = StoreCounters()
        self._clock = clock
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # least recently used first
        self._tries: dict[Bucket, RadixTrie] = {}
        self._by_digest: dict[bytes, int] = {}
        self._nbytes = 0  # bytes entries hold outside the block pool
        self.pool = pool  # shared KV blocks of entries whose payload is a BlockTable
        self._ids = itertools.count(1)
        self._ticks = itertools.count(1)
        self._warned_oversized = False
        # Pins: bounded by count and bytes (0: no pins are kept).
        self.pin_max_entries = pin_max_entries
        self.pin_capacity_bytes = pin_capacity_bytes
        self._pins: dict[int, CacheEntry] = {}
        # Called with each entry evicted to get under the caps (LRU or byte pressure), after it
        # left the store: the disk tier writes such entries out instead of losing them. Entries
        # that expire (TTL), are superseded or are cleared by a reset are not handed over.
        self.on_evict: Callable[[CacheEntry], None] | None = None
        # Called with each newly stored entry, once the caps hold: with --prompt-cache-write-through
        # the disk tier writes it at once, so that other servers sharing the directory can use it.
        self.on_insert: Callable[[CacheEntry], None] | None = None
        # The last entries evicted or expired, kept (tokens, bucket, when, why) so that a miss
        # they would have served can say so (``cache_explain``, ``cache/explain.py``).
        self.departed: collections.deque[Departure] = collections.deque(maxlen=DEPARTURES_KEPT)

    # --- public API ---

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: every shared block once, plus what entries hold whole."""
        return self._nbytes + (self.pool.stored_bytes if self.pool is not None else 0)

    @property
    def logical_bytes(self) -> int:
        """Bytes the entries would hold as whole copies of their state (no sharing)."""
        return sum(e.nbytes for e in self._entries.values())

    @property
    def logical_tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def get(self, entry_id: int) -> CacheEntry | None:
        """The live entry with this id, without touching its recency."""
        return self._entries.get(entry_id)

    def find(self, digest: bytes) -> CacheEntry | None:
        """The live entry with this key digest (``prompt_digest``), without touching its recency."""
        entry_id = self._by_digest.get(digest)
        return None if entry_id is None else self._entries[entry_id]

    def remove(self, entry_id: int) -> bool:
        """Drop one entry (its backing data went away); counted as nothing. False if unknown."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return False
        self._remove_entry(entry)
        return True

    def entries(self) -> list[CacheEntry]:
        """Live entries, least recently used first."""
        return list(self._entries.values())

    def insert(
        self,
        bucket: Bucket,
        session_key: str,
        tokens: Sequence[int],
        payload: object,
        nbytes: int,
        trimmable: bool,
        origin: str = "completion",
        pin_ttl: float = 0.0,
        final_logits: tuple[int, object, int] | None = None,
    ) -> InsertResult:
        """Store a finished sequence's state (donate).

        Args:
            bucket: the request's bucket.
            session_key: the request's session key.
            tokens: the tokens the payload holds state for (prompt + generated).
            payload: opaque state; the store only keeps a reference.
            nbytes: logical bytes of ``payload``.
            trimmable: whether ``payload`` can be cut to any shorter prefix.
            origin: donation kind; supersede only acts within one origin.
            pin_ttl: > 0 pins the entry for that many seconds (see the module docstring).
            final_logits: kept as ``CacheEntry.final_logits``; ``nbytes`` includes their bytes.

        Returns:
            Whether it was stored, why not, and which entries it displaced.
        """
        if not self.enabled:
            return InsertResult(inserted=False, reason="disabled")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        now = self._clock()
        self._sweep_helper(now)
        toks = tokens if isinstance(tokens, tuple) else tuple(tokens)
        if len(toks) < max(self.min_prefix, 1):
            return self._reject_helper("min_prefix", tokens=len(toks), min_prefix=self.min_prefix)
        if nbytes > self.capacity_bytes:
            self._warn_oversized_once(nbytes)
            return self._reject_helper("oversized", nbytes=nbytes, capacity_bytes=self.capacity_bytes)

        digest = prompt_digest(bucket, session_key, toks)
        result = InsertResult(inserted=True)
        duplicate_id = self._by_digest.get(digest)
        if duplicate_id is not None:
            result.reason = "duplicate"
            duplicate = self._entries[duplicate_id]
            pin_ttl = max(pin_ttl, duplicate.pin_ttl)  # the same tokens stay pinned
            self._supersede_helper(duplicate, result)
        for entry in self._supersede_candidates(bucket, session_key, toks, origin):
            self._supersede_helper(entry, result)

        entry = CacheEntry(
            id=next(self._ids), bucket=bucket, session_key=session_key, tokens=toks,
            payload=payload, nbytes=nbytes, trimmable=trimmable, created=now,
            last_used=now, origin=origin, digest=digest, use_tick=next(self._ticks), final_logits=final_logits,
        )
        self._add_entry(entry)
        if pin_ttl > 0:
            self._pin(entry, pin_ttl, now)
            self.counters.pins += 1
        result.entry_id = entry.id
        result.evicted = self._evict_to_caps_helper(keep=entry.id)
        assert entry.id in self._entries, f"{entry.id=} evicted right after insert"
        self.counters.inserts += 1
        self._after_insert(entry)
        if self.on_insert is not None:
            self.on_insert(entry)
        return result

    def refresh_pin(self, bucket: Bucket, session_key: str, tokens: Sequence[int], pin_ttl: float) -> bool:
        """Re-pin the stored entry holding exactly ``tokens`` (no copy); False when there is none."""
        if not self.enabled or pin_ttl <= 0:
            return False
        now = self._clock()
        self._sweep_helper(now)
        entry_id = self._by_digest.get(prompt_digest(bucket, session_key, tuple(tokens)))
        if entry_id is None:
            return False
        entry = self._entries[entry_id]
        self._touch(entry, now)
        self._pin(entry, max(pin_ttl, entry.pin_ttl), now)
        self.counters.pin_refreshes += 1
        return True

    @property
    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self._pins.values())

    def sweep(self) -> list[int]:
        """Evict TTL-expired entries now; returns their ids."""
        return self._sweep_helper(self._clock())

    def reset(self) -> tuple[int, int]:
        """Drop every entry (``POST /v1/cache/reset``); counters are kept.

        Returns:
            ``(entries_cleared, bytes_cleared)``; ``(0, 0)`` when already empty.
        """
        cleared = (len(self._entries), self.nbytes)
        for entry in self._entries.values():
            self._release_blocks(entry)
        self._entries.clear()
        self._tries.clear()
        self._by_digest.clear()
        self._nbytes = 0
        self._pins.clear()
        self._on_reset()
        return cleared

    # --- hooks for subclasses ---

    def _after_insert(self, entry: CacheEntry) -> None:
        """Called once the new entry is stored and the caps hold."""

    def _on_entry_removed(self, entry: CacheEntry) -> None:
        """Called for every entry leaving the store except through ``reset``."""

    def _on_reset(self) -> None:
        """Called by ``reset`` after the entries are gone."""

    # --- internal helpers ---

    def _supersede_candidates(
        self, bucket: Bucket, session_key: str, toks: tuple[int, ...], origin: str
    ) -> list[CacheEntry]:
        """Same-session, same-origin entries whose tokens are a prefix of ``toks``."""
        trie = self._tries.get(bucket)
        if trie is None:
            return []
        found = []
        for _, entry_id in trie.longest_prefix_entries(toks):
            entry = self._entries[entry_id]
            if entry.session_key == session_key and entry.origin == origin and not entry.pinned:
                found.append(entry)
        return found

    def _supersede_helper(self, entry: CacheEntry, result: InsertResult) -> None:
        if entry.id not in self._entries:  # already taken out as the duplicate
            return
        self._remove_entry(entry)
        result.superseded.append(entry.id)
        self.counters.supersedes += 1

    def _add_entry(self, entry: CacheEntry) -> None:
        self._entries[entry.id] = entry
        self._by_digest[entry.digest] = entry.id
        self._nbytes += self._own_bytes(entry)
        if isinstance(entry.payload, BlockTable):
            entry.payload.pool.retain(entry.payload.block_ids, stored=True)
        trie = self._tries.get(entry.bucket)
        if trie is None:
            trie = self._tries[entry.bucket] = RadixTrie()
        trie.insert(entry.tokens, entry.id)

    def _remove_entry(self, entry: CacheEntry) -> None:
        self._pins.pop(entry.id, None)
        del self._entries[entry.id]
        del self._by_digest[entry.digest]
        self._nbytes -= self._own_bytes(entry)
        self._release_blocks(entry)
        trie = self._tries[entry.bucket]
        trie.remove(entry.tokens, entry.id)
        if not len(trie):
            del self._tries[entry.bucket]  # stale buckets (old templates) leave nothing behind
        self._on_entry_removed(entry)

    @staticmethod
    def _own_bytes(entry: CacheEntry) -> int:
        """What an entry holds outside the block pool: all of it, or a table's final logits."""
        if isinstance(entry.payload, BlockTable):
            return entry.nbytes - entry.payload_nbytes
        return entry.nbytes

    @staticmethod
    def _release_blocks(entry: CacheEntry) -> None:
        if isinstance(entry.payload, BlockTable):
            entry.payload.pool.release(entry.payload.block_ids, stored=True)

    def _touch(self, entry: CacheEntry, now: float) -> None:
        """Mark a successful use: most recent in LRU order, TTL restarts."""
        entry.last_used = now
        entry.use_tick = next(self._ticks)
        self._entries.move_to_end(entry.id)
        if entry.pinned:
            entry.pin_until = now + entry.pin_ttl

    def _pin(self, entry: CacheEntry, pin_ttl: float, now: float) -> None:
        """Pin ``entry``, then demote the oldest pins while the pins exceed their bounds."""
        entry.pin_ttl = pin_ttl
        entry.pin_until = now + pin_ttl
        self._pins[entry.id] = entry
        while self._pins and (len(self._pins) > self.pin_max_entries or self.pinned_bytes > self.pin_capacity_bytes):
            self._unpin(min(self._pins.values(), key=lambda e: e.use_tick), "bound")

    def _unpin(self, entry: CacheEntry, reason: str) -> None:
        """Demote a pin: the entry stays, as an ordinary LRU entry."""
        del self._pins[entry.id]
        entry.pin_ttl = entry.pin_until = 0.0
        self.counters.unpins[reason] += 1

    def _sweep_helper(self, now: float) -> list[int]:
        for pin in [p for p in self._pins.values() if now >= p.pin_until]:
            self._unpin(pin, "ttl")
        if self.ttl_seconds <= 0:
            return []
        expired: list[int] = []
        # Entries are in last-use order, so the expired ones form a run at the front (pins
        # aside: the global TTL skips them).
        gone: list[CacheEntry] = []
        for entry in self._entries.values():
            if entry.pinned:
                continue
            if now - entry.last_used < self.ttl_seconds:
                break
            gone.append(entry)
        for entry in gone:
            self._remove_entry(entry)
            self.counters.evictions["ttl"] += 1
            self.departed.append(Departure(entry.bucket, entry.session_key, entry.tokens, time.time(), "ttl"))
            expired.append(entry.id)
        return expired

    def _evict_to_caps_helper(self, keep: int | None = None) -> list[int]:
        """Evict least recently used entries down to max_entries, then capacity_bytes.

        Unpinned entries go first, pins only when nothing else is left; ``keep`` (the entry
        just inserted) never goes.
        """
        evicted: list[int] = []
        while len(self._entries) > self.max_entries or self.nbytes > self.capacity_bytes:
            others = [e for e in self._entries.values() if e.id != keep] if self._pins else None
            if others is None:
                oldest = next(iter(self._entries.values()))
            else:
                oldest = next((e for e in others if not e.pinned), others[0])
            table = oldest.payload if isinstance(oldest.payload, BlockTable) else None
            if table is not None:  # its blocks outlive the entry until the disk tier has read them
                table.pool.retain(table.block_ids)
            self._remove_entry(oldest)
            self.counters.evictions["lru"] += 1  # byte-budget evictions fold into lru
            self.departed.append(Departure(oldest.bucket, oldest.session_key, oldest.tokens, time.time(), "lru"))
            evicted.append(oldest.id)
            try:
                if self.on_evict is not None:
                    self.on_evict(oldest)
            finally:
                if table is not None:
                    table.pool.release(table.block_ids)
        return evicted

    def _reject_helper(self, reason: str, **details: object) -> InsertResult:
        self.counters.rejections[reason] = self.counters.rejections.get(reason, 0) + 1
        self.counters.last_reject = {"reason": reason, **details}
        return InsertResult(inserted=False, reason=reason)

    def _warn_oversized_once(self, nbytes: int) -> None:
        if self._warned_oversized:
            return
        self._warned_oversized = True
        logger.warning(
            "%s entry of %d bytes exceeds the whole capacity of %d bytes and can never be "
            "stored (cached=0 on every turn); raise %s",
            self.store_label, nbytes, self.capacity_bytes, self.capacity_flag,
        )

    def _record_miss(
        self, reason: str, best_len: int = 0, candidate: Turndown | None = None
    ) -> LookupResult:
        self.counters.misses += 1
        self.counters.miss_reasons[reason] = self.counters.miss_reasons.get(reason, 0) + 1
        return self._miss_result(reason, best_len, candidate)

    @staticmethod
    def _miss_result(reason: str, best_len: int = 0, candidate: Turndown | None = None) -> LookupResult:
        if candidate is None:
            return LookupResult(hit=None, reason=reason, best_len=best_len)
        return LookupResult(
            hit=None, reason=reason, best_len=best_len, candidate_id=candidate.entry_id,
            common_len=candidate.common, detail=candidate.why,
        )

    def _record_hit(self, hit: CacheHit, now: float) -> LookupResult:
        if hit.entry.pinned:
            self.counters.pin_hits += 1
        self._touch(hit.entry, now)
        hit.entry.hits += 1
        self.counters.hits += 1
        self.counters.hits_by_stage[hit.stage] += 1
        self.counters.prefix_tokens_reused += hit.matched_len
        if hit.needs_trim:
            self.counters.partial_hits += 1
        return LookupResult(hit=hit, reason=None, best_len=hit.verified_len)

    def entries_by_lora_id(self) -> dict[str, dict[str, int]]:
        """Entries and bytes per ``lora_id`` ("" = the base model): adapters and scales never
        share entries, so this shows what each adapter set holds."""
        out: dict[str, dict[str, int]] = {}
        for entry in self._entries.values():
            item = out.setdefault(entry.bucket.lora_id, {"entries": 0, "bytes": 0})
            item["entries"] += 1
            item["bytes"] += entry.nbytes
        return out

    def _base_stats(self) -> dict[str, object]:
        c = self.counters
        return {
            "enabled": self.enabled,
            "entries": len(self._entries),
            "entries_by_lora_id": self.entries_by_lora_id(),
            # entries of requests with images (their bucket's mm_digest is not the text-only one)
            "multimodal_entries": sum(1 for e in self._entries.values() if not e.bucket.text_only),
            "bytes": self.nbytes,
            "capacity_bytes": self.capacity_bytes,
            "max_entries": self.max_entries,
            "ttl_seconds": self.ttl_seconds,
            "min_prefix": self.min_prefix,
            "lookups": c.lookups,
            "hits": c.hits,
            "misses": c.misses,
            "hit_rate": c.hits / c.lookups if c.lookups else 0.0,
            "partial_hits": c.partial_hits,
            "hits_by_stage": dict(c.hits_by_stage),
            "miss_reasons": dict(c.miss_reasons),
            "adoption_rejects": dict(c.adoption_rejects),
            "inserts": c.inserts,
            "supersedes": c.supersedes,
            "evictions": dict(c.evictions),
            "rejections": dict(c.rejections),
            "prefix_tokens_reused_total": c.prefix_tokens_reused,
            "last_reject": dict(c.last_reject) if c.last_reject is not None else None,
        }
