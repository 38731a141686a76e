"""The whole-image rule (``cache/media.py``): a cached prefix never ends inside an image's tokens.

Property-checked with Hypothesis over random, non-overlapping image spans and split points."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxcel_compat.cache.media import clip_to_media, first_media_token, split_ok


@st.composite
def spans_and_point(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int]:
    cuts = sorted(draw(st.sets(st.integers(0, 400), max_size=12)))
    pairs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
    return pairs, draw(st.integers(0, 420))


@given(spans_and_point())
def test_the_clipped_split_point_is_never_inside_an_image(case: tuple[list[tuple[int, int]], int]) -> None:
    spans, n = case
    clipped = clip_to_media(n, spans)
    assert 0 <= clipped <= n
    assert all(not (start < clipped < end) for start, end in spans)
    assert split_ok(clipped, spans)
    # Only as much is given up as needed: nothing when n was already outside every image,
    # else exactly back to the start of the image n fell into.
    if split_ok(n, spans):
        assert clipped == n
    else:
        assert any(start == clipped and start < n < end for start, end in spans)


def test_first_media_token() -> None:
    assert first_media_token([]) is None
    assert first_media_token([(30, 46), (5, 9)]) == 5
