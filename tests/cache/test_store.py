"""PromptCacheStore with fake payloads and a fake clock: budgets, lookup stages, APC."""

from __future__ import annotations

import logging

import pytest

from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.key import (
    multimodal_digest,
)
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from mlxcel_compat.cache.records import CacheEntry
from tests.cache.fakes import FakeClock, make_bucket


def make_store(clock: FakeClock | None = None, apc: ApcConfig | None = None, **kw: int) -> PromptCacheStore:
    params: dict[str, int] = dict(capacity_bytes=10_000, max_entries=16, ttl_seconds=100, min_prefix=4)
    params.update(kw)
    return PromptCacheStore(clock=clock or FakeClock(), apc=apc, **params)  # type: ignore[arg-type]


def seq(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


B = make_bucket()


def put(store: PromptCacheStore, tokens: tuple[int, ...], session: str = "s1", nbytes: int = 10, trimmable: bool = True, origin: str = "completion") -> int:
    result = store.insert(B, session, tokens, payload=f"kv{len(tokens)}", nbytes=nbytes, trimmable=trimmable, origin=origin)
    assert result.inserted and result.entry_id is not None, result
    return result.entry_id


# --- basic hits ---


def test_whole_prefix_hit_adopts_entry_length() -> None:
    store = make_store()
    eid = put(store, seq(40))
    res = store.lookup(B, "s1", seq(50))
    assert res.hit is not None and res.reason is None
    assert (res.hit.entry.id, res.hit.matched_len, res.hit.stage, res.hit.common_len) == (eid, 40, "session", 40)
    assert not res.hit.needs_trim and res.hit.entry.payload == "kv40"
    assert res.hit.entry.hits == 1


def test_exact_repeat_leaves_one_token_to_prefill() -> None:
    store = make_store()
    put(store, seq(40))
    res = store.lookup(B, "s1", seq(40))
    assert res.hit is not None and res.hit.matched_len == 39 and res.hit.needs_trim


def test_misses_have_reasons() -> None:
    store = make_store()
    assert store.lookup(B, "s1", seq(40)).reason == "no_candidate"  # empty store
    put(store, seq(40))
    assert store.lookup(make_bucket("other-model"), "s1", seq(50)).reason == "no_candidate"
    assert store.lookup(B, "s1", seq(50, start=1)).reason == "no_candidate"
    # Without APC a partial overlap (entry longer than the shared part) is not eligible.
    assert store.lookup(B, "s1", seq(30) + (-1,) * 20).reason == "no_candidate"
    assert store.lookup(B, "s1", seq(20)).reason == "no_candidate"  # request is a prefix of the entry
    assert store.lookup(B, "s1", (0,)).reason == "no_candidate"  # nothing left to adopt
    assert store.stats()["miss_reasons"] == {"no_candidate": 6, "prefix_too_short": 0}


def test_disabled_store() -> None:
    store = PromptCacheStore(capacity_bytes=100, enabled=False)
    assert store.insert(B, "s", seq(40), "kv", 1, True).reason == "disabled"
    assert store.lookup(B, "s", seq(40)).reason == "disabled"
    assert len(store) == 0 and store.stats()["lookups"] == 0


# --- min_prefix ---


def test_min_prefix_on_insert() -> None:
    store = make_store(min_prefix=32)
    result = store.insert(B, "s1", seq(31), "kv", 10, True)
    assert not result.inserted and result.reason == "min_prefix" and len(store) == 0
    stats = store.stats()
    assert stats["rejections"] == {"min_prefix": 1, "oversized": 0}
    assert stats["last_reject"] == {"reason": "min_prefix", "tokens": 31, "min_prefix": 32}
    assert store.insert(B, "s1", seq(32), "kv", 10, True).inserted


def test_min_prefix_on_lookup_with_partial_overlap() -> None:
    store = make_store(apc=ApcConfig(), min_prefix=32)
    put(store, seq(64))
    res = store.lookup(B, "s1", seq(20) + (-1,) * 40)
    assert res.hit is None and res.reason == "prefix_too_short" and res.best_len == 20
    hit = store.lookup(B, "s1", seq(40) + (-1,) * 40).hit
    assert hit is not None and hit.matched_len == 40


def test_min_prefix_applies_per_candidate() -> None:
    store = make_store(apc=ApcConfig(), min_prefix=32)
    request = seq(32)
    mine = put(store, seq(31) + (-1,) * 10, session="me")  # shares 31 < 32 tokens
    theirs = put(store, request, session="other")  # shares all 32
    # Both would adopt 31 after the clamp, but only the cross-session match reaches min_prefix.
    hit = store.lookup(B, "me", request).hit
    assert hit is not None and hit.entry.id == theirs and hit.matched_len == 31
    assert store.get(mine) is not None


# --- budgets ---


def test_lru_order_and_entry_cap() -> None:
    store = make_store(max_entries=3)
    a = put(store, seq(10, 100), nbytes=1)
    b = put(store, seq(10, 200), nbytes=1)
    c = put(store, seq(10, 300), nbytes=1)
    assert store.lookup(B, "s1", seq(11, 100)).hit is not None  # a becomes most recent
    assert [e.id for e in store.entries()] == [b, c, a]
    d = store.insert(B, "s1", seq(10, 400), "kv", 1, True)
    assert d.evicted == [b]
    assert [e.id for e in store.entries()] == [c, a, d.entry_id]
    assert store.lookup(B, "s1", seq(11, 200)).reason == "no_candidate"  # gone from the trie too
    assert store.stats()["evictions"] == {"lru": 1, "ttl": 0, "capacity": 0}


def test_byte_cap_evicts_lru_and_folds_into_lru_counter() -> None:
    store = make_store(capacity_bytes=100)
    a = put(store, seq(10, 100), nbytes=40)
    b = put(store, seq(10, 200), nbytes=40)
    result = store.insert(B, "s1", seq(10, 300), "kv", 70, True)
    assert result.evicted == [a, b]  # 40 + 40 + 70 > 100, then 40 + 70 > 100
    assert store.nbytes == 70 and len(store) == 1
    assert store.stats()["evictions"] == {"lru": 2, "ttl": 0, "capacity": 0}


def test_ttl_with_fake_clock_and_hit_refresh() -> None:
    clock = FakeClock()
    store = make_store(clock=clock, ttl_seconds=10)
    eid = put(store, seq(20))
    clock.advance(9)
    assert store.lookup(B, "s1", seq(21)).hit is not None  # TTL restarts here
    clock.advance(9)
    assert store.lookup(B, "s1", seq(21)).hit is not None  # 18 s after insert, 9 s after the hit
    clock.advance(10)
    res = store.lookup(B, "s1", seq(21))
    assert res.reason == "no_candidate" and store.get(eid) is None
    assert store.stats()["evictions"]["ttl"] == 1


def test_ttl_sweep_and_zero_ttl() -> None:
    clock = FakeClock()
    store = make_store(clock=clock, ttl_seconds=10)
    old = put(store, seq(20, 0))
    clock.advance(5)
    new = put(store, seq(20, 100))
    clock.advance(6)
    assert store.sweep() == [old] and [e.id for e in store.entries()] == [new]
    forever = make_store(clock=clock, ttl_seconds=0)
    put(forever, seq(20))
    clock.advance(10**9)
    assert forever.sweep() == [] and len(forever) == 1


def test_oversized_rejected_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(capacity_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="mlxcel_compat.cache.store"):
        first = store.insert(B, "s1", seq(40), "kv", 5000, True)
        second = store.insert(B, "s1", seq(50), "kv", 6000, True)
    assert not first.inserted and first.reason == "oversized" and second.reason == "oversized"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "5000" in warnings[0].getMessage() and "--prompt-cache-capacity-bytes" in warnings[0].getMessage()
    stats = store.stats()
    assert stats["rejections"]["oversized"] == 2 and len(store) == 0
    assert stats["last_reject"] == {"reason": "oversized", "nbytes": 6000, "capacity_bytes": 1000}


# --- supersede ---


def test_supersede_same_session_and_origin_only() -> None:
    store = make_store()
    base = put(store, seq(20))
    other_session = put(store, seq(20), session="s2")
    other_origin = put(store, seq(25), origin="boundary")  # also a prefix of the new entry
    result = store.insert(B, "s1", seq(30), "kv", 10, True)
    assert result.superseded == [base] and result.evicted == []
    assert {e.id for e in store.entries()} == {other_session, other_origin, result.entry_id}
    stats = store.stats()
    assert stats["supersedes"] == 1 and stats["evictions"] == {"lru": 0, "ttl": 0, "capacity": 0}
    # A diverging (not extending) entry of the same session does not supersede.
    assert store.insert(B, "s1", seq(10) + (-5,) * 10, "kv", 10, True).superseded == []


def test_identical_key_is_replaced() -> None:
    store = make_store()
    old = put(store, seq(20), nbytes=10)
    result = store.insert(B, "s1", seq(20), "kv-new", 30, True)
    assert result.inserted and result.reason == "duplicate" and result.superseded == [old]
    assert len(store) == 1 and store.nbytes == 30
    hit = store.lookup(B, "s1", seq(25)).hit
    assert hit is not None and hit.entry.payload == "kv-new"


# --- two-stage lookup ---


def test_same_session_preferred_on_tie() -> None:
    store = make_store()
    mine = put(store, seq(20), session="me")
    put(store, seq(20), session="other")  # more recent, same length
    hit = store.lookup(B, "me", seq(30)).hit
    assert hit is not None and hit.entry.id == mine and hit.stage == "session"


def test_cross_session_only_when_strictly_longer() -> None:
    store = make_store()
    put(store, seq(20), session="me")
    longer = put(store, seq(25), session="other")
    hit = store.lookup(B, "me", seq(30)).hit
    assert hit is not None and hit.entry.id == longer and hit.stage == "cross_session" and hit.matched_len == 25
    hit = store.lookup(B, "stranger", seq(30)).hit
    assert hit is not None and hit.entry.id == longer and hit.stage == "cross_session"


def test_ties_inside_a_stage_go_to_most_recently_used() -> None:
    store = make_store()
    # Both adopt 29 tokens of a 30-token request: one after the clamp, one whole.
    full = put(store, seq(30), origin="completion")
    short = put(store, seq(29), origin="boundary")  # other origin: no supersede
    hit = store.lookup(B, "s1", seq(30)).hit
    assert hit is not None and hit.entry.id == short and hit.matched_len == 29
    store.lookup(B, "s1", seq(31))  # 30 tokens win outright and make `full` most recent
    hit = store.lookup(B, "s1", seq(30)).hit
    assert hit is not None and hit.entry.id == full and hit.matched_len == 29
    # Same among other sessions.
    a = put(store, seq(25, 500), session="x")
    b = put(store, seq(25, 500), session="y")
    assert store.lookup(B, "z", seq(26, 500)).hit.entry.id == b  # type: ignore[union-attr]
    store.lookup(B, "x", seq(26, 500))
    assert store.lookup(B, "z", seq(26, 500)).hit.entry.id == a  # type: ignore[union-attr]


# --- APC partial reuse ---

SHARED = seq(200, 1)
ENTRY = SHARED + seq(100, 5000)
REQUEST = SHARED + seq(50, 9000)


@pytest.mark.parametrize("apc, expected", [(ApcConfig(), 200), (ApcConfig(hash_name="blake3", block_size=7), 200), (None, 0)])
def test_partial_overlap_of_200_tokens(apc: ApcConfig | None, expected: int) -> None:
    store = make_store(apc=apc, min_prefix=32)
    put(store, ENTRY)
    res = store.lookup(B, "s1", REQUEST)
    matched = res.hit.matched_len if res.hit is not None else 0
    assert matched == expected
    if res.hit is not None:
        assert res.hit.needs_trim and res.hit.common_len == 200 and res.hit.verified_len == 200
        assert store.stats()["partial_hits"] == 1


def test_block_and_token_extension_lengths_are_reported() -> None:
    store = make_store(apc=ApcConfig(block_size=16))
    put(store, ENTRY)
    hit = store.lookup(B, "s1", REQUEST).hit
    # 200 = 12 agreeing blocks (192) + 8 tokens verified one by one in block 13.
    assert hit is not None and hit.partial and (hit.block_len, hit.verified_len, hit.matched_len) == (192, 200, 200)
    whole = store.lookup(B, "s1", ENTRY + (1,)).hit
    assert whole is not None and not whole.partial and whole.block_len == whole.verified_len == len(ENTRY)
    stats = store.stats()
    assert (stats["apc_hits"], stats["apc_block_tokens_total"], stats["apc_extended_tokens_total"]) == (1, 192, 8)


@pytest.mark.parametrize(
    "apc, trimmable, request_tokens, reason, detail, common",
    [
        (None, True, REQUEST, "no_candidate", "partial_overlap_apc_off", 200),
        (ApcConfig(), False, REQUEST, "no_candidate", "partial_overlap_not_trimmable", 200),
        (ApcConfig(), False, ENTRY, "no_candidate", "not_trimmable_exact_repeat", len(ENTRY)),
        (ApcConfig(), True, seq(40, 70000), "no_candidate", "no_overlap", 0),
        (ApcConfig(), True, SHARED[:20] + (-5,) * 30, "prefix_too_short", "below_min_prefix", 20),
    ],
)
def test_misses_name_the_closest_entry_and_why(
    apc: ApcConfig | None, trimmable: bool, request_tokens: tuple[int, ...], reason: str, detail: str, common: int
) -> None:
    store = make_store(apc=apc, min_prefix=32)
    eid = put(store, ENTRY, trimmable=trimmable)
    res = store.lookup(B, "s1", request_tokens)
    assert res.hit is None and (res.reason, res.detail, res.common_len) == (reason, detail, common)
    assert res.candidate_id == (None if detail == "no_overlap" else eid)
    if reason == "prefix_too_short":
        assert res.best_len == 20


def test_partial_overlap_with_a_dropped_chain_is_explained() -> None:
    store = make_store(apc=ApcConfig(num_blocks=20))
    a = put(store, ENTRY, session="a")  # 19 blocks
    put(store, seq(64, 7000), session="b")  # 4 more: over the bound, a loses its chain
    res = store.lookup(B, "s1", REQUEST)
    assert (res.reason, res.detail, res.candidate_id) == ("no_candidate", "partial_overlap_no_chain", a)


@pytest.mark.parametrize(
    "spans, expected",
    [
        ((), 200),  # no image near the divergence: the 200 shared tokens
        (((150, 220),), 150),  # the match would end inside an image: cut back to its first token
        (((100, 150),), 200),  # the image is whole inside the match
        (((200, 260),), 200),  # the image starts exactly at the split point
        (((10, 40), (190, 230)), 190),  # the second image would be split
    ],
)
def test_multimodal_partial_overlap_never_ends_inside_an_image(spans: tuple[tuple[int, int], ...], expected: int) -> None:
    store = make_store(apc=ApcConfig())
    mm = make_bucket(mm_digest=multimodal_digest([b"image"]))
    store.insert(mm, "s1", ENTRY, "kv", 10, True)
    hit = store.lookup(mm, "s1", REQUEST, spans=spans).hit
    assert hit is not None and hit.matched_len == expected


def test_an_image_at_the_start_leaves_nothing_to_adopt() -> None:
    store = make_store(apc=ApcConfig())
    mm = make_bucket(mm_digest=multimodal_digest([b"image"]))
    store.insert(mm, "s1", ENTRY, "kv", 10, True)
    assert store.lookup(mm, "s1", REQUEST, spans=((0, 250),)).hit is None


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"apc": ApcConfig()}, None),
        ({}, "flag"),
        ({"apc_disabled_reason": "recurrent_family"}, "recurrent_family"),
        ({"apc": ApcConfig(), "enabled": False}, "cache_off"),  # APC needs the prompt cache
    ],
)
def test_apc_disabled_reason_in_stats(kwargs: dict[str, object], reason: str | None) -> None:
    stats = PromptCacheStore(capacity_bytes=100, **kwargs).stats()  # type: ignore[arg-type]
    assert stats["apc_disabled_reason"] == reason
    assert stats["apc_enabled"] is (reason is None)
    assert PromptCacheStore.disabled_stats()["apc_disabled_reason"] == "cache_off"


