"""Reasoning parsing: the ``<think>...</think>`` block of a finished generation.

``split_reasoning`` takes a reply apart into ``reasoning_content`` and ``content`` (deepseek
style), and ``prompt_opens_thinking`` tells whether the template already opened the block at the
end of the prompt, so the reply starts inside it. The markers are shared with the streaming
splitter (``chat/stream_splitter.py``) and the tool-call grammars (``chat/tool_grammar.py``).
"""

from __future__ import annotations

__all__ = ["THINK_END", "THINK_START", "prompt_opens_thinking", "split_reasoning"]

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the prompt ends inside an open ``<think>`` block (the template opened it)."""
    trimmed = prompt.rstrip()
    return trimmed.endswith(THINK_START)


def split_reasoning(text: str, *, thinking_forced_open: bool = False) -> tuple[str | None, str]:
    """Split a generation into ``(reasoning_content, content)``, deepseek style.

    Handles ``<think>...</think>`` at the start of the text, an unclosed ``<think>`` (a
    generation cut short while thinking: everything is reasoning), and a text that starts
    inside the block because the prompt already ended with ``<think>``: a ``</think>`` without
    an opening tag before it closes such a block. With ``thinking_forced_open`` a text with no
    ``</think>`` at all is reasoning too.

    Reasoning is stripped and is ``None`` when empty; content loses its leading whitespace.
    """
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        body = stripped[len(THINK_START) :]
        end = body.find(THINK_END)
        if end < 0:
            return _reasoning_or_none(body), ""
        return _reasoning_or_none(body[:end]), body[end + len(THINK_END) :].lstrip()
    end = text.find(THINK_END)
    if end >= 0 and THINK_START not in text[:end]:
        return _reasoning_or_none(text[:end]), text[end + len(THINK_END) :].lstrip()
    if thinking_forced_open:
        return _reasoning_or_none(text), ""
    return None, text


def _reasoning_or_none(text: str) -> str | None:
    text = text.strip()
    return text or None
