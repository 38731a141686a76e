"""Parsers for the two hand-written dialects: replies made of addressed messages.

Two families write a reply as a run of messages, each with a header naming where it goes, rather
than as text with markers around calls:

- **gpt-oss Harmony**: ``<|channel|>analysis<|message|>...<|end|>`` (reasoning),
  ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`` (a call;
  the recipient may also follow the channel), ``<|channel|>final<|message|>...<|return|>`` (the
  answer). The header's fields come in either order, so the marker analysis cannot read it.
- **Functionary v3.2**: ``>>>all\\ntext`` or ``>>>NAME\\n{json}``; the generation prompt ends with
  the first ``>>>``, so the first message's header is the model's first word.

Both return the events of ``chat/reply_parser.py`` and follow its rules (text that may be a marker
is held back; whitespace next to blocks is dropped), so their replies parse the same whole or
streamed.
"""

from __future__ import annotations

import json
from typing import Any

import regex

from mlxcel_compat.chat.call_reader import CallArgs, CallStart, new_call_id
from mlxcel_compat.chat.json_scan import close_json
from mlxcel_compat.chat.reply_parser import Event, TextField

__all__ = ["FunctionaryV32Parser", "HarmonyParser", "make_message_parser"]

_COMPACT_AT = 1 << 10
_HEADER_END = regex.compile(r"<\|message\|>")
_HARMONY_STOP = regex.compile(r"<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|<\|channel\|>")
_CHANNEL = regex.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = regex.compile(r"\bto=([^\s<]+)")
_HARMONY_OPEN = regex.compile(r"\s*(?:<\|start\|>|<\|channel\|>|to=)")


class _MessageParser:
    """What both dialects share: the buffer, the text fields and the current call."""

    def __init__(self, *, reasoning: bool, tools: bool) -> None:
        self.buf = ""
        self.pos = 0
        self.out: list[Event] = []
        self.content = TextField("content")
        self.thinking = TextField("reasoning_content", strip=True)
        self.reasoning = reasoning
        self.tools = tools
        self.calls = 0
        self.call_text: list[str] | None = None  # argument pieces sent for the open call (None: none open)

    def push(self, text: str) -> list[Event]:
        self.buf += text
        while self._step(final=False):
            pass
        if self.pos > _COMPACT_AT:  # what was read is not looked at again
            self.buf, self.pos = self.buf[self.pos:], 0
        return self._take()

    def finish(self) -> list[Event]:
        while self._step(final=True):
            pass
        self._close_call()
        self.thinking.flush(self.out)
        self.content.flush(self.out)
        return self._take()

    def _take(self) -> list[Event]:
        out, self.out = self.out, []
        return out

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _text(self, field: TextField, text: str) -> None:
        field.add(text, self.out)

    def _open_call(self, name: str) -> None:
        self.out.append(CallStart(self.calls, new_call_id(), name))
        self.calls += 1
        self.call_text = []
        self.content.block()

    def _args(self, text: str) -> None:
        if text and self.call_text is not None:
            self.call_text.append(text)
            self.out.append(CallArgs(self.calls - 1, text))

    def _close_call(self) -> None:
        """The open call's arguments end here: completed into JSON when they were cut short."""
        if self.call_text is None:
            return
        text, self.call_text = "".join(self.call_text), None
        if not text.strip():
            self.out.append(CallArgs(self.calls - 1, "{}"))
            return
        closed = close_json(text.rstrip())
        if closed is not None and closed != text.rstrip() and closed.startswith(text.rstrip()):
            self.out.append(CallArgs(self.calls - 1, closed[len(text.rstrip()):]))


