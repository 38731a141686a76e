"""One streamed reply taken apart as it is generated: text deltas and OpenAI tool-call deltas.

The streaming counterpart of ``chat/tool_calls.py: parse_reply``, over the same parser: a reply
streamed and a reply parsed whole give the same reasoning, content and calls. Deltas are
``(field, value)`` pairs in the order they happen:

- ``("reasoning_content", text)`` and ``("content", text)``;
- ``("tool_calls", [delta, ...])`` in OpenAI's stream shape: a call's first delta carries its
  ``index``, ``id``, ``type`` and ``function.name`` (with the arguments read so far), later ones
  ``index`` and the next ``function.arguments`` piece.

Text that may still turn out to be a marker or a call is held back only as long as it may
(``chat/reply_parser.py``; and content that may still be a loosely written call object,
``chat/lenient_calls.py``); :meth:`ReplyStream.finish` releases the rest.
"""

from __future__ import annotations

from typing import Any

from mlxcel_compat.chat.call_reader import CallArgs, CallStart
from mlxcel_compat.chat.reply_parser import Event, TextDelta
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.tool_calls import CallCollector, ReplyOptions, open_parser

__all__ = ["ReplyStream"]


class ReplyStream:
    """Feeds one reply's pieces to its syntax's parser and returns the deltas to send."""

    def __init__(self, syntax: ChatSyntax, options: ReplyOptions) -> None:
        self.parser = open_parser(syntax, options)
        self.collector = CallCollector(options.parallel)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls read so far, whole (OpenAI ``tool_calls``)."""
        return self.collector.calls

    def push(self, text: str) -> list[tuple[str, Any]]:
        """The next piece of generated text; returns the deltas it completes."""
        return self._deltas(self.parser.push(text)) if text else []

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the reply: what was held back."""
        return self._deltas(self.parser.finish())

    def _deltas(self, events: list[Event]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for event in events:
            if isinstance(event, TextDelta):
                if out and out[-1][0] == event.field:
                    out[-1] = (event.field, out[-1][1] + event.text)
                else:
                    out.append((event.field, event.text))
                continue
            if not self.collector.keep(event):
                continue
            self.collector.add(event)
            if not out or out[-1][0] != "tool_calls":
                out.append(("tool_calls", []))
            calls: list[dict[str, Any]] = out[-1][1]
            if isinstance(event, CallStart):
                calls.append({"index": event.index, "id": event.id, "type": "function",
                              "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, CallArgs):
                if calls and calls[-1]["index"] == event.index:
                    calls[-1]["function"]["arguments"] += event.text
                else:
                    calls.append({"index": event.index, "function": {"arguments": event.text}})
        return out
