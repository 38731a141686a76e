"""What a chat template is given: the messages and variables, shaped as llama-server shapes them.

Messages are deep-copied (never the caller's) into llama-server's JSON shape
(``prepare_messages``); their content takes the shape the template's capabilities ask for
(``adapt_messages``; the other changes llama-server makes are in ``chat/message_fixes.py``);
llama.cpp's ``preserve_reasoning`` and ``reasoning_effort`` switches are spelled out into the
variables templates test (``expand_switches``); and ``continue_final_message`` marks the end of
the final message so the rendered text can be cut there (``mark_final_message``,
``cut_final_message``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel_compat.chat.sandbox import TemplateError

__all__ = ["adapt_messages", "cut_final_message", "expand_switches", "mark_final_message", "prepare_messages"]

# Marks the end of the final message when continuing it; the rendered text is cut there.
_CONTINUE_MARKER = "<<mlxcel-continue-final-message-7c1e>>"
_C_SPACE = " \t\n\v\f\r"


def prepare_messages(messages: Sequence[Mapping[str, Any]], *, trim: bool = False) -> list[dict[str, Any]]:
    """Copies of ``messages`` (never the caller's) in the shape llama-server gives templates.

    llama.cpp rebuilds each message from what it parsed (``common_chat_msg::to_json_oaicompat``),
    in this key order: ``role``, ``content`` (``""`` when absent or null), ``reasoning_content``,
    ``name`` and ``tool_call_id`` (each only when not empty), then ``tool_calls`` (each call:
    ``type``, ``function`` with ``name`` and ``arguments``, then its ``id``). Templates that walk
    a message's items see that order; keys llama.cpp does not know come last. ``trim`` strips
    the text of surrounding whitespace first (``message_fixes.trims_content``).
    """
    prepared: list[dict[str, Any]] = []
    for message in messages:
        source = copy.deepcopy(dict(message))
        if trim:
            _trim_text(source)
        shaped: dict[str, Any] = {"role": source.pop("role", None)}
        content = source.pop("content", None)
        shaped["content"] = "" if content is None else content
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = source.pop(key, None)
            if value is not None and value != "":
                shaped[key] = value
        calls = source.pop("tool_calls", None)
        shaped.update(source)
        if calls:
            shaped["tool_calls"] = [_shape_call(call) for call in calls]
        prepared.append(shaped)
    return prepared


def _shape_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    call = dict(call)
    shaped: dict[str, Any] = {"type": call.pop("type", "function")}
    if "function" in call:
        shaped["function"] = call.pop("function")
    call_id = call.pop("id", None)
    shaped.update(call)
    if call_id:
        shaped["id"] = call_id
    return shaped


def _trim_text(message: dict[str, Any]) -> None:
    # C's isspace(), as llama.cpp's trim_whitespace.
    for key in ("content", "reasoning_content"):
        if isinstance(message.get(key), str):
            message[key] = message[key].strip(_C_SPACE)
    if isinstance(message.get("content"), list):
        for part in message["content"]:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                part["text"] = part["text"].strip(_C_SPACE)


def expand_switches(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply llama.cpp's switches; explicit kwargs still win.

    ``preserve_reasoning`` (a boolean) sets ``preserve_thinking``, ``clear_thinking``,
    ``truncate_history_thinking`` and ``drop_thinking``, the names templates test;
    ``reasoning_effort`` (a non-empty string) is also ``reasoning_strength``.
    """
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
    effort = kwargs.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        expanded.setdefault("reasoning_strength", effort)
    return expanded


def adapt_messages(messages: list[dict[str, Any]], caps: Mapping[str, bool]) -> list[dict[str, Any]]:
    """Shape prepared ``messages`` in place for a template with ``caps``: typed text parts joined
    when it only takes strings, strings wrapped in a text part when it only takes typed content."""
    only_string = caps["supports_string_content"] and not caps["supports_typed_content"]
    only_typed = caps["supports_typed_content"] and not caps["supports_string_content"]
    for message in messages:
        content = message.get("content")
        if only_string and isinstance(content, list):
            message["content"] = _join_text_parts(content)
        elif only_typed and isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
    return messages


def _join_text_parts(parts: list[Any]) -> str:
    # llama.cpp joins text parts with a newline when the template only takes strings.
    texts = [
        part.get("text", "")
        for part in parts
        if isinstance(part, Mapping) and part.get("type") == "text"
    ]
    return "\n".join(str(t) for t in texts)


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
        if field == "reasoning_content" and isinstance(final.get("content"), list):
            for block in final["content"]:  # Ministral 3's thinking block (message_fixes)
                if isinstance(block, dict) and block.get("thinking") == value:
                    block["thinking"] = value + _CONTINUE_MARKER
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
