"""The prompt-cache store: entries, LRU/TTL/byte budgets, two-stage lookup and APC.

Entries hold an opaque ``payload`` (the adapter's detached KV state) plus its logical
``nbytes`` and whether it can be cut to any shorter prefix (``trimmable``). Nothing
here imports mlx; the adapter that knows mlx-lm cache objects lives elsewhere.

Layout::

    EntryStore            entries in LRU order (OrderedDict, least recent first),
      |                   one RadixTrie per Bucket, digest index, byte total,
      |                   TTL sweep, eviction to caps, insert + supersede, counters
      +-- PromptCacheStore   two-stage lookup, APC block chains and block index
      +-- (SnapshotStore)    next: whole-cache snapshots for recurrent families

How the snapshot store plugs in: subclass ``EntryStore`` with its own
``capacity_flag``/``store_label`` and write only ``lookup`` (same bucket *and* same
session; classify divergent snapshots with ``self._record_miss("snapshot_diverged")``
and the best common length). Insert, supersede per session *and* origin, eviction,
TTL, reset and the base stats are already shared; ``_after_insert``,
``_on_entry_removed`` and ``_on_reset`` are the hooks (APC uses them here).

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
- Pins (explicit cache breakpoints, ``cache_control``): a pinned entry is skipped by the
  global TTL and evicted to meet the caps only once no unpinned entry is left. Pins are
  bounded on their own (count, bytes, a per-pin TTL refreshed by every hit or re-pin); a
  pin over a bound or past its TTL is *demoted*, oldest first: it becomes an ordinary
  entry again (still usable, evictable by LRU), so pins can never hold the budget.
  Pinned entries are never superseded; a duplicate insert keeps the pin.

The store is not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from mlxcel_compat.cache.block_hash import (
    ApcConfig,
    BlockHash,
    BlockHasher,
    BlockIndex,
    agreed_block_len,
    block_chain,
    extend_token_granular,
)
from mlxcel_compat.cache.key import Bucket, prompt_digest
from mlxcel_compat.cache.media import clip_to_media
from mlxcel_compat.cache.radix import RadixTrie

logger = logging.getLogger(__name__)

EVICTION_REASONS = ("lru", "ttl", "capacity")
UNPIN_REASONS = ("ttl", "bound")  # why a pin was demoted to an ordinary entry
REJECTION_REASONS = ("min_prefix", "oversized")
MISS_REASONS = ("no_candidate", "prefix_too_short")
# Candidates refused at adoption, counted: the stored token ids did not equal the request's prefix
# although the lookup (block hashes) vouched for it. Only a hash collision (or a bug) gets here.
ADOPTION_REJECT_REASONS = ("token_mismatch",)
# Why an overlapping entry was turned down (``LookupResult.detail``; trace only, not counted).
INELIGIBLE_REASONS = (
    "no_overlap",  # no stored entry of the bucket shares a first token with the request
    "partial_overlap_apc_off",  # only part of the entry matches and APC is off
    "partial_overlap_multimodal",  # no longer produced (multimodal matches are clipped to whole images); kept for the stats' shape
    "partial_overlap_not_trimmable",  # the entry's state cannot be cut (recurrent, wrapped window)
    "partial_overlap_no_chain",  # the entry's chain was dropped under --apc-num-blocks
    "not_trimmable_exact_repeat",  # whole entry, but its state cannot give the last token back
    "no_block_verified",  # the chains disagree from the first block and no token is common
    "below_min_prefix",  # eligible, but shorter than --prompt-cache-min-prefix
    "token_mismatch",  # the block hashes agreed but the stored tokens differ (a collision)
)

STAGE_SESSION = "session"
STAGE_CROSS_SESSION = "cross_session"


@dataclass(slots=True, eq=False, repr=False)
class CacheEntry:
    """One stored sequence state. Owned by the store; never mutate ``payload``."""

    id: int
    bucket: Bucket
    session_key: str
    tokens: tuple[int, ...]  # the exact tokens the payload holds state for
    payload: object  # opaque adapter object (detached KV state)
    nbytes: int  # logical bytes of the payload
    trimmable: bool  # payload can be cut to any shorter prefix
    created: float  # clock() at insert
    last_used: float  # clock() at insert or last hit; TTL counts from here
    hits: int = 0
    origin: str = "completion"  # who donated it ("completion", "boundary", ...)
    block_chain: list[BlockHash] | None = None  # APC chain; None when off or dropped
    digest: bytes = b""  # prompt_digest(bucket, session_key, tokens)
    use_tick: int = 0  # recency order that a coarse clock cannot tie
    pin_ttl: float = 0.0  # > 0: pinned (an explicit cache breakpoint) for this many seconds
    pin_until: float = 0.0  # clock() when the pin lapses; every hit or re-pin moves it
    # The adapter's (n, logits, nbytes of them) after the first n tokens, when the donor computed
    # them (its prompt's last position): a later prompt equal to tokens[:n] needs no forward pass
    # at all. The logits are opaque here, like the payload; their bytes are in ``nbytes`` too.
    final_logits: tuple[int, object, int] | None = None

    @property
    def payload_nbytes(self) -> int:
        """The payload's bytes alone (what the disk tier writes)."""
        return self.nbytes - (self.final_logits[2] if self.final_logits is not None else 0)

    @property
    def pinned(self) -> bool:
        return self.pin_ttl > 0

    def anon_repr(self) -> str:
        """A loggable description without tokens, session or payload."""
        return (
            f"CacheEntry(id={self.id}, tokens={len(self.tokens)}, nbytes={self.nbytes}, "
            f"trimmable={self.trimmable}, origin={self.origin}, hits={self.hits}, pinned={self.pinned})"
        )

    __repr__ = anon_repr


