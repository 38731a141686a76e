"""Reading tagged arguments, one ``KEY_PREFIX key KEY_SUFFIX value VALUE_SUFFIX`` after another.

Qwen3-Coder (``<parameter=city>\\nParis\\n</parameter>``), GLM (``<arg_key>``/``<arg_value>``),
MiniMax, DeepSeek DSML, Seed-OSS, Kimi K3 and others write a call's arguments this way
(``chat/syntax.py: TaggedArgs``). The reader turns them into one JSON object text, sent in pieces as
they are read: string values stream character by character (escaped), other values are sent when
they end. What a value is: the key marker says it where the template writes types (DSML's
``string="true"``), else the tool's schema does, else the value's own text (JSON, a Python literal,
nested elements, or a string).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any, Protocol

import regex

from mlxcel_compat.chat.markers import DONE, FAIL, WAIT, marker_pattern, marker_regex, match_marker
from mlxcel_compat.chat.syntax import TaggedArgs, core

__all__ = ["Cursor", "TaggedReader"]


class Cursor(Protocol):
    """The call being read: where reading stands in the reply, and where argument text goes."""

    pos: int

    def send(self, text: str, out: list[Any]) -> None: ...


_MAX_KEY = 256  # a key longer than this is no key: the text is not a call


class TaggedReader:
    """Tagged arguments being read: which argument, in which phase, and what was sent.

    ``closer`` is the marker after the arguments (the call's end), ``types`` the tool's parameter
    types (parameter -> JSON type)."""

    def __init__(self, part: TaggedArgs, closer: str | None, types: Mapping[str, str]) -> None:
        self.part = part
        self.types = types
        self.phase = "first"  # first | next | key | value
        self.count = 0
        self.key = ""
        self.kind = "schema"
        self.value_start = 0
        self.offset: int | None = None  # where the value's text starts (past marker whitespace, CDATA)
        self.cdata = False  # the value is wrapped in an XML CDATA section
        self.sent_to = 0  # the reply position up to which a string value was sent
        self.scan_from = 0  # where the search for the value's end marker goes on
        self.prefix = marker_regex(part.key_prefix)
        self.separator = marker_regex(part.separator) if core(part.separator) else None
        self.closer = marker_regex(closer) if closer else None
        suffixes = sorted(part.key_suffixes, key=lambda s: -len(core(s.text)))
        self.suffix_kinds = [s.kind for s in suffixes]
        self.suffix_ws = [_trailing_ws(s.text) for s in suffixes]
        self.suffixes = regex.compile("|".join(f"(?P<s{i}>{marker_pattern(s.text)})" for i, s in enumerate(suffixes)))
        self.lead_ws = ""  # the whitespace ending the key marker just read (not part of the value)
        self.trail_ws = _leading_ws(part.value_suffix)
        self.nested_openers = core(part.key_prefix)[:1] + core(part.value_suffix)[:1]
        self.value_end: regex.Pattern[str] | None = None

    def step(self, buf: str, final: bool, reader: Cursor, out: list[Any]) -> str:
        while True:
            if self.phase in ("first", "next"):
                status = self._next_argument(buf, final, reader)
                if status != "key":
                    if status == DONE:
                        reader.send("}" if self.count else "{}", out)
                    return status
            if self.phase == "key":
                status = self._key(buf, final, reader, out)
                if status != DONE:
                    return status
            if self.phase == "value":
                status = self._value(buf, final, reader, out)
                if status != DONE:
                    return status

    def _next_argument(self, buf: str, final: bool, reader: Cursor) -> str:
        pos = reader.pos
        if self.phase == "next" and self.separator is not None:
            status, end = match_marker(self.separator, buf, pos, final)
            if status == WAIT:
                return WAIT
            if status == DONE:
                status, end2 = match_marker(self.prefix, buf, end, final)
                if status == DONE:
                    reader.pos, self.phase = end2, "key"
                    return "key"
                return WAIT if status == WAIT else FAIL
        # The call's closing marker first: it may start like an argument's (MiniMax M3).
        if self.closer is not None:
            closer_status, _ = match_marker(self.closer, buf, pos, final)
            if closer_status != FAIL:
                return closer_status
        status, end = match_marker(self.prefix, buf, pos, final)
        if status == DONE:
            reader.pos, self.phase = end, "key"
            return "key"
        if status == WAIT:
            return WAIT
        return DONE if final or self.closer is None else FAIL

    def _key(self, buf: str, final: bool, reader: Cursor, out: list[Any]) -> str:
        m = self.suffixes.search(buf, reader.pos, partial=not final)
        if m is None or m.partial:
            # (a key that cannot end within the bound fails, however the text arrives)
            reach = (m.start() if m is not None else len(buf)) - reader.pos
            return FAIL if final or reach > _MAX_KEY else WAIT
        key = buf[reader.pos: m.start()].strip()
        if not key or m.start() - reader.pos > _MAX_KEY:
            return FAIL
        group = int(m.lastgroup[1:])
        self.key, self.kind, self.lead_ws = key, self.suffix_kinds[group], self.suffix_ws[group]
        if self.kind == "schema":
            declared = self.types.get(key)
            if declared == "string":
                self.kind = "string"
            elif declared is not None:
                self.kind = "json"
        reader.pos = self.value_start = self.sent_to = self.scan_from = m.end()
        self.offset, self.cdata = None, False
        closing = self.part.value_suffix.replace("{key}", key)
        self.value_end = regex.compile(marker_pattern(closing))
        self.end_opener = core(closing)[:1]  # the end marker can only start at this character
        self.phase = "value"
        reader.send(("{" if self.count == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ", out)
        if self.kind == "string":
            reader.send('"', out)
        return DONE

    def _value(self, buf: str, final: bool, reader: Cursor, out: list[Any]) -> str:
        assert self.value_end is not None
        m = self.value_end.search(buf, self.scan_from, partial=not final) if buf.find(self.end_opener, self.scan_from) >= 0 else None
        if m is not None and not m.partial:
            self._finish(buf, m.start(), reader, out)
            reader.pos = m.end()
            self.phase = "next"
            self.count += 1
            return DONE
        if final:
            return FAIL
        limit = m.start() if m is not None else len(buf)
        self.scan_from = limit  # no end marker can start before here
        if self.kind == "schema" and self._decide_start(buf, limit) and not self._may_be_json(buf, limit):
            self.kind = "string"  # text no JSON value starts with: a string, streamed from here
            reader.send('"', out)
        if self.kind == "string":  # string values stream; what may end the value is held back
            if not self._decide_start(buf, limit):
                return WAIT
            end = limit
            while end > self.sent_to and buf[end - 1].isspace():
                end -= 1  # whitespace may belong to the end marker
            if self.cdata:
                end = max(self.sent_to, end - len(_CDATA_CLOSE))  # ]]> may be coming
            if end > self.sent_to:
                reader.send(_escaped(buf[self.sent_to: end]), out)
                self.sent_to = end
        return WAIT

    def _may_be_json(self, buf: str, limit: int) -> bool:
        """Whether the value's text so far may still be something other than a bare string: JSON,
        a Python literal, or elements nested in the argument markers (which start like them)."""
        head = buf[self.sent_to: min(limit, self.sent_to + 8)].lstrip()
        if not head:
            return True
        if head[0] in "{[-0123456789" + self.nested_openers:
            return True
        return any(word.startswith(head[: len(word)]) for word in ("true", "false", "null", "True", "False", "None"))

    def _decide_start(self, buf: str, limit: int) -> bool:
        """Where the value's own text starts (past the key marker's whitespace and a CDATA opening)."""
        if self.offset is None:
            window = buf[self.value_start: min(limit, self.value_start + 64)]
            start = _value_start(window, self.lead_ws)
            if start is None:
                if limit - self.value_start < 64:
                    return False
                start = (0, False)
            self.offset, self.cdata = start
            self.sent_to = self.value_start + self.offset
        return True

    def _finish(self, buf: str, stop: int, reader: Cursor, out: list[Any]) -> None:
        """The value ends at ``stop``: send what is left of it."""
        if self.offset is None:
            self.offset, self.cdata = _value_start(buf[self.value_start: stop], self.lead_ws) or (0, False)
            self.sent_to = self.value_start + self.offset
        start, end = self.value_start + self.offset, stop
        if self.trail_ws and end - len(self.trail_ws) >= start and buf.startswith(self.trail_ws, end - len(self.trail_ws)):
            end -= len(self.trail_ws)
        if self.cdata:
            tight = end
            while tight > start and buf[tight - 1].isspace():
                tight -= 1
            if buf.startswith(_CDATA_CLOSE, tight - len(_CDATA_CLOSE)) and tight - len(_CDATA_CLOSE) >= start:
                end = tight - len(_CDATA_CLOSE)
        if self.kind == "string":
            reader.send(_escaped(buf[self.sent_to: end]) + '"', out)
        else:
            reader.send(json.dumps(_tagged_value(buf[start:end], self.kind, self.part), ensure_ascii=False), out)

    def finish_value(self, buf: str, reader: Cursor, out: list[Any]) -> None:
        """The reply ended inside a value: the value ends there."""
        if self.phase == "value":
            end = len(buf)
            while end > self.value_start and buf[end - 1].isspace():
                end -= 1
            self._finish(buf, end, reader, out)
            self.count += 1
            self.phase = "next"

    def keep_from(self, pos: int) -> int:
        """The earliest reply position still needed: in a value, its start or where sending stands;
        elsewhere, where reading stands (``pos``)."""
        if self.phase != "value":
            return pos
        if self.kind == "string" and self.offset is not None:
            return self.sent_to
        return self.value_start

    def rebase(self, delta: int) -> None:
        self.value_start -= delta
        self.sent_to -= delta
        self.scan_from -= delta


_CDATA_OPEN, _CDATA_CLOSE = "<![CDATA[", "]]>"


def _value_start(raw: str, lead_ws: str) -> tuple[int, bool] | None:
    """Where a tagged value's text starts: past the key marker's whitespace and an XML CDATA
    opening (MiniCPM 5 wraps values holding ``<`` or ``&`` in one); ``None`` while undecided."""
    if len(raw) < len(lead_ws) and lead_ws.startswith(raw):
        return None
    offset = len(lead_ws) if raw.startswith(lead_ws) else 0
    rest = raw[offset:]
    if len(rest) < len(_CDATA_OPEN) and _CDATA_OPEN.startswith(rest):
        return None
    if rest.startswith(_CDATA_OPEN):
        return offset + len(_CDATA_OPEN), True
    return offset, False


def _escaped(text: str) -> str:
    """``text`` as the inside of a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _tagged_value(raw: str, kind: str, part: TaggedArgs) -> Any:
    """A tagged value that is not known to be a string, as a Python value.

    JSON when it parses (a bare JSON string only when the marker said JSON); a Python literal when
    it is one (templates that print objects with ``|string`` write ``{'max': 20}``); arguments
    nested in the same markers when it holds them (MiniMax M3 expands objects into elements, and
    lists into ``item`` elements); else the text itself.
    """
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        pass
    else:
        if kind != "schema" or not isinstance(value, str):
            return value
        return raw
    if text in ("True", "False", "None"):  # a Python literal printed with |string (Qwen3-Coder)
        return {"True": True, "False": False, "None": None}[text]
    if text[:1] in "{[":
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
        else:
            if isinstance(value, (dict, list)):
                return value
    nested = _nested_arguments(text, part)
    return nested if nested is not None else raw


