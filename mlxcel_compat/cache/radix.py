"""A radix trie over token ids: which stored entries share how much with a request.

One ``RadixTrie`` exists per bucket. Edges are compressed (a node's edge holds every
token from its parent to it), and each node records the ids of the entries whose
token vector ends exactly there. Invariants kept by ``insert``/``remove``:

- every non-root leaf holds at least one entry (empty leaves are pruned), and
- every non-root node without entries has at least two children (a pass-through node
  is merged back into its parent edge),

so the node count is O(entries) and enumerating a subtree costs O(entries in it).

Lookups answer two questions with one walk of the request:

- ``longest_prefix_entries``: entries whose whole token vector is a prefix of the
  request (the only candidates without APC);
- ``overlap_groups``: *every* entry with its common-prefix length against the request,
  grouped by that length, deepest group first and lazily, so the store can stop as
  soon as no later group can beat what it already has. Entries under the point where
  the walk stops share the walk's depth; entries hanging off an ancestor on the path
  share that ancestor's depth.

Everything is iterative: 100k-token prompts and deep chains of entries never recurse.
The trie is not thread-safe; one engine thread owns it. Nothing here imports mlx.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

EntryId = int

# Edge comparison runs in C on slices of this many tokens before falling back to a
# per-token loop inside the one chunk that differs.
_COMPARE_CHUNK = 64


@dataclass(slots=True, eq=False)
class TrieNode:
    """One node; ``edge`` is the token run from the parent down to this node."""

    id: int
    parent: TrieNode | None
    edge: tuple[int, ...]
    depth: int  # tokens from the root to the end of ``edge``
    children: dict[int, TrieNode] = field(default_factory=dict)  # keyed by first edge token
    entries: set[EntryId] = field(default_factory=set)  # entries ending exactly here

    def __repr__(self) -> str:
        return f"TrieNode(id={self.id}, depth={self.depth}, edge_len={len(self.edge)}, entries={len(self.entries)})"


@dataclass(slots=True)
class OverlapGroup:
    """Entries sharing exactly ``common_len`` leading tokens with the request."""

    common_len: int
    entry_ids: list[EntryId]


def _as_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    return tokens if isinstance(tokens, tuple) else tuple(tokens)


def _common_len_helper(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[start:]``."""
    n = len(edge)
    if tokens[start : start + n] == edge:  # common case: the whole edge matches (one C compare)
        return n
    n = min(n, len(tokens) - start)
    i = 0
    while i + _COMPARE_CHUNK <= n and edge[i : i + _COMPARE_CHUNK] == tokens[start + i : start + i + _COMPARE_CHUNK]:
        i += _COMPARE_CHUNK
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