@dataclass(slots=True)
class CacheHit:
    """What the engine adopts: ``entry.payload`` cut to ``matched_len`` tokens."""

    entry: CacheEntry
    matched_len: int  # tokens to adopt; always <= len(request) - 1
    stage: str  # STAGE_SESSION or STAGE_CROSS_SESSION
    common_len: int  # longest common prefix of request and entry (trie length)
    verified_len: int  # length vouched for: whole entry, or the APC-verified length
    block_len: int = 0  # APC: the part verified by agreeing full blocks (<= verified_len);
    # verified_len - block_len tokens came from the token-by-token extension. Whole-entry
    # hits need no chain: block_len == verified_len.

    @property
    def partial(self) -> bool:
        """True when the entry overlaps the request only partly (an APC hit)."""
        return self.common_len < len(self.entry.tokens)

    @property
    def needs_trim(self) -> bool:
        """True when the payload holds more tokens than are adopted."""
        return self.matched_len < len(self.entry.tokens)


@dataclass(slots=True)
class LookupResult:
    """Outcome of one lookup: a hit, or the reason for the miss."""

    hit: CacheHit | None
    reason: str | None = None  # None on a hit; "disabled", "no_candidate", "prefix_too_short"
    best_len: int = 0  # best match found (before the clamp), also reported on a miss
    # On a miss: the deepest overlapping entry that was turned down, its common prefix with
    # the request and why (see INELIGIBLE_REASONS; "below_min_prefix" for prefix_too_short).
    candidate_id: int | None = None
    common_len: int = 0
    detail: str | None = None


@dataclass(slots=True)
class InsertResult:
    """Outcome of one insert."""

    inserted: bool
    entry_id: int | None = None
    reason: str | None = None  # not stored: "disabled", "min_prefix", "oversized"; stored: "duplicate" or None
    superseded: list[int] = field(default_factory=list)  # ids removed as dominated
    evicted: list[int] = field(default_factory=list)  # ids evicted to fit the caps


