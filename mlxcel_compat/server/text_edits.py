"""The ``edit_file`` tool's text replacement, as llama-server applies it.

Each edit's ``old_text`` is looked up in the original content, and must occur once. When one
of them is not found verbatim, every match is made on a "fuzzy" copy: trailing blanks dropped
from each line and typographic quotes, dashes and spaces folded to ASCII (models often type
them differently). The replaced lines then come from the fuzzy copy while every line no edit
touches keeps its original bytes. Edits must not overlap; one that changes nothing is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

_FOLD = {**{c: "'" for c in "\u2018\u2019\u201a\u201b"}, **{c: '"' for c in "\u201c\u201d\u201e\u201f"},
         **{chr(c): "-" for c in range(0x2010, 0x2016)}, "\u2212": "-", "\u00a0": " ",
         **{chr(c): " " for c in range(0x2002, 0x200b)}, "\u202f": " ", "\u205f": " ", "\u3000": " "}
_FOLD_TABLE = str.maketrans(_FOLD)


def fuzzy(content: str) -> str:
    """Each line without trailing spaces, tabs or CRs, and with the characters above folded."""
    return "\n".join(line.rstrip(" \t\r").translate(_FOLD_TABLE) for line in content.split("\n"))


@dataclass(frozen=True)
class _Match:
    edit: int
    start: int
    length: int
    new_text: str


def apply_edits(original: str, edits: list[tuple[str, str]], path: str) -> tuple[str, str]:
    """``(new content, "")``, or ``("", error message)`` in llama-server's words."""
    fuzzy_original = fuzzy(original)
    any_fuzzy = False
    for i, (old, _) in enumerate(edits):
        if old in original:
            continue
        if fuzzy(old) not in fuzzy_original:
            return "", (f"could not find edits[{i}].old_text in {path}, it must match the file's current "
                        "content exactly")
        any_fuzzy = True
    base = fuzzy_original if any_fuzzy else original
    matches: list[_Match] = []
    for i, (old, new) in enumerate(edits):
        needle = fuzzy(old) if any_fuzzy else old
        occurrences = _count(fuzzy_original, fuzzy(old))
        if occurrences > 1:
            return "", f"found {occurrences} occurrences of edits[{i}].old_text in {path}, it must be unique"
        matches.append(_Match(i, base.find(needle), len(needle), new))
    matches.sort(key=lambda m: m.start)
    for a, b in zip(matches, matches[1:]):
        if a.start + a.length > b.start:
            return "", (f"edits[{a.edit}] and edits[{b.edit}] overlap in {path}; merge them into one edit or "
                        "target disjoint regions")
    result = _keep_unchanged_lines(original, base, matches) if any_fuzzy else _replace(base, matches, 0)
    if result == original:
        return "", "no changes made: the replacement(s) produced identical content"
    return result, ""


def _count(content: str, needle: str) -> int:
    if not needle:
        return 0
    count = pos = 0
    while (pos := content.find(needle, pos)) >= 0:
        count += 1
        pos += len(needle)
    return count


def _replace(content: str, matches: list[_Match], offset: int) -> str:
    for m in reversed(matches):
        start = m.start - offset
        content = content[:start] + m.new_text + content[start + m.length:]
    return content


def _line_spans(content: str) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for line in _lines_with_endings(content):
        spans.append((offset, offset + len(line)))
        offset += len(line)
    return spans


def _lines_with_endings(content: str) -> list[str]:
    lines = [line + "\n" for line in content.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def _keep_unchanged_lines(original: str, base: str, matches: list[_Match]) -> str:
    """Lines an edit touches come from the fuzzy ``base`` with the edits applied; the rest from
    ``original``, byte for byte (both have the same lines: folding never adds or drops one)."""
    original_lines = _lines_with_endings(original)
    spans = _line_spans(base)
    groups: list[tuple[int, int, list[_Match]]] = []
    for m in matches:
        first = next((i for i, (s, e) in enumerate(spans) if s <= m.start < e), None)
        if first is None:
            continue
        last = first
        while last < len(spans) and spans[last][1] < m.start + m.length:
            last += 1
        if last >= len(spans):
            continue
        if groups and first < groups[-1][1]:
            start, end, members = groups[-1]
            groups[-1] = (start, max(end, last + 1), members + [m])
        else:
            groups.append((first, last + 1, [m]))
    out, line = [], 0
    for first, end, members in groups:
        out += original_lines[line:first]
        lo, hi = spans[first][0], spans[end - 1][1]
        out.append(_replace(base[lo:hi], members, lo))
        line = end
    out += original_lines[line:]
    return "".join(out)
