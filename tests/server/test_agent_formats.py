"""The Anthropic and Responses translations and event formatting, as plain functions.

The tiny random models never emit a tool call or a thinking block on their own, so the shapes a
generated ``<tool_call>`` / ``<think>`` reply takes are checked here on the real formatters; the
end-to-end tests cover everything the models do produce.
"""

from __future__ import annotations

import json

import orjson
import pytest

from mlxcel_compat.chat.render import render_prefix
from mlxcel_compat.chat.request import parse_chat_request
from mlxcel_compat.chat.stream_splitter import ReplyStream
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.syntax_formats import FALLBACK_REASONING, FALLBACK_TOOLS
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.server import api_anthropic, api_responses
from mlxcel_compat.server.cache_hooks import Breakpoint, find_breakpoints
from mlxcel_compat.server.errors import InvalidRequest
from mlxcel_compat.chat.tool_calls import ReplyOptions

REPLY = '<think>Check the tool.</think>Looking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def sse_payloads(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        name, data = chunk.decode().strip().split("\n")
        payload = orjson.loads(data[len("data: ") :])
        assert name == "event: " + payload["type"]
        out.append(payload)
    return out


HERMES = ChatSyntax("JSON call", reasoning=FALLBACK_REASONING, tools=(FALLBACK_TOOLS,))


def stream_through(writer, text: str) -> tuple[list[bytes], list[dict]]:
    """The reply streamed through ``writer`` in three pieces (calls left out, as the routes do);
    returns the chunks and the calls the stream read."""
    splitter = ReplyStream(HERMES, ReplyOptions(tools=True))
    chunks = []
    deltas = [d for piece in (text[:7], text[7:20], text[20:]) for d in splitter.push(piece)] + splitter.finish()
    for field, delta in deltas:
        if field != "tool_calls":
            chunks += writer.delta(field, delta)
    return chunks, splitter.tool_calls


def test_anthropic_stream_blocks_are_numbered_in_order() -> None:
    blocks = api_anthropic.ContentBlocks()
    chunks, calls = stream_through(blocks, REPLY)
    chunks += blocks.close()
    for call in calls:
        chunks += blocks.tool_use(api_anthropic.tool_use_block(call))
    events = sse_payloads(chunks)
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    thinking = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
    arguments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert (thinking, text) == ("Check the tool.", "Looking.")
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}]
    tool = next(e for e in events if e["type"] == "content_block_start" and e["index"] == 2)["content_block"]
    assert tool["id"].startswith("toolu_") and tool["name"] == "get_weather" and tool["input"] == {}


def test_responses_stream_items_and_sequence() -> None:
    events_writer = api_responses.ResponseEvents()
    chunks, calls = stream_through(events_writer, REPLY)
    chunks += events_writer.close()
    chunks += events_writer.function_call(calls[0])
    events = sse_payloads(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert kinds[-4:] == ["response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done"]
    out = events_writer.output
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"][0]["text"] == "Check the tool." and out[1]["content"][0]["text"] == "Looking."
    assert out[2]["call_id"].startswith("call_") and json.loads(out[2]["arguments"]) == {"city": "Paris"}
    assert out[0]["id"].startswith("rs_") and out[1]["id"].startswith("msg_") and out[2]["id"].startswith("fc_")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == out


def test_anthropic_translation() -> None:
    body = {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain", "is_error": True, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"type": "text", "text": "Thanks."},
            ]},
        ],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
        "metadata": {"user_id": "u-1"},
        "stop_sequences": ["END"],
        "top_k": 5,
    }
    chat = api_anthropic.to_chat_body(body)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant = chat["messages"][2]
    assert assistant["reasoning_content"] == "Use the tool." and json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: rain", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["user"], chat["stop"], chat["top_k"]) == ("required", False, "u-1", ["END"], 5)
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["max_tokens"] == api_anthropic.DEFAULT_MAX_TOKENS
    budgeted = api_anthropic.to_chat_body({"messages": [], "thinking": {"type": "enabled", "budget_tokens": 2048}})
    assert budgeted["chat_template_kwargs"] == {"enable_thinking": True} and budgeted["thinking_budget_tokens"] == 2048
    named = api_anthropic.to_chat_body({"messages": [], "tool_choice": {"type": "tool", "name": "f"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    parse_chat_request(chat)  # the pipeline accepts what the translation builds
    # Breakpoints: the tool (after the system message), the system part, the tool message.
    assert find_breakpoints(chat) == [Breakpoint(1, None, 300.0), Breakpoint(1, 1, 300.0), Breakpoint(4, None, 3600.0)]
    for bad in ({"messages": "x"}, {"messages": [{"role": "tool", "content": "x"}]}, {"messages": [], "max_tokens": 0},
                {"messages": [], "tools": [{"type": "web_search_20250305", "name": "web"}]}, {"messages": [], "thinking": {"type": "sometimes"}}):
        with pytest.raises(InvalidRequest):
            api_anthropic.to_chat_body(bad)


def test_responses_translation() -> None:
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}, {"type": "file_search"}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "reasoning": {"effort": "none"},
        "max_output_tokens": 9,
        "prompt_cache_key": "k",
    }
    chat = api_responses.to_chat_body(body)
    assert [m["role"] for m in chat["messages"]] == ["system", "system", "user", "assistant", "tool", "assistant"]
    assert chat["messages"][3]["reasoning_content"] == "Call the tool." and chat["messages"][3]["tool_calls"][0]["id"] == "c1"
    assert json.loads(chat["messages"][3]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert (chat["tool_choice"], chat["reasoning_effort"], chat["max_tokens"], chat["prompt_cache_key"]) == (
        {"type": "function", "function": {"name": "get_weather"}}, "none", 9, "k")
    parse_chat_request(chat)
    assert api_responses.to_chat_body({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}})["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {}}}


def test_render_prefix_ends_at_the_marked_block() -> None:
    template = ChatTemplate.builtin("chatml")
    chat = parse_chat_request({"messages": [
        {"role": "system", "content": "S."},
        {"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]},
    ]})
    prompt = template.render(chat.messages, add_generation_prompt=True)
    system_end = render_prefix(template, chat, 1, None, prompt)
    first_part = render_prefix(template, chat, 2, 1, prompt)
    whole = render_prefix(template, chat, 2, None, prompt)
    assert prompt.startswith(whole) and whole.endswith("second part<|im_end|>\n")
    assert system_end.endswith("S.<|im_end|>\n") and first_part.endswith("first part")
    assert len(system_end) < len(first_part) < len(whole) < len(prompt)