class HarmonyParser(_MessageParser):
    """gpt-oss replies: ``analysis`` is reasoning, ``final`` and plain ``commentary`` are content,
    ``commentary`` addressed ``to=functions.NAME`` is a call to NAME."""

    def __init__(self, *, reasoning: bool = True, tools: bool = True) -> None:
        super().__init__(reasoning=reasoning, tools=tools)
        self.mode = "header"
        self.channel = "final"
        self.body_start = 0

    def _step(self, final: bool) -> bool:
        if self.mode == "header":
            return self._header(final)
        return self._body(final)

    def _header(self, final: bool) -> bool:
        opening = _HARMONY_OPEN.match(self.buf, self.pos, partial=not final)
        if opening is not None and opening.partial:
            return False
        if opening is None:  # text without a header: the answer
            self.channel, self.mode = "final", "body"
            return True
        end = _HEADER_END.search(self.buf, self.pos, partial=not final)
        if end is None or end.partial:
            if final:  # a header the reply never finished: nothing to show
                self.pos = len(self.buf)
            return False
        header = self.buf[self.pos: end.start()]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else "final"
        self.pos, self.mode = end.end(), "body"
        if recipient is not None and self.tools and recipient.group(1) != "all":
            name = recipient.group(1)
            self._open_call(name[len("functions."):] if name.startswith("functions.") else name)
            self.channel = "call"
        return True

    def _body(self, final: bool) -> bool:
        stop = _HARMONY_STOP.search(self.buf, self.pos, partial=not final)
        limit = len(self.buf) if stop is None else stop.start()
        self._deliver(self.buf[self.pos: limit])
        self.pos = limit
        if stop is None or stop.partial:
            return False
        marker = stop.group()
        if marker in ("<|start|>", "<|channel|>"):
            self.pos = stop.start()  # the next message's header
        else:
            self.pos = stop.end()
        self._end_message()
        self.mode = "header"
        return True

    def _deliver(self, text: str) -> None:
        if not text:
            return
        if self.channel == "call":
            self._args(text)
        elif self.channel == "analysis" and self.reasoning:
            self._text(self.thinking, text)
        else:
            self._text(self.content, text)

    def _end_message(self) -> None:
        if self.channel == "call":
            self._close_call()
        elif self.channel == "analysis" and self.reasoning:
            self.thinking.flush(self.out)
            self.content.block()


_RECIPIENT_LINE = regex.compile(r"\s*([\w.\-]{1,128})\n")
_NEXT_MESSAGE = regex.compile(r">>>")


class FunctionaryV32Parser(_MessageParser):
    """Functionary v3.2 replies: messages ``>>>RECIPIENT\\nBODY``; ``all`` is text, other recipients
    are calls whose body is the JSON arguments (``python``'s body is code: ``{"code": ...}``)."""

    def __init__(self, *, reasoning: bool = True, tools: bool = True) -> None:
        super().__init__(reasoning=reasoning, tools=tools)
        self.mode = "recipient"
        self.recipient = "all"
        self.code = ""

    def _step(self, final: bool) -> bool:
        if self.mode == "recipient":
            m = _RECIPIENT_LINE.match(self.buf, self.pos, partial=not final)
            if m is not None and m.partial:
                return False
            if m is None:  # no header: plain text
                self.recipient, self.mode = "all", "body"
                return True
            self.recipient = m.group(1)
            self.pos, self.mode = m.end(), "body"
            if self.recipient != "all" and self.tools:
                self._open_call(self.recipient)
            return True
        stop = _NEXT_MESSAGE.search(self.buf, self.pos, partial=not final)
        limit = len(self.buf) if stop is None else stop.start()
        self._deliver(self.buf[self.pos: limit])
        self.pos = limit
        if stop is None or stop.partial:
            return False
        self.pos = stop.end()
        self._end_message()
        self.mode = "recipient"
        return True

    def _deliver(self, text: str) -> None:
        if self.recipient == "all" or not self.tools:
            self._text(self.content, text)
        elif self.recipient == "python":
            self.code += text
        else:
            self._args(text if self.call_text else text.lstrip())

    def _end_message(self) -> None:
        if self.recipient == "python" and self.call_text is not None:
            self._args(json.dumps({"code": self.code}, ensure_ascii=False))
            self.code = ""
        self._close_call()

    def finish(self) -> list[Event]:
        while self._step(final=True):
            pass
        self._end_message()
        self.thinking.flush(self.out)
        self.content.flush(self.out)
        return self._take()


def make_message_parser(dialect: str, **options: Any) -> _MessageParser:
    """The parser of a hand-written dialect (``"harmony"`` or ``"functionary_v3_2"``)."""
    if dialect == "harmony":
        return HarmonyParser(**options)
    return FunctionaryV32Parser(**options)
