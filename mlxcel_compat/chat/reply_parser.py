"""Taking a generated reply apart, piece by piece, in the syntax its template writes (``ChatSyntax``).

:class:`MarkersParser` is fed the reply as it is generated (:meth:`~MarkersParser.push`) and returns
events: :class:`TextDelta` for content and reasoning text, ``CallStart`` and ``CallArgs`` for tool
calls (``chat/call_reader.py``). A finished reply is the same machine fed once
(``chat/tool_calls.py: parse_reply``), so a reply parses the same whole or streamed.

The rules, for every syntax:

- a reasoning block is recognised at the start of the reply (or the reply starts inside one when
  the prompt opened it) and ends at its end marker;
- text that may still be the start of a marker is held back, and only as long as it may;
- a call is announced once its name is read; text read for a call that turns out not to be one is
  given back as content;
- content does not start right after a reasoning block or a call with whitespace, nor end with the
  whitespace before a call; whitespace-only reasoning is no reasoning.

Each character is scanned a bounded number of times (markers are searched from where the last
search stopped, and a tool call's JSON is scanned once), so the cost is linear in the reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import regex

from mlxcel_compat.chat.call_reader import CallArgs, CallReader, CallStart
from mlxcel_compat.chat.markers import DONE, WAIT, cached_marker_regex, marker_pattern, marker_regex, match_marker
from mlxcel_compat.chat.syntax import ChatSyntax, JsonCall, Lit, ToolSyntax, core

__all__ = [
    "Event",
    "MarkersParser",
    "TextDelta",
    "TextField",
    "collect_arg_types",
    "tool_trigger",
]


@dataclass(frozen=True)
class TextDelta:
    """Text for ``field``: ``"content"`` or ``"reasoning_content"``."""

    field: str
    text: str


Event = Union[TextDelta, CallStart, CallArgs]

_COMPACT_AT = 1 << 10  # drop the consumed start of the buffer once it is this long
_JSON_OPEN = regex.compile(r"\s*\{")


class TextField:
    """One text field's whitespace rules, applied as its pieces arrive.

    Trailing whitespace is held until more text follows. ``block()`` marks a reasoning block or a
    call next to the text: before any text, the whitespace after the block is dropped; after some,
    the whitespace on both sides of the block becomes one run; whitespace held before a block is
    dropped when nothing follows it. ``strip``: the field never starts or ends with whitespace.
    """

    def __init__(self, name: str, *, strip: bool = False) -> None:
        self.name = name
        self.strip = strip
        self.pending = ""
        self.drop_leading = strip
        self.collapse = False
        self.blocked = False
        self.started = False

    def add(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self.drop_leading:
            text = text.lstrip()
            if not text:
                return
            self.drop_leading = False
        elif self.collapse:
            lead = len(text) - len(text.lstrip())
            if lead and self.pending:
                text = text[lead:]
            if not text:
                return
            self.collapse = False
        whole = self.pending + text
        body = whole.rstrip()
        self.pending = whole[len(body):]
        if body:
            self.blocked = False
            self.started = True
            if out and isinstance(out[-1], TextDelta) and out[-1].field == self.name:
                out[-1] = TextDelta(self.name, out[-1].text + body)
            else:
                out.append(TextDelta(self.name, body))

    def block(self) -> None:
        self.blocked = True
        if self.started:
            self.collapse = True
        else:
            self.drop_leading = True

    def flush(self, out: list[Event]) -> None:
        if self.pending and not self.blocked and not self.strip:
            pending, self.pending = self.pending, ""
            out.append(TextDelta(self.name, pending))
        self.pending = ""


class MarkersParser:
    """The parser of the ``"markers"`` dialect: reasoning block, content, tool sections.

    Args:
        syntax: the template's syntax.
        reasoning: take reasoning out of the content (``reasoning_format`` other than ``none``).
        in_reasoning: the prompt opened the reasoning block (``ChatSyntax.reply_starts_in_reasoning``).
        tools: the request offers tools: calls are parsed (else they stay content).
        arg_types: function name -> parameter name -> JSON type, from the request's tools.
    """

    def __init__(self, syntax: ChatSyntax, *, reasoning: bool = True, in_reasoning: bool = False, tools: bool = True,
                 arg_types: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.syntax = syntax
        self.buf = ""
        self.pos = 0
        self.out: list[Event] = []
        self.content = TextField("content")
        self.thinking = TextField("reasoning_content", strip=True)
        self.arg_types = arg_types
        self.formats: tuple[ToolSyntax, ...] = syntax.tools if tools else ()
        self.active: ToolSyntax | None = None  # the format of the section being read
        self.calls = 0
        self.reader: CallReader | None = None
        self.mark = 0  # where the current call (or section) began: given back if it is no call
        self.skip_trigger_at = -1  # a trigger here was given back already
        self.mode = "content"
        self.reasoning = syntax.reasoning if reasoning else None
        if self.reasoning is not None:
            self.mode = "reasoning" if in_reasoning else "start"
            self.start_marker = marker_regex(self.reasoning.start) if core(self.reasoning.start) else None
            self.end_marker = regex.compile(marker_pattern(self.reasoning.end))
            self.end_opener = core(self.reasoning.end)[:1]
            self.bare_end = marker_regex(self.reasoning.end)
        self.triggers, self.extensions, self.openers = _content_markers(syntax, self.formats)

    # --- feeding ---------------------------------------------------------------------------------

    def push(self, text: str) -> list[Event]:
        """Feed the next piece of the reply; returns the events it completes."""
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The reply is complete: what was held back is decided now."""
        self._run(final=True)
        if self.mode == "call" and self.reader is not None:
            self._call_ended_early()
        elif self.mode == "reasoning":
            self.thinking.add(self.buf[self.pos:], self.out)
            self.pos = len(self.buf)
        elif self.pos < len(self.buf):
            self.content.add(self.buf[self.pos:], self.out)
            self.pos = len(self.buf)
        self.thinking.flush(self.out)
        self.content.flush(self.out)
        return self._take()

    def _take(self) -> list[Event]:
        out, self.out = self.out, []
        return out

    def _run(self, final: bool) -> None:
        while getattr(self, "_" + self.mode)(final):
            pass
        self._compact()

    def _compact(self) -> None:
        """Drop the start of the buffer nothing will look at again, so appending stays cheap."""
        reader = self.reader
        if reader is not None:
            keep = reader.keep_from() if reader.announced else self.mark
        else:
            keep = self.pos
        if keep < _COMPACT_AT:
            return
        self.buf = self.buf[keep:]
        self.pos -= keep
        self.mark -= keep
        self.skip_trigger_at = self.skip_trigger_at - keep if self.skip_trigger_at >= keep else -1
        if reader is not None:
            reader.rebase(keep)

    # --- modes: each returns True when it made progress ------------------------------------------

    def _start(self, final: bool) -> bool:
        """A reasoning block opens at the reply's start; a reply that starts with the block's end
        closes one it never showed (the prompt opened it in a way not recognised): both are dropped."""
        for marker, mode in ((self.start_marker, "reasoning"), (self.bare_end, "content")):
            if marker is None:
                continue
            m = marker.match(self.buf, self.pos, partial=not final)
            if m is not None and m.partial:
                return False
            if m is not None:
                self.pos, self.mode = m.end(), mode
                if mode == "content":
                    self.content.block()
                return True
        self.mode = "content"
        return True

    def _reasoning(self, final: bool) -> bool:
        m = self.end_marker.search(self.buf, self.pos, partial=not final) if _holds_any(self.buf, self.pos, self.end_opener) else None
        if m is None:
            self.thinking.add(self.buf[self.pos:], self.out)
            self.pos = len(self.buf)
            return False
        self.thinking.add(self.buf[self.pos: m.start()], self.out)
        if m.partial:
            self.pos = m.start()
            return False
        self.pos, self.mode = m.end(), "content"
        self.thinking.flush(self.out)
        self.content.block()
        return True

    def _content(self, final: bool) -> bool:
        if self.triggers is None:
            self.content.add(self.buf[self.pos:], self.out)
            self.pos = len(self.buf)
            return False
        if not _holds_any(self.buf, self.pos, self.openers):  # no marker can start in the new text
            m = None
        else:
            m = self.triggers.search(self.buf, self.pos, partial=not final)
        if m is not None and not m.partial and not final and self._may_grow(m):
            m = _Held(m.start())
        if m is None:
            self.content.add(self.buf[self.pos:], self.out)
            self.pos = len(self.buf)
            return False
        self.content.add(self.buf[self.pos: m.start()], self.out)
        self.pos = m.start()
        if isinstance(m, _Held) or m.partial:
            return False
        if m.start() == self.skip_trigger_at:  # already given back: it is content
            self.content.add(self.buf[m.start(): m.end()], self.out)
            self.pos = max(m.end(), m.start() + 1)
            return True
        kind = m.lastgroup
        if kind in ("content_start", "content_end"):
            self.pos = m.end()
            return True
        self.active = self.formats[int(kind[len("tools"):])]
        self.mark = m.start()
        if core(self.active.section_start):
            self._open_call(m.end(), 0)
        elif isinstance(self.active.call[0], Lit):
            self._open_call(m.end(), 1)
        else:
            self._open_call(m.start(), 0)
        return True

    def _may_grow(self, m: regex.Match[str]) -> bool:
        """A longer marker that starts like the one found may still match at the same place."""
        for pattern in self.extensions.get(m.lastgroup, ()):
            longer = pattern.match(self.buf, m.start(), partial=True)
            if longer is not None and longer.partial:
                return True
        return False

    def _open_call(self, pos: int, first_part: int) -> None:
        assert self.active is not None
        self.reader = CallReader(self.active, self.calls, pos, first_part, self.arg_types)
        self.mode = "call"
        self.content.block()

    def _call(self, final: bool) -> bool:
        reader = self.reader
        assert reader is not None
        status = reader.step(self.buf, final, self.out)
        if reader.announced and reader.index == self.calls:
            self.calls += 1
        if status == WAIT:
            return False
        if status == DONE:
            self.pos, self.reader, self.mode = reader.pos, None, "after_call"
            return True
        if final:  # FAIL at the end: _call_ended_early decides
            return False
        if reader.announced:  # the call is over where its text stopped making sense
            reader.abandon(self.buf, self.out)
            self.pos = reader.resume_at()
            if self.pos <= self.mark:
                self.pos, self.skip_trigger_at = self.mark, self.mark
        else:  # it was no call: its text is content
            self.pos, self.skip_trigger_at = self.mark, self.mark
        self.reader, self.mode = None, "content"
        return True

    def _call_ended_early(self) -> None:
        reader = self.reader
        assert reader is not None
        if reader.announced:
            reader.abandon(self.buf, self.out)
        else:
            self.content.blocked = False
            self.content.add(self.buf[self.mark:], self.out)
        self.pos, self.reader, self.mode = len(self.buf), None, "content"

    def _after_call(self, final: bool) -> bool:
        tools = self.active
        assert tools is not None
        pos = self.pos
        if core(tools.separator):
            status, end = match_marker(cached_marker_regex(tools.separator), self.buf, pos, final)
            if status == WAIT:
                return False
            if status == DONE:
                self.mark = pos
                self._open_call(end, 0)
                return True
        else:
            first = tools.call[0]
            if isinstance(first, Lit) and core(first.text):
                status, end = match_marker(cached_marker_regex(first.text), self.buf, pos, final)
                if status == WAIT:
                    return False
                if status == DONE:
                    self.mark = pos
                    self._open_call(end, 1)
                    return True
            elif isinstance(first, JsonCall):  # calls one after another, each a JSON object
                status, end = match_marker(_JSON_OPEN, self.buf, pos, final)
                if status == WAIT:
                    return False
                if status == DONE:
                    self.mark = pos
                    self._open_call(pos, 0)
                    return True
        if core(tools.section_end):
            status, end = match_marker(cached_marker_regex(tools.section_end), self.buf, pos, final)
            if status == WAIT:
                return False
            if status == DONE:
                pos = end
        self.pos, self.mode = pos, "content"
        self.content.block()
        return True


