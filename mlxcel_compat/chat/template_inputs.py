"""What a chat template is given: the messages and variables, shaped for that template.

Messages are deep-copied (never the caller's) with reasoning under both names templates read;
their content and tool-call arguments take the shapes the template's capabilities ask for
(``adapt_messages``); llama.cpp's ``preserve_reasoning`` switch is spelled out into the variables
templates test (``expand_switches``); and ``continue_final_message`` marks the end of the final
message so the rendered text can be cut there (``mark_final_message``, ``cut_final_message``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel_compat.chat.sandbox import TemplateError

__all__ = ["adapt_messages", "cut_final_message", "expand_switches", "mark_final_message", "prepare_messages"]

# Marks the end of the final message when continuing it; the rendered text is cut there.
_CONTINUE_MARKER = "<<mlxcel-continue-final-message-7c1e>>"


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deep-copy messages (never mutate the caller's) and alias reasoning for templates.

    Templates read an assistant's reasoning as ``reasoning_content`` or, for gpt-oss, as
    ``thinking``; transformers fills both, so do we.
    """
    prepared: list[dict[str, Any]] = []
    for message in messages:
        copied = copy.deepcopy(dict(message))
        reasoning = copied.get("reasoning_content")
        if reasoning is not None and "thinking" not in copied:
            copied["thinking"] = reasoning
        prepared.append(copied)
    return prepared


def expand_switches(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply llama.cpp's ``preserve_reasoning`` switch; explicit kwargs still win."""
    expanded = dict(kwargs)
    switch = kwargs.get("preserve_reasoning")
    if isinstance(switch, bool):
        derived = {
            "preserve_thinking": switch,
            "clear_thinking": not switch,
            "truncate_history_thinking": not switch,
            "drop_thinking": not switch,
        }
        for key, value in derived.items():
            expanded.setdefault(key, value)
    return expanded


def adapt_messages(messages: list[dict[str, Any]], caps: Mapping[str, bool]) -> list[dict[str, Any]]:
    """Shape prepared ``messages`` in place for a template with ``caps``: typed text parts joined
    when it only takes strings, strings wrapped in a text part when it only takes typed content,
    JSON-string tool-call arguments as objects when it wants objects."""
    only_string = caps["supports_string_content"] and not caps["supports_typed_content"]
    only_typed = caps["supports_typed_content"] and not caps["supports_string_content"]
    for message in messages:
        content = message.get("content")
        if only_string and isinstance(content, list):
            message["content"] = _join_text_parts(content)
        elif only_typed and isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
        if caps["supports_object_arguments"]:
            _arguments_to_objects(message)
    return messages


def _join_text_parts(parts: list[Any]) -> str:
    # llama.cpp joins text parts with a newline when the template only takes strings.
    texts = [
        part.get("text", "")
        for part in parts
        if isinstance(part, Mapping) and part.get("type") == "text"
    ]
    return "\n".join(str(t) for t in texts)


def _arguments_to_objects(message: dict[str, Any]) -> None:
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                function["arguments"] = parsed


def mark_final_message(messages: list[dict[str, Any]], field: str) -> None:
    """Append the continue marker to ``field`` of the final message (last text part for lists)."""
    if not messages:
        raise TemplateError("continue_final_message is set but there are no messages")
    final = messages[-1]
    value = final.get(field)
    if isinstance(value, str):
        final[field] = value + _CONTINUE_MARKER
        if field == "reasoning_content" and final.get("thinking") == value:
            final["thinking"] = value + _CONTINUE_MARKER
        return
    if isinstance(value, list):
        for part in reversed(value):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = part["text"] + _CONTINUE_MARKER
                return
    raise TemplateError(
        f"continue_final_message is set but the final message has no {field} to continue"
    )


def cut_final_message(text: str, field: str) -> str:
    """The rendered ``text`` cut where :func:`mark_final_message` marked the final message's ``field``."""
    cut = text.rfind(_CONTINUE_MARKER)
    if cut < 0:
        raise TemplateError(
            f"continue_final_message is set but the final message's {field} does not "
            "appear in the rendered chat"
        )
    return text[:cut]