def test_partial_prefers_deeper_overlap_over_shorter_whole_prefix() -> None:
    store = make_store(apc=ApcConfig())
    whole = put(store, SHARED[:100], session="s2")
    partial = put(store, ENTRY, session="s3")
    hit = store.lookup(B, "s1", REQUEST).hit
    assert hit is not None and hit.entry.id == partial and hit.matched_len == 200
    hit = store.lookup(B, "s2", SHARED[:150] + (-1,)).hit
    assert hit is not None and hit.entry.id == partial and hit.stage == "cross_session"
    assert store.get(whole) is not None


def test_request_inside_longer_entry_is_clamped() -> None:
    store = make_store(apc=ApcConfig())
    put(store, ENTRY)
    hit = store.lookup(B, "s1", ENTRY[:120]).hit
    assert hit is not None and hit.matched_len == 119 and hit.common_len == 120


def test_non_trimmable_entries_never_match_partially() -> None:
    store = make_store(apc=ApcConfig())
    put(store, ENTRY, trimmable=False)
    assert store.lookup(B, "s1", REQUEST).reason == "no_candidate"
    assert store.lookup(B, "s1", ENTRY).reason == "no_candidate"  # exact repeat needs a token back
    hit = store.lookup(B, "s1", ENTRY + (7,)).hit
    assert hit is not None and hit.matched_len == len(ENTRY) and not hit.needs_trim
    assert store.stats()["apc_active_entries"] == 0  # no chain kept for it