class _Held:
    """A marker found where a longer one may still match: wait for more text."""

    partial = True

    def __init__(self, start: int) -> None:
        self._start = start

    def start(self) -> int:
        return self._start



def _holds_any(buf: str, pos: int, chars: str) -> bool:
    """Whether ``buf[pos:]`` holds one of ``chars`` (a marker can only start at one of them)."""
    return any(buf.find(ch, pos) >= 0 for ch in chars)


def _content_markers(syntax: ChatSyntax, formats: tuple[ToolSyntax, ...]) -> tuple[regex.Pattern[str] | None, dict[str, list[regex.Pattern[str]]], str]:
    """The markers searched for in content, as one pattern (a group each: ``tools0``, ``tools1``,
    ``content_start``, ``content_end``), the longer markers each may grow into, and the characters
    they start with (text without them needs no search)."""
    markers: dict[str, tuple[str, str]] = {}  # group -> (pattern, the marker's core)
    for i, tools in enumerate(formats):
        trigger = tool_trigger(tools)
        if trigger is not None:
            markers[f"tools{i}"] = trigger
    if core(syntax.content_start):
        markers["content_start"] = (marker_pattern(syntax.content_start), core(syntax.content_start))
    if core(syntax.content_end):
        markers["content_end"] = (marker_pattern(syntax.content_end), core(syntax.content_end))
    if not markers:
        return None, {}, ""
    ordered = sorted(markers.items(), key=lambda item: -len(item[1][1]))
    pattern = regex.compile("|".join(f"(?P<{name}>{body})" for name, (body, _) in ordered))
    extensions: dict[str, list[regex.Pattern[str]]] = {}
    for name, (_, text) in markers.items():
        for other, (body, other_text) in markers.items():
            if other != name and text and other_text.startswith(text) and len(other_text) > len(text):
                extensions.setdefault(name, []).append(regex.compile(body))
    return pattern, extensions, "".join(sorted({text[0] for _, text in markers.values() if text}))


def tool_trigger(tools: ToolSyntax) -> tuple[str, str] | None:
    """What opens a reply's tool calls, as a pattern and as text: the section's marker, the call's
    first marker, or, for a bare JSON call (Llama 3.x), ``{`` and its name key."""
    if core(tools.section_start):
        return marker_pattern(tools.section_start), core(tools.section_start)
    first = tools.call[0]
    if isinstance(first, Lit) and core(first.text):
        return marker_pattern(first.text), core(first.text)
    if isinstance(first, JsonCall) and not first.name_is_key:
        key = '"' + first.name_path[0] + '"'
        return r"\{\s*" + regex.escape(key) + r"\s*:", "{" + key
    return None


def collect_arg_types(tools: Any) -> dict[str, dict[str, str]]:
    """Function name -> parameter -> JSON type, read from OpenAI tools (what a tagged value is)."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        properties = (function.get("parameters") or {}).get("properties") if isinstance(function.get("parameters"), Mapping) else None
        fields: dict[str, str] = {}
        for key, schema in (properties or {}).items():
            if isinstance(schema, Mapping) and isinstance(schema.get("type"), str):
                fields[str(key)] = schema["type"]
        types[function["name"]] = fields
    return types
