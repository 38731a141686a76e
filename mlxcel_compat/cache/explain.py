"""Why a request missed the prompt cache (``cache_explain``): the store's side, pure Python.

The question users ask most about a prompt cache is why a request missed. The lookup itself only
knows its own bucket; this module looks wider, at every entry of the request's namespace (never
another tenant's: an isolated namespace's entries are not even read), and at the entries the
store let go recently (:class:`Departure`), to name the cause:

- ``cache_off``: the prompt cache is off, or the request opted out (``cache_prompt: false``);
- ``first_request``: nothing is stored yet that shares a token with the request; ``namespace``
  when the cache is partitioned by tenant and this tenant's part holds nothing that overlaps
  (other tenants' entries are never considered, so the reason is the same whatever they hold);
- ``model_changed``, ``lora_changed``, ``template_changed``, ``media_changed``: the entry that
  shares the longest prefix with the request is in another bucket, and that is the first field
  of the bucket that differs (``differs`` lists them all); for media the first diverging
  position is the first image token (images' tokens are placeholders, equal for any image). The
  outcome is then ``partial_hit`` where the text before the image was reused;
- ``below_min_prefix``: the best match is shorter than ``--prompt-cache-min-prefix``;
- ``not_trimmable``: the entry's state cannot be cut back to the shared prefix (recurrent
  state, a wrapped sliding window), ``apc_off``: only part of it matches and APC is off;
- ``evicted``: an entry that would have matched was evicted (with when and why);
- ``session``: the best candidate belongs to another session and sessions are not shared
  (session snapshots);
- ``no_overlap``: entries of the bucket exist but none shares a first token with the request.

With the best candidate come the first diverging token position and a few tokens on each side
of it, of the stored prompt and of the request (token ids here; the server detokenizes them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from mlxcel_compat.cache.key import Bucket
from mlxcel_compat.cache.records import CacheEntry, LookupResult

WINDOW_TOKENS = 8  # tokens shown on each side of the first diverging position
BUCKET_FIELDS = (("model_id", "model"), ("lora_id", "lora"), ("template_sig", "template"), ("mm_digest", "media"),
                 ("rope_regime", "rope"))
TURNDOWN_REASONS = {
    "below_min_prefix": "below_min_prefix",
    "partial_overlap_not_trimmable": "not_trimmable",
    "not_trimmable_exact_repeat": "not_trimmable",
    "partial_overlap_apc_off": "apc_off",
    "partial_overlap_no_chain": "apc_off",
}


@dataclass(frozen=True, slots=True)
class Departure:
    """An entry the store let go (evicted by LRU or byte pressure, or expired), remembered a while
    so that a later miss it would have served can say so."""

    bucket: Bucket
    session_key: str
    tokens: tuple[int, ...]
    at: float  # wall-clock seconds
    why: str  # "lru" or "ttl"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def differing_fields(a: Bucket, b: Bucket) -> list[str]:
    """The bucket dimensions in which ``a`` and ``b`` differ (the namespace never: callers only
    compare buckets of one namespace)."""
    return [name for field, name in BUCKET_FIELDS if getattr(a, field) != getattr(b, field)]


def divergence(stored: Sequence[int], request: Sequence[int], common: int) -> dict[str, Any]:
    """The first diverging position and the tokens around it, of both sides."""

    def window(tokens: Sequence[int]) -> dict[str, list[int]]:
        return {"before": list(tokens[max(0, common - WINDOW_TOKENS):common]), "after": list(tokens[common:common + WINDOW_TOKENS])}

    diverges = common < len(stored) and common < len(request)
    return {"first_divergence": common if diverges else None, "stored_window": window(stored), "request_window": window(request)}


KEY_ORDER = ("outcome", "reason", "tokens_reused", "prompt_tokens", "stage", "min_prefix", "candidate", "evicted",
             "first_divergence", "stored_window", "request_window")


def explain_lookup(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The ``cache_explain`` record of one lookup (plain values; token ids in the windows), its
    keys in reading order: the outcome and reason first."""
    out = _explain(*args, **kwargs)
    return {k: out[k] for k in KEY_ORDER if k in out} | {k: v for k, v in out.items() if k not in KEY_ORDER}


