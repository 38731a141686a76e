"""The state a slot keeps after its task (``--slot-save-path``), as llama-server's slots keep their
KV cells: what it holds, how a finished sequence leaves it, and how the next request that lands
on the slot reuses it while the prompt cache is off. ``slot_files.py`` saves and restores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel_compat.cache import kv
from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket

if TYPE_CHECKING:
    from mlxcel_compat.engine.sequence import Sequence


@dataclass
class KeptState:
    """The state a slot keeps after its task, as llama-server's slots do (``--slot-save-path``).

    ``cache`` is the finished sequence's list of mlx-lm cache objects (engine thread only); it is
    what ``POST /slots/{id}?action=save`` writes and ``restore`` puts back.
    """

    tokens: list[int]
    cache: list[Any]
    bucket: Any  # cache.key.Bucket of the task that produced it
    session_key: str


def request_bucket(model_id: str, cache: Any) -> Bucket:
    """The bucket of a request's ``CacheContext`` (the prompt cache's key minus session and tokens)."""
    return Bucket(
        model_id=model_id,
        lora_id=cache.lora_id,
        template_sig=cache.template_sig or RAW_PROMPT_TEMPLATE_SIG,
        rope_regime=None,
        mm_digest=cache.mm_digest or TEXT_ONLY_MM_DIGEST,
    )


def keep_state(model_id: str, seq: "Sequence") -> KeptState:
    """What a slot keeps when its task ends consistently."""
    req = seq.request
    if seq.exact_tokens is not None:  # after a context shift, only the kept prefix is reusable
        n = seq.exact_tokens
        return KeptState(list(seq.cache_tokens[:n]), kv.detached_prefix(seq.cache, n),
                         request_bucket(model_id, req.cache), req.cache.session_key)
    return KeptState(list(seq.cache_tokens), seq.cache, request_bucket(model_id, req.cache), req.cache.session_key)


def adopt_kept(seq: "Sequence", kept: KeptState) -> int:
    """With the prompt cache off: reuse the common prefix of the slot's state, as llama-server does.

    The whole state is reused when it is a prefix of the prompt; a shorter common prefix only when
    every layer can be cut. At least one prompt token is always left to prefill. State computed
    under other LoRA scales is not reused (llama-server clears the slot when they change).
    """
    if kept.bucket.mm_digest != (seq.request.cache.mm_digest or TEXT_ONLY_MM_DIGEST) or not kept.tokens:
        return 0
    if kept.bucket.lora_id != seq.request.cache.lora_id:
        return 0
    common = 0
    for a, b in zip(kept.tokens, seq.prompt):
        if a != b:
            break
        common += 1
    limit = seq.n_prompt - 1
    if common == len(kept.tokens) and common <= limit:
        usable = common
    elif kv.can_truncate(kept.cache):
        usable = min(common, limit)
    else:
        return 0
    media = seq.request.media
    if media is not None:  # never split the prompt inside an image (cache/media.py)
        from mlxcel_compat.cache.media import clip_to_media

        usable = clip_to_media(usable, media.spans)
        if usable < len(kept.tokens) and not kv.can_truncate(kept.cache):
            return 0
    if usable <= 0:
        return 0
    cache = kv.copy_cache(kept.cache)
    if usable < len(kept.tokens):
        kv.truncate(cache, usable)
    seq.cache = cache
    seq.adopt(usable)
    return usable
