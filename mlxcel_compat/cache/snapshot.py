"""The session snapshot store: whole-cache snapshots for recurrent, hybrid and sliding families.

Some families keep state that is not a token-indexed KV table (SSM / linear-attention layers,
rotating sliding-window caches that have wrapped, chunked attention). Their state cannot be cut
back to an arbitrary prefix, so the prompt store's partial reuse does not apply. Their multi-turn
reuse goes through this store instead: whole-cache snapshots keyed by bucket *and* session.

Payloads are opaque (the engine's adapter takes and restores them); nothing here imports mlx.
Insert, supersede, LRU/TTL eviction, the byte budget and reset come from ``EntryStore``.

Lookup, for a request of ``n`` tokens, looks only at the snapshots of the request's bucket and
session. A snapshot of ``L`` tokens sharing ``common`` leading tokens with the request can be::

    whole restore     common == L and L <= n - 1        restore L tokens as stored
    partial restore   trimmable, text-only bucket       restore min(common, n - 1), cut the rest
    refused           otherwise                         classified below

and it must restore at least ``max(min_prefix, 1)`` tokens. The longest restore wins; ties go to
the most recently used snapshot. When nothing can be restored, the session's best snapshot
(longest common prefix, then most recent) gives the reason:

- ``no_candidate``: the session has no snapshot in this bucket (a cold session).
- ``snapshot_diverged``: a non-trimmable snapshot that is not a prefix of the request (the client
  rewrote or dropped history); restoring it would yield a state that never existed.
- ``exact_repeat``: a non-trimmable snapshot equal to the request: no token would be left to
  prefill, and the state cannot give one back.
- ``prefix_too_short``: the restorable part is below ``min_prefix``.
- ``multimodal``: a partial restore in a multimodal bucket (those adopt whole entries only).

Insert adds ``min_prefix`` and ``oversized``. Every rejection is counted by reason and recorded as
``last_reject`` with its geometry and a per-store tag of the session (never the session key).

Origins: ``boundary`` snapshots are taken at the history boundary and extended by the warm-up;
``completion`` snapshots hold prompt + generated tokens. Supersede acts within one session and
one origin only. One exception is inherited from the shared digest index: a snapshot with the
very same tokens as an existing one of the session replaces it whatever its origin (same tokens,
same state: keeping both would only spend bytes).

The store is not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from blake3 import blake3

from mlxcel_compat.cache.key import Bucket
from mlxcel_compat.cache.records import STAGE_SESSION, CacheEntry, CacheHit, InsertResult
from mlxcel_compat.cache.store import EntryStore

logger = logging.getLogger(__name__)

ORIGIN_BOUNDARY = "boundary"
ORIGIN_COMPLETION = "completion"
SNAPSHOT_ORIGINS = (ORIGIN_BOUNDARY, ORIGIN_COMPLETION)

# Lookup refusals, then insert rejections; together the keys of ``snapshot_rejections``.
SNAPSHOT_MISS_REASONS = ("no_candidate", "snapshot_diverged", "exact_repeat", "prefix_too_short", "multimodal")
SNAPSHOT_INSERT_REJECTIONS = ("min_prefix", "oversized")
SNAPSHOT_REJECTION_REASONS = SNAPSHOT_MISS_REASONS + SNAPSHOT_INSERT_REJECTIONS

SNAPSHOT_CAPACITY_FLOOR = 512 * 1024**2  # bytes; the model-aware default never goes below it
DEFAULT_SNAPSHOT_MAX_ENTRIES = 4096
DEFAULT_SNAPSHOT_TTL_SECONDS = 7200.0

# mlx-lm cache classes by what their state is. Anything else counts as a snapshot family.
DENSE_KV_KINDS = frozenset({"KVCache", "QuantizedKVCache", "ConcatenateKVCache", "BatchKVCache"})
RECURRENT_KINDS = frozenset({"ArraysCache", "MambaCache"})
SLIDING_KINDS = frozenset({"RotatingKVCache", "BatchRotatingKVCache", "ChunkedKVCache"})
CONTAINER_KINDS = frozenset({"CacheList"})

# A layer's kind: a class name, "CacheList(ArraysCache,KVCache)", or a nested list of kinds.
LayerKind = str | Sequence["LayerKind"]

_KIND_NAME = re.compile(r"[A-Za-z_][\w.]*")
_COMPARE_CHUNK = 256


@dataclass(slots=True)
class SnapshotLookup:
    """Outcome of one snapshot lookup: what to restore, or why nothing is."""

    hit: CacheHit | None  # restore hit.entry.payload cut to hit.matched_len tokens; None on a miss
    reason: str | None = None  # None on a hit; a SNAPSHOT_MISS_REASONS value, or "disabled"
    common_prefix: int = 0  # common prefix of the request and the chosen / best snapshot
    stored_len: int = 0  # token count of that snapshot (0 when the session has none)
    request_len: int = 0


@dataclass(slots=True)
class _Candidate:
    entry: CacheEntry
    common: int
    usable: int  # tokens that can be restored; 0 when refused
    reason: str | None  # why it is refused; None when usable


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples (compared in C, chunk by chunk)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i : i + _COMPARE_CHUNK] == b[i : i + _COMPARE_CHUNK]:
        i += _COMPARE_CHUNK
    while a[i] == b[i]:  # stops inside this chunk: it holds the first difference
        i += 1
    return i


def snapshot_capacity_default(entry_bytes: int, left_bytes: int) -> int:
    """The model-aware byte budget of the snapshot store.

    ``max(512 MiB, min(6 * entry, left / 4))``, raised to one whole entry when one entry fits in
    ``left / 2``. The caller applies it only when neither flag nor env set a budget.

    Args:
        entry_bytes: snapshot size of one sequence at the representative length.
        left_bytes: memory left after the model's own footprint (a negative estimate counts as 0).

    Returns:
        The budget in bytes.
    """
    if entry_bytes < 0:
        raise ValueError(f"entry_bytes must be >= 0, got {entry_bytes}")
    left = max(left_bytes, 0)
    capacity = max(SNAPSHOT_CAPACITY_FLOOR, min(6 * entry_bytes, left // 4))
    if 2 * entry_bytes <= left:
        capacity = max(capacity, entry_bytes)
    return capacity


def is_snapshot_family(layer_kinds: Sequence[LayerKind]) -> bool:
    """Whether a model's cache needs the snapshot store (its state cannot be cut to any prefix).

    Args:
        layer_kinds: one kind per layer of the mlx-lm cache, each the class name
            (``"KVCache"``, ``type(layer).__name__``). A ``CacheList`` is given either as a string
            ``"CacheList(ArraysCache,KVCache)"`` or as a nested list of its children's kinds.
            Module-qualified names (``"mlx_lm.models.cache.KVCache"``) are accepted.

    Returns:
        True when any layer is recurrent (``ArraysCache``, ``MambaCache``), sliding or chunked
        (``RotatingKVCache``, ``ChunkedKVCache``) or of a class not known to be a plain KV table
        (whole snapshots are right for any state); False for dense KV only (and for no layers).
    """
    stack: list[LayerKind] = list(layer_kinds)
    while stack:
        kind = stack.pop()
        if not isinstance(kind, str):
            stack.extend(kind)
            continue
        for name in _KIND_NAME.findall(kind):
            name = name.rsplit(".", 1)[-1]
            if name not in DENSE_KV_KINDS and name not in CONTAINER_KINDS:
                return True
    return False


class SnapshotStore(EntryStore):
    """Whole-cache snapshots per bucket and session, with their own budget, cap and TTL."""

    capacity_flag = "--prompt-cache-snapshot-capacity-bytes"
    store_label = "session snapshot"

    def __init__(
        self,
        *,
        capacity_bytes: int,
        max_entries: int = DEFAULT_SNAPSHOT_MAX_ENTRIES,
        ttl_seconds: float = DEFAULT_SNAPSHOT_TTL_SECONDS,
        min_prefix: int = 32,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
    ) -> None:
        super().__init__(
            capacity_bytes=capacity_bytes, max_entries=max_entries, ttl_seconds=ttl_seconds,
            min_prefix=min_prefix, clock=clock, enabled=enabled,
        )
        self.counters.miss_reasons = dict.fromkeys(SNAPSHOT_MISS_REASONS, 0)
        self.num_warmups_run = 0
        self.num_warmups_skipped = 0
        # Which mechanism served and fed the store (boundary vs completion snapshots).
        self.hits_by_origin = dict.fromkeys(SNAPSHOT_ORIGINS, 0)
        self.inserts_by_origin = dict.fromkeys(SNAPSHOT_ORIGINS, 0)
        self._sessions: dict[tuple[Bucket, str], set[int]] = {}
        self._tag_key = os.urandom(32)  # per store: tags correlate log lines, never reveal keys

    # --- public API ---

    def insert(
        self,
        bucket: Bucket,
        session_key: str,
        tokens: Sequence[int],
        payload: object,
        nbytes: int,
        trimmable: bool,
        origin: str = ORIGIN_COMPLETION,
    ) -> InsertResult:
        """Store a whole-cache snapshot of a session.

        Args:
            bucket: the request's bucket.
            session_key: the request's session key.
            tokens: exactly the tokens the snapshot holds state for.
            payload: opaque snapshot; the store only keeps a reference.
            nbytes: logical bytes of ``payload``.
            trimmable: every layer can drop tokens from its end (e.g. a sliding cache not wrapped).
            origin: ``"boundary"`` (history boundary and its warm-up extensions) or ``"completion"``.

        Returns:
            As ``EntryStore.insert``; superseded ids are the session's same-origin prefixes.
        """
        if origin not in SNAPSHOT_ORIGINS:
            raise ValueError(f"origin must be one of {SNAPSHOT_ORIGINS}, got {origin!r}")
        result = super().insert(bucket, session_key, tokens, payload, nbytes, trimmable, origin)
        if not result.inserted and result.reason in SNAPSHOT_INSERT_REJECTIONS:
            details = self.counters.last_reject or {}
            self._set_last_reject(result.reason, session_key, None, len(tokens), None, details)
        return result

    def lookup(
        self, bucket: Bucket, session_key: str, tokens: Sequence[int], *, record: bool = True
    ) -> SnapshotLookup:
        """Find the session's snapshot to restore before prefilling ``tokens``.

        Only snapshots of the same bucket *and* session are considered. A hit refreshes the
        snapshot's recency and TTL.

        Args:
            bucket: the request's bucket.
            session_key: the request's session key.
            tokens: the full rendered prompt.
            record: False for the engine's own probes (warm-up): no counters, no ``last_reject``,
                no recency change, so the stats describe requests only.

        Returns:
            A ``SnapshotLookup``; on a hit ``hit.matched_len`` leaves at least one token to
            prefill and ``hit.needs_trim`` says whether the payload must be cut.
        """
        toks = tokens if isinstance(tokens, tuple) else tuple(tokens)
        if not self.enabled:
            return SnapshotLookup(hit=None, reason="disabled", request_len=len(toks))
        now = self._clock()
        self._sweep_helper(now)
        ids = self._sessions.get((bucket, session_key), ())
        cands = [self._evaluate_helper(self._entries[i], bucket, toks) for i in ids]
        usable = [c for c in cands if c.reason is None]
        if usable:
            best = max(usable, key=lambda c: (c.usable, c.entry.use_tick))
            return self._hit_helper(best, session_key, toks, now, record)
        if not cands:
            return self._miss_helper("no_candidate", None, session_key, toks, record)
        best = max(cands, key=lambda c: (c.common, c.entry.use_tick))
        assert best.reason is not None, f"{best.usable=}"
        return self._miss_helper(best.reason, best, session_key, toks, record)

    def record_warmup(self, run: bool) -> None:
        """Count one background warm-up of a session's next turn: run, or skipped."""
        if run:
            self.num_warmups_run += 1
        else:
            self.num_warmups_skipped += 1

    def session_tag(self, session_key: str) -> str:
        """A short per-store tag of a session key, safe for logs and stats."""
        return blake3(session_key.encode("utf-8"), key=self._tag_key).hexdigest(length=8)

    def stats(self) -> dict[str, object]:
        """The ``snapshot_*`` fields of ``GET /v1/cache/stats`` (same keys as ``disabled_stats``)."""
        c = self.counters
        rejections = {r: c.miss_reasons.get(r, 0) + c.rejections.get(r, 0) for r in SNAPSHOT_REJECTION_REASONS}
        return {
            "snapshot_enabled": self.enabled,
            "snapshot_entries": len(self._entries),
            "snapshot_entries_by_lora_id": self.entries_by_lora_id(),
            "snapshot_bytes": self._nbytes,
            "snapshot_capacity_bytes": self.capacity_bytes,
            "snapshot_max_entries": self.max_entries,
            "snapshot_ttl_seconds": self.ttl_seconds,
            "snapshot_lookups": c.lookups,
            "snapshot_hits": c.hits,
            "snapshot_misses": c.misses,
            "snapshot_hit_rate": c.hits / c.lookups if c.lookups else 0.0,
            "snapshot_partial_hits": c.partial_hits,
            "snapshot_tokens_restored_total": c.prefix_tokens_reused,
            "snapshot_inserts": c.inserts,
            "snapshot_inserts_by_origin": dict(self.inserts_by_origin),
            "snapshot_hits_by_origin": dict(self.hits_by_origin),
            "snapshot_supersedes": c.supersedes,
            "snapshot_evictions_lru": c.evictions["lru"],
            "snapshot_evictions_ttl": c.evictions["ttl"],
            "snapshot_warmups_run": self.num_warmups_run,
            "snapshot_warmups_skipped": self.num_warmups_skipped,
            "snapshot_rejections": rejections,
            "snapshot_last_reject": dict(c.last_reject) if c.last_reject is not None else None,
        }

    @staticmethod
    def disabled_stats() -> dict[str, object]:
        """The stats shape when the store is off: every key present, all zero."""
        out = SnapshotStore(capacity_bytes=0, max_entries=1, ttl_seconds=0, min_prefix=0, enabled=False).stats()
        out.update(snapshot_max_entries=0, snapshot_ttl_seconds=0.0)
        return out

    # --- hooks ---

    def _after_insert(self, entry: CacheEntry) -> None:
        self._sessions.setdefault((entry.bucket, entry.session_key), set()).add(entry.id)
        self.inserts_by_origin[entry.origin] += 1

    def _on_entry_removed(self, entry: CacheEntry) -> None:
        key = (entry.bucket, entry.session_key)
        ids = self._sessions.get(key)
        if ids is None:  # removed before _after_insert ran (cannot happen today; stay safe)
            return
        ids.discard(entry.id)
        if not ids:
            del self._sessions[key]

    def _on_reset(self) -> None:
        self._sessions.clear()

    # --- internal helpers ---

    def _evaluate_helper(self, entry: CacheEntry, bucket: Bucket, toks: tuple[int, ...]) -> _Candidate:
        """How much of ``entry`` a request of ``toks`` may restore, or why it may not."""
        length = len(entry.tokens)
        limit = len(toks) - 1  # the last prompt token is always prefilled for fresh logits
        common = common_prefix_len(entry.tokens, toks)
        if common == length and length <= limit:
            usable = length
        elif not entry.trimmable:
            reason = "exact_repeat" if common == length else "snapshot_diverged"
            return _Candidate(entry, common, 0, reason)
        elif not bucket.text_only:
            return _Candidate(entry, common, 0, "multimodal")  # would need a cut: whole entries only
        else:
            usable = min(common, limit)
        if usable < max(self.min_prefix, 1):
            return _Candidate(entry, common, 0, "prefix_too_short")
        return _Candidate(entry, common, usable, None)

    def _hit_helper(
        self, best: _Candidate, session_key: str, toks: tuple[int, ...], now: float, record: bool
    ) -> SnapshotLookup:
        hit = CacheHit(best.entry, best.usable, STAGE_SESSION, best.common, best.common)
        if record:
            self.counters.lookups += 1
            self._record_hit(hit, now)
            self.hits_by_origin[best.entry.origin] += 1
        logger.debug(
            "session snapshot hit: entry=%d session=%s restore=%d common=%d stored=%d request=%d origin=%s",
            best.entry.id, self.session_tag(session_key), best.usable, best.common,
            len(best.entry.tokens), len(toks), best.entry.origin,
        )
        return SnapshotLookup(hit, None, best.common, len(best.entry.tokens), len(toks))

    def _miss_helper(
        self, reason: str, best: _Candidate | None, session_key: str, toks: tuple[int, ...], record: bool
    ) -> SnapshotLookup:
        common = best.common if best is not None else 0
        stored = len(best.entry.tokens) if best is not None else 0
        if record:
            self.counters.lookups += 1
            self._record_miss(reason, common)
            self._set_last_reject(reason, session_key, common, stored, len(toks), {})
        logger.debug(
            "session snapshot refused: reason=%s session=%s common=%d stored=%d request=%d",
            reason, self.session_tag(session_key), common, stored, len(toks),
        )
        return SnapshotLookup(None, reason, common, stored, len(toks))

    def _set_last_reject(
        self,
        reason: str,
        session_key: str,
        common: int | None,
        stored: int,
        request: int | None,
        extra: dict[str, object],
    ) -> None:
        """Record a rejection's geometry; ``None`` marks a field that does not apply (inserts)."""
        record: dict[str, object] = {
            "reason": reason,
            "common_prefix": common,
            "stored_len": stored,
            "request_len": request,
            "session": self.session_tag(session_key),
        }
        record.update((k, v) for k, v in extra.items() if k not in record)
        self.counters.last_reject = record
