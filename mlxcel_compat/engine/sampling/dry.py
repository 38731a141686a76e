"""DRY ("Don't Repeat Yourself", llama.cpp's repetition penalty): the sequence breakers a
tokenizer's vocabulary gives a request's breaker strings, and the penalties of one step.

Only used when ``dry_multiplier > 0``, so the penalties are plain Python; the breakers' search
over the whole vocabulary is whole-array NumPy steps, run on the request's worker thread
(``server/pipeline.py``) and cached per tokenizer.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

_DRY_MAX_CHAR_LEN = 40
_DRY_MAX_SEQ_LEN = 20
_DRY_FLOAT_MAX_LOG = 88.7228391

_Breakers = dict[int, list[tuple[int, ...]]]
# tokenizer -> breaker strings -> processed breakers (public so that a benchmark can time the
# mapping itself: scripts/bench_scans.py clears it)
breakers_by_tokenizer: "weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, ...], _Breakers]]" = (
    weakref.WeakKeyDictionary()
)
_breakers_lock = threading.Lock()
# Breaker sets remembered per tokenizer (least recently used dropped): requests choose the
# breakers, so an unbounded cache would grow with every distinct list a client sends.
_DRY_CACHE_SIZE = 64


@dataclass(frozen=True)
class VocabText:
    """Every token's bytes (``special=True``, as llama.cpp's DRY sees them) back to back, so
    that a search over the whole vocabulary is a few whole-array steps instead of a Python loop
    over its tokens."""

    data: np.ndarray  # uint8: all the tokens' bytes, concatenated in token order
    starts: np.ndarray  # int64, n_vocab + 1: token t is data[starts[t]:starts[t + 1]]
    by_last: np.ndarray  # the non-empty tokens ordered by their last byte (then by id)
    last_bounds: np.ndarray  # by_last[last_bounds[b]:last_bounds[b + 1]] end with byte b

    @classmethod
    def of(cls, hf: Any) -> "VocabText":
        from mlxcel_compat.engine.textstream import all_token_bytes

        words = all_token_bytes(hf, special=True)
        starts = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum([len(w) for w in words], out=starts[1:])
        data = np.frombuffer(b"".join(words), dtype=np.uint8)
        nonempty = np.flatnonzero(starts[1:] > starts[:-1])
        last = data[starts[1:][nonempty] - 1]
        order = np.argsort(last, kind="stable")
        bounds = np.searchsorted(last[order], np.arange(257))
        return cls(data, starts, nonempty[order], bounds)

    def containing(self, needle: bytes) -> np.ndarray:
        """Sorted ids of the tokens whose bytes contain ``needle`` (not empty)."""
        n = len(needle)
        pos = np.flatnonzero(self.data[: max(len(self.data) - n + 1, 0)] == needle[0])
        for k in range(1, n):
            pos = pos[self.data[pos + k] == needle[k]]
        owner = np.searchsorted(self.starts, pos, side="right") - 1
        return np.unique(owner[pos + n <= self.starts[owner + 1]])  # not across two tokens

    def ending_with(self, piece: bytes) -> np.ndarray:
        """Sorted ids of the tokens whose bytes end with ``piece`` (not empty)."""
        ids = self.by_last[self.last_bounds[piece[-1]]:self.last_bounds[piece[-1] + 1]]
        ends = self.starts[ids + 1]
        keep = ends - self.starts[ids] >= len(piece)
        ids, ends = ids[keep], ends[keep]
        for k, byte in enumerate(piece[:-1]):
            keep = self.data[ends - len(piece) + k] == byte
            ids, ends = ids[keep], ends[keep]
        return ids  # by_last keeps token order within one last byte


def dry_sequence_breakers(
    tokenizer: Any, breakers: Sequence[str]
) -> dict[int, list[tuple[int, ...]]]:
    """Map head token -> token tails for every way a breaker string can appear.

    Same approach as llama.cpp's ``get_overlapping_token_sequences``: a token
    containing the whole breaker is a single-token breaker (empty tail); a token
    ending with a prefix of the breaker is a head whose tail is the tokenized
    rest. The vocabulary is searched with whole-array steps (:class:`VocabText`): a
    150k vocabulary took seconds a breaker set as a Python loop over its tokens. Results are
    still cached per tokenizer.
    """
    from mlxcel_compat.engine.textstream import derived
    from mlxcel_compat.tokenizer.served import unwrap_tokenizer

    hf = unwrap_tokenizer(tokenizer)
    key = tuple(breakers)
    with _breakers_lock:
        per_tokenizer = breakers_by_tokenizer.get(hf)
        cached = per_tokenizer.get(key) if per_tokenizer is not None else None
        if cached is not None:
            per_tokenizer.move_to_end(key)
            return cached

    text = derived(tokenizer, "vocab text", VocabText.of)
    result: dict[int, list[tuple[int, ...]]] = {}

    def add(token_id: int, tail: tuple[int, ...]) -> None:
        tails = result.setdefault(token_id, [])
        if tail not in tails:
            tails.append(tail)

    for breaker in breakers:
        needle = breaker.encode("utf-8")[:_DRY_MAX_CHAR_LEN]
        if not needle:
            continue
        containing = text.containing(needle)
        for token_id in containing.tolist():
            add(token_id, ())
        for overlap in range(1, len(needle)):  # a token ending with the breaker's first bytes
            heads = np.setdiff1d(text.ending_with(needle[:overlap]), containing, assume_unique=True)
            if not len(heads):
                continue
            try:
                rest = needle[overlap:].decode("utf-8")
            except UnicodeDecodeError:
                continue  # the split fell inside a character
            tail = tuple(hf.encode(rest, add_special_tokens=False))[:_DRY_MAX_SEQ_LEN]
            for token_id in heads.tolist():
                add(token_id, tail)
    with _breakers_lock:
        per_tokenizer = breakers_by_tokenizer.setdefault(hf, OrderedDict())
        per_tokenizer[key] = result
        while len(per_tokenizer) > _DRY_CACHE_SIZE:
            per_tokenizer.popitem(last=False)
    return result


def dry_penalties(
    tokens: Sequence[int],
    breakers: dict[int, list[tuple[int, ...]]],
    multiplier: float,
    base: float,
    allowed_length: int,
) -> dict[int, float]:
    """Penalty per token that would extend a repeated sequence (llama.cpp DRY).

    ``tokens`` is the scanned window, oldest first. A restart sequence (breaker)
    limits how far back a repetition may reach.
    """
    n = len(tokens)
    if n <= allowed_length:
        return {}
    rev = list(reversed(tokens))  # rev[0] is the most recent token

    # Step 1: the nearest breaker caps the repetition length.
    rep_limit = n
    for i in range(n):
        tails = breakers.get(rev[i])
        if not tails:
            continue
        longest = -1
        for tail in tails:
            size = len(tail)
            if longest < size <= i and all(tail[o] == rev[i - o - 1] for o in range(size)):
                longest = size
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return {}

    # Step 2: Z-function of the reversed window: z[k] is how many of the most
    # recent tokens also appear ending k tokens back.
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        length = min(right - k, z[k - left]) if k < right else 0
        while k + length < n and rev[length] == rev[k + length]:
            length += 1
        z[k] = length
        if k + length > right:
            left, right = k, k + length

    # Step 3: the token that followed each earlier occurrence would extend it.
    max_repeat: dict[int, int] = {}
    for k in range(1, n):
        repeat = min(z[k], rep_limit)
        if repeat >= allowed_length:
            token = rev[k - 1]
            if max_repeat.get(token, -1) < repeat:
                max_repeat[token] = repeat

    # Step 4: exponential penalty, clamped so pow() cannot overflow a float.
    max_exponent = int(_DRY_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    penalties: dict[int, float] = {}
    for token, repeat in max_repeat.items():
        if () in breakers.get(token, ()):
            continue  # single-token breakers are never penalized
        exponent = repeat - allowed_length
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        penalties[token] = multiplier * base**exponent
    return penalties
