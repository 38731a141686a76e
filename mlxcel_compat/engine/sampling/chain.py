"""llama.cpp-compatible token sampling on MLX.

The sampler chain follows llama.cpp (``common/sampling.cpp`` and
``src/llama-sampler.cpp``): logit bias first, then the configured samplers in
order, then the final draw. The common path stays in lazy MLX ops so the engine
can ``mx.async_eval`` the sampled token and pipeline decode steps.

Representation: llama.cpp shrinks its candidate array as samplers remove
tokens. Here a removed token gets a ``-inf`` logit instead, except ``top_k``,
which compacts the candidates to ``k`` entries (``ids`` + ``logits``) so later
sorts run on ``k`` values rather than the whole vocabulary.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import mlx.core as mx
import numpy as np

DEFAULT_SEED = 0xFFFFFFFF

DEFAULT_SAMPLERS: tuple[str, ...] = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)

DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")

CANONICAL_SAMPLERS: tuple[str, ...] = (
    "dry",
    "top_k",
    "top_p",
    "top_n_sigma",
    "typ_p",
    "min_p",
    "temperature",
    "xtc",
    "infill",
    "penalties",
    "adaptive_p",
)

# llama.cpp common_sampler_type_to_chr
SAMPLER_CHARS: dict[str, str] = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "t": "temperature",
    "x": "xtc",
    "i": "infill",
    "e": "penalties",
    "a": "adaptive_p",
}

_NEG_INF = float("-inf")
_FLOAT32_LOWEST = float(np.finfo(np.float32).min)


def _build_sampler_aliases() -> dict[str, str]:
    """Canonical names plus the kebab-case, no-dash and misc aliases llama.cpp accepts."""
    names = {name: name for name in CANONICAL_SAMPLERS}
    for name in CANONICAL_SAMPLERS:
        if "_" in name:
            names.setdefault(name.replace("_", "-"), name)
            names.setdefault(name.replace("_", ""), name)
    # "typical"/"typical-p" come from older llama.cpp builds; harmless to keep.
    extra = {
        "nucleus": "top_p",
        "temp": "temperature",
        "typ": "typ_p",
        "typical": "typ_p",
        "typical-p": "typ_p",
    }
    for alias, name in extra.items():
        names.setdefault(alias, name)
    return names


SAMPLER_ALIASES: dict[str, str] = _build_sampler_aliases()


def parse_samplers(value: list[str] | str, *, strict: bool = True) -> list[str]:
    """Parse the ``samplers`` request field into canonical sampler names.

    A list holds names (case-insensitive, aliases allowed); a string holds
    llama.cpp's one-character codes (e.g. ``"edskypmxt"``). llama.cpp only logs
    a warning for unknown entries and drops them; ``strict=False`` does the same,
    the default raises ``ValueError`` so a typo does not go unnoticed.
    """
    result: list[str] = []
    if isinstance(value, str):
        for ch in value:
            name = SAMPLER_CHARS.get(ch)
            if name is None:
                if strict:
                    raise ValueError(
                        f"unknown sampler character {ch!r}; valid characters are "
                        f"{''.join(SAMPLER_CHARS)!r}"
                    )
                continue
            result.append(name)
        return result
    if not isinstance(value, (list, tuple)):
        raise ValueError("samplers must be an array of names or a string of sampler characters")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"sampler names must be strings, got {item!r}")
        name = SAMPLER_ALIASES.get(item.lower())
        if name is None:
            if strict:
                raise ValueError(
                    f"unknown sampler name {item!r}; valid names are "
                    f"{', '.join(CANONICAL_SAMPLERS)}"
                )
            continue
        result.append(name)
    return result


# strtol(key, &end, 10) with *end == 0: optional whitespace and sign, then digits.
# An empty key also parses (as 0) in llama.cpp, so it is kept as a token id too.
_C_LONG_RE = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def _parse_bias_value(value: Any) -> float | None:
    """A number is a bias, ``false`` bans the token, anything else is skipped."""
    if isinstance(value, bool):
        return _NEG_INF if value is False else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def parse_logit_bias(
    value: Any,
    vocab_size: int,
    tokenize: Callable[[str], list[int]],
) -> dict[int, float]:
    """Parse the three llama.cpp ``logit_bias`` formats into ``{token_id: bias}``.

    ``tokenize`` must tokenize without special tokens (no BOS, no special-token
    parsing), as llama.cpp does for string keys. llama.cpp keeps a list of
    (token, bias) entries and applies all of them, so a token named twice gets
    the sum of its biases here.
    """
    if value is None:
        return {}
    out: dict[int, float] = {}

    def add(token: int, bias: float) -> None:
        if 0 <= token < vocab_size:
            out[token] = out.get(token, 0.0) + bias

    if isinstance(value, list):
        for entry in value:
            if not isinstance(entry, list) or len(entry) != 2:
                continue
            bias = _parse_bias_value(entry[1])
            if bias is None:
                continue
            key = entry[0]
            if isinstance(key, int) and not isinstance(key, bool):
                add(key, bias)
            elif isinstance(key, str):
                for token in tokenize(key):
                    add(int(token), bias)
    elif isinstance(value, dict):
        for key, raw in value.items():
            bias = _parse_bias_value(raw)
            if bias is None:
                continue
            key = str(key)
            if key == "" or _C_LONG_RE.fullmatch(key):
                add(int(key) if key.strip() else 0, bias)
            else:
                for token in tokenize(key):
                    add(int(token), bias)
    else:
        raise ValueError("logit_bias must be an array of [token, bias] pairs or an object")
    return out


@dataclass
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in llama.cpp."""

    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(
        default_factory=lambda: list(DEFAULT_DRY_SEQUENCE_BREAKERS)
    )
    min_keep: int = 0
    seed: int = DEFAULT_SEED
    samplers: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLERS))
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    # Not in the default chain; mirostat replaces it when set to 1 or 2.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9

    def to_json(self, seed: int | None = None) -> dict[str, Any]:
        """The sampling keys of llama.cpp's ``generation_settings``, in its order.

        Pass ``seed=chain.seed`` to report the seed actually drawn for a random one.
        """
        return {
            "seed": self.seed if seed is None else seed,
            "temperature": self.temperature,
            "dynatemp_range": self.dynatemp_range,
            "dynatemp_exponent": self.dynatemp_exponent,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "top_n_sigma": self.top_n_sigma,
            "xtc_probability": self.xtc_probability,
            "xtc_threshold": self.xtc_threshold,
            "typical_p": self.typical_p,
            "repeat_last_n": self.repeat_last_n,
            "repeat_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "dry_multiplier": self.dry_multiplier,
            "dry_base": self.dry_base,
            "dry_allowed_length": self.dry_allowed_length,
            "dry_penalty_last_n": self.dry_penalty_last_n,
            "dry_sequence_breakers": list(self.dry_sequence_breakers),
            "samplers": list(self.samplers),
        }


