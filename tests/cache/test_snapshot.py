"""SnapshotStore with fake payloads and a fake clock; capacity default; family detection."""

from __future__ import annotations

import logging
import random

import pytest

from mlxcel_compat.cache.key import (
    Bucket,
    multimodal_digest,
)
from mlxcel_compat.cache.snapshot import (
    SNAPSHOT_CAPACITY_FLOOR,
    SNAPSHOT_REJECTION_REASONS,
    SnapshotLookup,
    SnapshotStore,
    common_prefix_len,
    is_snapshot_family,
    snapshot_capacity_default,
)
from tests.cache.fakes import FakeClock, make_bucket

MiB = 1024**2
GiB = 1024**3


class FakePayload:
    """Stands in for a detached mlx-lm cache: only its size matters to the store."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def make_store(clock: FakeClock | None = None, **kw: int) -> SnapshotStore:
    params: dict[str, int] = dict(capacity_bytes=10_000, max_entries=16, ttl_seconds=100, min_prefix=4)
    params.update(kw)
    return SnapshotStore(clock=clock or FakeClock(), **params)  # type: ignore[arg-type]


def seq(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


B = make_bucket()
MM = make_bucket(mm_digest=multimodal_digest([b"image"]))


def put(
    store: SnapshotStore,
    tokens: tuple[int, ...],
    session: str = "s1",
    nbytes: int = 10,
    trimmable: bool = False,
    origin: str = "boundary",
    bucket: Bucket = B,
) -> int:
    result = store.insert(bucket, session, tokens, FakePayload(nbytes), nbytes, trimmable, origin)
    assert result.inserted and result.entry_id is not None, result
    return result.entry_id


def geometry(res: SnapshotLookup) -> tuple[str | None, int, int, int]:
    return res.reason, res.common_prefix, res.stored_len, res.request_len


# --- hits ---


def test_hit_needs_the_whole_snapshot_as_prefix() -> None:
    store = make_store()
    eid = put(store, seq(40))
    res = store.lookup(B, "s1", seq(50))
    assert res.hit is not None and res.reason is None
    assert (res.hit.entry.id, res.hit.matched_len, res.hit.needs_trim) == (eid, 40, False)
    assert geometry(res) == (None, 40, 40, 50)
    assert res.hit.entry.hits == 1
    # The request shares 39 of the 40 stored tokens: a non-trimmable snapshot is refused.
    res = store.lookup(B, "s1", seq(39) + (-1,) * 11)
    assert res.hit is None and geometry(res) == ("snapshot_diverged", 39, 40, 50)


def test_longest_usable_wins_then_most_recent() -> None:
    store = make_store()
    short = put(store, seq(20), origin="completion")
    long = put(store, seq(30), origin="boundary")  # other origin: both stay
    hit = store.lookup(B, "s1", seq(35)).hit
    assert hit is not None and hit.entry.id == long and hit.matched_len == 30
    assert store.get(short) is not None
    # Two snapshots restoring the same 20 tokens (one whole, one cut): the most recent one wins.
    put(store, seq(20, 500), session="s2", origin="boundary")
    b = put(store, seq(20, 500) + (1,), session="s2", origin="completion", trimmable=True)
    request = seq(20, 500) + (9,)
    hit = store.lookup(B, "s2", request).hit
    assert hit is not None and (hit.entry.id, hit.matched_len, hit.needs_trim) == (b, 20, True)
    a = put(store, seq(20, 500), session="s2", origin="boundary")  # donated again: now the most recent
    hit = store.lookup(B, "s2", request).hit
    assert hit is not None and (hit.entry.id, hit.matched_len, hit.needs_trim) == (a, 20, False)


def test_only_the_same_session_restores() -> None:
    store = make_store()
    put(store, seq(40), session="alice")
    res = store.lookup(B, "bob", seq(50))
    assert res.hit is None and geometry(res) == ("no_candidate", 0, 0, 50)
    assert store.lookup(B, "alice", seq(50)).hit is not None
    # Same session, other bucket (model, template, media...): no candidate either.
    assert store.lookup(make_bucket("other-model"), "alice", seq(50)).reason == "no_candidate"


def test_exact_repeat_needs_a_trimmable_snapshot() -> None:
    store = make_store()
    put(store, seq(40), session="frozen")
    res = store.lookup(B, "frozen", seq(40))
    assert res.hit is None and geometry(res) == ("exact_repeat", 40, 40, 40)
    put(store, seq(40), session="sliding", trimmable=True)
    res = store.lookup(B, "sliding", seq(40))
    assert res.hit is not None and res.hit.matched_len == 39 and res.hit.needs_trim


# --- partial restores ---


def test_partial_restore_only_when_trimmable() -> None:
    store = make_store()
    request = seq(30) + (-1,) * 20
    put(store, seq(60), session="frozen")
    put(store, seq(60), session="sliding", trimmable=True)
    assert geometry(store.lookup(B, "frozen", request)) == ("snapshot_diverged", 30, 60, 50)
    res = store.lookup(B, "sliding", request)
    assert res.hit is not None and res.hit.matched_len == 30 and res.hit.needs_trim
    assert geometry(res) == (None, 30, 60, 50)
    # A request that is a prefix of the snapshot: cut to len(request) - 1.
    hit = store.lookup(B, "sliding", seq(45)).hit
    assert hit is not None and hit.matched_len == 44
    assert geometry(store.lookup(B, "frozen", seq(45))) == ("snapshot_diverged", 45, 60, 45)
    stats = store.stats()
    assert stats["snapshot_partial_hits"] == 2 and stats["snapshot_tokens_restored_total"] == 74


def test_partial_restore_below_min_prefix_is_too_short() -> None:
    store = make_store(min_prefix=32)
    put(store, seq(60), trimmable=True)
    res = store.lookup(B, "s1", seq(20) + (-1,) * 40)
    assert res.hit is None and geometry(res) == ("prefix_too_short", 20, 60, 60)
    assert store.lookup(B, "s1", seq(32) + (-1,) * 40).hit is not None


def test_multimodal_buckets_restore_whole_snapshots_only() -> None:
    store = make_store()
    put(store, seq(60), trimmable=True, bucket=MM)
    res = store.lookup(MM, "s1", seq(30) + (-1,) * 20)
    assert res.hit is None and geometry(res) == ("multimodal", 30, 60, 50)
    assert store.lookup(MM, "s1", seq(60)).reason == "multimodal"  # the repeat would need a cut too
    hit = store.lookup(MM, "s1", seq(61)).hit
    assert hit is not None and hit.matched_len == 60 and not hit.needs_trim


def test_failure_reason_comes_from_the_closest_snapshot() -> None:
    store = make_store()
    put(store, seq(40), origin="boundary")
    put(store, seq(50, 1000), origin="completion", trimmable=True)  # shares nothing: too short
    res = store.lookup(B, "s1", seq(35) + (-1,) * 10)
    assert geometry(res) == ("snapshot_diverged", 35, 40, 45)


def test_tiny_requests_never_hit() -> None:
    store = make_store(min_prefix=0)
    put(store, (7,), trimmable=True)
    assert store.lookup(B, "s1", (7,)).reason == "prefix_too_short"  # nothing left to restore
    assert store.lookup(B, "s1", ()).reason == "prefix_too_short"
    hit = store.lookup(B, "s1", (7, 8)).hit
    assert hit is not None and hit.matched_len == 1


# --- rejections ---


def test_rejection_counters_and_last_reject() -> None:
    store = make_store(min_prefix=4, capacity_bytes=1000)
    assert store.lookup(B, "s1", seq(10)).reason == "no_candidate"
    put(store, seq(10))
    store.lookup(B, "s1", seq(5) + (-1,) * 10)  # diverged
    store.lookup(B, "s1", seq(10))  # exact repeat
    assert store.insert(B, "s1", seq(3), FakePayload(1), 1, False, "boundary").reason == "min_prefix"
    oversized = store.insert(B, "s1", seq(20), FakePayload(5000), 5000, False, "completion")
    assert not oversized.inserted and oversized.reason == "oversized"
    stats = store.stats()
    assert stats["snapshot_rejections"] == {
        "no_candidate": 1, "snapshot_diverged": 1, "exact_repeat": 1, "prefix_too_short": 0,
        "multimodal": 0, "min_prefix": 1, "oversized": 1,
    }
    last = stats["snapshot_last_reject"]
    assert isinstance(last, dict)
    assert last["reason"] == "oversized" and last["stored_len"] == 20
    assert last["common_prefix"] is None and last["request_len"] is None
    assert (last["nbytes"], last["capacity_bytes"]) == (5000, 1000)
    assert last["session"] == store.session_tag("s1")
    store.lookup(B, "s1", seq(5) + (-1,) * 10)
    last = store.stats()["snapshot_last_reject"]
    assert last == {
        "reason": "snapshot_diverged", "common_prefix": 5, "stored_len": 10, "request_len": 15,
        "session": store.session_tag("s1"),
    }


def test_session_key_never_reaches_stats_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    secret = "user-4711@example.com"
    store = make_store()
    with caplog.at_level(logging.DEBUG, logger="mlxcel_compat.cache.snapshot"):
        store.lookup(B, secret, seq(10))
        put(store, seq(10), session=secret)
        store.lookup(B, secret, seq(11))
    assert len([r for r in caplog.records if r.name == "mlxcel_compat.cache.snapshot"]) == 2
    assert secret not in caplog.text and secret not in repr(store.stats())
    tag = store.session_tag(secret)
    assert tag in caplog.text and len(tag) == 16
    assert tag != store.session_tag("someone-else") and tag != make_store().session_tag(secret)


def test_oversized_warns_once_naming_the_snapshot_flag(caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(capacity_bytes=1000)
    with caplog.at_level(logging.WARNING):
        store.insert(B, "s1", seq(40), FakePayload(5000), 5000, False, "boundary")
        store.insert(B, "s2", seq(40), FakePayload(6000), 6000, False, "boundary")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "--prompt-cache-snapshot-capacity-bytes" in warnings[0].getMessage()
    assert "5000" in warnings[0].getMessage() and len(store) == 0


def test_unknown_origin_is_refused() -> None:
    with pytest.raises(ValueError):
        make_store().insert(B, "s1", seq(10), FakePayload(1), 1, False, "warmup")


# --- supersede ---


def test_supersede_per_session_and_origin() -> None:
    store = make_store()
    boundary = put(store, seq(20), origin="boundary")
    completion = put(store, seq(25), origin="completion")
    other_session = put(store, seq(20), session="s2", origin="boundary")
    # The warm-up extends the boundary snapshot: only the old boundary snapshot goes.
    result = store.insert(B, "s1", seq(30), FakePayload(10), 10, False, "boundary")
    assert result.superseded == [boundary] and result.evicted == []
    assert {e.id for e in store.entries()} == {completion, other_session, result.entry_id}
    # A longer completion snapshot replaces the old completion one, never the boundary one.
    newer = store.insert(B, "s1", seq(40), FakePayload(10), 10, False, "completion")
    assert newer.superseded == [completion]
    assert {e.id for e in store.entries()} == {other_session, result.entry_id, newer.entry_id}
    # A diverging snapshot of the same origin does not supersede.
    assert store.insert(B, "s1", seq(10) + (-5,) * 10, FakePayload(10), 10, False, "boundary").superseded == []
    stats = store.stats()
    assert stats["snapshot_supersedes"] == 2 and stats["snapshot_evictions_lru"] == 0
    assert stats["snapshot_entries"] == 4 and stats["snapshot_bytes"] == 40


def test_identical_tokens_replace_whatever_the_origin() -> None:
    # The digest index holds one entry per (bucket, session, tokens): same tokens, same state.
    store = make_store()
    old = put(store, seq(30), origin="completion")
    result = store.insert(B, "s1", seq(30), FakePayload(12), 12, False, "boundary")
    assert result.reason == "duplicate" and result.superseded == [old]
    (entry,) = store.entries()
    assert entry.origin == "boundary" and store.nbytes == 12
    hit = store.lookup(B, "s1", seq(31)).hit
    assert hit is not None and hit.entry.id == result.entry_id


# --- budgets ---


def test_budgets_hold_under_churn() -> None:
    rng = random.Random(4)
    store = make_store(capacity_bytes=1000, max_entries=8, ttl_seconds=0)
    history: dict[str, tuple[int, ...]] = {}
    for step in range(400):
        session = f"s{rng.randrange(30)}"
        tokens = history.get(session, seq(8, 1000 * int(session[1:]))) + seq(rng.randrange(1, 5), step * 10)
        history[session] = tokens
        origin = rng.choice(("boundary", "completion"))
        nbytes = rng.randrange(50, 300)
        result = store.insert(B, session, tokens, FakePayload(nbytes), nbytes, False, origin)
        assert result.inserted
        assert store.nbytes <= 1000 and len(store) <= 8
        assert store.nbytes == sum(e.nbytes for e in store.entries())
        if rng.random() < 0.5:
            store.lookup(B, session, tokens + (1,))
    stats = store.stats()
    assert stats["snapshot_evictions_lru"] > 0 and stats["snapshot_evictions_ttl"] == 0
    assert stats["snapshot_inserts"] == 400
    assert stats["snapshot_inserts"] - stats["snapshot_supersedes"] - stats["snapshot_evictions_lru"] == len(store)
    # Every live snapshot can still be found by its own session; nothing else can be.
    for entry in store.entries():
        hit = store.lookup(B, entry.session_key, entry.tokens + (1,)).hit
        assert hit is not None and hit.entry.id == entry.id


def test_lru_eviction_follows_use() -> None:
    store = make_store(max_entries=2)
    a = put(store, seq(10), session="a")
    b = put(store, seq(10), session="b")
    assert store.lookup(B, "a", seq(11)).hit is not None  # a becomes most recent
    result = store.insert(B, "c", seq(10), FakePayload(1), 1, False, "boundary")
    assert result.evicted == [b] and store.get(a) is not None
    assert store.lookup(B, "b", seq(11)).reason == "no_candidate"
    assert store.stats()["snapshot_evictions_lru"] == 1


def test_ttl_with_fake_clock() -> None:
    clock = FakeClock()
    store = make_store(clock=clock, ttl_seconds=10)
    eid = put(store, seq(20))
    clock.advance(9)
    assert store.lookup(B, "s1", seq(21)).hit is not None  # the TTL restarts here
    clock.advance(9)
    assert store.lookup(B, "s1", seq(21)).hit is not None
    clock.advance(10)
    assert store.lookup(B, "s1", seq(21)).reason == "no_candidate" and store.get(eid) is None
    stats = store.stats()
    assert stats["snapshot_evictions_ttl"] == 1 and stats["snapshot_entries"] == 0


def test_default_cap_and_ttl() -> None:
    store = SnapshotStore(capacity_bytes=SNAPSHOT_CAPACITY_FLOOR)
    assert (store.max_entries, store.ttl_seconds) == (4096, 7200.0)


# --- warm-up probes and counters ---


def test_unrecorded_probe_leaves_stats_and_recency_alone() -> None:
    store = make_store(max_entries=2)
    a = put(store, seq(10), session="a")
    put(store, seq(10), session="b")
    probe = store.lookup(B, "a", seq(11), record=False)
    assert probe.hit is not None and probe.hit.entry.id == a
    assert store.lookup(B, "x", seq(11), record=False).reason == "no_candidate"
    stats = store.stats()
    assert (stats["snapshot_lookups"], stats["snapshot_hits"], stats["snapshot_last_reject"]) == (0, 0, None)
    assert store.insert(B, "c", seq(10), FakePayload(1), 1, False, "boundary").evicted == [a]


def test_warmup_counters() -> None:
    store = make_store()
    store.record_warmup(True)
    store.record_warmup(True)
    store.record_warmup(False)
    store.reset()
    stats = store.stats()
    assert (stats["snapshot_warmups_run"], stats["snapshot_warmups_skipped"]) == (2, 1)


# --- stats, reset, shape ---


def test_stats_arithmetic() -> None:
    store = make_store()
    put(store, seq(20), nbytes=100)
    put(store, seq(30, 100), nbytes=250, session="s2")
    store.lookup(B, "s1", seq(25))  # hit: 20
    store.lookup(B, "s2", seq(31, 100))  # hit: 30
    store.lookup(B, "s1", seq(5, 900))  # diverged
    store.lookup(B, "s3", seq(5, 900))  # no candidate
    stats = store.stats()
    assert (stats["snapshot_entries"], stats["snapshot_bytes"]) == (2, 350)
    assert (stats["snapshot_capacity_bytes"], stats["snapshot_max_entries"]) == (10_000, 16)
    assert (stats["snapshot_lookups"], stats["snapshot_hits"], stats["snapshot_misses"]) == (4, 2, 2)
    assert stats["snapshot_hit_rate"] == pytest.approx(0.5)
    assert stats["snapshot_tokens_restored_total"] == 50 and stats["snapshot_partial_hits"] == 0
    assert stats["snapshot_inserts"] == 2 and stats["snapshot_enabled"] is True
    rejections = stats["snapshot_rejections"]
    assert isinstance(rejections, dict) and sum(rejections.values()) == stats["snapshot_misses"]


def test_reset_returns_what_it_cleared() -> None:
    store = make_store()
    put(store, seq(40), nbytes=100)
    put(store, seq(40), nbytes=20, session="s2")
    assert store.lookup(B, "s1", seq(41)).hit is not None
    assert store.reset() == (2, 120)
    assert store.reset() == (0, 0)
    stats = store.stats()
    assert (stats["snapshot_entries"], stats["snapshot_bytes"], stats["snapshot_hits"]) == (0, 0, 1)
    assert store.lookup(B, "s1", seq(41)).reason == "no_candidate"
    put(store, seq(40))
    assert store.lookup(B, "s1", seq(41)).hit is not None


def test_disabled_store_and_stats_shape() -> None:
    disabled = SnapshotStore.disabled_stats()
    live = make_store().stats()
    assert disabled.keys() == live.keys()
    assert all(key.startswith("snapshot_") for key in live)
    assert disabled["snapshot_enabled"] is False and disabled["snapshot_last_reject"] is None
    assert disabled["snapshot_rejections"] == dict.fromkeys(SNAPSHOT_REJECTION_REASONS, 0)
    numbers = {k: v for k, v in disabled.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numbers and all(v == 0 for v in numbers.values())
    off = SnapshotStore(capacity_bytes=100, enabled=False)
    assert off.insert(B, "s", seq(40), FakePayload(1), 1, False, "boundary").reason == "disabled"
    assert off.lookup(B, "s", seq(40)).reason == "disabled" and off.stats()["snapshot_lookups"] == 0


# --- pure helpers ---


@pytest.mark.parametrize(
    "a, b, expected",
    [((), (), 0), ((1, 2, 3), (1, 2, 3, 4), 3), ((1, 2, 3), (1, 9), 1), ((5,), (6,), 0)],
)
def test_common_prefix_len_small(a: tuple[int, ...], b: tuple[int, ...], expected: int) -> None:
    assert common_prefix_len(a, b) == expected == common_prefix_len(b, a)


@pytest.mark.parametrize("split", [0, 255, 256, 257, 1000, 4999])
def test_common_prefix_len_long(split: int) -> None:
    a = seq(5000)
    b = a[:split] + (-1,) + a[split + 1 :]
    assert common_prefix_len(a, b) == split
    assert common_prefix_len(a, a[:split]) == split


@pytest.mark.parametrize(
    "entry, left, expected",
    [
        (0, 0, SNAPSHOT_CAPACITY_FLOOR),  # nothing known: the floor
        (10 * MiB, 64 * GiB, SNAPSHOT_CAPACITY_FLOOR),  # six small entries: still the floor
        (200 * MiB, 64 * GiB, 1200 * MiB),  # six entries fit in left / 4
        (1 * GiB, 8 * GiB, 2 * GiB),  # capped at left / 4
        (3 * GiB, 8 * GiB, 3 * GiB),  # left / 4 < entry <= left / 2: one whole entry
        (5 * GiB, 8 * GiB, 2 * GiB),  # one entry does not fit in left / 2: the cap stays
        (1 * GiB, -4 * GiB, SNAPSHOT_CAPACITY_FLOOR),  # no memory left: the floor
    ],
)
def test_snapshot_capacity_default(entry: int, left: int, expected: int) -> None:
    assert snapshot_capacity_default(entry, left) == expected


def test_snapshot_capacity_default_rejects_negative_entry() -> None:
    with pytest.raises(ValueError):
        snapshot_capacity_default(-1, GiB)


@pytest.mark.parametrize(
    "kinds, expected",
    [
        ([], False),
        (["KVCache"] * 4, False),
        (["QuantizedKVCache", "KVCache"], False),
        (["KVCache", "ArraysCache"], True),  # hybrid (Qwen3-Next, Jamba, ...)
        (["MambaCache"], True),  # older mlx-lm name of the recurrent cache
        (["RotatingKVCache", "KVCache"], True),  # sliding window (Gemma 3)
        (["ChunkedKVCache", "KVCache"], True),  # chunked attention drops old chunks (Llama 4)
        (["CacheList(ArraysCache,KVCache)"], True),
        (["CacheList(KVCache, KVCache)"], False),
        ([["ArraysCache", "KVCache"]], True),  # CacheList given as a nested list
        ([["KVCache", ["KVCache"]]], False),
        (["mlx_lm.models.cache.KVCache"], False),
        (["mlx_lm.models.cache.RotatingKVCache"], True),
        (["LayerCache"], True),  # a model's own cache class: not known to truncate
    ],
)
def test_is_snapshot_family(kinds: list[object], expected: bool) -> None:
    assert is_snapshot_family(kinds) is expected  # type: ignore[arg-type]