def _explain(
    bucket: Bucket,
    session_key: str,
    tokens: Sequence[int],
    result: LookupResult,
    adopted: int,
    entries: Iterable[CacheEntry],
    departures: Iterable[Departure],
    min_prefix: int,
    *,
    sessions_shared: bool = True,
    media_start: int | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    now = time.time() if now is None else now
    toks = tuple(tokens)
    out: dict[str, Any] = {"tokens_reused": adopted, "prompt_tokens": len(toks)}
    if result.hit is not None:  # a hit names itself: no scan of the namespace (the chat page asks on every answer)
        hit = result.hit
        out.update(outcome="hit", reason="hit", stage=hit.stage)
        out["candidate"] = _describe(hit.entry, hit.common_len, bucket, session_key, now)
        out.update(divergence(hit.entry.tokens, toks, hit.common_len))
        return out
    own_ns = [e for e in entries if e.bucket.namespace == bucket.namespace]  # never another tenant's
    best, best_common = None, -1
    for entry in own_ns:
        c = common_prefix(entry.tokens, toks)
        key = (c, entry.bucket == bucket, entry.session_key == session_key, entry.use_tick)
        if best is None or key > (best_common, best.bucket == bucket, best.session_key == session_key, best.use_tick):
            best, best_common = entry, c
    out["outcome"] = "partial_hit" if adopted else "miss"  # e.g. the text before a changed image was reused
    if best is None or best_common == 0:
        gone = _departed_match(bucket, toks, departures, min_prefix)
        if gone is not None:
            return _evicted(out, gone, toks, bucket, session_key, now)
        out["reason"] = "namespace" if bucket.namespace else ("first_request" if best is None else "no_overlap")
        return out
    out["candidate"] = _describe(best, best_common, bucket, session_key, now)
    out.update(divergence(best.tokens, toks, best_common))
    if best.bucket != bucket:
        differs = differing_fields(best.bucket, bucket)
        out["reason"] = differs[0] + "_changed"
        if "media" in differs and media_start is not None:  # image tokens are placeholders: the image is where it differs
            out.update(divergence(best.tokens, toks, min(best_common, media_start)))
        return out
    gone = _departed_match(bucket, toks, departures, max(min_prefix, best_common + 1))
    if gone is not None:  # a longer match was evicted
        return _evicted(out, gone, toks, bucket, session_key, now)
    if not sessions_shared and best.session_key != session_key:
        out["reason"] = "session"
        return out
    if best_common < min_prefix:
        out["reason"] = "below_min_prefix"
        out["min_prefix"] = min_prefix
        return out
    out["reason"] = TURNDOWN_REASONS.get(result.detail or "", result.detail or result.reason or "no_candidate")
    return out


def _describe(entry: CacheEntry, common: int, bucket: Bucket, session_key: str, now: float) -> dict[str, Any]:
    """What may be said of an entry of the request's own namespace: no session key, no tokens
    beyond the windows."""
    return {
        "tokens": len(entry.tokens),
        "common_prefix": common,
        "same_bucket": entry.bucket == bucket,
        "differs": differing_fields(entry.bucket, bucket),
        "same_session": entry.session_key == session_key,
        "trimmable": entry.trimmable,
        "origin": entry.origin,
        "hits": entry.hits,
    }


def _departed_match(bucket: Bucket, toks: tuple[int, ...], departures: Iterable[Departure], at_least: int) -> tuple[Departure, int] | None:
    best = None
    for d in departures:
        if d.bucket != bucket:
            continue
        c = common_prefix(d.tokens, toks)
        if c >= max(at_least, 1) and (best is None or c > best[1]):
            best = (d, c)
    return best


def _evicted(out: dict[str, Any], gone: tuple[Departure, int], toks: tuple[int, ...], bucket: Bucket, session_key: str,
             now: float) -> dict[str, Any]:
    d, c = gone
    out["reason"] = "evicted"
    out["evicted"] = {"seconds_ago": round(max(0.0, now - d.at), 3), "why": d.why, "tokens": len(d.tokens), "common_prefix": c,
                      "same_session": d.session_key == session_key}
    out.update(divergence(d.tokens, toks, c))
    return out
