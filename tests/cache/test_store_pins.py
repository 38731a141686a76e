"""Pinned entries (explicit cache breakpoints): they outlive LRU, supersede and the global TTL,
and their own bounds demote them back to ordinary entries."""

from __future__ import annotations

from mlxcel_compat.cache.key import PIN_SESSION
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from tests.cache.fakes import FakeClock, make_bucket

B = make_bucket()


def make_store(clock: FakeClock, **kw: int) -> PromptCacheStore:
    params = dict(capacity_bytes=1000, max_entries=3, ttl_seconds=100, min_prefix=4, pin_max_entries=2, pin_capacity_bytes=500)
    params.update(kw)
    return PromptCacheStore(clock=clock, **params)  # type: ignore[arg-type]


def seq(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def put(store: PromptCacheStore, tokens: tuple[int, ...], session: str = "s1", nbytes: int = 10, pin_ttl: float = 0.0) -> int:
    origin = "breakpoint" if pin_ttl else "completion"
    result = store.insert(B, PIN_SESSION if pin_ttl else session, tokens, payload=len(tokens), nbytes=nbytes, trimmable=True, origin=origin, pin_ttl=pin_ttl)
    assert result.inserted and result.entry_id is not None
    return result.entry_id


def test_a_pin_survives_lru_eviction_of_longer_entries() -> None:
    clock = FakeClock()
    store = make_store(clock)
    pin = put(store, seq(10), pin_ttl=300)
    full = put(store, seq(30))
    for start in (1000, 2000, 3000):  # three unrelated entries push the cap of 3
        clock.advance(1)
        put(store, seq(20, start), session=f"other{start}")
    assert store.get(full) is None and store.get(pin) is not None
    assert store.counters.evictions["lru"] == 2
    hit = store.lookup(B, "s1", seq(10) + seq(5, 500)).hit  # shares only the pinned prefix
    assert hit is not None and hit.entry.id == pin and hit.matched_len == 10
    assert store.counters.pin_hits == 1


def test_pins_are_evicted_only_when_nothing_else_is_left() -> None:
    clock = FakeClock()
    store = make_store(clock, capacity_bytes=100, pin_capacity_bytes=100)
    pin = put(store, seq(10), nbytes=60, pin_ttl=300)
    other = put(store, seq(20, 100), nbytes=30)
    put(store, seq(20, 200), nbytes=30)  # 120 bytes: the unpinned entry goes, not the older pin
    assert store.get(other) is None and store.get(pin) is not None
    put(store, seq(20, 300), nbytes=90)  # only the pin is left to evict
    assert store.get(pin) is None and store.nbytes <= 100


def test_pins_over_their_bounds_become_ordinary_entries_oldest_first() -> None:
    clock = FakeClock()
    store = make_store(clock, max_entries=10)
    first = put(store, seq(10), pin_ttl=300)
    clock.advance(1)
    second = put(store, seq(11, 50), pin_ttl=300)
    clock.advance(1)
    third = put(store, seq(12, 80), pin_ttl=300)  # pin_max_entries=2: the oldest pin is demoted
    assert [store.get(i).pinned for i in (first, second, third)] == [False, True, True]
    assert store.counters.unpins["bound"] == 1 and store.stats()["pinned_entries"] == 2
    big = put(store, seq(13, 120), nbytes=480, pin_ttl=300)  # 500 pinned bytes at most
    assert store.get(big).pinned and store.pinned_bytes <= 500
    assert store.get(first) is not None  # demoted, still stored


def test_a_pin_lapses_after_its_ttl_and_each_hit_renews_it() -> None:
    clock = FakeClock()
    store = make_store(clock, ttl_seconds=1000)
    pin = put(store, seq(10), pin_ttl=300)
    clock.advance(200)
    assert store.lookup(B, "s1", seq(12)).hit is not None  # renews: 300 s from now
    clock.advance(200)
    store.sweep()
    assert store.get(pin).pinned
    clock.advance(150)
    store.sweep()
    assert not store.get(pin).pinned and store.counters.unpins["ttl"] == 1
    assert store.get(pin) is not None  # demoted, subject to the global TTL from now on


def test_the_global_ttl_skips_pins() -> None:
    clock = FakeClock()
    store = make_store(clock, ttl_seconds=100)
    pin = put(store, seq(10), pin_ttl=3600)
    plain = put(store, seq(20, 100))
    clock.advance(150)
    store.sweep()
    assert store.get(plain) is None and store.get(pin) is not None


def test_refresh_pin_needs_the_same_tokens_and_copies_nothing() -> None:
    clock = FakeClock()
    store = make_store(clock)
    pin = put(store, seq(10), pin_ttl=300)
    assert not store.refresh_pin(B, PIN_SESSION, seq(11), 300)
    clock.advance(250)
    assert store.refresh_pin(B, PIN_SESSION, seq(10), 300)
    assert store.get(pin).pin_until == clock() + 300 and store.counters.pin_refreshes == 1
    assert len(store) == 1


def test_pins_are_never_superseded_and_a_duplicate_keeps_the_pin() -> None:
    clock = FakeClock()
    store = make_store(clock, max_entries=10)
    short = put(store, seq(10), pin_ttl=300)
    longer = put(store, seq(20), pin_ttl=300)  # same session and origin, a longer prefix
    assert store.get(short) is not None and store.get(longer) is not None
    again = store.insert(B, PIN_SESSION, seq(10), payload=10, nbytes=10, trimmable=True, origin="breakpoint")
    assert again.reason == "duplicate" and store.get(again.entry_id).pinned


def test_stats_report_pins() -> None:
    store = make_store(FakeClock())
    put(store, seq(10), nbytes=25, pin_ttl=300)
    stats = store.stats()
    assert (stats["pinned_entries"], stats["pinned_bytes"], stats["pins"]) == (1, 25, 1)
    assert (stats["pin_max_entries"], stats["pin_capacity_bytes"]) == (2, 500)
    assert set(PromptCacheStore.disabled_stats()) == set(stats)
