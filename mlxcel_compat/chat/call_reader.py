"""Reading one tool call out of a growing reply, part by part (``chat/syntax.py``'s :data:`Part`).

The reply parser (``chat/reply_parser.py``) hands a :class:`CallReader` the reply text and where
the call begins; :meth:`CallReader.step` reads as far as the text allows and says whether it needs
more text, finished the call, or found that the text is not a call after all. It announces the call
(:class:`CallStart`: index, id, name) as soon as the name (and an id written before the arguments)
is known, then streams the arguments as :class:`CallArgs` pieces of one JSON object text.

Markers are matched as ``chat/markers.py`` says (partial matches wait for more text); tagged
arguments are read by ``chat/tagged_args.py``, Python and Gemma arguments decoded by
``chat/arg_encodings.py``.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import regex

from mlxcel_compat.chat.arg_encodings import bracket_end, gemma_arguments, python_arguments
from mlxcel_compat.chat.json_scan import JsonScanner, close_json
from mlxcel_compat.chat.markers import DONE, FAIL, WAIT, cached_marker_regex, match_marker
from mlxcel_compat.chat.syntax import (
    CallId,
    CallIndex,
    GemmaArgs,
    JsonArgs,
    JsonCall,
    Lit,
    Name,
    Part,
    PythonArgs,
    TaggedArgs,
    ToolSyntax,
    core,
)
from mlxcel_compat.chat.tagged_args import TaggedReader

__all__ = ["CallArgs", "CallReader", "CallStart", "new_call_id"]

_ALNUM = string.ascii_letters + string.digits
_NAME = regex.compile(r"\s*([\w\-]+)")  # OpenAI and Anthropic names: letters, digits, _ and -
_ID = regex.compile(r"\s*([^\s<>\[\]{}\"'|,]+)")
_INDEX = regex.compile(r"\s*(\d+)")
_WS = regex.compile(r"\s*")
_HIGH_SURROGATE = regex.compile(r"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}\Z")


@dataclass(frozen=True)
class CallStart:
    """A call is announced: its position among the reply's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """The next piece of a call's arguments (pieces of one JSON object text, in order)."""

    index: int
    text: str


def new_call_id(style: str = "call") -> str:
    """An id for a call the model wrote without one, in the shape the template accepts back."""
    if style == "alnum9":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


class CallReader:
    """Reads the parts of one call starting at a position of the reply text.

    ``arg_types`` maps a function name to its parameters' JSON types (from the request's tools):
    a tagged argument whose marker does not say how its value is written is a string when the schema
    says so, else JSON when it parses as JSON.
    """

    def __init__(self, tools: ToolSyntax, index: int, pos: int, first_part: int = 0,
                 arg_types: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.tools = tools
        self.parts: tuple[Part, ...] = tools.call
        self.index = index
        self.pos = pos
        self.part = first_part
        self.arg_types = arg_types or {}
        self.name: str | None = None
        self.id: str | None = None
        self.call_index: int | None = None
        self.announced = False
        self.args_sent = False  # some argument text was sent
        self._state: Any = None  # the current part's reading state
        # A call written as a bare JSON object (Llama 3.x): only its keys tell it from prose.
        self.bare = not core(tools.section_start) and not any(isinstance(p, Lit) and core(p.text) for p in tools.call)

    # --- driving -----------------------------------------------------------------------------

    def step(self, buf: str, final: bool, out: list[Any]) -> str:
        """Read parts until the text runs out (``WAIT``), the call ends (``DONE``) or fails (``FAIL``)."""
        while self.part < len(self.parts):
            part = self.parts[self.part]
            status = self._read(part, buf, final, out)
            if status != DONE:
                return status
            self.part += 1
            self._state = None
        self._announce(out)
        if not self.args_sent:
            self.send("{}", out)
        return DONE

    def abandon(self, buf: str, out: list[Any]) -> None:
        """The reply ended inside an announced call: close its arguments as well as they can be."""
        part = self.parts[self.part] if self.part < len(self.parts) else None
        if isinstance(part, (JsonArgs, JsonCall)) and isinstance(self._state, _JsonState) and self._state.start is not None:
            state = self._state
            if not state.as_string:
                self.send(state.pending_text(buf, state.scanner.pos), out)
            tail = state.closing()
            if tail:
                self.send(tail, out)
            elif not self.args_sent:
                self.send("{}", out)
            return
        if isinstance(part, TaggedArgs) and isinstance(self._state, TaggedReader):
            self._state.finish_value(buf, self, out)
            self.send("}" if self._state.count else "{}", out)
            return
        if not self.args_sent:
            self.send("{}", out)

    def keep_from(self) -> int:
        """The earliest reply position this reader may still look at."""
        state = self._state
        if isinstance(state, _JsonState):  # a JSON part reads from its scanner, not from pos
            return state.keep_from()
        if isinstance(state, TaggedReader):
            return state.keep_from(self.pos)
        return self.pos

    def resume_at(self) -> int:
        """Where reading stopped: the reply's text goes on from here when the call ends early."""
        if isinstance(self._state, _JsonState):
            return max(self.pos, self._state.scanner.pos)
        return self.pos

    def rebase(self, delta: int) -> None:
        """The parser dropped ``delta`` characters from the start of the reply buffer."""
        self.pos -= delta
        if isinstance(self._state, (_JsonState, TaggedReader)):
            self._state.rebase(delta)

    # --- announcing and sending ----------------------------------------------------------------

    def _announce(self, out: list[Any]) -> None:
        if self.announced or self.name is None:
            return
        self.announced = True
        call_id = self.id
        if call_id is None and self.call_index is not None:
            index_part = next(p for p in self.parts if isinstance(p, CallIndex))
            if index_part.id_template:
                call_id = index_part.id_template.format(name=self.name, index=self.call_index)
        out.append(CallStart(self.index, call_id or new_call_id(self.tools.id_style), self.name))

    def send(self, text: str, out: list[Any]) -> None:
        """Send the next piece of the arguments' text."""
        if text:
            self.args_sent = True
            out.append(CallArgs(self.index, text))

    # --- the parts -----------------------------------------------------------------------------

    def _read(self, part: Part, buf: str, final: bool, out: list[Any]) -> str:
        if isinstance(part, Lit):
            if not core(part.text):
                return DONE
            status, end = match_marker(cached_marker_regex(part.text), buf, self.pos, final)
            if status == DONE:
                self.pos = end
            return status
        if isinstance(part, Name):
            if self.name is not None:  # the name written again (Muse Glimmer): it must be the same
                first = self.name
                status = self._field(_NAME, buf, final, "name")
                return FAIL if status == DONE and self.name != first else status
            return self._field(_NAME, buf, final, "name")
        if isinstance(part, CallId):
            return self._field(_ID, buf, final, "id")
        if isinstance(part, CallIndex):
            status = self._field(_INDEX, buf, final, "call_index")
            if status == DONE:
                self.call_index = int(self.call_index)  # type: ignore[arg-type]
            return status
        if isinstance(part, JsonArgs):
            return self._json_args(buf, final, out)
        if isinstance(part, JsonCall):
            return self._json_call(part, buf, final, out)
        if isinstance(part, TaggedArgs):
            return self._tagged(part, buf, final, out)
        if isinstance(part, PythonArgs):
            return self._bracketed(buf, final, out, "(", ")", python_arguments)
        if isinstance(part, GemmaArgs):
            return self._bracketed(buf, final, out, "{", "}", gemma_arguments)
        raise TypeError(f"unknown call part {part!r}")

    def _field(self, pattern: regex.Pattern[str], buf: str, final: bool, attr: str) -> str:
        m = pattern.match(buf, self.pos)
        if m is None or not m.group(1):
            if not final and not buf[self.pos:].strip():
                return WAIT
            return FAIL
        if m.end() >= len(buf) and not final:
            return WAIT  # the field may go on
        setattr(self, attr, m.group(1))
        self.pos = m.end()
        return DONE

    def _json_args(self, buf: str, final: bool, out: list[Any]) -> str:
        state = self._state
        if state is None:
            start = _WS.match(buf, self.pos).end()
            if start >= len(buf):
                return FAIL if final else WAIT
            if buf[start] != "{":
                return FAIL
            self._announce(out)
            state = self._state = _JsonState(JsonScanner(start))
            state.begin(start, 0, False)
        scanner = state.scanner
        scanner.feed(buf, final)
        if scanner.failed:
            return FAIL
        self.send(state.pending_text(buf, scanner.pos), out)
        if scanner.done:
            self.pos = scanner.pos
            return DONE
        return FAIL if final else WAIT

    def _json_call(self, part: JsonCall, buf: str, final: bool, out: list[Any]) -> str:
        state = self._state
        if state is None:
            start = _WS.match(buf, self.pos).end()
            if start >= len(buf):
                return FAIL if final else WAIT
            if buf[start] != "{":
                return FAIL
            watch = {part.name_path, part.args_path}
            if part.id_path is not None:
                watch.add(part.id_path)
            scanner = JsonScanner(start, frozenset(watch))
            scanner.watch_first_key = part.name_is_key
            state = self._state = _JsonState(scanner)
        scanner = state.scanner
        while True:  # event by event, so the call is announced at the same place however text comes
            scanner.feed(buf, final)
            status = self._json_call_event(part, state, buf, out)
            if status is not None or not scanner.paused:
                return status if status is not None else (FAIL if final else WAIT)

    def _json_call_event(self, part: JsonCall, state: _JsonState, buf: str, out: list[Any]) -> str | None:
        """What the call object read so far gives: the name, id, where the arguments start; the
        announcement and the arguments' next piece. ``None`` while the object goes on."""
        scanner = state.scanner
        if scanner.failed:
            if self.announced and state.start is not None:  # what streamed before the fault, whole too
                limit = max(state.sent_to, scanner.pos)
                self.send(state.pending_string(buf, limit, final=False) if state.as_string else state.pending_text(buf, limit), out)
            return FAIL
        if part.name_is_key:
            name, args_path = scanner.first_key, (scanner.first_key,)
        else:
            name, args_path = scanner.strings.get(part.name_path), part.args_path
        if self.name is None and name is not None:
            self.name = name
        if part.id_path is not None and part.id_path in scanner.strings:
            self.id = scanner.strings[part.id_path]
        if state.start is None and args_path in scanner.starts:
            start = scanner.starts[args_path]
            as_string = buf[start] == '"'  # arguments written as a JSON string
            state.begin(start + as_string, len(args_path), as_string)
        if scanner.done and (self.name is None or (self.bare and args_path not in scanner.starts)):
            return FAIL  # no name; or, without markers around it, an object that only names something
        may_announce = self.name is not None and (not part.id_after_args or scanner.done)
        if may_announce and (state.start is not None or scanner.done):
            self._announce(out)
        if self.announced and state.start is not None:
            end = scanner.ends.get(args_path)
            if end is not None and state.as_string:
                end -= 1
            limit = end if end is not None else scanner.pos
            if state.as_string:
                self.send(state.pending_string(buf, limit, final=end is not None), out)
            else:
                self.send(state.pending_text(buf, limit), out)
        if scanner.done:
            self.pos = scanner.pos
            return DONE
        return None

    def _tagged(self, part: TaggedArgs, buf: str, final: bool, out: list[Any]) -> str:
        if self._state is None:
            self._announce(out)
            closer = next((p for p in self.parts[self.part + 1:] if isinstance(p, Lit) and core(p.text)), None)
            self._state = TaggedReader(part, closer.text if closer else None, self._types())
        return self._state.step(buf, final, self, out)

    def _types(self) -> Mapping[str, str]:
        return self.arg_types.get(self.name or "", {})

    def _bracketed(self, buf: str, final: bool, out: list[Any], open_: str, close: str, convert: Any) -> str:
        start = _WS.match(buf, self.pos).end()
        if start >= len(buf):
            return FAIL if final else WAIT
        if buf[start] != open_:
            return FAIL
        self._announce(out)
        end = bracket_end(buf, start, open_, close)
        if end is None:
            return FAIL if final else WAIT
        arguments = convert(buf[start:end])
        if arguments is None:
            return FAIL
        self.send(json.dumps(arguments, ensure_ascii=False), out)
        self.pos = end
        return DONE


