"""An incremental JSON scanner: where a value written piece by piece ends, and what its shallow keys hold.

Tool calls carry JSON that arrives a few characters at a time. The reply parser
(``chat/reply_parser.py``) must know where a JSON value ends without waiting for the rest of the
reply, must refuse text that is not JSON as soon as it is clear, and, for calls written as one JSON
object (``{"name": ..., "arguments": {...}}``), must know where the value at a key path starts and
ends and what a string at a path holds. :class:`JsonScanner` does that in one pass: each character
is looked at once (string bodies and whitespace are skipped with regular expressions), so the cost
is linear in the text.
"""

from __future__ import annotations

import json
import re

__all__ = ["JsonScanner", "close_json"]

_WS = re.compile(r"[ \t\r\n]*")
_STRING_BODY = re.compile(r'[^"\\]*')
_NUMBER = re.compile(r"-?[0-9]*(?:\.[0-9]*)?(?:[eE][-+]?[0-9]*)?")
_NUMBER_FULL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?\Z")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = ("true", "false", "null")

# Scanner states.
_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER, _ARR_FIRST, _STRING, _NUMBER_S, _LITERAL = range(9)


class JsonScanner:
    """Scans one JSON value in ``text``, which grows between calls to :meth:`feed`.

    ``watch`` names key paths (tuples of object keys from the outer value) whose values are
    recorded: ``starts[path]`` and ``ends[path]`` (positions in the text) and, for strings,
    ``strings[path]`` (decoded). ``first_key`` is the outer object's first key. After ``feed``,
    ``done`` means the value ended at ``pos``; ``failed`` means the text is not JSON.
    """

    def __init__(self, start: int, watch: frozenset[tuple[str, ...]] = frozenset()) -> None:
        self.pos = start
        self.start = start
        self.state = _VALUE
        self.stack: list[str] = []  # "{" or "["
        self.keys: list[str | None] = []  # the key of each open object's current member
        self.done = False
        self.failed = False
        self.watch = watch
        self.starts: dict[tuple[str, ...], int] = {}
        self.ends: dict[tuple[str, ...], int] = {}
        self.strings: dict[tuple[str, ...], str] = {}
        self.first_key: str | None = None
        self.watch_first_key = False  # also record the value under the outer object's first key
        self.paused = False  # feed stopped after a watched event, so the caller sees each in turn
        self._string_start = 0
        self._string_is_key = False
        self._literal = ""

    def _path(self) -> tuple[str, ...] | None:
        """The key path of the value about to start, ``None`` inside an array."""
        if any(k is None for k in self.keys):
            return None
        return tuple(self.keys)  # type: ignore[arg-type]

    def _watched(self, path: tuple[str, ...] | None) -> bool:
        if path is None:
            return False
        return path in self.watch or (self.watch_first_key and len(path) == 1 and path[0] == self.first_key)

    def _value_started(self, at: int) -> None:
        if self._watched(self._path()):
            self.starts[self._path()] = at  # type: ignore[index]
            self.paused = True

    def _value_ended(self, at: int, string: str | None = None) -> None:
        path = self._path()
        if self._watched(path):
            self.ends[path] = at
            if string is not None:
                self.strings[path] = string
            self.paused = True
        self.state = _AFTER
        if not self.stack:
            self.done = True

    def feed(self, text: str, final: bool = False) -> None:
        """Scan as far as ``text`` allows, or up to the next watched event (``paused``: a watched value
        started or ended, the outer object's first key was read), so that what a caller does at each
        event happens at the same place of the text however it arrives. ``final``: no more text will
        come (a trailing number ends)."""
        pos, n = self.pos, len(text)
        self.paused = False
        while not self.done and not self.failed and not self.paused:
            state = self.state
            if state == _STRING:
                match = _STRING_BODY.match(text, pos)
                pos = match.end()
                if pos >= n:
                    break
                if text[pos] == "\\":
                    if pos + 1 >= n:
                        break
                    esc = text[pos + 1]
                    if esc not in _ESCAPES:
                        self.failed = True
                        break
                    if esc == "u":
                        if pos + 6 > n:
                            break
                        if not all(c in _HEX for c in text[pos + 2 : pos + 6]):
                            self.failed = True
                            break
                        pos += 6
                    else:
                        pos += 2
                    continue
                # the closing quote
                body = text[self._string_start : pos]
                pos += 1
                if self._string_is_key:
                    key = _decode(body)
                    if key is None:
                        self.failed = True
                        break
                    self.keys[-1] = key
                    if len(self.stack) == 1 and self.first_key is None:
                        self.first_key = key
                        self.paused = self.watch_first_key
                    self.state = _COLON
                else:
                    value = _decode(body) if self._watched(self._path()) else None
                    self._value_ended(pos, value)
                continue
            if state == _NUMBER_S:
                match = _NUMBER.match(text, pos)
                end = match.end()
                if end >= n and not final:
                    break  # the number may go on: pos stays at its start (read whole, once complete)
                if not _NUMBER_FULL.match(text[self._string_start : end]):
                    self.failed = True
                    break
                pos = end
                self._value_ended(pos)
                continue
            if state == _LITERAL:
                want = self._literal
                have = text[self._string_start : min(n, self._string_start + len(want))]
                if not want.startswith(have):
                    self.failed = True
                    break
                if len(have) < len(want):
                    break  # pos stays at the literal's start until it is complete
                pos = self._string_start + len(want)
                self._value_ended(pos)
                continue
            pos = _WS.match(text, pos).end()
            if pos >= n:
                break
            ch = text[pos]
            if state == _VALUE or state == _ARR_FIRST:
                if state == _ARR_FIRST and ch == "]":
                    pos += 1
                    self._close(pos)
                    continue
                self._value_started(pos)
                if ch == "{":
                    self.stack.append("{")
                    self.keys.append("")
                    self.state = _OBJ_FIRST
                    pos += 1
                elif ch == "[":
                    self.stack.append("[")
                    self.keys.append(None)
                    self.state = _ARR_FIRST
                    pos += 1
                elif ch == '"':
                    self.state, self._string_is_key, self._string_start = _STRING, False, pos + 1
                    pos += 1
                elif ch == "-" or ch.isdigit():
                    self.state, self._string_start = _NUMBER_S, pos
                elif ch in "tfn":
                    self.state, self._string_start = _LITERAL, pos
                    self._literal = next(lit for lit in _LITERALS if lit[0] == ch)
                else:
                    self.failed = True
            elif state == _OBJ_FIRST or state == _OBJ_KEY:
                if ch == "}" and state == _OBJ_FIRST:
                    pos += 1
                    self._close(pos)
                elif ch == '"':
                    self.state, self._string_is_key, self._string_start = _STRING, True, pos + 1
                    pos += 1
                else:
                    self.failed = True
            elif state == _COLON:
                if ch != ":":
                    self.failed = True
                else:
                    self.state = _VALUE
                    pos += 1
            elif state == _AFTER:
                top = self.stack[-1]
                if ch == ",":
                    self.state = _OBJ_KEY if top == "{" else _VALUE
                    pos += 1
                elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                    pos += 1
                    self._close(pos)
                else:
                    self.failed = True
        self.pos = pos

    def _close(self, at: int) -> None:
        self.stack.pop()
        self.keys.pop()
        self._value_ended(at)

    def closing(self, keep: int = 0) -> str | None:
        """Text that would end the value here, closing the containers deeper than ``keep`` (the
        outer ones stay open); ``None`` when no text can (a key cut in its middle)."""
        if self.done or len(self.stack) <= keep and self.state == _AFTER:
            return ""
        state = self.state
        if state == _STRING and self._string_is_key or state in (_OBJ_KEY, _LITERAL):
            return None
        head = {_STRING: '"', _COLON: ": null", _VALUE: "null"}.get(state, "")
        if state == _VALUE and not (self.stack and self.stack[-1] == "{"):
            return None  # an array's next item or the value itself: nothing to close with
        closers = "".join("}" if kind == "{" else "]" for kind in reversed(self.stack[keep:]))
        return head + closers

    def token_start(self) -> int:
        """Where the token being read started, when the scanner will look back to it (a key, a
        watched string, a number or literal), else ``pos``."""
        if self.state == _STRING and not self._string_is_key and not self._watched(self._path()):
            return self.pos  # an unwatched string's text is not decoded
        if self.state in (_STRING, _NUMBER_S, _LITERAL):
            return max(0, self._string_start - 1)
        return self.pos

    def rebase(self, delta: int) -> None:
        """The text lost its first ``delta`` characters: positions move back by that much."""
        self.pos -= delta
        self.start -= delta
        self._string_start -= delta
        self.starts = {k: v - delta for k, v in self.starts.items()}
        self.ends = {k: v - delta for k, v in self.ends.items()}


def _decode(body: str) -> str | None:
    try:
        return json.loads('"' + body + '"', strict=False)  # models write raw newlines in strings
    except ValueError:
        return None


def close_json(text: str) -> str | None:
    """``text`` (the start of a JSON value) completed into valid JSON, or ``None`` when it cannot be.

    A reply cut short in the middle of a call's arguments still yields arguments a client can read.
    """
    scanner = JsonScanner(0)
    scanner.feed(text, final=True)
    if scanner.failed:
        return None
    if scanner.done:
        return text[: scanner.pos]
    tail = scanner.closing()
    if tail is None:
        return None
    candidate = text.rstrip() + tail
    try:
        json.loads(candidate)
    except ValueError:
        return None
    return candidate
