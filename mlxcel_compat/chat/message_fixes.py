"""llama-server's changes to the messages before a template sees them, and to what it renders.

llama-server b11312 does not hand a request's messages to the template as they came: it adapts
them to what the template can take (``common_chat_templates_apply_jinja`` in ``common/chat.cpp``)
and, for some families, to what that family's template expects (``common/parsers/*.cpp``). A
prompt equal to llama-server's needs the same changes, so they are made here, in this order:

For every template, by its capabilities (``chat_template_caps``):

- ``developer`` messages become ``system`` ones (not for gpt-oss, whose template has both);
- a template without a system role gets the system prompt merged into the next message
  (``"system\\nuser"``), or dropped when nothing follows;
- a template that takes object arguments gets tool-call arguments as parsed JSON (arguments
  that are not JSON are refused, as llama-server refuses them).

For some families, recognised by what their template's source holds (as llama-server recognises
them):

- StepFun 3.5: message text trimmed of surrounding whitespace (llama.cpp issue 24181);
- gpt-oss: reasoning under ``thinking`` (the name its template reads), and no ``content`` next to
  tool calls that have reasoning; without a generation prompt the last ``<|return|>`` becomes
  ``<|end|>`` (``fix_rendered``: a finished turn that is history, llama.cpp issue 15417);
- LFM2 and LFM2.5: reasoning under ``thinking``;
- Ministral 3 / Magistral (``[ARGS]`` without ``[CALL_ID]``): system and assistant content as
  blocks, the reasoning first as a ``thinking`` block;
- DeepSeek V4 (DSML ``tool_calls``): a run of tool results in the order of the calls they answer;
- Gemma 4 templates older than the one with OpenAI tool messages: an assistant's calls, their
  results (as ``tool_responses``) and the answer after them folded into one message.

The messages given are llama-server's JSON shape already (``template_inputs.prepare_messages``);
they are changed in place or replaced, never the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mlxcel_compat.chat.sandbox import TemplateError

__all__ = ["fix_messages", "fix_rendered"]


def fix_messages(messages: list[dict[str, Any]], source: str, caps: Mapping[str, bool]) -> list[dict[str, Any]]:
    """``messages`` as llama-server hands them to the template of ``source`` with ``caps``."""
    if "<|channel|>" not in source:
        for message in messages:
            if message.get("role") == "developer":
                message["role"] = "system"
    if not caps["supports_system_role"]:
        messages = _merge_system_message(messages)
    if caps["supports_object_arguments"]:
        for message in messages:
            _parse_arguments(message)
    for applies, fix in _FAMILY_FIXES:
        if applies(source):
            messages = fix(messages)
    return messages


def fix_rendered(text: str, source: str, add_generation_prompt: bool) -> str:
    """The rendered ``text`` as llama-server leaves it: gpt-oss history ends its last turn with ``<|end|>``."""
    if _is_gpt_oss(source) and not add_generation_prompt:
        at = text.rfind("<|return|>")
        if at >= 0:
            text = text[:at] + "<|end|>" + text[at + len("<|return|>"):]
    return text


def trims_content(source: str) -> bool:
    """StepFun 3.5's template: llama-server trims the messages' text before rendering it."""
    return "You have access to the following functions in JSONSchema format" in source


# --- every template -------------------------------------------------------------------------


def _merge_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages or messages[0].get("role") != "system":
        return messages
    if len(messages) == 1:
        return []
    first, second = messages[0], messages[1]
    if not isinstance(first.get("content"), str) or not isinstance(second.get("content"), str):
        raise TemplateError("this template has no system role, and a system prompt made of parts cannot be "
                            "merged into the next message")
    second["content"] = first["content"] + "\n" + second["content"]
    return messages[1:]


def _parse_arguments(message: dict[str, Any]) -> None:
    for call in message.get("tool_calls") or []:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError as exc:
                raise TemplateError(f"Failed to parse tool call arguments as JSON: {exc}") from None


# --- families -------------------------------------------------------------------------------


def _is_gpt_oss(source: str) -> bool:
    return "<|channel|>" in source


def _is_lfm2(source: str) -> bool:
    lfm2 = "<|tool_list_start|>" in source and "<|tool_list_end|>" in source
    lfm25 = "List of tools: [" in source and "<|tool_list_start|>" not in source
    return lfm2 or lfm25


def _is_ministral3(source: str) -> bool:
    return all(s in source for s in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) and "[CALL_ID]" not in source


def _is_deepseek_v4(source: str) -> bool:
    # V3.2 and V4 write calls in DSML; V4 names the block "tool_calls", V3.2 "function_calls".
    return "dsml_token" in source and "DSML" in source and "tool_calls" in source and "function_calls" not in source


def _is_old_gemma4(source: str) -> bool:
    return "'<|tool_call>call:'" in source and "{#- OpenAI Chat Completions:" not in source


def _gpt_oss_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for message in messages:
        if isinstance(message.get("reasoning_content"), str):
            message["thinking"] = message["reasoning_content"]
            if message.get("tool_calls"):
                message.pop("content", None)
    return messages


def _thinking_alias(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for message in messages:
        if isinstance(message.get("reasoning_content"), str):
            message["thinking"] = message["reasoning_content"]
    return messages


def _ministral3_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for message in messages:
        if message.get("role") not in ("system", "assistant"):
            continue
        blocks: list[dict[str, Any]] = []
        if isinstance(message.get("reasoning_content"), str):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"]})
        content = message.get("content")
        if isinstance(content, str):
            blocks.append({"type": "text", "text": content})
        elif isinstance(content, list):
            blocks.extend(content)
        message["content"] = blocks
        message.pop("reasoning_content", None)
    return messages


def _deepseek_v4_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of user and tool messages renders as one user block in V4; its tool results go in
    the order of the calls of the assistant message before it (matched by id; unknown ids first)."""
    order: dict[str, int] = {}
    i = 0
    while i < len(messages):
        role = messages[i].get("role")
        if role == "assistant" and messages[i].get("tool_calls"):
            order = {call["id"]: k for k, call in enumerate(messages[i]["tool_calls"]) if call.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end].get("role") in ("user", "tool"):
            end += 1
        positions = [k for k in range(i, end) if messages[k].get("role") == "tool"]
        if len(positions) > 1 and order:
            results = sorted((messages[k] for k in positions), key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for k, result in zip(positions, results):
                messages[k] = result
        i = end
    return messages


def _gemma4_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Older Gemma 4 templates read a model turn's results from ``tool_responses`` (name and parsed
    response) on the assistant message that made the calls, and its answer from the same message."""
    folded: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            folded.append(message)
            i += 1
            continue
        calls = list(message["tool_calls"])
        i += 1
        responses = []
        while i < len(messages) and messages[i].get("role") == "tool":
            responses.append(_gemma4_response(messages[i], calls, len(responses)))
            i += 1
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i].get("role") == "assistant" and not messages[i].get("tool_calls"):
            content = messages[i].get("content")
            if content:
                turn["content"] = content
                i += 1
        if isinstance(message.get("reasoning_content"), str):
            turn["reasoning_content"] = message["reasoning_content"]
        folded.append(turn)
    return folded


def _gemma4_response(result: Mapping[str, Any], calls: list[dict[str, Any]], index: int) -> dict[str, Any]:
    content = result.get("content")
    response: Any = content
    if isinstance(content, str):
        try:
            response = json.loads(content)
        except ValueError:
            response = content
    name = ""
    if index < len(calls):
        name = (calls[index].get("function") or {}).get("name", "")
    return {"name": name or result.get("tool_call_id", ""), "response": response}


_FAMILY_FIXES = (
    (_is_gpt_oss, _gpt_oss_messages),
    (_is_lfm2, _thinking_alias),
    (_is_ministral3, _ministral3_messages),
    (_is_deepseek_v4, _deepseek_v4_messages),
    (_is_old_gemma4, _gemma4_messages),
)
