"""The ``<think>`` markers the tool-call grammars and the structured-output constraints know.

Reasoning itself is taken apart in each template's own syntax (``ChatSyntax.reasoning``, read by
``chat/reply_parser.py``). What stays here is the Hermes/Qwen ``<think>`` block the tool-call
grammars (``chat/tool_grammar.py``) and ``server/structured.py`` reason about: its markers, and
whether a prompt ends inside one (the template opened it, so the reply starts inside it).
"""

from __future__ import annotations

__all__ = ["THINK_END", "THINK_START", "prompt_opens_thinking"]

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the prompt ends inside an open ``<think>`` block (the template opened it)."""
    trimmed = prompt.rstrip()
    return trimmed.endswith(THINK_START)