def test_multimodal_bucket_is_its_own_and_a_whole_entry_is_adopted() -> None:
    store = make_store(apc=ApcConfig())
    mm = make_bucket(mm_digest=multimodal_digest([b"image"]))
    store.insert(mm, "s1", ENTRY, "kv", 10, True)
    hit = store.lookup(mm, "s1", ENTRY + (1,), spans=((20, 60),)).hit
    assert hit is not None and hit.matched_len == len(ENTRY)
    assert store.lookup(B, "s1", ENTRY + (1,)).reason == "no_candidate"  # other bucket


def test_apc_block_index_stats_and_bound() -> None:
    store = make_store(apc=ApcConfig(block_size=16, num_blocks=40))
    a = put(store, SHARED + (1,) * 40, session="a")  # 240 tokens = 15 blocks
    stats = store.stats()
    assert (stats["total_blocks_stored"], stats["unique_block_hashes"], stats["apc_active_entries"]) == (15, 15, 1)
    put(store, SHARED + (2,) * 40, session="b")  # shares the 12 full blocks of SHARED
    stats = store.stats()
    assert (stats["total_blocks_stored"], stats["unique_block_hashes"], stats["apc_active_entries"]) == (30, 18, 2)
    assert stats["total_blocks_stored"] - stats["unique_block_hashes"] == 12
    put(store, seq(200, 7000), session="c")  # 13 blocks: 43 > 40, so the LRU entry (a) loses its chain
    stats = store.stats()
    assert (stats["total_blocks_stored"], stats["apc_active_entries"]) == (28, 2)
    entry_a = store.get(a)
    assert entry_a is not None and entry_a.block_chain is None
    # a keeps whole-prefix eligibility but no longer serves partial overlaps.
    assert store.lookup(B, "a", SHARED + (1,) * 40 + (9,)).hit.entry.id == a  # type: ignore[union-attr]
    hit = store.lookup(B, "a", SHARED + (3,)).hit
    assert hit is not None and hit.entry.id != a and hit.stage == "cross_session"


