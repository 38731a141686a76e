"""Structured output on the HTTP side: request fields to the :class:`Constraint` the engine applies.

The fields, with llama-server's rules:

- ``grammar`` (llama.cpp GBNF, or Lark when it starts with ``%llguidance`` or has a ``start:``
  rule) and ``json_schema`` on every generation route. On ``/completion`` and ``/v1/completions``
  a ``grammar`` wins over a ``json_schema``; on the chat routes having both is a 400.
- ``response_format`` on ``/v1/completions`` and the chat routes: ``text`` (or no type) is free
  text, ``json_object`` is any JSON object (or its ``schema``), ``json_schema`` is its
  ``json_schema.schema`` (``strict`` is accepted: the output always follows the schema); an empty
  schema means any object; any other type is a 400.
- ``grammar_lazy`` with ``grammar_triggers`` (token, word, pattern, full pattern) and
  ``preserved_tokens``; a lazy grammar without a trigger is a 400.
- Chat tools (``tools``, ``tool_choice``, ``parallel_tool_calls``): "required" or a named function
  force a well-formed call in the served template's own syntax (``chat/tool_grammar.py``); "auto"
  constrains a call once the model writes the format's opening marker; a custom ``grammar`` with
  active tools is a 400.
- ``--grammar`` / ``--grammar-file`` / ``-j`` / ``-jf``: the constraint of every request that
  brings none of its own.

Grammars are compiled here (cached by text, see ``engine/grammar.py``), so an invalid one is a 400
naming llguidance's reason before anything is queued. Nothing here touches MLX.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from mlxcel_compat.chat.call_grammar import closed_objects
from mlxcel_compat.chat.call_layout import CallLayout, call_layout
from mlxcel_compat.chat.request import ChatRequest
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.tool_grammar import HERMES, forced_calls, lazy_trigger, tool_call_grammar
from mlxcel_compat.engine.grammar import (
    TRIGGER_PATTERN,
    TRIGGER_PATTERN_FULL,
    TRIGGER_TOKEN,
    TRIGGER_TYPES,
    TRIGGER_WORD,
    Constraint,
    GrammarCompiler,
    GrammarError,
    GrammarTrigger,
    compile_trigger_pattern,
    json_rule,
    lark_from_gbnf,
    lark_from_json_schema,
)
from mlxcel_compat.server.errors import InvalidRequest
from mlxcel_compat.server.params import Body

_NO_SCHEMA = object()


@dataclass(frozen=True)
class _ToolFormat:
    """How the served template writes calls: its syntax and the layout its renders show."""

    syntax: ChatSyntax
    layout: CallLayout


@dataclass
class StructuredOutput:
    """Builds and validates constraints for one model (lives on the ServerContext)."""

    compiler: GrammarCompiler
    tokenize: Callable[[str], list[int]]  # plain text to ids, added tokens parsed, no BOS
    default: Constraint | None = None  # the server-wide --grammar / --json-schema

    # ------------------------------------------------------------------ requests

    def for_completion(self, data: Mapping[str, Any], *, response_format: bool) -> Constraint | None:
        """``/completion`` (``response_format`` False) and ``/v1/completions``: a grammar wins."""
        grammar = _grammar_text(data)
        schema: Any = _NO_SCHEMA
        if grammar is None:
            schema = _json_schema(data)
            if response_format and schema is _NO_SCHEMA:
                schema = _response_format_schema(data)
        return self._finish(data, grammar, schema)

    def for_chat(self, data: Mapping[str, Any], chat: ChatRequest, prompt: str, template: Any = None) -> Constraint | None:
        """The chat routes: grammar, json_schema, response_format and the tools' calls.

        ``template`` is the ``ChatTemplate`` the prompt was rendered with: calls are forced in its
        syntax and layout (Hermes ``<tool_call>`` calls without one).
        """
        grammar = _grammar_text(data)
        schema = _json_schema(data)
        if schema is not _NO_SCHEMA and grammar:
            raise InvalidRequest("Cannot use both json_schema and grammar")
        response = _response_format_schema(data)
        if response is not _NO_SCHEMA:
            if grammar:
                raise InvalidRequest('Either "json_schema" or "grammar" can be specified, but not both')
            schema = response
        tools = chat.callable_tools
        if not tools:
            return self._finish(data, grammar, schema)
        if data.get("grammar") is not None:
            raise InvalidRequest("Cannot use custom grammar constraints with tools.")
        syntax = template.syntax() if template is not None else HERMES
        layout = call_layout(template, forced_calls(syntax)) if template is not None else CallLayout()
        return self._tool_constraint(data, chat, tools, prompt, schema, _ToolFormat(syntax, layout))

    def _tool_constraint(self, data: Mapping[str, Any], chat: ChatRequest, tools: list[dict[str, Any]], prompt: str, schema: Any,
                         form: _ToolFormat) -> Constraint:
        parallel = data.get("parallel_tool_calls") is not False
        thinking_open = form.syntax.reply_starts_in_reasoning(prompt)
        choice = chat.tool_choice
        if choice not in ("auto", "required"):
            tools = [t for t in tools if t["function"]["name"] == choice]
            if not tools:
                raise InvalidRequest(f"tool_choice names the function '{choice}', which is not among the tools")
        grammar = {"syntax": form.syntax, "spell": self.compiler.lark_literal, "mark": self.compiler.lark_marker, "layout": form.layout}
        if choice == "auto" and schema is _NO_SCHEMA:
            # llama-server's "auto": free text until the model opens a call, then a valid call.
            lark = tool_call_grammar(tools, parallel=parallel, lazy=True, **grammar)
            self._compile_tools(lark, tools, grammar)
            return Constraint(lark=lark, lazy=True, triggers=(lazy_trigger(tools, form.syntax, thinking_open),))
        response = None
        if choice == "auto":  # a reply in the response format, or calls
            self._compile(lark_from_json_schema(_object_schema(schema)), '"json_schema": ')
            response = json_rule(_object_schema(schema))
        lark = tool_call_grammar(tools, parallel=parallel, thinking_open=thinking_open, response_rule=response, **grammar)
        self._compile_tools(lark, tools, grammar)
        return Constraint(lark=lark)

    def _compile_tools(self, lark: str, tools: list[dict[str, Any]], grammar: dict[str, Any]) -> None:
        """Compile a tool-call grammar; a failure names the tool whose parameters are at fault."""
        try:
            self.compiler.compile(lark)
        except GrammarError as exc:
            for tool in tools:
                name = tool["function"]["name"]
                self._compile(tool_call_grammar([tool], parallel=False, **grammar), f"\"tools\": function '{name}': ")
            raise InvalidRequest(f'"tools": {exc}') from None

    # ------------------------------------------------------------------ shared

    def _finish(self, data: Mapping[str, Any], grammar: str | None, schema: Any) -> Constraint | None:
        """The constraint of ``grammar`` or ``schema`` with the lazy-grammar fields, else the default."""
        preserved_words, preserved = self._preserved_tokens(data)
        triggers = self._triggers(data, preserved)
        lazy = Body(data).bool("grammar_lazy", False)
        if lazy and not triggers:
            raise InvalidRequest("Error: no triggers set for lazy grammar!")
        if grammar:
            lark = self._compile_gbnf(grammar)
        elif schema is not _NO_SCHEMA:
            lark = lark_from_json_schema(_object_schema(schema))
            self._compile(lark, '"json_schema": ')
        else:
            return self.default
        return Constraint(lark=lark, lazy=lazy, triggers=tuple(triggers), preserved_tokens=tuple(preserved), preserved_words=tuple(preserved_words))

    def _compile_gbnf(self, grammar: str) -> str:
        try:
            lark = lark_from_gbnf(grammar)
        except GrammarError as exc:
            raise InvalidRequest(f"Failed to parse grammar: {exc}") from None
        self._compile(lark, "Failed to parse grammar: ")
        return lark

    def _compile(self, lark: str, prefix: str) -> None:
        try:
            self.compiler.compile(lark)
        except GrammarError as exc:
            raise InvalidRequest(prefix + str(exc)) from None

    def _preserved_tokens(self, data: Mapping[str, Any]) -> tuple[list[str], list[int]]:
        """``preserved_tokens``: the words as given and the ids of those that are one token."""
        raw = data.get("preserved_tokens")
        if raw is None:
            return [], []
        if not isinstance(raw, list) or not all(isinstance(w, str) for w in raw):
            raise InvalidRequest("Field 'preserved_tokens': type must be array of strings")
        ids = []
        for word in raw:
            tokens = self.tokenize(word)
            if len(tokens) == 1:
                ids.append(tokens[0])
        return list(raw), ids

    def _triggers(self, data: Mapping[str, Any], preserved: list[int]) -> list[GrammarTrigger]:
        """``grammar_triggers`` as llama-server reads them: a word that is one token becomes a
        token trigger and must be a preserved token."""
        raw = data.get("grammar_triggers")
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise InvalidRequest("Field 'grammar_triggers': type must be array")
        triggers = []
        for entry in raw:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("type"), int) or not isinstance(entry.get("value"), str):
                raise InvalidRequest("Field 'grammar_triggers': each trigger needs an integer 'type' and a string 'value'")
            kind, value = entry["type"], entry["value"]
            if kind not in TRIGGER_TYPES:
                raise InvalidRequest("Unknown grammar trigger type")
            if kind == TRIGGER_TOKEN:
                token = entry.get("token")
                if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.compiler.vocab_size:
                    raise InvalidRequest("Field 'grammar_triggers': a token trigger needs a valid 'token' id")
                triggers.append(GrammarTrigger(kind, value, token))
                continue
            if kind == TRIGGER_WORD:
                ids = self.tokenize(value)
                if len(ids) == 1:
                    if ids[0] not in preserved:
                        raise InvalidRequest(f"Grammar trigger word should be marked as preserved token: {value}")
                    triggers.append(GrammarTrigger(TRIGGER_TOKEN, value, ids[0]))
                    continue
            trigger = GrammarTrigger(kind, value)
            if kind in (TRIGGER_PATTERN, TRIGGER_PATTERN_FULL):
                try:
                    compile_trigger_pattern(trigger)
                except re.error as exc:
                    raise InvalidRequest(f"Invalid grammar trigger pattern {value!r}: {exc}") from None
            triggers.append(trigger)
        return triggers


# ---------------------------------------------------------------------- server-wide default


def server_default(settings: Any, compiler: GrammarCompiler) -> Constraint | None:
    """``--grammar``/``--grammar-file``/``-j``/``-jf`` as one constraint; ValueError if invalid."""
    given = {
        name: getattr(settings, name, None)
        for name in ("grammar", "grammar_file", "json_schema", "json_schema_file")
        if getattr(settings, name, None)
    }
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("give only one of --grammar, --grammar-file, --json-schema and --json-schema-file")
    (name, value), = given.items()
    text = value
    if name.endswith("_file"):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--{name.replace('_', '-')}: cannot read {value}: {exc}") from None
    try:
        if name.startswith("json_schema"):
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise GrammarError(f"not valid JSON: {exc}") from None
            lark = lark_from_json_schema(_object_schema(schema))
        else:
            lark = lark_from_gbnf(text)
        compiler.compile(lark)
    except GrammarError as exc:
        raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
    return Constraint(lark=lark)


# ---------------------------------------------------------------------- field readers


def _grammar_text(data: Mapping[str, Any]) -> str | None:
    """The ``grammar`` field (None when absent or null; "" means no grammar)."""
    grammar = data.get("grammar")
    if grammar is None:
        return None
    if not isinstance(grammar, str):
        raise InvalidRequest("Field 'grammar': type must be string")
    return grammar


def _json_schema(data: Mapping[str, Any]) -> Any:
    schema = data.get("json_schema", _NO_SCHEMA)
    if schema is None:
        return _NO_SCHEMA
    if schema is not _NO_SCHEMA and not isinstance(schema, (dict, bool)):
        raise InvalidRequest("Field 'json_schema': type must be object")
    return schema


def _response_format_schema(data: Mapping[str, Any]) -> Any:
    """The schema ``response_format`` asks for (``_NO_SCHEMA`` for free text)."""
    spec = data.get("response_format")
    if spec is None:
        return _NO_SCHEMA
    if not isinstance(spec, Mapping):
        raise InvalidRequest(f'response_format type must be one of "text", "json_object" or "json_schema", but got: {json.dumps(spec)}')
    kind = spec.get("type") or ""
    if kind in ("", "text"):
        return _NO_SCHEMA
    if kind == "json_object":
        schema = spec.get("schema")
        return {} if schema is None else schema
    if kind == "json_schema":
        wrapper = spec.get("json_schema")
        if wrapper is None:
            wrapper = {}
        if not isinstance(wrapper, Mapping):
            raise InvalidRequest("response_format.json_schema must be an object")
        strict = wrapper.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest("response_format.json_schema.strict must be a boolean")
        schema = wrapper.get("schema")
        return {} if schema is None else schema
    raise InvalidRequest(f'response_format type must be one of "text", "json_object" or "json_schema", but got: {kind}')


def _object_schema(schema: Any) -> Any:
    """A schema as ``json_rule`` takes it (an empty one or ``true`` means any JSON object there),
    its objects read as llama.cpp reads them: one that lists its properties and says nothing of
    ``additionalProperties`` takes no others (``closed_objects``)."""
    if schema is True:
        return schema
    if not isinstance(schema, Mapping):
        raise InvalidRequest('"json_schema": the schema must be a JSON object')
    return closed_objects(dict(schema))
