"""Where a multimodal prompt may be split between cached KV and a fresh prefill (no MLX).

An image occupies a run of tokens (its *span*) whose KV depends on the whole image: the vision
tower's features for those positions come out of one pass over all its patches, and the
positions after it are numbered from the image's grid (multimodal RoPE). A cached prefix that
ends inside a span would leave the rest of the image to a prefill that has no features for only
part of it, so every adoption point (RAM entries and their APC partial matches, disk entries,
snapshots, a slot's kept state, explicit cache breakpoints) is clipped with :func:`clip_to_media`:
a split is allowed at or before an image's first token, or at or after its last one.

Entries live in the bucket of their ``mm_digest`` (every image, in order), so a lookup in that
bucket only ever meets KV of the same images. The text before the first image does not depend on
any image, so a multimodal request may also adopt from the text-only bucket up to its first image
token (:func:`first_media_token`), and a multimodal sequence donates that prefix there.
"""

from __future__ import annotations

from typing import Sequence

Span = tuple[int, int]  # [start, end) token positions of one image


def clip_to_media(n: int, spans: Sequence[Span]) -> int:
    """The largest split point ``<= n`` that is not strictly inside any span."""
    for start, end in spans:
        if start < n < end:
            return start
    return n


def first_media_token(spans: Sequence[Span]) -> int | None:
    """Position of the first image token, or None for a text-only prompt."""
    return min((start for start, _ in spans), default=None)


def split_ok(n: int, spans: Sequence[Span]) -> bool:
    """Whether a prefix of ``n`` tokens ends outside every image."""
    return clip_to_media(n, spans) == n
