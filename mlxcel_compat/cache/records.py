"""The prompt-cache stores' plain records: entries, hits, lookup and insert outcomes, counters.

Also the vocabularies of reasons (evictions, rejections, misses, turned-down candidates); the
counted ones key the counters of ``GET /v1/cache/stats``. The entry store (``cache/store.py``),
the prompt store (``cache/prompt_store.py``), the snapshot store (``cache/snapshot.py``) and their
users share these records. Nothing here imports mlx.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcel_compat.cache.block_hash import BlockHash
from mlxcel_compat.cache.key import Bucket

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


@dataclass(slots=True)
class Turndown:
    """An overlapping entry that lookup could not use, kept to explain a miss."""

    entry_id: int | None
    common: int
    why: str  # one of INELIGIBLE_REASONS
