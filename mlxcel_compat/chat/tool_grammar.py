"""Grammars that force well-formed tool calls, in the syntax ``parse_tool_calls`` reads back
(``chat/tool_calls.py``).

The chat templates this server parses calls from (Hermes/Qwen style, every factory family's
template) write a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

With ``tool_choice: "required"`` (or a named function) the grammar applies from the first token:
the reply is one call (``parallel_tool_calls: false``) or several, each to one of the allowed
functions with arguments valid against its ``parameters`` schema. With ``"auto"`` the same grammar
is lazy, as llama-server's: the text stays free until the model opens a call (outside a
``<think>`` block), and from there the call must be well formed.
"""

from __future__ import annotations

from typing import Any

from mlxcel_compat.chat.reasoning import THINK_END
from mlxcel_compat.chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from mlxcel_compat.engine.grammar import TRIGGER_PATTERN_FULL, GrammarTrigger, json_rule

# Where a lazy tool-call grammar starts ("auto"): the first <tool_call> once any <think> block
# the reply opened is closed. A prompt that already opened the block needs its </think> first.
_AUTO_TRIGGER = r"(?:[\s\S]*?</think>|(?![\s\S]*<think>))[\s\S]*?(<tool_call>)[\s\S]*"
_AUTO_TRIGGER_IN_THINKING = r"[\s\S]*?</think>[\s\S]*?(<tool_call>)[\s\S]*"


def call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON object of one call to ``tool``: its name (a constant) and its arguments."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_rules(tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark rules for ``calls``: one or several calls to the given tools."""
    bodies = [f"fn_{i}: {json_rule(call_schema(tool))}" for i, tool in enumerate(tools)]
    alternatives = " | ".join(f"fn_{i}" for i in range(len(tools)))
    calls = "call (WS? call)*" if parallel else "call"
    return "\n".join(
        [
            f"calls: {calls}",
            f'call: "{TOOL_CALL_OPEN}" WS? call_body WS? "{TOOL_CALL_CLOSE}"',
            f"call_body: {alternatives}",
            *bodies,
            r"WS: /[ \t\n]{1,8}/",
        ]
    )


def tool_call_grammar(tools: list[dict[str, Any]], *, parallel: bool, thinking_open: bool = False, response_rule: str | None = None) -> str:
    """A Lark grammar whose text is tool calls only (applied from the first token).

    ``thinking_open``: the prompt ends inside a ``<think>`` block, which the reply may close first.
    ``response_rule``: a JSON-schema rule (``response_format``) the reply may match instead.
    """
    start = "calls"
    if thinking_open:
        start = f'("{THINK_END}" WS?)? {start}'
    if response_rule is not None:
        start = f"({start}) | response"
    lines = ["%llguidance {}", f"start: {start}", tool_call_rules(tools, parallel)]
    if response_rule is not None:
        lines.append(f"response: {response_rule}")
    return "\n".join(lines) + "\n"


def lazy_trigger(thinking_open: bool) -> GrammarTrigger:
    """The trigger of an "auto" tool-call grammar: a call opened outside any thinking block."""
    return GrammarTrigger(TRIGGER_PATTERN_FULL, _AUTO_TRIGGER_IN_THINKING if thinking_open else _AUTO_TRIGGER)
