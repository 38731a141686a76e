"""Markers as the reply parser matches them: their core, optional whitespace, partial matches.

A marker written in a template (``"\\n</tool_call>"``) is matched by its core (``</tool_call>``)
with whitespace before it optional and whitespace inside it flexible, since models do not always
reproduce a template's padding. Matching uses :mod:`regex`'s partial matches: text that ends in the
middle of a marker makes the caller wait for the next piece instead of failing.
"""

from __future__ import annotations

import regex

from mlxcel_compat.chat.syntax import core
from mlxcel_compat.chat.syntax_probe import segments

__all__ = ["DONE", "FAIL", "WAIT", "cached_marker_regex", "marker_pattern", "marker_regex", "match_marker"]

WAIT, DONE, FAIL = "wait", "done", "fail"


def marker_pattern(text: str) -> str:
    """A marker as a regular expression: its core, with optional whitespace between its segments."""
    pieces: list[str] = []
    for seg in segments(core(text)):
        if seg.isspace():
            pieces.append(r"\s+")
        else:
            if pieces and pieces[-1] != r"\s+":
                pieces.append(r"\s*")
            pieces.append(regex.escape(seg))
    return "".join(pieces)


def marker_regex(text: str) -> regex.Pattern[str]:
    """A marker's pattern with the whitespace before it optional (``match`` at a position)."""
    return regex.compile(r"\s*" + marker_pattern(text))


def match_marker(pattern: regex.Pattern[str], buf: str, pos: int, final: bool) -> tuple[str, int]:
    """``(DONE, end)`` when ``pattern`` matches at ``pos``; ``WAIT`` when the text may still grow into it."""
    m = pattern.match(buf, pos, partial=not final)
    if m is None:
        return FAIL, pos
    if m.partial:
        return WAIT, pos
    return DONE, m.end()



_CACHE: dict[str, regex.Pattern[str]] = {}


def cached_marker_regex(text: str) -> regex.Pattern[str]:
    """:func:`marker_regex`, compiled once per marker text."""
    pattern = _CACHE.get(text)
    if pattern is None:
        pattern = _CACHE[text] = marker_regex(text)
    return pattern
