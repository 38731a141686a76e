"""Calls that small models write loosely: an answer that is only a call object, without its markers.

Beyond llama-server. Measured 12-06 on a real Qwen2.5-Coder-0.5B-Instruct asked for the weather
with a ``get_weather`` tool offered: the model wrote ``{"name": "get_weather", "arguments":
{"city": "Paris"}}`` (once inside a json code fence) without its ``<tool_call>`` tags, so the agent
got text instead of a call. As Ollama does, such an answer is returned as the call, but only when:

- the request offers tools and its ``tool_choice`` is not ``none`` (the caller decides:
  ``ReplyOptions.lenient_schemas`` is empty otherwise, and with ``--no-lenient-tool-calls``);
- the reply's whole content (reasoning aside) is one JSON object, bare or in one
  ```` ```json ```` fence, whose first key is ``"name"`` and which holds ``"arguments"`` (or
  ``"parameters"``, as Llama's templates teach) as an object (or a JSON string of one);
- the name is an offered tool's, and the arguments validate against that tool's ``parameters``
  schema (``jsonschema``; a schema it cannot read validates nothing);
- the template's own parser read no call in the reply.

Anything else stays content, unchanged. :class:`LenientCalls` wraps a reply's parser, so a reply
parsed whole and one streamed decide the same. Streamed, such an answer is only known to be a call
when the reply ends, so content is held back while it can still be one: from its first character
while it is whitespace, a fence's opening or the object's start, then as long as the text read so
far is that object (and its fence's close). Content that cannot be one (any other first
character, another first key, text after the object) is released at once, and streams as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import regex

from mlxcel_compat.chat.call_reader import CallArgs, CallStart, new_call_id
from mlxcel_compat.chat.json_scan import JsonScanner
from mlxcel_compat.chat.reply_parser import Event, TextDelta

__all__ = ["LenientCalls", "collect_schemas", "recover_call"]

ARGUMENT_KEYS = ("arguments", "parameters")
# The start of a loosely written call: an optional ```json fence, then an object whose first key is "name".
_START = regex.compile(r'\s*(?P<fence>```(?:json)?[ \t]*\n?\s*)?(?P<object>\{)\s*"name"\s*:')
_FENCED = regex.compile(r"\s*```(?:json)?[ \t]*\n?(?P<object>.*?)```\s*\Z", regex.DOTALL)
_FENCE_CLOSE = regex.compile(r"\s*```\s*\Z")
_SPACE = regex.compile(r"\s*\Z")


def collect_schemas(tools: Any) -> dict[str, Any]:
    """Function name -> its ``parameters`` schema, read from OpenAI tools (``{}`` when absent)."""
    schemas: dict[str, Any] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {}
    return schemas


def recover_call(text: str, schemas: Mapping[str, Any]) -> tuple[str, str] | None:
    """The ``(name, arguments JSON)`` of a whole content that is one loosely written call, else ``None``."""
    fenced = _FENCED.match(text)
    body = fenced.group("object") if fenced is not None else text
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in schemas:
        return None
    key = next((k for k in ARGUMENT_KEYS if k in call), None)
    if key is None:
        return None
    arguments = call[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or not _valid(arguments, schemas[call["name"]]):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _valid(arguments: dict[str, Any], schema: Any) -> bool:
    """Whether ``arguments`` validate against ``schema``; a schema that is not one validates nothing."""
    import jsonschema  # only a reply that looks like a call pays for the import

    if not isinstance(schema, Mapping):
        return False
    try:
        validator = jsonschema.validators.validator_for(schema)
        validator.check_schema(schema)
        return validator(schema).is_valid(arguments)
    except Exception:  # noqa: BLE001 - an invalid schema, a $ref it cannot resolve: no call is proven
        return False


class LenientCalls:
    """A reply's parser with loosely written calls recovered (see the module's docstring).

    Events pass through unchanged except content, which is held back while the content so far may
    still be such a call; at the end a held content that is one becomes a ``CallStart`` and one
    ``CallArgs``, else it is released as it was.
    """

    def __init__(self, parser: Any, schemas: Mapping[str, Any], id_style: str = "call") -> None:
        self.parser = parser
        self.schemas = schemas
        self.id_style = id_style
        self.deciding = True  # content may still be a loose call
        self.held: list[TextDelta] = []
        self.text = ""  # the held content
        self.scanner: JsonScanner | None = None  # the object's scan, once its start is read
        self.fenced = False

    def push(self, text: str) -> list[Event]:
        return self._filter(self.parser.push(text), final=False)

    def finish(self) -> list[Event]:
        return self._filter(self.parser.finish(), final=True)

    def _filter(self, events: list[Event], final: bool) -> list[Event]:
        if not self.deciding:
            return events
        out: list[Event] = []
        for event in events:
            if isinstance(event, TextDelta) and event.field == "content" and self.deciding:
                self.held.append(event)
                self.text += event.text
            elif self.held:  # anything after the content began (a call, reasoning): it was text
                out += self._release()
                out.append(event)
            else:
                self.deciding = self.deciding and not isinstance(event, (CallStart, CallArgs))
                out.append(event)
        if self.deciding and self.held and not self._may_be_call():
            out += self._release()
        if final and self.deciding:
            recovered = recover_call(self.text, self.schemas) if self.held else None
            if recovered is None:
                out += self._release()
            else:
                name, arguments = recovered
                out += [CallStart(0, new_call_id(self.id_style), name), CallArgs(0, arguments)]
                self.held, self.deciding = [], False
        return out

    def _release(self) -> list[Event]:
        held, self.held, self.deciding = self.held, [], False
        return list(held)

    def _may_be_call(self) -> bool:
        """Whether the content held so far can still be a whole loose call (each character is scanned once)."""
        if self.scanner is None:
            m = _START.match(self.text, partial=True)
            if m is None:
                return False
            if m.partial:
                return True
            self.fenced = m.group("fence") is not None
            self.scanner = JsonScanner(m.start("object"))
        scanner = self.scanner
        if not scanner.done:
            scanner.feed(self.text)
            if scanner.failed:
                return False
            if not scanner.done:
                return True
        rest = self.text[scanner.pos:]
        if self.fenced:
            return _FENCE_CLOSE.match(rest, partial=True) is not None
        return _SPACE.match(rest) is not None