@dataclass
class SampleResult:
    """One sampling step. All arrays are lazy until the engine evaluates them.

    ``token``: int32 scalar. ``logprobs``: log-softmax of the raw logits (before
    bias), shape (vocab,), for ``n_probs`` / OpenAI logprobs. ``probs``: the
    probabilities of the final draw over the vocabulary (zero for removed
    tokens), only when ``post_sampling_probs`` is on.
    """

    token: mx.array
    logprobs: mx.array
    probs: mx.array | None = None


def _top_pairs(values: mx.array, n: int) -> tuple[list[int], list[float]]:
    """Ids and values of the ``n`` largest entries, best first, ties by lower id."""
    flat = values.reshape(-1).astype(mx.float32)
    size = flat.shape[0]
    n = min(n, size)
    if n <= 0:
        return [], []
    if n < size:
        idx = mx.argpartition(-flat, kth=n - 1)[:n]
    else:
        idx = mx.arange(size)
    ids = np.array(idx).astype(np.int64)
    vals = np.array(flat[idx]).astype(np.float64)
    order = np.lexsort((ids, -vals))
    return ids[order].tolist(), vals[order].tolist()


def top_logprobs(logprobs: mx.array, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens as ``(id, logprob)``; log(0) becomes the lowest float.

    llama.cpp never reports ``-inf`` (JSON would turn it into null).
    """
    ids, vals = _top_pairs(logprobs, n)
    return [(i, v if v != _NEG_INF else _FLOAT32_LOWEST) for i, v in zip(ids, vals)]


def top_probs(probs: mx.array, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens after the chain as ``(id, prob)``, zeros dropped."""
    ids, vals = _top_pairs(probs, n)
    return [(i, v) for i, v in zip(ids, vals) if v > 0.0]


# ---------------------------------------------------------------------------
# DRY (only used when dry_multiplier > 0, so plain Python is fine)
# ---------------------------------------------------------------------------

_DRY_MAX_CHAR_LEN = 40
_DRY_MAX_SEQ_LEN = 20
_DRY_FLOAT_MAX_LOG = 88.7228391

_Breakers = dict[int, list[tuple[int, ...]]]
# tokenizer -> breaker strings -> processed breakers
_dry_cache: "weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, ...], _Breakers]]" = (
    weakref.WeakKeyDictionary()
)
_dry_cache_lock = threading.Lock()
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
    with _dry_cache_lock:
        per_tokenizer = _dry_cache.get(hf)
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
    with _dry_cache_lock:
        per_tokenizer = _dry_cache.setdefault(hf, OrderedDict())
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


# ---------------------------------------------------------------------------
# The chain
# ---------------------------------------------------------------------------


@dataclass
class _Cands:
    """Candidate set: ``logits`` over the vocab (``ids`` None) or over ``ids``."""

    logits: mx.array
    ids: mx.array | None = None

    def gather(self, full: mx.array) -> mx.array:
        return full if self.ids is None else full[self.ids]


def _softmax(logits: mx.array) -> mx.array:
    return mx.softmax(logits, axis=-1)


def _softmax_np(logits: np.ndarray) -> np.ndarray:
    """Softmax of float64 logits for the samplers that run in NumPy. Logits that overflowed to
    +inf (a temperature near 0 divides them) hold all the probability, shared equally; the
    shift by the maximum would otherwise compute inf - inf."""
    top = logits.max()
    probs = np.isposinf(logits).astype(np.float64) if np.isposinf(top) else np.exp(logits - top)
    return probs / probs.sum()


def _keep_sorted_prefix(cond: mx.array) -> mx.array:
    """Keep sorted positions up to and including the first one where ``cond`` holds."""
    before = mx.cumsum(cond.astype(mx.int32)) - cond.astype(mx.int32)
    return before == 0


def _scatter_mask(order: mx.array, sorted_mask: mx.array) -> mx.array:
    """Map a mask over sorted positions back to candidate positions."""
    empty = mx.zeros(order.shape, dtype=mx.bool_)
    return mx.put_along_axis(empty, order, sorted_mask, axis=0)


def _greedy_mask(logits: mx.array) -> mx.array:
    """llama.cpp temp <= 0: keep the (first) highest logit, set the rest to -inf."""
    best = mx.argmax(logits)
    keep = mx.arange(logits.shape[0]) == best
    return mx.where(keep, logits, _NEG_INF)


def _alive(logits: mx.array) -> mx.array:
    return logits > _NEG_INF


def _as_int(token: Any) -> int:
    return int(token.item()) if isinstance(token, mx.array) else int(token)


def _index_array(tokens: Sequence[Any]) -> mx.array:
    """Token ids (ints and/or lazy MLX scalars) as one int32 array, without syncing."""
    ints = [t for t in tokens if not isinstance(t, mx.array)]
    lazy = [t.reshape(1).astype(mx.int32) for t in tokens if isinstance(t, mx.array)]
    parts = ([mx.array(ints, dtype=mx.int32)] if ints else []) + lazy
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


@dataclass(frozen=True)
class PieceIndex:
    """A vocabulary's pieces in sorted order, for the infill merge: which tokens extend a token.

    The pieces that start with a given piece form one run of the sorted pieces, so the tokens whose
    piece starts with token t's are ``order[run_start[r]:run_end[r]]`` with ``r = rank[t]`` (t
    itself included, and the tokens with an equal piece, before or after it). Built once per
    tokenizer (:func:`piece_index`), because every infill step without a top-k before it sees the
    whole vocabulary.
    """

    order: np.ndarray  # token ids sorted by piece
    rank: np.ndarray  # rank[t]: where token t sits in ``order``
    run_start: np.ndarray  # run_start[pos]: the first of the pieces equal to the one at ``pos``
    run_end: np.ndarray  # run_end[pos]: the end of the pieces that start with the one at ``pos``

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes]) -> "PieceIndex":
        order = sorted(range(len(pieces)), key=pieces.__getitem__)
        ordered = [pieces[i] for i in order]
        run_start = np.arange(len(order), dtype=np.int64)
        run_end = run_start + 1
        for pos, head in enumerate(ordered):
            if not head:  # an empty piece (a special token) is nobody's prefix, as in llama.cpp
                continue
            if pos and ordered[pos - 1] == head:
                run_start[pos], run_end[pos] = run_start[pos - 1], run_end[pos - 1]
                continue
            end = pos + 1
            while end < len(ordered) and ordered[end].startswith(head):
                end += 1
            run_end[pos] = end
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return cls(np.asarray(order, dtype=np.int64), rank, run_start, run_end)


