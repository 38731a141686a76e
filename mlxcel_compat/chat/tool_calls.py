"""Tool-call parsing: the calls a finished generation wrote, as OpenAI ``tool_calls``.

The syntax read here is Hermes/Qwen's ``<tool_call>{"name":..., "arguments":...}</tool_call>``,
the one the tool-call grammars force (``chat/tool_grammar.py``) and the streaming splitter
withholds (``chat/stream_splitter.py``); the markers are defined here for both.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "parse_tool_calls"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_TOOL_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + "(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_ID_ALPHABET = string.ascii_letters + string.digits


def _tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Extract Hermes/Qwen ``<tool_call>{"name":..., "arguments":...}</tool_call>`` blocks.

    Returns the remaining content and OpenAI tool calls
    ``{"type":"function","id":"call_...","function":{"name","arguments":<JSON string>}}``.
    A block whose body is not a JSON object with a string ``name`` stays in the content, as
    does an unclosed block; the content is stripped only when a call was extracted.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL_BLOCK.finditer(text):
        call = _tool_call_from_json(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:])
    content = "\n".join(piece.strip() for piece in kept if piece.strip())
    return content, calls


def _tool_call_from_json(body: str) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        arguments_text = arguments
    else:
        arguments_text = json.dumps(arguments, ensure_ascii=False)
    return {
        "type": "function",
        "id": _tool_call_id(),
        "function": {"name": data["name"], "arguments": arguments_text},
    }