def _nested_arguments(text: str, part: TaggedArgs) -> Any:
    """``text`` read as elements in ``part``'s markers, ``KEY_PREFIX key KEY_SUFFIX value </key>``: a
    dict, or a list when every key is ``item``. Marker text around the elements (MiniMax M3's
    namespace token) is passed over."""
    if not part.key_suffixes or "{key}" not in part.value_suffix:
        return None
    opening = regex.compile(regex.escape(core(part.key_prefix)) + r"([\w\-.]+)" + regex.escape(core(part.key_suffixes[0].text)))
    before, _, after = core(part.value_suffix).partition("{key}")
    close_at_key = before.rsplit(">", 1)[-1] if ">" in before else before  # the closing tag's start: "</"
    noise_before, noise_after = before[: len(before) - len(close_at_key)].strip(), after.lstrip(">").strip()
    items: list[tuple[str, Any]] = []
    pos = 0
    for _ in range(len(text)):
        m = opening.search(text, pos)
        if m is None:
            break
        key = m.group(1)
        closing = close_at_key + key + ">"
        end = _closing_at(text, m.end(), m.group(), closing)
        if end is None:
            return None
        value = text[m.end(): end].strip()
        if noise_after and value.startswith(noise_after):
            value = value[len(noise_after):]
        if noise_before and value.endswith(noise_before):
            value = value[: len(value) - len(noise_before)]
        items.append((key, _tagged_value(value, "schema", part)))
        pos = end + len(closing)
    if not items:
        return None
    if all(key == "item" for key, _ in items):
        return [value for _, value in items]
    return dict(items)


def _closing_at(text: str, start: int, opening: str, closing: str) -> int | None:
    """Where the value opened at ``start`` closes, counting elements of the same name inside it."""
    depth, pos = 1, start
    while True:
        close_at = text.find(closing, pos)
        if close_at < 0:
            return None
        open_at = text.find(opening, pos)
        if 0 <= open_at < close_at:
            depth, pos = depth + 1, open_at + len(opening)
            continue
        depth -= 1
        if depth == 0:
            return close_at
        pos = close_at + len(closing)


def _leading_ws(text: str) -> str:
    return text[: len(text) - len(text.lstrip())]


def _trailing_ws(text: str) -> str:
    return text[len(text.rstrip()):]