def piece_index(tokenizer: Any) -> PieceIndex:
    """The tokenizer's :class:`PieceIndex` over its generated-text pieces (built once)."""
    from mlxcel_compat.engine.textstream import all_token_bytes, derived

    def build(hf: Any) -> PieceIndex:
        return PieceIndex.from_pieces(all_token_bytes(hf, special=False))

    return derived(tokenizer, "infill piece index", build)


def _merge_prefix_pieces(index: PieceIndex, ids: np.ndarray, logits: np.ndarray, probs: np.ndarray) -> None:
    """The infill sampler's merge, in place over the candidates ``ids`` (their logits and
    probabilities alongside): a candidate whose piece is a prefix of another's pools the two
    probabilities into the likelier one and the other drops out (logit -inf).

    llama.cpp compares every pair in order (i0 outer, i1 inner, both in candidate order), so
    the result depends on that order; this visits the same pairs in the same order but takes
    each i0's partners from the vocabulary's :class:`PieceIndex`, and skips the candidates that
    no other token extends (they have no partner). Without a top-k before it the sampler sees the
    whole vocabulary, and comparing every pair was quadratic in it: minutes of the engine thread
    a step for an 8K vocabulary, stalling every other request.
    """
    n_vocab = len(index.rank)
    position = np.full(max(n_vocab, int(ids.max()) + 1), -1, dtype=np.int64)
    position[ids] = np.arange(len(ids))
    known = ids < n_vocab  # a model's padded vocabulary beyond the tokenizer: no piece
    rank = np.where(known, index.rank[np.minimum(ids, n_vocab - 1)], 0)
    run_start, run_end = index.run_start[rank], index.run_end[rank]
    for i0 in np.flatnonzero(known & (run_end - run_start > 1)).tolist():
        partners = position[index.order[run_start[i0] : run_end[i0]]]
        for i1 in np.sort(partners[partners >= 0]).tolist():
            if logits[i0] == _NEG_INF:
                break
            if i1 == i0 or logits[i1] == _NEG_INF:
                continue
            dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
            probs[dst] += probs[src]
            logits[src] = _NEG_INF
            probs[src] = 0.0