class _JsonState:
    """A JSON value being read: its scanner, where the arguments' text starts, how much was sent.

    Positions are absolute in the reply buffer (``rebase`` moves them when the parser drops the
    buffer's consumed start). Arguments written as a JSON string are sent decoded.
    """

    def __init__(self, scanner: JsonScanner) -> None:
        self.scanner = scanner
        self.start: int | None = None  # where the arguments' text starts in the reply
        self.depth = 0  # the containers around the arguments (a call object's key path)
        self.as_string = False  # the arguments are a JSON string holding their text
        self.sent_to = 0  # the reply position up to which the arguments were sent
        self.decoded: list[str] = []  # string arguments: the decoded pieces sent

    def begin(self, start: int, depth: int, as_string: bool) -> None:
        self.start, self.depth, self.as_string = start, depth, as_string
        self.sent_to = start

    def pending_text(self, buf: str, limit: int) -> str:
        text = buf[self.sent_to: limit]
        self.sent_to = max(self.sent_to, limit)
        return text

    def pending_string(self, buf: str, limit: int, final: bool) -> str:
        """Arguments held in a JSON string: the newly decoded characters (escapes kept whole)."""
        raw = buf[self.sent_to: limit]
        if not final:  # an escape may be incomplete, or the first half of a surrogate pair
            cut = raw.rfind("\\", max(0, len(raw) - 12))
            if cut >= 0:
                raw = raw[:cut]
            if _HIGH_SURROGATE.search(raw):
                raw = raw[:-6]
        try:
            text = json.loads('"' + raw + '"', strict=False)
        except ValueError:
            return ""
        self.sent_to += len(raw)
        self.decoded.append(text)
        return text

    def closing(self) -> str | None:
        """What completes the arguments sent so far into JSON (``None`` when nothing can)."""
        if self.as_string:
            sent = "".join(self.decoded)
            closed = close_json(sent.rstrip()) if sent.strip() else None
            return closed[len(sent.rstrip()):] if closed is not None else None
        return self.scanner.closing(self.depth)

    def keep_from(self) -> int:
        return min(self.sent_to if self.start is not None else self.scanner.pos, self.scanner.token_start())

    def rebase(self, delta: int) -> None:
        self.scanner.rebase(delta)
        if self.start is not None:
            self.start -= delta
            self.sent_to -= delta
