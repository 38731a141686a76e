"""Grammars that force well-formed tool calls in the served template's own syntax.

A template's reply syntax is learned from its renders (``ChatTemplate.syntax()``); the grammar
writes a call the way the template renders one (``chat/call_grammar.py``): Hermes'
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, Qwen3-Coder's
``<function=NAME><parameter=KEY>``, GLM's ``<arg_key>``, Mistral's ``[TOOL_CALLS]NAME[ARGS]{...}``,
Kimi's ``functions.NAME:0``, LFM2's ``[name(key='value')]``, gpt-oss Harmony's
`` to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`` and so on. A call forced
this way and sent back as history renders to the text that was generated, so the next turn's
prompt reuses the cache past it.

With ``tool_choice: "required"`` (or a named function) the grammar applies from the first token:
the reply is one call (``parallel_tool_calls: false``, or a template that renders one call per
turn) or several, each to an allowed function with arguments valid against its ``parameters``.
With ``"auto"`` the same grammar is lazy, as llama-server's: the text stays free until the model
writes the format's opening marker (outside a reasoning block), and from there the call must be
well formed (:func:`lazy_trigger`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from mlxcel_compat.chat.call_grammar import RuleWriter, Spell, call_rule, lstrip_call, seq
from mlxcel_compat.chat.call_layout import CallLayout
from mlxcel_compat.chat.syntax import ChatSyntax, JsonArgs, JsonCall, Lit, Name, ReasoningSyntax, ToolSyntax, core
from mlxcel_compat.engine.grammar import TRIGGER_PATTERN_FULL, GrammarTrigger, lark_string

__all__ = [
    "FUNCTIONARY_V3_2_CALLS",
    "HARMONY_CALLS",
    "HERMES",
    "forced_calls",
    "lazy_trigger",
    "tool_call_grammar",
]

# Hermes/Qwen calls as Qwen2.5's template renders them: what a request is constrained to when the
# served template gives no syntax (the completion routes' callers, tests).
HERMES = ChatSyntax("JSON call", reasoning=ReasoningSyntax("<think>", "</think>", "<think>"),
                    tools=(ToolSyntax(call=(Lit("<tool_call>\n"), JsonCall(), Lit("\n</tool_call>")), separator="\n"),))

# The two hand-written dialects' calls, as their templates render them: gpt-oss renders one call
# per turn as a message to ``functions.NAME`` (the prompt ends with ``<|start|>assistant``);
# Functionary v3.2's prompt ends with ``>>>``, so a reply starts with the first call's name and
# later calls follow another ``>>>``.
HARMONY_CALLS = ToolSyntax(call=(Lit(" to=functions."), Name(), Lit("<|channel|>commentary json<|message|>"), JsonArgs(), Lit("<|call|>")),
                           parallel=False)
FUNCTIONARY_V3_2_CALLS = ToolSyntax(call=(Name(), Lit("\n"), JsonArgs()), separator=">>>")


def forced_calls(syntax: ChatSyntax) -> ToolSyntax:
    """The call format a grammar writes for ``syntax``: its first (Llama 3.1's ``<|python_tag|>``
    built-ins, the second, are for built-in tools only)."""
    if syntax.dialect == "harmony":
        return HARMONY_CALLS
    if syntax.dialect == "functionary_v3_2":
        return FUNCTIONARY_V3_2_CALLS
    return syntax.tools[0] if syntax.tools else HERMES.tools[0]


def tool_call_grammar(
    tools: list[dict[str, Any]],
    *,
    parallel: bool,
    syntax: ChatSyntax = HERMES,
    lazy: bool = False,
    thinking_open: bool = False,
    response_rule: str | None = None,
    spell: Spell = lark_string,
    mark: Spell = lark_string,
    layout: CallLayout | None = None,
) -> str:
    """A Lark grammar whose text is calls to ``tools`` in ``syntax``.

    ``lazy``: the grammar starts where :func:`lazy_trigger` hands over (the opening marker's first
    visible character). ``thinking_open``: the prompt ends inside a reasoning block, which the
    reply closes first (the parser reads calls after it). ``response_rule``: a JSON-schema rule (``response_format``) the reply
    may match instead. ``spell`` writes literals (special tokens as ``<[id]>``), ``mark`` the
    syntax's markers (as the tokenizer's tokens: ``GrammarCompiler.lark_marker``); ``layout`` is how
    the template writes JSON and the whitespace its syntax leaves out (``chat/call_layout.py``).
    """
    calls = forced_calls(syntax)
    parallel = parallel and calls.parallel
    layout = layout or CallLayout()
    writer = RuleWriter(spell=spell, mark=mark, style=layout.style, before_call=layout.before_call, after_name=layout.after_name,
                        python_values=layout.python_values, index_key=layout.index_key,
                        python_bools=layout.python_bools, element_marker=layout.element_marker)
    first = lstrip_call(calls) if lazy else calls
    opens_section = bool(core(calls.section_start))  # else the first call's first literal opens
    lead = layout.lead
    if not lazy and not opens_section:
        lead, first = _fold_lead(lead, first)
    alternatives = " | ".join(call_rule(writer, first, tool, opening=not opens_section) for tool in tools)
    body = f"({alternatives})"
    if parallel:
        later = " | ".join(call_rule(writer, calls, tool) for tool in tools)
        separator = writer.lit(calls.separator)
        body += f" ({separator} ({later}))*" if separator else f" ({later})*"
    section_start = writer.marker(first.section_start) if opens_section else writer.lit(first.section_start)
    start = " ".join(x for x in (section_start, body, writer.lit(calls.section_end)) if x)
    if not lazy:
        start = seq(_lead(writer, syntax, thinking_open, lead, layout.lead), start)
    if response_rule is not None:
        start = f"({start}) | response"
    lines = ["%llguidance {}", f"start: {start}", *writer.lines()]
    if response_rule is not None:
        lines.append(f"response: {response_rule}")
    return "\n".join(lines) + "\n"


def _fold_lead(lead: str, calls: ToolSyntax) -> tuple[str, ToolSyntax]:
    """``(lead, calls)`` with the spaces that end ``lead`` moved into the first call's opening
    literal when it starts with a word: the opening marker is written as the tokens the tokenizer
    makes of it, and a BPE pre-tokenizer glues a space to the word after it (muse-glimmer's
    `` to=`` is ``" to"``, ``"="``, never ``" "``, ``"to"``). Newlines stay in the lead: they are
    their own pre-token, and a marker made of them splits differently (``</think>\\n\\n<tool_call>``)."""
    head = calls.call[0] if calls.call else None
    space = lead[len(lead.rstrip(" ")):]
    if not space or not isinstance(head, Lit) or not head.text[:1].isalnum():
        return lead, calls
    return lead[: len(lead) - len(space)], dataclasses.replace(calls, call=(Lit(space + head.text), *calls.call[1:]))


def _lead(writer: RuleWriter, syntax: ChatSyntax, thinking_open: bool, lead: str, rendered: str) -> str:
    """What comes before forced calls: what the template renders there (``lead``: an empty
    ``<think></think>`` block, the end of the block the prompt opened; ``rendered``: all of it, with
    whitespace the first call's marker took), and at least the end of the reasoning block the
    prompt opened, where the parser looks for calls."""
    reasoning = syntax.reasoning
    end = core(reasoning.end) if reasoning is not None and syntax.dialect == "markers" else ""
    if not thinking_open or not end or end in rendered:
        return writer.marker(lead)
    space = "/[ \\n]{0,2}/"
    return seq(space, writer.lit(end), space)


def _opening(calls: ToolSyntax, tools: list[dict[str, Any]]) -> str:
    """A regex of how the first call opens, at its first visible character."""
    if core(calls.section_start):
        return re.escape(core(calls.section_start))
    names = "|".join(re.escape(t["function"]["name"]) for t in tools)
    head = calls.call[0]
    if isinstance(head, Lit) and core(head.text):
        return re.escape(core(head.text))
    if isinstance(head, JsonCall):
        if head.name_is_key:
            return r'\{"(?:' + names + ')"'
        return re.escape('{"' + head.name_path[0] + '"') if head.name_path else r"\{"
    return f"(?:{names})"


def lazy_trigger(tools: list[dict[str, Any]], syntax: ChatSyntax = HERMES, thinking_open: bool = False) -> GrammarTrigger:
    """The trigger of an "auto" tool-call grammar: the first call's opening marker written
    outside any reasoning block (after the block's end when the prompt opened one)."""
    opening = _opening(forced_calls(syntax), tools)
    reasoning = syntax.reasoning
    end = re.escape(core(reasoning.end)) if reasoning is not None and core(reasoning.end) else ""
    start = re.escape(core(reasoning.start)) if reasoning is not None and core(reasoning.start) else ""
    if thinking_open and end:
        prefix = rf"[\s\S]*?{end}"
    elif start and end:
        prefix = rf"(?:[\s\S]*?{end}|(?![\s\S]*{start}))"
    else:
        prefix = ""
    return GrammarTrigger(TRIGGER_PATTERN_FULL, rf"{prefix}[\s\S]*?({opening})[\s\S]*")