class SamplerChain:
    """Samples tokens for one request with llama.cpp's chain semantics.

    Build one per request (it holds the RNG and penalty history) and call
    :meth:`sample` once per generated token, from any thread. ``history`` is the
    prompt plus the generated tokens so far; it must only grow between calls
    (elements may be ints or lazy MLX scalars, so the newest token need not be
    evaluated yet). ``n_ctx`` is what ``-1`` means for ``repeat_last_n`` /
    ``dry_penalty_last_n`` (None: unbounded). ``tokenizer`` (the served
    tokenizer, an HF tokenizer or an mlx-lm wrapper) is needed only for DRY and infill.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        eog_token_ids: Iterable[int] = (),
        tokenizer: Any = None,
        n_ctx: int | None = None,
    ) -> None:
        self.params = params
        self.vocab_size = int(vocab_size)
        self.eog_token_ids = [int(t) for t in eog_token_ids]
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.seed = int(params.seed) & 0xFFFFFFFF
        if self.seed == DEFAULT_SEED:
            self.seed = secrets.randbits(32)

        samplers = [SAMPLER_ALIASES.get(str(name).lower()) for name in params.samplers]
        if any(name is None for name in samplers):
            raise ValueError(f"unknown sampler in {params.samplers!r}")

        self._build_logit_bias()

        self._mirostat = int(params.mirostat)
        if self._mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0, 1 or 2, got {params.mirostat}")
        self._adaptive = "adaptive_p" in samplers and self._mirostat == 0
        self._stages = (
            [name for name in samplers if self._is_active(name)] if self._mirostat == 0 else []
        )
        if "infill" in self._stages and tokenizer is None:
            raise ValueError("the infill sampler needs a tokenizer")

        self._pen_active = self._mirostat == 0 and "penalties" in self._stages
        self._dry_active = self._mirostat == 0 and "dry" in self._stages
        self._greedy_prefix = self._find_greedy_prefix()

        keys = mx.random.split(mx.random.key(self.seed), 2)
        self._dist_key, self._xtc_key = keys[0], keys[1]
        mx.eval(self._dist_key, self._xtc_key)
        self._np_rng = np.random.default_rng(self.seed)
        self._mirostat_mu = 2.0 * params.mirostat_tau
        decay = min(max(params.adaptive_decay, 0.0), 0.99)
        self._adaptive_decay = decay
        self._adaptive_weighted_sum = params.adaptive_target / (1.0 - decay)
        self._adaptive_total_weight = 1.0 / (1.0 - decay)

        self._n_seen = 0
        self._counts: mx.array | None = None
        self._window: deque[Any] = deque()
        self._dry_tokens: list[int] = []
        self._dry_breakers: dict[int, list[tuple[int, ...]]] = {}
        if self._dry_active and params.dry_sequence_breakers:
            if tokenizer is None:
                raise ValueError("the dry sampler needs a tokenizer for its sequence breakers")
            self._dry_breakers = dry_sequence_breakers(tokenizer, params.dry_sequence_breakers)

    # -- construction helpers ------------------------------------------------

    def _build_logit_bias(self) -> None:
        bias: dict[int, float] = {}
        for token, value in self.params.logit_bias.items():
            token = int(token)
            if 0 <= token < self.vocab_size:
                bias[token] = bias.get(token, 0.0) + float(value)
        if self.params.ignore_eos:
            for token in self.eog_token_ids:
                if 0 <= token < self.vocab_size:
                    bias[token] = bias.get(token, 0.0) + _NEG_INF
        self._bias_idx: mx.array | None = None
        self._bias_val: mx.array | None = None
        self._bias_np: tuple[np.ndarray, np.ndarray] | None = None  # argmax_of's copy, made at first use
        if bias:
            self._bias_idx = mx.array(list(bias.keys()), dtype=mx.int32)
            self._bias_val = mx.array(list(bias.values()), dtype=mx.float32)

    def _is_active(self, name: str) -> bool:
        """Mirror llama.cpp, which swaps disabled samplers for no-op ones."""
        p = self.params
        if name == "penalties":
            return p.repeat_last_n != 0 and not (
                p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            )
        if name == "dry":
            return p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0
        if name == "top_k":
            return p.top_k > 0
        if name == "top_p":
            return p.top_p < 1.0
        if name == "min_p":
            return p.min_p > 0.0
        if name == "typ_p":
            return p.typical_p < 1.0
        if name == "top_n_sigma":
            return p.top_n_sigma > 0.0
        if name == "xtc":
            return p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5
        if name == "temperature":
            return not (p.temperature == 1.0 and p.dynatemp_range <= 0.0)
        if name == "infill":
            return True
        return False  # adaptive_p is the final draw, not a stage

    def _find_greedy_prefix(self) -> list[str] | None:
        """Stages to run before a plain argmax, or None if the full chain is needed.

        With temperature <= 0 the temperature stage keeps only the top token, so
        the result is the argmax after the stages that change logits. Stages that
        always keep the top token (top-k, top-p, min-p, top-n-sigma) can be
        skipped; typical-p, XTC and infill may drop it, so they force the full path.
        """
        p = self.params
        if self._mirostat or (self._adaptive and p.adaptive_target >= 0.0):
            return None
        if p.temperature > 0.0 or p.dynatemp_range > 0.0 or "temperature" not in self._stages:
            return None
        prefix = self._stages[: self._stages.index("temperature")]
        if any(name in ("typ_p", "xtc", "infill") for name in prefix):
            return None
        return [name for name in prefix if name in ("penalties", "dry")]

    # -- history -------------------------------------------------------------

    def _penalty_window_size(self) -> int | None:
        last_n = self.params.repeat_last_n
        return self.n_ctx if last_n < 0 else last_n

    def _dry_window_size(self) -> int | None:
        last_n = self.params.dry_penalty_last_n
        size = self.n_ctx if last_n < 0 else last_n
        if size is not None and self.n_ctx is not None:
            size = min(size, self.n_ctx)
        return size

    def _update_history(self, history: Sequence[Any] | None) -> None:
        if history is None or not (self._pen_active or self._dry_active):
            return
        if len(history) < self._n_seen:
            # Not an append: start over from this history.
            self._n_seen = 0
            self._counts = None
            self._window.clear()
            self._dry_tokens = []
        new = [
            t
            for t in history[self._n_seen :]
            if isinstance(t, mx.array) or 0 <= int(t) < self.vocab_size
        ]
        self._n_seen = len(history)
        if not new:
            return
        if self._pen_active:
            self._penalty_accept(new)
        if self._dry_active:
            self._dry_accept(new)

    def _penalty_accept(self, new: list[Any]) -> None:
        """Keep token counts over the last ``repeat_last_n`` tokens, incrementally."""
        cap = self._penalty_window_size()
        if self._counts is None:
            self._counts = mx.zeros((self.vocab_size,), dtype=mx.float32)
        if cap is not None and len(new) >= cap:
            self._window = deque(new[-cap:])
            self._counts = mx.zeros((self.vocab_size,), dtype=mx.float32)
            self._counts = self._counts.at[_index_array(list(self._window))].add(1.0)
            return
        self._counts = self._counts.at[_index_array(new)].add(1.0)
        if cap is None:
            return
        self._window.extend(new)
        evicted = []
        while len(self._window) > cap:
            evicted.append(self._window.popleft())
        if evicted:
            self._counts = self._counts.at[_index_array(evicted)].add(-1.0)

    def _dry_accept(self, new: list[Any]) -> None:
        self._dry_tokens.extend(_as_int(t) for t in new)
        cap = self._dry_window_size()
        if cap is not None and len(self._dry_tokens) > 2 * cap + 64:
            del self._dry_tokens[:-cap]

    # -- stages --------------------------------------------------------------

    def _apply_penalties(self, c: _Cands) -> _Cands:
        p = self.params
        if self._counts is None:
            return c
        counts = c.gather(self._counts)
        logits = c.logits
        repeated = mx.where(logits <= 0, logits * p.repeat_penalty, logits / p.repeat_penalty)
        penalized = repeated - counts * p.frequency_penalty - p.presence_penalty
        return _Cands(mx.where(counts > 0, penalized, logits), c.ids)

    def _apply_dry(self, c: _Cands) -> _Cands:
        p = self.params
        size = self._dry_window_size()
        tokens = self._dry_tokens if size is None else self._dry_tokens[-size:] if size else []
        penalties = dry_penalties(
            tokens, self._dry_breakers, p.dry_multiplier, p.dry_base, p.dry_allowed_length
        )
        penalties = {t: v for t, v in penalties.items() if 0 <= t < self.vocab_size}
        if not penalties:
            return c
        idx = mx.array(list(penalties.keys()), dtype=mx.int32)
        val = mx.array(list(penalties.values()), dtype=mx.float32)
        if c.ids is None:
            return _Cands(c.logits.at[idx].add(-val), None)
        dense = mx.zeros((self.vocab_size,), dtype=mx.float32).at[idx].add(val)
        return _Cands(c.logits - dense[c.ids], c.ids)

    def _apply_top_k(self, c: _Cands) -> _Cands:
        k = self.params.top_k
        if k >= c.logits.shape[0]:
            return c
        idx = mx.argpartition(-c.logits, kth=k - 1)[:k]
        ids = idx if c.ids is None else c.ids[idx]
        return _Cands(c.logits[idx], ids)

    def _apply_top_p(self, c: _Cands) -> _Cands:
        p = self.params
        order = mx.argsort(-c.logits)
        probs = _softmax(c.logits)[order]
        cum = mx.cumsum(probs)
        positions = mx.arange(probs.shape[0])
        cond = (cum >= p.top_p) & (positions + 1 >= p.min_keep)
        keep = _scatter_mask(order, _keep_sorted_prefix(cond))
        return _Cands(mx.where(keep, c.logits, _NEG_INF), c.ids)

    def _apply_min_p(self, c: _Cands) -> _Cands:
        p = self.params
        logits = c.logits
        threshold = mx.max(logits) + math.log(p.min_p)
        keep = logits >= threshold
        n = logits.shape[0]
        if p.min_keep > 0:
            # Keep at least min_keep tokens: the filter result or the top min_keep.
            m = min(p.min_keep, n)
            top = mx.argpartition(-logits, kth=m - 1)[:m]
            keep = mx.put_along_axis(keep, top, mx.array(True), axis=0)
        return _Cands(mx.where(keep, logits, _NEG_INF), c.ids)

    def _apply_typical(self, c: _Cands) -> _Cands:
        p = self.params
        probs = _softmax(c.logits)
        logp = mx.log(probs)
        entropy = -mx.sum(mx.where(probs > 0, probs * logp, 0.0))
        shifted = mx.abs(-logp - entropy)  # +inf for removed tokens: sorted last
        order = mx.argsort(shifted)
        cum = mx.cumsum(probs[order])
        positions = mx.arange(probs.shape[0])
        cond = cum > p.typical_p
        if p.min_keep > 0:
            cond = cond & (positions >= p.min_keep - 1)
        keep = _scatter_mask(order, _keep_sorted_prefix(cond))
        return _Cands(mx.where(keep, c.logits, _NEG_INF), c.ids)

    def _apply_top_n_sigma(self, c: _Cands) -> _Cands:
        logits = c.logits
        if logits.shape[0] <= 1:
            return c
        alive = _alive(logits)
        count = mx.maximum(mx.sum(alive), 1)
        mean = mx.sum(mx.where(alive, logits, 0.0)) / count
        var = mx.sum(mx.where(alive, mx.square(logits - mean), 0.0)) / count
        cut = mx.max(logits) - self.params.top_n_sigma * mx.sqrt(var)
        return _Cands(mx.where(logits < cut, _NEG_INF, logits), c.ids)

    def _apply_xtc(self, c: _Cands) -> _Cands:
        """Exclude Top Choices: with some chance, drop all tokens above the
        threshold except the least likely of them."""
        p = self.params
        self._xtc_key, sub = mx.random.split(self._xtc_key)
        chance = mx.random.uniform(key=sub)
        logits = c.logits
        order = mx.argsort(-logits)
        sorted_probs = _softmax(logits)[order]
        n_remove = mx.sum(sorted_probs >= p.xtc_threshold) - 1
        n_alive = mx.sum(_alive(logits))
        apply = (
            (chance <= p.xtc_probability)
            & (n_alive >= 2)
            & (n_remove > 0)
            & (n_alive - n_remove >= p.min_keep)
        )
        remove = _scatter_mask(order, mx.arange(logits.shape[0]) < n_remove)
        return _Cands(mx.where(apply & remove, _NEG_INF, logits), c.ids)

    def _apply_temperature(self, c: _Cands) -> _Cands:
        p = self.params
        if p.dynatemp_range <= 0.0:
            return self._apply_plain_temperature(c, p.temperature)
        logits = c.logits
        if logits.shape[0] <= 1:
            return c
        min_temp = max(0.0, p.temperature - p.dynatemp_range)
        max_temp = p.temperature + p.dynatemp_range
        # Removed tokens do not count towards the maximum entropy here; llama.cpp
        # counts every candidate left in its array (bias-banned ones included).
        n_alive = mx.sum(_alive(logits))
        probs = _softmax(logits)
        entropy = -mx.sum(mx.where(probs > 0, probs * mx.log(probs), 0.0))
        max_entropy = mx.log(mx.maximum(n_alive, 2).astype(mx.float32))
        normalized = entropy / max_entropy
        dyn_temp = min_temp + (max_temp - min_temp) * mx.power(normalized, p.dynatemp_exponent)
        scaled = logits / mx.maximum(dyn_temp, 1e-30)
        out = mx.where(dyn_temp <= 0, _greedy_mask(logits), scaled)
        return _Cands(mx.where(n_alive > 1, out, logits), c.ids)

    @staticmethod
    def _apply_plain_temperature(c: _Cands, temperature: float) -> _Cands:
        if temperature <= 0.0:
            return _Cands(_greedy_mask(c.logits), c.ids)
        if temperature == 1.0:
            return c
        return _Cands(c.logits / temperature, c.ids)

    def _apply_infill(self, c: _Cands) -> _Cands:
        """llama.cpp's infill sampler: prefer EOG when text is unlikely, merge
        tokens that are prefixes of each other, then keep the confident ones."""
        logits_np = np.array(c.logits, dtype=np.float64)
        ids_np = (
            np.arange(logits_np.shape[0]) if c.ids is None else np.array(c.ids).astype(np.int64)
        )
        alive = np.flatnonzero(logits_np > _NEG_INF)
        if alive.size == 0:
            return c
        alive = alive[np.argsort(-logits_np[alive], kind="stable")]
        lg = logits_np[alive].copy()
        ids = ids_np[alive]
        probs = _softmax_np(lg)
        is_eog = np.isin(ids, self.eog_token_ids)
        keep = np.zeros(logits_np.shape[0], dtype=bool)

        p_eog = float(probs[is_eog].sum())
        p_txt = float(probs[~is_eog].sum())
        if 3.0 * p_eog * len(ids) > p_txt:
            keep[alive[is_eog]] = True
            return _Cands(mx.where(mx.array(keep), c.logits, _NEG_INF), c.ids)

        _merge_prefix_pieces(piece_index(self.tokenizer), ids, lg, probs)

        # Whole-array steps: without a top-k before it this sees the whole vocabulary every token.
        survivors = (probs >= 0.2) | is_eog
        n_non_eog = int((survivors & ~is_eog).sum())
        if n_non_eog == 0:
            # llama.cpp collapses to a single EOT/EOS token.
            eot = self.eog_token_ids[0] if self.eog_token_ids else int(ids[0])
            only_eot = mx.where(mx.arange(self.vocab_size) == eot, 1.0, _NEG_INF)
            return _Cands(only_eot.astype(mx.float32), None)
        total = sum(probs[survivors].tolist())  # a few terms, summed in order as before
        threshold = 1.0 / (n_non_eog + 1)
        final = survivors & ((probs / total >= threshold) | is_eog) & (lg > _NEG_INF)
        keep[alive[final]] = True
        return _Cands(mx.where(mx.array(keep), c.logits, _NEG_INF), c.ids)

    # -- final draws ---------------------------------------------------------

    def _full_probs(self, c: _Cands, probs: mx.array) -> mx.array:
        if c.ids is None:
            return probs
        empty = mx.zeros((self.vocab_size,), dtype=mx.float32)
        return mx.put_along_axis(empty, c.ids.astype(mx.int32), probs, axis=0)

    def _draw_dist(self, c: _Cands) -> tuple[mx.array, mx.array]:
        self._dist_key, sub = mx.random.split(self._dist_key)
        idx = mx.random.categorical(c.logits, key=sub)
        token = idx if c.ids is None else c.ids[idx]
        return token, _softmax(c.logits)

    def _draw_numpy(self, probs: np.ndarray) -> int:
        """Inverse-CDF draw for the numpy-side samplers (mirostat, adaptive-p)."""
        cdf = np.cumsum(probs)
        target = self._np_rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, target, side="left"), len(probs) - 1))

    def _draw_adaptive(self, c: _Cands) -> tuple[mx.array, mx.array]:
        """adaptive-p: reshape the distribution towards a moving target probability."""
        logits = np.array(c.logits, dtype=np.float64)
        ids = np.arange(logits.shape[0]) if c.ids is None else np.array(c.ids).astype(np.int64)
        alive = logits > _NEG_INF
        probs = np.zeros_like(logits)
        probs[alive] = _softmax_np(logits[alive])
        target = min(max(self.params.adaptive_target, 0.0), 1.0)
        if self._adaptive_total_weight == 0.0:
            adapted = target
        else:
            adapted = 2.0 * target - self._adaptive_weighted_sum / self._adaptive_total_weight
        adapted = min(max(adapted, 0.0), 1.0)
        dist = np.abs((probs - adapted) / 0.3)
        new_logits = np.where(alive, 5.0 - 10.0 * dist * dist / (1.0 + dist), _NEG_INF)
        new_probs = np.zeros_like(new_logits)
        new_probs[alive] = _softmax_np(new_logits[alive])
        idx = self._draw_numpy(new_probs)
        decay = self._adaptive_decay
        self._adaptive_weighted_sum = probs[idx] + decay * self._adaptive_weighted_sum
        self._adaptive_total_weight = 1.0 + decay * self._adaptive_total_weight
        full = np.zeros(self.vocab_size, dtype=np.float32)
        full[ids] = new_probs
        return mx.array(int(ids[idx]), dtype=mx.int32), mx.array(full)

    def _draw_mirostat(self, c: _Cands) -> tuple[mx.array, mx.array]:
        p = self.params
        logits = np.array(c.logits, dtype=np.float64)
        order = np.argsort(-logits, kind="stable")
        sorted_logits = logits[order]
        probs = _softmax_np(sorted_logits)
        if self._mirostat == 1:
            m = 100
            count = min(m - 1, len(probs) - 1)
            with np.errstate(divide="ignore", invalid="ignore"):
                t = np.log(np.arange(2, count + 2) / np.arange(1, count + 1))
                b = np.log(probs[:count] / probs[1 : count + 1])
                s_hat = float(np.sum(t * b) / np.sum(t * t)) if count > 0 else 1.0
                eps = s_hat - 1.0
                k_float = ((eps * 2.0**self._mirostat_mu) / (1.0 - self.vocab_size ** (-eps))) ** (
                    1.0 / s_hat
                )
            k = int(k_float) if math.isfinite(k_float) else len(probs)
            size = min(max(k, 1), len(probs))
        else:
            surprise = -np.log2(np.maximum(probs, 1e-45))
            over = np.flatnonzero(surprise > self._mirostat_mu)
            size = int(over[0]) if over.size else len(probs)
            size = max(size, 1)
        kept = _softmax_np(sorted_logits[:size])
        idx = self._draw_numpy(kept)
        observed = -math.log2(max(float(kept[idx]), 1e-45))
        self._mirostat_mu -= p.mirostat_eta * (observed - p.mirostat_tau)
        ids = order[:size] if c.ids is None else np.array(c.ids).astype(np.int64)[order[:size]]
        full = np.zeros(self.vocab_size, dtype=np.float32)
        full[ids] = kept
        return mx.array(int(ids[idx]), dtype=mx.int32), mx.array(full)

    # -- public --------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when each step is a plain argmax (temperature <= 0)."""
        return self._greedy_prefix is not None

    @property
    def is_plain_argmax(self) -> bool:
        """True when the token is the argmax of the logits after the logit bias (``ignore_eos``'s
        included: -inf on the end-of-generation tokens): greedy, nothing that reads the history,
        no post-sampling probabilities. A batch can then pick all such rows with one argmax
        (``biased``), and the CPU decode runtime's rows with ``argmax_of``, instead of one chain
        call per row (~0.1 ms of MLX ops a token)."""
        return self._greedy_prefix == [] and not self.params.post_sampling_probs

    def biased(self, logits: mx.array, row: int | None = None) -> mx.array:
        """``logits`` (a row, or row ``row`` of a batch's matrix) plus the logit bias, lazily: the
        same float32 additions as ``sample``'s."""
        if self._bias_idx is None:
            return logits
        if row is None:
            return logits.at[self._bias_idx].add(self._bias_val)
        return logits.at[mx.full(self._bias_idx.shape, row, mx.int32), self._bias_idx].add(self._bias_val)

    def argmax_of(self, logits: np.ndarray) -> int:
        """The argmax of a float32 NumPy row after the logit bias (the first of equal maxima, as
        MLX's): what ``sample`` draws when ``is_plain_argmax``. The row is biased in place for the
        argmax and put back (the bias's tokens are distinct), not copied."""
        if self._bias_idx is None:
            return int(logits.argmax())
        if self._bias_np is None:
            self._bias_np = (np.array(self._bias_idx, np.int64), np.array(self._bias_val, np.float32))
        idx, val = self._bias_np
        row = logits if logits.flags.writeable else logits.copy()
        saved = row[idx]
        row[idx] = saved + val
        try:
            return int(row.argmax())
        finally:
            row[idx] = saved

    def sample(self, logits: mx.array, history: Sequence[Any] | None = None, allowed: mx.array | None = None) -> SampleResult:
        """Sample the next token from raw logits of shape (vocab,).

        ``allowed``: a grammar's boolean mask (engine/grammar.py); the tokens outside it are
        removed right after the logit bias, before any other sampler (llama.cpp's grammar-first
        order), so every sampler and the final draw see only what the grammar accepts.
        """
        logits = logits.reshape(-1).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        self._update_history(history)

        c = _Cands(logits)
        if self._bias_idx is not None:
            c = _Cands(logits.at[self._bias_idx].add(self._bias_val))
        if allowed is not None:
            c = _Cands(mx.where(allowed, c.logits, _NEG_INF))

        if self._greedy_prefix is not None:
            for name in self._greedy_prefix:
                c = self._apply_penalties(c) if name == "penalties" else self._apply_dry(c)
            token = mx.argmax(c.logits).astype(mx.int32)
            probs = None
            if self.params.post_sampling_probs:
                probs = (mx.arange(self.vocab_size) == token).astype(mx.float32)
            return SampleResult(token, logprobs, probs)

        if self._mirostat:
            c = self._apply_plain_temperature(c, self.params.temperature)
            token, probs = self._draw_mirostat(c)
            return SampleResult(token, logprobs, probs if self.params.post_sampling_probs else None)

        for name in self._stages:
            c = self._stage(name, c)

        if self._adaptive and self.params.adaptive_target >= 0.0:
            token, probs = self._draw_adaptive(c)
        else:
            token, cand_probs = self._draw_dist(c)
            token = token.astype(mx.int32)
            probs = self._full_probs(c, cand_probs) if self.params.post_sampling_probs else None
        return SampleResult(token, logprobs, probs if self.params.post_sampling_probs else None)

    def _stage(self, name: str, c: _Cands) -> _Cands:
        if name == "penalties":
            return self._apply_penalties(c)
        if name == "dry":
            return self._apply_dry(c)
        if name == "top_k":
            return self._apply_top_k(c)
        if name == "top_p":
            return self._apply_top_p(c)
        if name == "min_p":
            return self._apply_min_p(c)
        if name == "typ_p":
            return self._apply_typical(c)
        if name == "top_n_sigma":
            return self._apply_top_n_sigma(c)
        if name == "xtc":
            return self._apply_xtc(c)
        if name == "temperature":
            return self._apply_temperature(c)
        if name == "infill":
            return self._apply_infill(c)
        raise ValueError(f"unknown sampler {name!r}")
