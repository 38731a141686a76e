"""How a template lays out a call beyond what its learned syntax says: its JSON and its gaps.

The learned syntax (``chat/syntax_learn.py``) keeps what the parser needs; the parser reads
markers with the whitespace around them optional, so the syntax may leave out whitespace the
template writes where two fields meet (GLM 4.6 writes a newline between a function's name and its
first ``<arg_key>``; MiniMax M1 one before each JSON call). A grammar must write that whitespace
too, or a forced call re-renders to other tokens than were generated. This module renders one
probe call through the template and reads it off the text:

- :class:`JsonStyle`: the separators ``tojson`` writes (``[1, 2]`` or ``[1,2]``, ``"n": "v"`` or
  ``"n":"v"``), or indentation (then llama.cpp's bounded whitespace is allowed instead);
- ``before_call``: whitespace between the section's opening marker (or the separator) and a call
  that starts with its name or its JSON object;
- ``after_name``: whitespace between the name and tagged arguments that open without any;
- ``index_key``: a key a JSON call starts with, holding the call's position (Command R7B's
  ``tool_call_id``);
- ``python_values``: tagged argument values that are objects or lists are written as Python
  literals (``{'max': 20}``: Seed-OSS, MiniCPM 5);
- ``lead``: what the template renders between the generation prompt and the first call, when it
  is whitespace and reasoning markers only (an empty ``<think></think>`` block);
- ``python_bools``: tagged booleans are written as Python's ``True``/``False`` (templates that
  print a value with ``| string``: Qwen3-Coder, Nemotron 3);
- ``element_marker``: tagged object and list values are written as elements nested in the
  argument's tags (MiniMax M3: ``<m>NS<n>vNS</n>NS</m>``, lists as ``<item>``), each opening and
  closing tag after this marker (M3's namespace token ``NS``); None when values are not nested.

The layout is computed once per template source (a probe render, a millisecond or so) and cached.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlxcel_compat.chat.call_grammar import JsonStyle
from mlxcel_compat.chat.syntax import ChatSyntax, JsonCall, Lit, Name, TaggedArgs, ToolSyntax, core

__all__ = ["CallLayout", "call_layout"]

_PROBE_NAME = "probe_fn"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "", "parameters": {
    "type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}},
                                     "m": {"type": "object", "additionalProperties": {"type": "string"}},
                                     "flag_b": {"type": "boolean"}}}}}  # items and additionalProperties: Command R+ reads them
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "K7p2Rq9Zx", "type": "function", "function": {"name": _PROBE_NAME, "arguments": json.dumps({"k": [1, 2], "m": {"n": "v"}, "flag_b": True})}}]}
_CACHE_SIZE = 64


@dataclass(frozen=True)
class CallLayout:
    """What a grammar writes besides the syntax's markers (see the module's docstring)."""

    style: JsonStyle = field(default_factory=JsonStyle)
    before_call: str = ""
    after_name: str = ""
    python_values: bool = False
    index_key: str = ""
    python_bools: bool = False
    lead: str = ""
    element_marker: str | None = None


_LAYOUTS: OrderedDict[str, CallLayout] = OrderedDict()
_LOCK = threading.Lock()


def call_layout(template: Any, calls: ToolSyntax | None = None) -> CallLayout:
    """The layout of ``template``'s calls (a ``ChatTemplate``), ``calls`` being the call format
    the grammar writes (None: the JSON style only)."""
    key = f"{template.source}\0{calls!r}"
    with _LOCK:
        if key in _LAYOUTS:
            return _LAYOUTS[key]
    text = _probe_render(template, [_PROBE_CALL], False)
    layout = read_layout(text, calls)
    if calls is not None and text:
        lead = _lead(_probe_render(template, [], True), text, calls, template.syntax())
        layout = dataclasses.replace(layout, lead=lead)
    with _LOCK:
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > _CACHE_SIZE:
            _LAYOUTS.popitem(last=False)
    return layout


def _probe_render(template: Any, reply: list[dict[str, Any]], generation_prompt: bool) -> str:
    try:
        return template.render([{"role": "user", "content": "probe"}, *reply], tools=[_PROBE_TOOL],
                               add_generation_prompt=generation_prompt, enable_thinking=True)
    except Exception:  # a template that cannot render the probe keeps the plain layout
        return ""


def _lead(prompt: str, text: str, calls: ToolSyntax, syntax: ChatSyntax) -> str:
    """What the template renders between the generation prompt and a reply's first call, when it
    is only whitespace and reasoning markers (Qwen3's ``<think>\n\n</think>\n\n``, GLM 4.6's
    ``\n<think></think>\n``, the ``</think>`` that closes the block a prompt opened)."""
    at = len(prompt) if text.startswith(prompt) else len(os.path.commonprefix([prompt, text]))
    head = calls.call[0] if calls.call else None
    written = calls.section_start  # what the grammar writes up to the opening marker's core
    if core(calls.section_start):
        opening = core(calls.section_start)
    elif isinstance(head, Lit) and core(head.text):
        opening, written = core(head.text), calls.section_start + head.text
    else:
        opening = "{" if isinstance(head, JsonCall) else _PROBE_NAME
    found = text.find(opening, at)
    if found < 0:
        return ""
    lead = text[at:found]
    before = written[: written.index(opening)] if opening in written else ""
    if before and lead.endswith(before):
        lead = lead[: len(lead) - len(before)]
    rest = lead
    for marker in (core(syntax.reasoning.start), core(syntax.reasoning.end)) if syntax.reasoning else ():
        if marker:
            rest = rest.replace(marker, "")
    return lead if not rest.strip() else ""


def read_layout(text: str, calls: ToolSyntax | None) -> CallLayout:
    """The layout read from ``text``, a render of the probe call."""
    style = JsonStyle()
    if re.search(r"\[\s*\n\s+1,\s*\n", text):
        style = JsonStyle(indented=True)
    elif "[1,2]" in text or '"n":"v"' in text:
        style = JsonStyle("," if "[1,2]" in text else ", ", ":" if '"n":"v"' in text else ": ")
    if calls is None or not text:
        return CallLayout(style)
    boolean = re.search(r"flag_b[^A-Za-z]{0,40}(True|true)", text)
    nested = re.search(r"<k>(.{0,40}?)<item>1(.{0,40}?)</item>", text, re.DOTALL)
    element_marker = nested.group(1) if nested and nested.group(1) == nested.group(2) else None
    return CallLayout(style, _before_call(text, calls), _after_name(text, calls), "{'n': 'v'}" in text,
                      _index_key(text, calls, style), boolean is not None and boolean.group(1) == "True",
                      element_marker=element_marker)


def _before_call(text: str, calls: ToolSyntax) -> str:
    head = calls.call[0] if calls.call else None
    opening = calls.section_start
    if not core(opening) or not isinstance(head, (JsonCall, Name)):
        return ""
    first = r"\{" if isinstance(head, JsonCall) else re.escape(_PROBE_NAME)
    match = re.search(re.escape(opening) + r"([ \t\n]*)" + first, text)
    return match.group(1) if match else ""


def _index_key(text: str, calls: ToolSyntax, style: JsonStyle) -> str:
    """A key the template writes first in a JSON call with the call's position (Command R7B's
    ``{"tool_call_id": "0", "tool_name": ...}``)."""
    head = calls.call[0] if calls.call else None
    if not isinstance(head, JsonCall) or head.name_is_key or not head.name_path:
        return ""
    name_key = json.dumps(head.name_path[0])
    match = re.search(r'\{\s*"([A-Za-z_]+)"' + re.escape(style.key_separator) + '"0"' + re.escape(style.item_separator) + re.escape(name_key), text)
    return match.group(1) if match else ""


def _after_name(text: str, calls: ToolSyntax) -> str:
    parts = calls.call
    for before, after in zip(parts, parts[1:]):
        if isinstance(before, Name) and isinstance(after, TaggedArgs) and after.key_prefix == after.key_prefix.lstrip():
            match = re.search(re.escape(_PROBE_NAME) + r"([ \t\n]*)" + re.escape(after.key_prefix), text)
            return match.group(1) if match else ""
    return ""
