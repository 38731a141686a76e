"""The shared KV block pool's bookkeeping (cache/block_pool.py) and the store's use of it.

The adapter's arrays are stood in for by tuples of positions, so every check is exact: a table
holds the right positions, a shared block is the very object another table holds, and the pool's
counts and bytes equal what the entries and the running sequences ("leases") reach.
"""

from __future__ import annotations

import collections
import random

import pytest

from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.block_pool import BlockIndex, BlockPool, BlockTable, block_keys, build_table
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from tests.cache.fakes import make_bucket

BYTES_PER_TOKEN = 10
BLOCK = 4


def fake_blocks(tokens: list[int]):
    """make_block for a state of ``tokens``: the block's 'arrays' are its positions' tokens."""

    def make(start: int, stop: int) -> tuple[object, int]:
        return tuple(tokens[start:stop]), (stop - start) * BYTES_PER_TOKEN

    return make


def gathered(table: BlockTable, n: int) -> list[int]:
    out: list[int] = []
    for block_id in table.block_ids:
        out.extend(table.pool.data(block_id))  # type: ignore[arg-type]
    return out[:n]


def test_allocate_retain_release_frees_once() -> None:
    pool = BlockPool(BLOCK)
    a = pool.allocate("a", 4, 40)
    pool.retain([a], stored=True)
    assert pool.nbytes == 40 and pool.stored_bytes == 40 and pool.referenced() == {a: (2, 1)}
    assert pool.release([a]) == 0
    assert pool.release([a], stored=True) == 1
    assert len(pool) == 0 and pool.nbytes == 0 and pool.stored_bytes == 0
    with pytest.raises(KeyError):
        pool.release([a])  # never freed twice
    b = pool.allocate("b", 1, 10)
    assert b != a  # ids are never reused
    with pytest.raises(ValueError):
        pool.release([b], stored=True)  # no stored reference to drop
    with pytest.raises(ValueError):
        pool.allocate("c", BLOCK + 1, 1)


def test_table_shares_the_lease_and_copies_the_partial_block() -> None:
    pool = BlockPool(BLOCK)
    tokens = list(range(10))
    first = build_table(pool, 10, (), fake_blocks(tokens))
    assert [pool.block(i).n_tokens for i in first.block_ids] == [4, 4, 2]
    assert gathered(first, 10) == tokens
    # A sequence adopted 7 positions: its lease is the one full block inside them; the partial
    # second block is its own copy, so its donation stores positions 4.. again.
    lease = first.full_blocks(7)
    assert lease == first.block_ids[:1]
    longer = tokens[:7] + [70, 71, 72, 73, 74]
    second = build_table(pool, 12, lease, fake_blocks(longer))
    assert second.block_ids[0] == first.block_ids[0] and second.block_ids[1] not in first.block_ids
    assert gathered(second, 12) == longer
    assert pool.referenced()[first.block_ids[0]] == (2, 0)
    assert pool.counters.shared == 1 and pool.counters.allocated == 5


def test_a_failing_block_releases_what_the_table_took() -> None:
    pool = BlockPool(BLOCK)
    base = build_table(pool, 8, (), fake_blocks(list(range(8))))

    def broken(start: int, stop: int) -> tuple[object, int]:
        if start >= 12:
            raise RuntimeError("out of memory")
        return (start,), 10

    with pytest.raises(RuntimeError):
        build_table(pool, 16, base.block_ids, broken)
    assert pool.referenced() == {i: (1, 0) for i in base.block_ids}  # only base's own references


def test_store_counts_shared_blocks_once_and_frees_on_eviction() -> None:
    pool = BlockPool(BLOCK)
    store = PromptCacheStore(capacity_bytes=10_000, max_entries=10, ttl_seconds=0, min_prefix=1, pool=pool)
    bucket = make_bucket()
    system = list(range(100, 108))  # two full blocks shared by every session
    tables = []
    lease: tuple[int, ...] = ()
    for s in range(3):
        tokens = system + [s * 10 + i for i in range(5)]
        table = build_table(pool, len(tokens), lease, fake_blocks(tokens))
        assert store.insert(bucket, f"s{s}", tokens, table, len(tokens) * BYTES_PER_TOKEN, True).inserted
        pool.release(table.block_ids)
        lease = table.full_blocks(len(system))
        tables.append(table)
    unique = (len(system) + 3 * 5) * BYTES_PER_TOKEN
    assert store.nbytes == pool.stored_bytes == unique
    assert store.logical_bytes == 3 * 13 * BYTES_PER_TOKEN
    stats = store.stats()
    assert stats["bytes"] == unique and stats["logical_tokens"] == 39
    assert stats["sharing_ratio"] == round(39 / 23, 4)
    # Evicting the oldest entry frees only its own tail: the shared system blocks stay.
    store.capacity_bytes = unique - 1
    assert store.insert(bucket, "s9", system + [1], build_table(pool, 9, lease, fake_blocks(system + [1])), 90, True).inserted
    assert all(i in pool for i in lease)
    assert all(i not in pool for i in tables[0].block_ids[2:])
    store.reset()
    # the last table's own reference (a donation that never released it) is all that is left
    assert store.nbytes == 0 and pool.stored_bytes == 0


