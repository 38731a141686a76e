"""RadixTrie: prefix queries, overlap groups, split/prune/merge, deep and wide tries."""

from __future__ import annotations

import random

import pytest

from mlxcel_compat.cache.radix import RadixTrie


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_groups(trie: RadixTrie, stored: dict[int, tuple[int, ...]], request: tuple[int, ...]) -> None:
    """overlap_groups must list every entry once, with its true LCP, deepest first."""
    groups = list(trie.overlap_groups(request))
    lens = [g.common_len for g in groups]
    assert lens == sorted(set(lens), reverse=True), lens
    seen = {eid: g.common_len for g in groups for eid in g.entry_ids}
    assert sum(len(g.entry_ids) for g in groups) == len(seen) == len(stored)
    assert seen == {eid: lcp(toks, request) for eid, toks in stored.items()}
    prefixes = trie.longest_prefix_entries(request)
    expected = sorted(((len(t), e) for e, t in stored.items() if request[: len(t)] == t), key=lambda p: -p[0])
    assert sorted(prefixes) == sorted(expected)
    assert [p[0] for p in prefixes] == sorted((p[0] for p in prefixes), reverse=True)


def test_longest_prefix_entries_longest_first() -> None:
    trie = RadixTrie()
    trie.insert((1, 2, 3), 10)
    trie.insert([1, 2, 3, 4, 5], 11)
    trie.insert((1, 2, 9), 12)
    trie.insert((1, 2, 3), 13)  # second entry at the same node
    found = trie.longest_prefix_entries((1, 2, 3, 4, 5, 6))
    assert found[0] == (5, 11)
    assert sorted(found[1:]) == [(3, 10), (3, 13)]
    assert trie.longest_prefix_entries((1, 2)) == []
    assert trie.longest_prefix_entries((7,)) == []
    assert len(trie) == 4


def test_overlap_groups_mid_edge_divergence() -> None:
    trie = RadixTrie()
    trie.insert((1, 2, 3, 4, 5, 6), 1)
    trie.insert((1, 2, 3, 4, 5, 7), 2)
    trie.insert((1, 8), 3)
    groups = [(g.common_len, sorted(g.entry_ids)) for g in trie.overlap_groups((1, 2, 3, 9))]
    assert groups == [(3, [1, 2]), (1, [3])]
    assert sorted(trie.best_overlap((1, 2, 3, 4, 5, 6, 0))) == [(1, 6)]
    # Nothing shared: every entry has common length 0.
    assert sorted(trie.best_overlap((5,))) == [(1, 0), (2, 0), (3, 0)]
    assert RadixTrie().best_overlap((5,)) == []


def test_split_prune_and_merge_node_counts() -> None:
    trie = RadixTrie()
    assert trie.num_nodes == 1
    trie.insert((1, 2, 3, 4), 1)
    assert trie.num_nodes == 2  # root + one compressed edge
    trie.insert((1, 2, 5), 2)
    assert trie.num_nodes == 4  # edge split at 2: [1 2] -> {[3 4], [5]}
    trie.remove((1, 2, 5), 2)
    # The [5] leaf is pruned and the pass-through [1 2] node merges back with [3 4].
    assert trie.num_nodes == 2
    assert "[1 2 3 4]" in trie.pretty_print()
    trie.remove((1, 2, 3, 4), 1)
    assert trie.num_nodes == 1 and len(trie) == 0


def test_remove_keeps_nodes_that_still_hold_entries() -> None:
    trie = RadixTrie()
    trie.insert((1, 2), 1)
    trie.insert((1, 2, 3), 2)
    trie.insert((1, 2, 3), 3)
    trie.remove((1, 2, 3), 2)
    assert trie.num_nodes == 3 and trie.longest_prefix_entries((1, 2, 3)) == [(3, 3), (2, 1)]
    trie.remove((1, 2, 3), 3)
    assert trie.num_nodes == 2 and trie.longest_prefix_entries((1, 2, 3)) == [(2, 1)]
    # Removing an inner entry with one child merges the edge.
    trie.insert((1, 2, 3, 4), 4)
    trie.remove((1, 2), 1)
    assert trie.num_nodes == 2 and "[1 2 3 4]" in trie.pretty_print()