def test_entry_removal_releases_blocks() -> None:
    store = make_store(apc=ApcConfig(), max_entries=1)
    put(store, SHARED, session="a")
    put(store, seq(64, 9000), session="b")  # evicts the first entry
    stats = store.stats()
    assert (stats["total_blocks_stored"], stats["unique_block_hashes"], stats["apc_active_entries"]) == (4, 4, 1)


# --- stats, reset, shape ---


def test_stats_arithmetic() -> None:
    store = make_store()
    put(store, seq(20), nbytes=100)
    put(store, seq(30, 100), nbytes=250)
    store.lookup(B, "s1", seq(25))  # hit: 20
    store.lookup(B, "s1", seq(30, 100))  # hit: 29 (clamped)
    store.lookup(B, "s1", seq(5, 900))  # miss
    stats = store.stats()
    assert stats["entries"] == 2 and stats["bytes"] == 350 == store.nbytes
    assert (stats["lookups"], stats["hits"], stats["misses"]) == (3, 2, 1)
    assert stats["hit_rate"] == pytest.approx(2 / 3)
    assert stats["prefix_tokens_reused_total"] == 49
    assert stats["inserts"] == 2 and stats["enabled"] is True
    assert (stats["apc_enabled"], stats["block_size"], stats["hash"]) == (False, 0, None)