def test_an_entry_larger_than_the_budget_is_refused_even_when_it_adds_less() -> None:
    """The "oversized" bound is the entry's logical size, not the bytes it adds beside the entries
    it shares blocks with: once those are evicted, it holds every one of its blocks alone, so a
    store that took it would sit over its budget with nothing left to evict."""
    pool = BlockPool(BLOCK)
    store = PromptCacheStore(capacity_bytes=100, max_entries=10, ttl_seconds=0, min_prefix=1, pool=pool)
    bucket = make_bucket()
    base = list(range(100, 108))  # 80 bytes: fits
    table = build_table(pool, len(base), (), fake_blocks(base))
    assert store.insert(bucket, "a", base, table, 80, True).inserted
    pool.release(table.block_ids)
    longer = base + [1, 2, 3]  # 110 bytes logical, 30 of them new
    grown = build_table(pool, len(longer), table.full_blocks(len(base)), fake_blocks(longer))
    result = store.insert(bucket, "b", longer, grown, 110, True)
    pool.release(grown.block_ids)
    assert not result.inserted and result.reason == "oversized"
    assert store.nbytes == 80 <= store.capacity_bytes


def test_a_prefix_computed_again_folds_into_the_live_copy_only_when_its_bits_are_equal() -> None:
    pool = BlockPool(BLOCK)
    index = BlockIndex(pool)
    tokens = list(range(100, 111))  # two full blocks and a part
    keys = block_keys(b"bucket", tokens, BLOCK, 2)
    assert len(keys) == 2 and keys != block_keys(b"other bucket", tokens, BLOCK, 2) != block_keys(b"bucket", tokens, BLOCK, 3)
    assert block_keys(b"bucket", tokens[:8] + [0, 0, 0], BLOCK, 2) == keys  # a key covers its block's prefix only
    first = index.merge(build_table(pool, 11, (), fake_blocks(tokens)), keys, lambda a, b: a == b)
    assert len(index) == 2 and pool.counters.merged == 0  # the first copy is indexed
    again = index.merge(build_table(pool, 11, (), fake_blocks(tokens)), keys, lambda a, b: a == b)
    assert again.block_ids[:2] == first.block_ids[:2] and again.block_ids[2] != first.block_ids[2]
    assert pool.counters.merged == 2 and len(pool) == 4  # the copies of the two full blocks are freed
    assert pool.referenced()[first.block_ids[0]] == (2, 0)  # each caller holds its one reference
    assert gathered(again, 11) == tokens
    # The same tokens with other bits (another chunking's last bits): kept apart, nothing merged.
    skewed = build_table(pool, 11, (), lambda start, stop: (("other", start), (stop - start) * BYTES_PER_TOKEN))
    kept = index.merge(skewed, keys, lambda a, b: a == b)
    assert kept is skewed and pool.counters.merged == 2

    def broken(a: object, b: object) -> bool:
        raise RuntimeError("cannot compare")

    again_broken = build_table(pool, 11, (), fake_blocks(tokens))
    assert index.merge(again_broken, keys, broken) is again_broken  # a failing compare keeps the copy
    pool.release(again_broken.block_ids)
    for table in (first, again, kept):
        pool.release(table.block_ids)
    assert len(pool) == 0
    # A key whose block was freed names nothing: the next copy takes its place.
    third = index.merge(build_table(pool, 11, (), fake_blocks(tokens)), keys, lambda a, b: a == b)
    assert pool.counters.merged == 2 and len(pool) == 3
    pool.release(third.block_ids)


def test_evicted_blocks_stay_readable_for_the_disk_tier() -> None:
    pool = BlockPool(BLOCK)
    store = PromptCacheStore(capacity_bytes=200, max_entries=1, ttl_seconds=0, min_prefix=1, pool=pool)
    seen: list[list[int]] = []
    store.on_evict = lambda entry: seen.append(gathered(entry.payload, len(entry.tokens)))
    bucket = make_bucket()
    for s in range(2):
        tokens = [s] * 6
        table = build_table(pool, 6, (), fake_blocks(tokens))
        store.insert(bucket, "s", tokens, table, 60, True)
        pool.release(table.block_ids)
    assert seen == [[0] * 6]
    assert len(pool) == 2  # the evicted entry's blocks went after the spill read them


