"""A template's reply syntax: hand-written for the two dialects the analysis cannot read, else learned.

Every other template's syntax is read from the template itself (``chat/syntax_learn.py``), so a new
model's template works without a release. Two are written here, recognised by their markers:

- **gpt-oss Harmony** (``<|channel|>``, ``<|message|>``): a reply is a run of messages whose headers
  carry a channel and a recipient in either order (``to=functions.NAME<|channel|>commentary`` or
  ``<|channel|>commentary to=functions.NAME``), with ``<|constrain|>`` tokens between; the marker
  syntax has no way to say "these fields in any order", and the template renders only one call
  per turn, so there is nothing to learn a section from.
- **Functionary v3.2** (``>>>all``, ``>>>${recipient}``): the generation prompt ends with the
  first message's ``>>>``, so the first call's opening marker is in the prompt and its name is the
  first thing the model writes; the marker syntax needs an opening marker in the reply.

What else llama-server b11312 writes by hand is learned here: Ministral 3 (``[THINK]``, from a
``thinking`` content part), Kimi K2 (``functions.NAME:0`` ids), Kimi K3, MiniMax M3, DeepSeek V3.2
and V4 (typed argument markers), Gemma 4 and LFM2 (their argument encodings, recognised by
decoding the rendered call), Qwen3-Coder, Cohere2 MoE, GigaChat 3, Ling 3, MiniCPM 5 and Muse
Glimmer; each is checked against its template's renders (``tests/chat/test_tool_syntax.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dataclasses

from mlxcel_compat.chat.syntax import ChatSyntax, JsonCall, Lit, Name, PythonArgs, ReasoningSyntax, ToolSyntax
from mlxcel_compat.chat.syntax_learn import learn_syntax
from mlxcel_compat.chat.syntax_probe import Renderer

__all__ = [
    "ANALYSIS_KWARGS",
    "DESCRIBED",
    "FALLBACK_REASONING",
    "FALLBACK_TOOLS",
    "FUNCTIONARY_V3_2",
    "GRANITE_3_TOOLS",
    "HANDWRITTEN",
    "HARMONY",
    "LFM2_TOOLS",
    "template_syntax",
    "with_fallbacks",
]

# The variables a request renders with that matter to the analysis (llama-server always passes
# enable_thinking; the date variables keep Llama's templates off their fallback text).
ANALYSIS_KWARGS: dict[str, Any] = {"enable_thinking": True, "date_string": "01 Jan 2026", "datetime": "Jan 01 2026"}

HARMONY = ChatSyntax(
    format="Harmony channels",
    reasoning=ReasoningSyntax("<|channel|>analysis<|message|>", "<|end|>"),
    dialect="harmony",
    origin="hand-written: gpt-oss Harmony",
)

FUNCTIONARY_V3_2 = ChatSyntax(
    format=">>>recipient messages",
    dialect="functionary_v3_2",
    origin="hand-written: Functionary v3.2",
)

# What a template that shows no calls (or no reasoning) is read with: the Hermes calls the tool-call
# grammars force (chat/tool_grammar.py) and the <think> block most reasoning models write.
FALLBACK_TOOLS = ToolSyntax(call=(Lit("<tool_call>"), JsonCall(), Lit("</tool_call>")), separator="\n")
FALLBACK_REASONING = ReasoningSyntax("<think>", "</think>", "<think>")

# (markers that must all be in the template's source, syntax)
HANDWRITTEN: tuple[tuple[tuple[str, ...], ChatSyntax], ...] = (
    (("<|channel|>", "<|message|>"), HARMONY),
    ((">>>all", ">>>${recipient}"), FUNCTIONARY_V3_2),
)


# Templates that tell the model how to write a call but never render one (so there is nothing to
# learn from): the syntax their text asks for, recognised by that text.
#   LFM2 (8B-A1B, 2.5-Instruct): tools listed between <|tool_list_start|>/"List of tools: [", calls
#     written as <|tool_call_start|>[name(key='value'), ...]<|tool_call_end|> (LFM2.5-8B-A1B's
#     template renders exactly that, and is learned).
#   Granite 3.3: "respond only with <|tool_call|> followed by a JSON list of tools used", and
#     "<think></think>" / "<response></response>" around thoughts and answer.
LFM2_TOOLS = ToolSyntax(call=(Name(), PythonArgs()), section_start="<|tool_call_start|>[", section_end="]<|tool_call_end|>",
                        separator=",")
GRANITE_3_TOOLS = ToolSyntax(call=(JsonCall(),), section_start="<|tool_call|>[", section_end="]", separator=",")
DESCRIBED: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("<|tool_list_start|>",), {"tools": (LFM2_TOOLS,), "format": "Python arguments (described)"}),
    (("List of tools: [",), {"tools": (LFM2_TOOLS,), "format": "Python arguments (described)"}),
    (("<|tool_call|> followed by a JSON list",), {"tools": (GRANITE_3_TOOLS,), "format": "JSON call (described)",
                                                  "content_start": "<response>", "content_end": "</response>"}),
)


def template_syntax(source: str, render: Renderer, caps: Mapping[str, bool]) -> ChatSyntax:
    """The syntax of a template's replies: hand-written for the dialects above, else learned from
    renders of the template (``render`` renders a conversation, ``caps`` are its capabilities)."""
    for markers, syntax in HANDWRITTEN:
        if all(marker in source for marker in markers):
            return syntax
    learned = learn_syntax(render, source, caps, ANALYSIS_KWARGS)
    if not learned.tools:
        for markers, changes in DESCRIBED:
            if all(marker in source for marker in markers):
                learned = dataclasses.replace(learned, **changes, origin="described in the template's text")
                break
    return with_fallbacks(learned)


def with_fallbacks(syntax: ChatSyntax) -> ChatSyntax:
    """``syntax`` with Hermes calls when it has no call format, and ``<think>`` when no reasoning."""
    notes = list(syntax.notes)
    changes: dict[str, Any] = {}
    if not syntax.tools:
        changes["tools"] = (FALLBACK_TOOLS,)
        notes.append("no calls in the template: Hermes <tool_call> calls are read")
    if syntax.reasoning is None:
        changes["reasoning"] = FALLBACK_REASONING
        notes.append("no reasoning in the template: a <think> block is read")
    return dataclasses.replace(syntax, **changes, notes=tuple(notes)) if changes else syntax
