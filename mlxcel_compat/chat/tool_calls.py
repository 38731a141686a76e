"""A generated reply taken apart in its template's syntax: reasoning, content and OpenAI tool calls.

The syntax comes from the served template (``ChatTemplate.syntax()``: ``chat/syntax_formats.py``);
the parser from the syntax's dialect (:func:`open_parser`). :func:`parse_reply` feeds a finished
reply to the same parser a stream uses (``chat/stream_splitter.py``), so both give the same result.
:class:`CallCollector` turns the parser's call events into OpenAI ``tool_calls``
(``{"type": "function", "id", "function": {"name", "arguments": <JSON text>}}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxcel_compat.chat.call_reader import CallArgs, CallStart
from mlxcel_compat.chat.lenient_calls import LenientCalls
from mlxcel_compat.chat.message_parsers import make_message_parser
from mlxcel_compat.chat.reply_parser import Event, MarkersParser, TextDelta
from mlxcel_compat.chat.syntax import ChatSyntax, JsonCall, Lit, ToolSyntax

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "CallCollector",
    "ParsedReply",
    "ReplyOptions",
    "ReplyParser",
    "open_parser",
    "parse_reply",
    "parse_tool_calls",
]

# The Hermes markers the tool-call grammars force (``chat/tool_grammar.py``), and that syntax.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_GRAMMAR_SYNTAX = ChatSyntax("JSON call", tools=(ToolSyntax(call=(Lit(TOOL_CALL_OPEN), JsonCall(), Lit(TOOL_CALL_CLOSE))),))


class ReplyParser(Protocol):
    """What every dialect's parser offers: pieces in, events out."""

    def push(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


@dataclass(frozen=True)
class ReplyOptions:
    """How one request's reply is parsed.

    ``reasoning``: reasoning is taken out of the content (``reasoning_format`` other than
    ``none``); ``in_reasoning``: the prompt opened the reasoning block; ``tools``: the request offers
    tools (else calls stay content); ``parallel``: more than one call is kept
    (``parallel_tool_calls``); ``arg_types``: function -> parameter -> JSON type, from the tools;
    ``lenient_schemas``: function -> parameters schema of the offered tools when an answer that is
    only a loosely written call object is read as the call (``chat/lenient_calls.py``; empty: off).
    """

    reasoning: bool = True
    in_reasoning: bool = False
    tools: bool = False
    parallel: bool = True
    arg_types: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    lenient_schemas: Mapping[str, Any] = field(default_factory=dict)


def open_parser(syntax: ChatSyntax, options: ReplyOptions) -> ReplyParser:
    """A fresh parser for one reply in ``syntax`` (recovering loosely written calls where the options ask)."""
    parser: ReplyParser
    if syntax.dialect != "markers":
        parser = make_message_parser(syntax.dialect, reasoning=options.reasoning, tools=options.tools)
    else:
        parser = MarkersParser(syntax, reasoning=options.reasoning, in_reasoning=options.in_reasoning, tools=options.tools,
                               arg_types=options.arg_types)
    if options.tools and options.lenient_schemas:
        parser = LenientCalls(parser, options.lenient_schemas, syntax.tools[0].id_style if syntax.tools else "call")
    return parser


class CallCollector:
    """Call events gathered into OpenAI ``tool_calls``; with ``parallel`` off only the first is kept."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self._starts: list[CallStart] = []
        self._pieces: list[list[str]] = []  # each call's argument pieces (joined when asked)

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [{"type": "function", "id": start.id, "function": {"name": start.name, "arguments": "".join(pieces)}}
                for start, pieces in zip(self._starts, self._pieces)]

    def keep(self, event: Event) -> bool:
        """Whether ``event`` belongs to a kept call (text events always do)."""
        if isinstance(event, (CallStart, CallArgs)):
            return self.parallel or event.index == 0
        return True

    def add(self, event: Event) -> None:
        if not self.keep(event):
            return
        if isinstance(event, CallStart):
            self._starts.append(event)
            self._pieces.append([])
        elif isinstance(event, CallArgs):
            self._pieces[event.index].append(event.text)


@dataclass
class ParsedReply:
    """A finished reply taken apart: reasoning (``None`` when there was none), content, calls."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]]


def parse_reply(syntax: ChatSyntax, text: str, options: ReplyOptions) -> ParsedReply:
    """``text``, a whole reply, taken apart in ``syntax``."""
    parser = open_parser(syntax, options)
    collector = CallCollector(options.parallel)
    fields = {"content": "", "reasoning_content": ""}
    for event in parser.push(text) + parser.finish():
        if isinstance(event, TextDelta):
            fields[event.field] += event.text
        else:
            collector.add(event)
    return ParsedReply(fields["reasoning_content"] or None, fields["content"], collector.calls)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The content and calls of ``text`` in the Hermes syntax the tool-call grammars force."""
    parsed = parse_reply(_GRAMMAR_SYNTAX, text, ReplyOptions(reasoning=False, tools=True))
    return parsed.content, parsed.tool_calls
