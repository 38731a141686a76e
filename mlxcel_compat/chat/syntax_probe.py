"""Sentinel renders of a chat template: what its model writes for an assistant turn.

The analysis in ``chat/syntax_learn.py`` reads a family's syntax from the difference between
renders. Each render here is the text a model emits for one assistant message: the conversation
up to the assistant turn is rendered with a generation prompt, the same conversation with the
message is rendered closed, and the emitted text is what the second adds to the first (split at a
marker boundary when the generation prompt itself differs, as when it opens a ``<think>`` block
that a history message does not show). What follows every turn (``<|im_end|>``) is cut off by the
caller once it is known (:func:`turn_end`).

Sentinels are distinctive strings the analysis looks for: a function name, argument keys and
values, a call id, content and reasoning text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ARG_INT",
    "CONTENT",
    "FN1",
    "FN2",
    "ID1",
    "ID2",
    "K1",
    "K2",
    "REASONING",
    "USER",
    "V1",
    "V2",
    "Renderer",
    "TemplateProbes",
    "Turn",
    "common_prefix",
    "common_suffix",
    "probe_call",
    "probe_tools",
    "segments",
]

USER = "Question q9Z"
CONTENT = "Answer a7Q"
REASONING = "Thought r3K"
FN1 = "alpha_fn"
FN2 = "beta_fn"
K1 = "akey"
K2 = "bkey"
V1 = "vAlpha"
V2 = "vBeta"
ARG_INT = 73519
ID1 = "call00001"  # 9 letters or digits: Mistral's templates accept no other ids
ID2 = "call00002"

# Markers (<...>, [WORD]), whitespace runs and other text: diffs are taken on these, so a boundary
# never splits a marker. A marker cut by a sentinel (``<parameter=`` before the key) is one segment.
_SEGMENT = re.compile(r"<[^<>]*>?|\[[A-Za-z_/][^\[\]\s<>]*\]|\s+|[^<\[\s]+|.", re.DOTALL)


def segments(text: str) -> list[str]:
    """``text`` cut into markers, whitespace runs and plain runs."""
    return _SEGMENT.findall(text)


def common_prefix(a: str, b: str) -> str:
    """The longest run of whole segments both texts start with."""
    out = []
    for x, y in zip(segments(a), segments(b)):
        if x != y:
            break
        out.append(x)
    return "".join(out)


def common_suffix(a: str, b: str) -> str:
    """The longest run of whole segments both texts end with."""
    out = []
    for x, y in zip(reversed(segments(a)), reversed(segments(b))):
        if x != y:
            break
        out.append(x)
    return "".join(reversed(out))


class Renderer(Protocol):
    """Renders a conversation (``ChatTemplate.render``'s signature); raises on a refused one."""

    def __call__(self, messages: list[dict[str, Any]], /, *, tools: Any = None, add_generation_prompt: bool = True,
                 **kwargs: Any) -> str: ...


def probe_tools() -> list[dict[str, Any]]:
    """The two tools the probe calls, with the argument types the sentinels use."""
    parameters = {
        "type": "object",
        "properties": {K1: {"type": "string", "description": "a text"}, K2: {"type": "integer", "description": "a number"}},
        "required": [],
    }
    return [
        {"type": "function", "function": {"name": name, "description": "Probe tool", "parameters": parameters}}
        for name in (FN1, FN2)
    ]


def probe_call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@dataclass
class Turn:
    """One rendered assistant turn: the text the model emits, and what the prompt added instead.

    ``prompt_extra`` is the generation prompt's text that the history turn does not repeat (a
    ``<think>`` the template opens for the model, or an empty block it closes); ``text`` starts
    where the two part.
    """

    text: str
    prompt_extra: str


class TemplateProbes:
    """Renders sentinel turns through one template (each once; failures are ``None``)."""

    def __init__(self, render: Renderer, kwargs: dict[str, Any]) -> None:
        self.render = render
        self.kwargs = kwargs
        self.user = [{"role": "user", "content": USER}]
        self._cache: dict[str, Turn | None] = {}

    def generation_prompt(self, **extra: Any) -> str | None:
        """What the template appends to open the assistant turn (``add_generation_prompt``)."""
        try:
            closed = self.render(self.user, tools=probe_tools(), add_generation_prompt=False, **{**self.kwargs, **extra})
            opened = self.render(self.user, tools=probe_tools(), add_generation_prompt=True, **{**self.kwargs, **extra})
        except Exception:
            return None
        cut = len(closed) if opened.startswith(closed) else len(common_prefix(opened, closed))
        return opened[cut:]

    def turn(self, key: str, message: dict[str, Any]) -> Turn | None:
        """The emitted text of ``message`` after the user turn (cached under ``key``)."""
        if key not in self._cache:
            self._cache[key] = self._turn(message)
        return self._cache[key]

    def _turn(self, message: dict[str, Any]) -> Turn | None:
        try:
            prompt = self.render(self.user, tools=probe_tools(), add_generation_prompt=True, **self.kwargs)
            full = self.render([*self.user, message], tools=probe_tools(), add_generation_prompt=False, **self.kwargs)
        except Exception:
            return None
        if full.startswith(prompt):
            return Turn(full[len(prompt):], "")
        shared = len(common_prefix(prompt, full))
        return Turn(full[shared:], prompt[shared:])

    # --- the sentinel messages ---------------------------------------------------------------

    def content(self) -> Turn | None:
        return self.turn("content", {"role": "assistant", "content": CONTENT})

    def reasoning(self) -> Turn | None:
        return self.turn("reasoning", {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING})

    def reasoning_part(self) -> Turn | None:
        """Reasoning as a typed ``thinking`` content part (Mistral's reasoning templates read it so)."""
        parts = [{"type": "thinking", "thinking": REASONING}, {"type": "text", "text": CONTENT}]
        return self.turn("reasoning_part", {"role": "assistant", "content": parts})

    def calls(self, key: str, *calls: dict[str, Any], reasoning: bool = False) -> Turn | None:
        message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": list(calls)}
        if reasoning:
            message["reasoning_content"] = REASONING
        return self.turn(key, message)

    def one_call(self) -> Turn | None:
        return self.calls("one", probe_call(FN1, {K1: V1}, ID1))

    def two_args(self) -> Turn | None:
        return self.calls("two_args", probe_call(FN1, {K1: V1, K2: ARG_INT}, ID1))

    def no_args(self) -> Turn | None:
        return self.calls("no_args", probe_call(FN1, {}, ID1))

    def two_calls(self) -> Turn | None:
        return self.calls("two", probe_call(FN1, {K1: V1}, ID1), probe_call(FN2, {K1: V2}, ID2))

    def accepts_id(self, call_id: str) -> bool:
        """Whether the template renders a call whose id is ``call_id`` (Mistral's refuse most)."""
        return self.calls("id:" + call_id, probe_call(FN1, {K1: V1}, call_id)) is not None