@dataclass(slots=True)
class StoreCounters:
    """Monotonic counters (never reset, as Prometheus counters must not go back)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    partial_hits: int = 0  # hits that adopt less than the whole entry
    apc_hits: int = 0  # hits on an entry that overlaps the request only partly (needs APC)
    apc_block_tokens: int = 0  # over apc_hits: tokens verified by agreeing full blocks
    apc_extended_tokens: int = 0  # over apc_hits: tokens added by the token-by-token extension
    hits_by_stage: dict[str, int] = field(default_factory=lambda: {STAGE_SESSION: 0, STAGE_CROSS_SESSION: 0})
    inserts: int = 0
    supersedes: int = 0
    prefix_tokens_reused: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTION_REASONS, 0))
    miss_reasons: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    adoption_rejects: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ADOPTION_REJECT_REASONS, 0))
    last_reject: dict[str, object] | None = None
    pins: int = 0  # entries stored pinned (explicit cache breakpoints)
    pin_refreshes: int = 0  # re-pins of an entry already stored
    pin_hits: int = 0  # hits on a pinned entry
    unpins: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNPIN_REASONS, 0))


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
        self._nbytes = 0
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

    # --- public API ---

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Logical bytes of all live entries."""
        return self._nbytes

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
        cleared = (len(self._entries), self._nbytes)
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
        self._nbytes += entry.nbytes
        trie = self._tries.get(entry.bucket)
        if trie is None:
            trie = self._tries[entry.bucket] = RadixTrie()
        trie.insert(entry.tokens, entry.id)

    def _remove_entry(self, entry: CacheEntry) -> None:
        self._pins.pop(entry.id, None)
        del self._entries[entry.id]
        del self._by_digest[entry.digest]
        self._nbytes -= entry.nbytes
        trie = self._tries[entry.bucket]
        trie.remove(entry.tokens, entry.id)
        if not len(trie):
            del self._tries[entry.bucket]  # stale buckets (old templates) leave nothing behind
        self._on_entry_removed(entry)

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
            expired.append(entry.id)
        return expired

    def _evict_to_caps_helper(self, keep: int | None = None) -> list[int]:
        """Evict least recently used entries down to max_entries, then capacity_bytes.

        Unpinned entries go first, pins only when nothing else is left; ``keep`` (the entry
        just inserted) never goes.
        """
        evicted: list[int] = []
        while len(self._entries) > self.max_entries or self._nbytes > self.capacity_bytes:
            others = [e for e in self._entries.values() if e.id != keep] if self._pins else None
            if others is None:
                oldest = next(iter(self._entries.values()))
            else:
                oldest = next((e for e in others if not e.pinned), others[0])
            self._remove_entry(oldest)
            self.counters.evictions["lru"] += 1  # byte-budget evictions fold into lru
            evicted.append(oldest.id)
            if self.on_evict is not None:
                self.on_evict(oldest)
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
        self, reason: str, best_len: int = 0, candidate: _Turndown | None = None
    ) -> LookupResult:
        self.counters.misses += 1
        self.counters.miss_reasons[reason] = self.counters.miss_reasons.get(reason, 0) + 1
        return self._miss_result(reason, best_len, candidate)

    @staticmethod
    def _miss_result(reason: str, best_len: int = 0, candidate: _Turndown | None = None) -> LookupResult:
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
            "bytes": self._nbytes,
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


@dataclass(slots=True)
class _Candidate:
    entry: CacheEntry
    usable: int  # adoptable length after the len - 1 clamp
    verified: int  # before the clamp
    common: int
    rank: tuple[int, bool, int]  # (usable, same session, recency): max wins
    block_len: int  # part of ``verified`` vouched for by agreeing full blocks


@dataclass(slots=True)
class _Turndown:
    """An overlapping entry that lookup could not use, kept to explain a miss."""

    entry_id: int | None
    common: int
    why: str  # one of INELIGIBLE_REASONS


@dataclass(slots=True)
class _Selection:
    best: _Candidate | None = None
    short_len: int = 0  # longest eligible match below min_prefix
    short: _Turndown | None = None  # the entry behind short_len
    turndown: _Turndown | None = None  # the deepest overlapping entry that was not eligible


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
    ) -> None:
        super().__init__(
            capacity_bytes=capacity_bytes, max_entries=max_entries, ttl_seconds=ttl_seconds,
            min_prefix=min_prefix, clock=clock, enabled=enabled,
            pin_max_entries=pin_max_entries, pin_capacity_bytes=pin_capacity_bytes,
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
                miss = ("no_candidate", 0, sel.turndown or _Turndown(None, 0, "no_overlap"))
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
        )
        return out

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
                        sel.turndown = _Turndown(entry_id, group.common_len, cand)
                elif cand.verified < self.min_prefix:
                    if sel.short is None or cand.verified > sel.short_len:
                        sel.short_len = cand.verified
                        sel.short = _Turndown(entry_id, group.common_len, "below_min_prefix")
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