def test_reset_is_idempotent_and_keeps_counters() -> None:
    store = make_store(apc=ApcConfig(hash_name="blake3"))
    put(store, seq(40), nbytes=100)
    put(store, seq(40, 500), nbytes=20)
    store.lookup(B, "s1", seq(41))
    assert store.reset() == (2, 120)
    assert store.reset() == (0, 0)
    stats = store.stats()
    assert stats["entries"] == 0 and stats["bytes"] == 0 and stats["hits"] == 1
    assert (stats["total_blocks_stored"], stats["unique_block_hashes"], stats["apc_active_entries"]) == (0, 0, 0)
    assert stats["hash"] == "blake3"
    assert store.lookup(B, "s1", seq(41)).reason == "no_candidate"
    put(store, seq(40))  # usable after a reset
    assert store.lookup(B, "s1", seq(41)).hit is not None


def test_disabled_stats_has_the_same_shape() -> None:
    disabled = PromptCacheStore.disabled_stats()
    live = make_store(apc=ApcConfig()).stats()
    assert disabled.keys() == live.keys()
    assert disabled["enabled"] is False and disabled["entries"] == 0 and disabled["apc_enabled"] is False
    assert disabled["evictions"] == {"lru": 0, "ttl": 0, "capacity": 0}
    assert disabled["rejections"] == {"min_prefix": 0, "oversized": 0}