def test_errors() -> None:
    trie = RadixTrie()
    trie.insert((1, 2, 3), 1)
    with pytest.raises(ValueError):
        trie.insert((1, 2, 3), 1)
    with pytest.raises(ValueError):
        trie.insert((), 2)
    with pytest.raises(KeyError):
        trie.remove((1, 2, 3), 99)
    with pytest.raises(KeyError):
        trie.remove((1, 2), 1)  # id exists but not at these tokens
    with pytest.raises(KeyError):
        trie.remove((1, 2, 3, 4), 1)
    assert len(trie) == 1


def test_node_ids_are_per_instance() -> None:
    a, b = RadixTrie(), RadixTrie()
    a.insert((1,), 1)
    a.insert((2,), 2)
    b.insert((1,), 1)
    assert "#1 " in b.pretty_print() and "#2 " not in b.pretty_print()


def test_random_against_brute_force() -> None:
    rng = random.Random(1234)
    trie = RadixTrie()
    stored: dict[int, tuple[int, ...]] = {}
    for eid in range(300):
        base = rng.choice(list(stored.values())) if stored and rng.random() < 0.7 else ()
        cut = rng.randint(0, len(base))
        toks = base[:cut] + tuple(rng.randint(0, 3) for _ in range(rng.randint(1 if cut == 0 else 0, 12)))
        if not toks or any(t == toks for t in stored.values()) and rng.random() < 0.5:
            continue
        trie.insert(toks, eid)
        stored[eid] = toks
    for _ in range(50):
        check_groups(trie, stored, tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 20))))
    for eid in rng.sample(sorted(stored), len(stored) // 2):
        trie.remove(stored.pop(eid), eid)
    for _ in range(50):
        check_groups(trie, stored, tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 20))))
    # Invariants: every non-root node has entries or at least two children.
    assert len(trie) == len(stored)
    assert trie.num_nodes <= 2 * len(stored) + 1
    for eid in list(stored):
        trie.remove(stored.pop(eid), eid)
    assert trie.num_nodes == 1


def test_deep_chain_of_100k_tokens_and_1000_entries() -> None:
    base = tuple(range(100_000))
    trie = RadixTrie()
    lengths = [100 * (i + 1) for i in range(1000)]
    for eid, n in enumerate(lengths):
        trie.insert(base[:n], eid)
    assert trie.num_nodes == 1001
    found = trie.longest_prefix_entries(base)
    assert len(found) == 1000 and found[0] == (100_000, 999) and found[-1] == (100, 0)
    request = base[:55_555] + (-1,)
    groups = list(trie.overlap_groups(request))
    assert groups[0].common_len == 55_555 and len(groups[0].entry_ids) == 1000 - 555
    assert sum(len(g.entry_ids) for g in groups) == 1000
    order = list(range(1000))
    random.Random(7).shuffle(order)
    for eid in order:
        trie.remove(base[: lengths[eid]], eid)
    assert trie.num_nodes == 1 and len(trie) == 0


def test_branches_off_a_long_spine() -> None:
    spine = tuple(range(100_000))
    trie = RadixTrie()
    trie.insert(spine, 0)
    for eid in range(1, 201):
        trie.insert(spine[: eid * 487] + (-eid, -eid), eid)  # branch after eid * 487 tokens
    assert trie.num_nodes == 1 + 1 + 2 * 200  # root, spine leaf, (split node + branch leaf) each
    groups = list(trie.overlap_groups(spine[:50_000] + (-1,)))
    # Below the divergence point: the spine and every branch made after token 50,000.
    assert groups[0].common_len == 50_000
    assert sorted(groups[0].entry_ids) == [0, *range(103, 201)]
    assert len(groups) == 1 + 102  # then one group per earlier branch point
    assert dict((g.common_len, g.entry_ids) for g in groups)[487 * 50] == [50]
    for eid in range(1, 201):
        trie.remove(spine[: eid * 487] + (-eid, -eid), eid)
    assert trie.num_nodes == 2


def test_many_children_under_one_node() -> None:
    trie = RadixTrie()
    for eid in range(2000):
        trie.insert((7, 7, eid, 1), eid)
    assert trie.num_nodes == 2 + 2000
    groups = list(trie.overlap_groups((7, 7, 1234, 1, 5)))
    assert groups[0].common_len == 4 and groups[0].entry_ids == [1234]
    assert groups[1].common_len == 2 and len(groups[1].entry_ids) == 1999
    assert trie.longest_prefix_entries((7, 7, 1234, 1, 5)) == [(4, 1234)]