class RadixTrie:
    """Compressed trie of token vectors, each node holding the entry ids ending there."""

    def __init__(self) -> None:
        self._ids = itertools.count()  # per instance: tests never reset a global
        self._root = TrieNode(id=next(self._ids), parent=None, edge=(), depth=0)
        self._num_nodes = 1
        self._num_entries = 0

    # --- public API ---

    def __len__(self) -> int:
        """Number of (tokens, entry id) pairs stored."""
        return self._num_entries

    @property
    def num_nodes(self) -> int:
        """Nodes in the trie, the root included (an empty trie has 1)."""
        return self._num_nodes

    def insert(self, tokens: Sequence[int], entry_id: EntryId) -> None:
        """Record that entry ``entry_id`` holds exactly ``tokens``.

        Args:
            tokens: the entry's token vector (non-empty).
            entry_id: the entry's id; may share a node with other ids.

        Raises:
            ValueError: empty tokens, or this id is already recorded at these tokens.
        """
        toks = _as_tuple(tokens)
        if not toks:
            raise ValueError("cannot insert an empty token vector")
        node = self._root
        pos = 0
        while pos < len(toks):
            child = node.children.get(toks[pos])
            if child is None:
                leaf = self._new_node(node, toks[pos:])
                node.children[toks[pos]] = leaf
                node, pos = leaf, len(toks)
                break
            k = _common_len_helper(child.edge, toks, pos)
            if k < len(child.edge):
                child = self._split_node(child, k)
            node, pos = child, pos + k
        if entry_id in node.entries:
            raise ValueError(f"entry {entry_id} is already stored at these tokens")
        node.entries.add(entry_id)
        self._num_entries += 1

    def remove(self, tokens: Sequence[int], entry_id: EntryId) -> None:
        """Forget entry ``entry_id`` at ``tokens``; prune and merge nodes it leaves useless.

        Raises:
            KeyError: the id is not recorded at exactly these tokens.
        """
        node = self._find_node_helper(_as_tuple(tokens))
        if node is None or entry_id not in node.entries:
            raise KeyError(entry_id)
        node.entries.remove(entry_id)
        self._num_entries -= 1
        self._prune_helper(node)

    def longest_prefix_entries(self, tokens: Sequence[int]) -> list[tuple[int, EntryId]]:
        """Entries whose whole token vector is a prefix of ``tokens``.

        Args:
            tokens: the request.

        Returns:
            ``(length, entry_id)`` pairs, longest first.
        """
        toks = _as_tuple(tokens)
        path, matched = self._walk_helper(toks)
        found: list[tuple[int, EntryId]] = []
        for node in reversed(path):
            if node.depth <= matched:
                found.extend((node.depth, eid) for eid in node.entries)
        return found

    def overlap_groups(self, tokens: Sequence[int]) -> Iterator[OverlapGroup]:
        """Every entry with its common-prefix length against ``tokens``, deepest first.

        Each entry appears in exactly one group; ``common_len`` strictly decreases from
        group to group and empty groups are skipped. An entry is a whole prefix of the
        request exactly when its length equals its group's ``common_len``. Groups are
        computed lazily, so stopping early skips enumerating shallow subtrees. Do not
        modify the trie while iterating.

        Args:
            tokens: the request.

        Yields:
            ``OverlapGroup`` records.
        """
        toks = _as_tuple(tokens)
        path, matched = self._walk_helper(toks)
        deepest = self._subtree_entries_helper(path[-1], skip=None)
        if deepest:
            yield OverlapGroup(matched, deepest)
        for i in range(len(path) - 2, -1, -1):
            ids = self._subtree_entries_helper(path[i], skip=path[i + 1])
            if ids:
                yield OverlapGroup(path[i].depth, ids)

    def best_overlap(self, tokens: Sequence[int]) -> list[tuple[EntryId, int]]:
        """The deepest overlap group as ``(entry_id, common_len)`` pairs ([] when empty)."""
        for group in self.overlap_groups(tokens):
            return [(eid, group.common_len) for eid in group.entry_ids]
        return []

    def pretty_print(self) -> str:
        """A readable dump of the trie (at most 10 tokens shown per edge)."""
        lines: list[str] = []
        stack: list[tuple[TrieNode, int]] = [(self._root, 0)]
        while stack:
            node, indent = stack.pop()
            shown = " ".join(str(t) for t in node.edge[:10])
            more = f" ...(+{len(node.edge) - 10})" if len(node.edge) > 10 else ""
            ids = ",".join(str(e) for e in sorted(node.entries))
            lines.append(f"{'  ' * indent}#{node.id} d={node.depth} [{shown}{more}] entries={{{ids}}}")
            for first in sorted(node.children, reverse=True):
                stack.append((node.children[first], indent + 1))
        return "\n".join(lines)

    # --- internal helpers ---

    def _new_node(self, parent: TrieNode, edge: tuple[int, ...]) -> TrieNode:
        self._num_nodes += 1
        return TrieNode(id=next(self._ids), parent=parent, edge=edge, depth=parent.depth + len(edge))

    def _split_node(self, child: TrieNode, k: int) -> TrieNode:
        """Cut ``child``'s edge after ``k`` tokens; returns the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.edge), f"{k=} {len(child.edge)=}"
        middle = self._new_node(parent, child.edge[:k])
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[k:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _walk_helper(self, toks: tuple[int, ...]) -> tuple[list[TrieNode], int]:
        """Follow ``toks`` from the root.

        Returns:
            The nodes touched (root first; the last one may be matched only partway
            along its edge) and the number of tokens matched.
        """
        node = self._root
        path = [node]
        pos = 0
        while pos < len(toks):
            child = node.children.get(toks[pos])
            if child is None:
                break
            k = _common_len_helper(child.edge, toks, pos)
            path.append(child)
            pos += k
            if k < len(child.edge):
                break
            node = child
        return path, pos

    def _find_node_helper(self, toks: tuple[int, ...]) -> TrieNode | None:
        """The node ending exactly at ``toks``, if there is one."""
        path, matched = self._walk_helper(toks)
        last = path[-1]
        return last if matched == len(toks) and last.depth == matched else None

    def _subtree_entries_helper(self, top: TrieNode, skip: TrieNode | None) -> list[EntryId]:
        """All entry ids at ``top`` and below, leaving out the subtree of ``skip``."""
        found = list(top.entries)
        stack = [c for c in top.children.values() if c is not skip]
        while stack:
            node = stack.pop()
            found.extend(node.entries)
            stack.extend(node.children.values())
        return found

    def _prune_helper(self, node: TrieNode) -> None:
        """Restore the invariants after ``node`` lost an entry."""
        while node is not self._root and not node.entries:
            parent = node.parent
            assert parent is not None
            if not node.children:
                # Empty leaf: drop it, then look at the parent, which may now be a pass-through.
                del parent.children[node.edge[0]]
                self._num_nodes -= 1
                node = parent
                continue
            if len(node.children) == 1:
                # Pass-through node: fold its edge into its only child.
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
                self._num_nodes -= 1
            break