def test_entry_repr_hides_tokens_and_payload() -> None:
    store = make_store()
    eid = put(store, seq(40, 123456))
    entry = store.get(eid)
    assert isinstance(entry, CacheEntry)
    text = repr(entry)
    assert "123456" not in text and "kv40" not in text and "tokens=40" in text


def test_constructor_validation() -> None:
    for bad in ({"capacity_bytes": -1}, {"max_entries": 0}, {"ttl_seconds": -1}, {"min_prefix": -1}):
        with pytest.raises(ValueError):
            make_store(**bad)
    with pytest.raises(ValueError):
        make_store().insert(B, "s", seq(40), "kv", -1, True)


def test_long_prompt_partial_lookup_is_fast_enough() -> None:
    store = make_store(apc=ApcConfig(num_blocks=10_000), capacity_bytes=10**9)
    long_entry = seq(100_000)
    put(store, long_entry)
    request = long_entry[:80_000] + (-1,) * 10
    hit = store.lookup(B, "s1", request).hit
    assert hit is not None and hit.matched_len == 80_000
    assert store.stats()["total_blocks_stored"] == 6250


# --- adoption checks the tokens, never the hashes alone ---


class CollidingHash:
    """A "hash" under which every block collides: the chains of any two sequences agree."""

    def update(self, data: bytes) -> None:
        pass

    def digest(self) -> bytes:
        return b"\x00" * 32


def test_forced_block_hash_collision_is_refused_and_counted(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import mlxcel_compat.cache.block_hash as block_hash

    monkeypatch.setattr(block_hash, "hasher_factory", lambda name: CollidingHash)
    store = make_store(apc=ApcConfig(block_size=16), min_prefix=4)
    put(store, ENTRY)
    # Shares 3 tokens with the entry; every block hash "agrees" all the same.
    request = SHARED[:3] + seq(250, 20000)
    with caplog.at_level(logging.WARNING):
        res = store.lookup(B, "s1", request)
    assert res.hit is None and res.detail == "token_mismatch"
    stats = store.stats()
    assert stats["adoption_rejects"] == {"token_mismatch": 1}
    assert stats["hits"] == 0 and stats["misses"] == 1
    assert "tokens differ" in caplog.text
    # A request that extends the whole entry needs no hash: it is still served.
    hit = store.lookup(B, "s1", ENTRY + seq(10, 30000)).hit
    assert hit is not None and hit.matched_len == len(ENTRY)


def test_entries_of_another_namespace_are_invisible() -> None:
    """Tenant isolation: the namespace is part of the bucket, so no stage of lookup (own
    session, other sessions, APC) reaches another tenant's entries."""
    store = make_store(apc=ApcConfig(), min_prefix=4)
    tenant_a, tenant_b = make_bucket(namespace="a"), make_bucket(namespace="b")
    store.insert(tenant_a, "s1", ENTRY, payload="kv", nbytes=10, trimmable=True)
    assert store.lookup(tenant_b, "s1", ENTRY + (1,)).hit is None  # same session, same prompt
    assert store.lookup(tenant_b, "s2", REQUEST).hit is None  # APC partial overlap
    assert store.lookup(B, "s1", ENTRY + (1,)).hit is None  # the shared namespace
    hit = store.lookup(tenant_a, "s2", ENTRY + (1,)).hit
    assert hit is not None and hit.matched_len == len(ENTRY)