class Walk:
    """A seeded random walk over what the engine does with the pool: adopt (a lease on the full
    blocks inside the match), donate (a table starting with the lease, stored, the donor's
    reference released), cancel and engine faults (the lease released, nothing donated), a
    donation that fails half-way, evictions under a small byte budget, TTL-less removes and
    resets. A donation's blocks computed again fold into equal live blocks (``BlockIndex``; the
    stand-in arrays are the tokens, so a block of the same prefix is always equal). After every
    step the pool's counts must equal what entries and leases reach."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = BlockPool(BLOCK)
        self.store = PromptCacheStore(capacity_bytes=30 * BYTES_PER_TOKEN, max_entries=5, ttl_seconds=0, min_prefix=1,
                                      pool=self.pool, apc=ApcConfig(block_size=2, hash_name="sha256", num_blocks=None))
        self.bucket = make_bucket()
        self.index = BlockIndex(self.pool)
        self.running: dict[int, tuple[list[int], tuple[int, ...]]] = {}  # seq id -> (tokens, lease)
        self.ids = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(self.rng.randrange(3, 14))] for _ in range(3)]

    def step(self) -> str:
        action = self.rng.choice(["adopt"] * 4 + ["donate"] * 4 + ["cancel", "fault", "failed_donation", "remove", "reset"])
        getattr(self, action)()
        self.check()
        return action

    def adopt(self) -> None:
        entries = self.store.entries()
        if entries and self.rng.random() < 0.4:  # the next turn of a stored conversation
            start = list(self.rng.choice(entries).tokens)
        else:  # a shared system prompt and a new question (an APC partial hit)
            start = list(self.rng.choice(self.prefixes))
        tokens = start + [self.rng.randrange(50) for _ in range(self.rng.randrange(1, 9))]
        hit = self.store.lookup(self.bucket, f"s{self.rng.randrange(3)}", tokens).hit
        lease: tuple[int, ...] = ()
        if hit is not None and isinstance(hit.entry.payload, BlockTable):
            lease = hit.entry.payload.full_blocks(hit.matched_len)
            assert gathered(hit.entry.payload, hit.matched_len) == tokens[: hit.matched_len]
            self.pool.retain(lease)
        self.ids += 1
        self.running[self.ids] = (tokens, lease)

    def _end(self) -> tuple[list[int], tuple[int, ...]] | None:
        if not self.running:
            return None
        seq = self.rng.choice(sorted(self.running))
        tokens, lease = self.running.pop(seq)
        return tokens, lease

    def donate(self) -> None:
        ended = self._end()
        if ended is None:
            return
        tokens, lease = ended
        tokens = tokens + [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 4))]  # generated
        try:
            table = build_table(self.pool, len(tokens), lease, fake_blocks(tokens))
            table = self.index.merge(table, block_keys(b"walk", tokens, BLOCK, None), lambda a, b: a == b)
            try:
                self.store.insert(self.bucket, f"s{self.rng.randrange(3)}", tokens, table, len(tokens) * BYTES_PER_TOKEN, True)
            finally:
                self.pool.release(table.block_ids)
        finally:
            self.pool.release(lease)

    def cancel(self) -> None:
        ended = self._end()
        if ended is not None:
            self.pool.release(ended[1])

    fault = cancel  # an engine fault ends the sequence without donating, like a cancel

    def failed_donation(self) -> None:
        ended = self._end()
        if ended is None:
            return
        tokens, lease = ended

        def breaks(start: int, stop: int) -> tuple[object, int]:
            raise MemoryError("no room for a block")

        try:
            with pytest.raises(MemoryError):
                build_table(self.pool, len(tokens) + BLOCK, lease, breaks)
        finally:
            self.pool.release(lease)

    def remove(self) -> None:
        entries = self.store.entries()
        if entries:
            self.store.remove(self.rng.choice(entries).id)

    def reset(self) -> None:
        if self.rng.random() < 0.1:
            self.store.reset()

    def check(self) -> None:
        refs: collections.Counter[int] = collections.Counter()
        stored: collections.Counter[int] = collections.Counter()
        for entry in self.store.entries():
            table = entry.payload
            assert isinstance(table, BlockTable)
            assert gathered(table, table.n_tokens) == list(entry.tokens)  # a table holds its tokens
            refs.update(table.block_ids)
            stored.update(table.block_ids)
        for _, lease in self.running.values():
            refs.update(lease)
        assert self.pool.referenced() == {i: (refs[i], stored[i]) for i in refs}
        assert (self.pool.refs, self.pool.stored_refs) == (sum(refs.values()), sum(stored.values()))  # the stats' running sums
        unique = sum(self.pool.block(i).nbytes for i in stored)
        assert self.pool.stored_bytes == unique == self.store.nbytes
        assert self.store.nbytes <= self.store.capacity_bytes
        assert self.pool.counters.allocated - self.pool.counters.freed == len(self.pool)


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_keeps_the_accounting_exact(seed: int) -> None:
    walk = Walk(seed)
    done = collections.Counter(walk.step() for _ in range(400))
    assert done["donate"] > 50 and done["adopt"] > 50
    assert walk.pool.counters.shared > 0  # leases were really shared into stored tables
    assert walk.store.counters.evictions["lru"] > 10  # and the budget evicted entries that shared them
    assert walk.pool.counters.merged > 0  # copies computed again were folded into live blocks
    for _, lease in walk.running.values():
        walk.pool.release(lease)
    walk.running.clear()
    walk.store.reset()
    walk.check()
    assert len(walk.pool) == 0  # no entry and no sequence: no block is left
