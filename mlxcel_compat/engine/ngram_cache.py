"""Lookup decoding's n-gram caches: llama-server's ``--spec-type ngram-cache`` and its
``-lcs``/``-lcd`` files (llama.cpp's ``common/ngram-cache.cpp``, read as the reference).

Where ``ngram-simple`` needs the last n tokens (12 by default) to have occurred before, this kind
counts, for every 1- to 4-gram of the sequence, which tokens followed it and how often, and drafts
token by token from the longest of the last 1-4 tokens whose followers are clear enough: seen
often enough and dominated by one token (``CONTEXT``'s thresholds). So it still drafts where a
copied text was left for a few tokens and then taken up again, after a 2- or 3-token overlap,
which an n-gram of 4 or more must wait for. Two optional caches loaded at start-up add counts
from elsewhere, in llama.cpp's file format:

- ``-lcd`` (dynamic: counts from earlier generations, e.g. written by llama.cpp's
  ``llama-lookup``), consulted after the sequence's own with stricter thresholds (``DYNAMIC``);
- ``-lcs`` (static: bigram counts over a corpus), which weighs the candidates of the other two
  (a token the corpus knows counts 100 times its corpus count) and drafts alone when both fail.

Like llama-server, this server reads both files and never writes them. Two differences from
llama.cpp, neither of which changes a generated token (a draft only decides how much is verified
at once): a sequence's cache holds every n-gram of the sequence, where llama.cpp's misses those
that straddle two of its updates; and it begins with each request, where llama.cpp's keeps
counting across a slot's requests while the new prompt is no shorter than what it counted.

Pure Python, no MLX: a pass adds the n-grams of its few new tokens and looks up at most 4 parts a
drafted token; each part keeps its total and its most frequent token as it counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NGRAM_MIN, NGRAM_MAX = 1, 4  # the n-gram sizes counted (llama.cpp's LLAMA_NGRAM_MIN / _MAX)
STATIC_N = 2  # the static cache's n-grams (LLAMA_NGRAM_STATIC)
N_DRAFT = 8  # tokens drafted a pass, at most (llama-server's, fixed)
NULL = -1  # llama.cpp's LLAMA_TOKEN_NULL: a file's key shorter than NGRAM_MAX is padded with it


@dataclass(frozen=True)
class Thresholds:
    """A part drafts its most frequent token only with at least ``samples[n - 1]`` counts in all
    and that token at least ``percent[n - 1]`` % of them (n: the n-gram's size)."""

    samples: tuple[int, ...]
    percent: tuple[int, ...]

    def clear(self, n: int, total: int, top: int) -> bool:
        return total >= self.samples[n - 1] and 100 * top >= self.percent[n - 1] * total


CONTEXT = Thresholds((2, 2, 1, 1), (66, 50, 50, 50))  # the sequence's own counts (llama.cpp's "lax")
DYNAMIC = Thresholds((4, 3, 2, 2), (75, 66, 66, 66))  # -lcd's ("strict")


class Part:
    """The tokens seen after one n-gram and their counts, with the total and the most frequent
    token kept up to date (a tie keeps the token that got there first)."""

    __slots__ = ("counts", "total", "top", "top_count")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = self.top_count = 0
        self.top = NULL

    def add(self, token: int, count: int = 1) -> None:
        seen = self.counts.get(token, 0) + count
        self.counts[token] = seen
        self.total += count
        if seen > self.top_count:
            self.top, self.top_count = token, seen


NgramCache = dict[tuple[int, ...], Part]


class LookupCacheError(ValueError):
    """A -lcs/-lcd file that is not a llama.cpp n-gram cache."""


def load(path: str | Path) -> NgramCache:
    """A cache file as llama.cpp's ``common_ngram_cache_save`` writes it: records of the key's
    NGRAM_MAX tokens (int32, NULL past its size), the count of followers (int32), then each
    follower and its count (int32 pairs), little-endian, to the end of the file."""
    words = np.fromfile(path, dtype="<i4")
    if words.size * 4 != Path(path).stat().st_size:
        raise LookupCacheError(f"'{path}' is not a whole number of 32-bit words")
    values = words.tolist()
    cache: NgramCache = {}
    i = 0
    while i < len(values):
        if i + NGRAM_MAX + 1 > len(values):
            raise LookupCacheError(f"'{path}' ends inside a record's key (word {i})")
        key = values[i:i + NGRAM_MAX]
        size = key.index(NULL) if NULL in key else NGRAM_MAX
        n_followers = values[i + NGRAM_MAX]
        if size == 0 or any(t != NULL for t in key[size:]) or n_followers <= 0:
            raise LookupCacheError(f"'{path}': record at word {i} is not an n-gram with followers")
        i += NGRAM_MAX + 1
        if i + 2 * n_followers > len(values):
            raise LookupCacheError(f"'{path}' ends inside the followers of the record at word {i - NGRAM_MAX - 1}")
        part = cache.setdefault(tuple(key[:size]), Part())
        for j in range(i, i + 2 * n_followers, 2):
            if values[j + 1] <= 0:
                raise LookupCacheError(f"'{path}': a follower's count at word {j + 1} is not positive")
            part.add(values[j], values[j + 1])
        i += 2 * n_followers
    return cache


@dataclass
class LookupFiles:
    """The caches read at start-up (-lcs, -lcd): shared by every sequence, never written."""

    static: NgramCache = field(default_factory=dict)
    dynamic: NgramCache = field(default_factory=dict)

    @classmethod
    def read(cls, static: str | None, dynamic: str | None) -> "LookupFiles":
        return cls(load(static) if static else {}, load(dynamic) if dynamic else {})


@dataclass
class LookupState:
    """One sequence's own counts: every n-gram of its first ``counted`` tokens."""

    cache: NgramCache = field(default_factory=dict)
    counted: int = 0

    def update(self, tokens: list[int], sampled: int) -> None:
        """Count the n-grams that end in the tokens of ``tokens`` + ``sampled`` after the first
        ``counted``. The sequence only grows within a request, but for a context shift, which
        drops tokens from its middle: counting then goes on from the new end (the counts of
        the dropped text stay, as drafts they are only guesses)."""
        end = len(tokens) + 1
        self.counted = min(self.counted, end - 1)
        start = max(self.counted, NGRAM_MIN)
        base = max(0, start - NGRAM_MAX)
        tail = [int(t) for t in tokens[base:]] + [int(sampled)]
        for i in range(start - base, len(tail)):
            follower = tail[i]
            for n in range(NGRAM_MIN, min(NGRAM_MAX, i) + 1):
                key = tuple(tail[i - n:i])
                part = self.cache.get(key)
                if part is None:
                    part = self.cache[key] = Part()
                part.add(follower)
        self.counted = end


def _choose(primary: NgramCache, keys: list[tuple[int, ...]], static_part: Part | None,
            thresholds: Thresholds) -> int:
    """The token of the longest key whose part is clear (``keys`` from the shortest): its most
    frequent follower, or with a static part, the follower whose count times its corpus weight
    (100 x the static count, 1 where the corpus has none) is the largest."""
    for key in reversed(keys):
        part = primary.get(key)
        if part is None:
            continue
        if static_part is None:
            token, top = part.top, part.top_count
        else:
            token, top, best = NULL, 0, 0
            for candidate, count in part.counts.items():
                weighted = count * 100 * static_part.counts.get(candidate, 0) or count
                if weighted > best:
                    token, top, best = candidate, count, weighted
        if thresholds.clear(len(key), part.total, top):
            return token
    return NULL


def draft(state: LookupState, files: LookupFiles | None, tokens: list[int], sampled: int,
          n_max: int = N_DRAFT) -> list[int]:
    """Up to ``n_max`` tokens to follow ``tokens`` + ``sampled``, each from the sequence's own
    counts (CONTEXT), else -lcd's (DYNAMIC), else -lcs's bigram alone (CONTEXT's 2-gram
    thresholds); the first token none of them gives ends the draft."""
    state.update(tokens, sampled)
    if len(tokens) + 1 < STATIC_N:
        return []
    static = files.static if files is not None else {}
    dynamic = files.dynamic if files is not None else {}
    window = [int(t) for t in tokens[max(0, len(tokens) - NGRAM_MAX + 1):]] + [int(sampled)]
    drafted: list[int] = []
    while len(drafted) < n_max:
        keys = [tuple(window[-n:]) for n in range(NGRAM_MIN, min(NGRAM_MAX, len(window)) + 1)]
        static_part = static.get(tuple(window[-STATIC_N:])) if static else None
        token = _choose(state.cache, keys, static_part, CONTEXT)
        if token == NULL and dynamic:
            token = _choose(dynamic, keys, static_part, DYNAMIC)
        if token == NULL and static_part is not None:  # the corpus's bigram alone
            token = static_part.top if CONTEXT.clear(STATIC_N, static_part.total, static_part.top_count) else NULL
        if token == NULL:
            break
        drafted.append(token)
        window = window[1 - NGRAM_MAX:] + [token]
    return drafted
