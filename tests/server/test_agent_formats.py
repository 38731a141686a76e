"""The Anthropic and Responses translations and event formatting, as plain functions.

The tiny random models never emit a tool call or a thinking block on their own, so the shapes a
generated ``<tool_call>`` / ``<think>`` reply takes are checked here on the real formatters, and the
SDKs' own stream accumulators must rebuild from the events what the whole reply parses to; the
end-to-end tests (``tests/e2e/test_agent_streams.py``) cover forced calls on real servers.
"""

from __future__ import annotations

import json

import openai
import orjson
import pydantic
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
from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply

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
TWO_CALLS = REPLY + ' <tool_call>{"name": "get_time", "arguments": {"zone": "CET", "exact": true}}</tool_call>'


def stream_through(writer, text: str, size: int = 5) -> list[bytes]:
    """The reply streamed through ``writer`` in pieces of ``size`` characters, as the routes feed
    it: text deltas to ``delta``, call deltas to ``tool_calls``, then the last item closed."""
    splitter = ReplyStream(HERMES, ReplyOptions(tools=True))
    pieces = [text[i: i + size] for i in range(0, len(text), size)]
    chunks = []
    for field, value in [d for piece in pieces for d in splitter.push(piece)] + splitter.finish():
        chunks += writer.feed(field, value)
    return chunks + writer.close()


def whole(text: str):
    return parse_reply(HERMES, text, ReplyOptions(tools=True))


def anthropic_message(chunks: list[bytes]):
    """What the anthropic SDK's stream accumulator builds from the events."""
    from anthropic.lib.streaming._messages import accumulate_event

    start = {"type": "message_start", "message": api_anthropic.message_body("msg_1", "m", [], None, None, api_anthropic.usage_json(1, 0, 0, 0))}
    snapshot, bufs = None, {}
    for event in [start, *sse_payloads(chunks)]:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_anthropic_stream_blocks_in_order_as_they_are_read(size: int) -> None:
    blocks = api_anthropic.ContentBlocks()
    chunks = stream_through(blocks, TWO_CALLS, size)
    events = sse_payloads(chunks)
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2, 3]
    kinds = [e["type"] + ":" + e.get("delta", {}).get("type", "") for e in events]
    # the thinking block ends with its signature; each block opens before its deltas, closes after
    assert kinds.index("content_block_delta:signature_delta") + 1 == kinds.index("content_block_stop:")
    tool = next(e for e in events if e["type"] == "content_block_start" and e["index"] == 2)["content_block"]
    assert tool["id"].startswith("toolu_") and tool["name"] == "get_weather" and tool["input"] == {}
    if size == 1:  # the arguments arrive in increments, before the call's end marker is read
        assert sum(1 for e in events if e.get("delta", {}).get("type") == "input_json_delta" and e["index"] == 2) > 5
    # the SDK's accumulator rebuilds what the whole reply parses to
    message = anthropic_message(chunks)
    parsed = whole(TWO_CALLS)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert (message.content[0].thinking, message.content[1].text) == (parsed.reasoning, parsed.content) == ("Check the tool.", "Looking.")
    assert [(b.name, b.input) for b in message.content[2:]] == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]
    assert [c["id"] for c in blocks.calls()] == [b.id for b in message.content[2:]]
    assert [b.model_dump(exclude_none=True) for b in message.content] == blocks.content  # what a whole response lists


def test_anthropic_stream_sends_the_call_before_the_reply_ends() -> None:
    blocks = api_anthropic.ContentBlocks()
    splitter = ReplyStream(HERMES, ReplyOptions(tools=True))
    cut = TWO_CALLS.index("Paris") + 3  # inside the first call's arguments
    chunks = []
    for field, value in splitter.push(TWO_CALLS[:cut]):
        chunks += blocks.feed(field, value)
    events = sse_payloads(chunks)
    assert events[-2]["content_block"]["name"] == "get_weather"
    assert events[-1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Par'}


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_responses_stream_items_as_they_are_read(size: int) -> None:
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    writer = api_responses.ResponseEvents()
    chunks = stream_through(writer, TWO_CALLS, size)
    events = sse_payloads(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    first_call = [i for i, k in enumerate(kinds) if k == "response.output_item.added"][2]
    assert events[first_call]["item"]["type"] == "function_call" and events[first_call]["item"]["arguments"] == ""
    assert kinds[first_call + 1] == "response.function_call_arguments.delta"
    assert kinds[-3:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done"]
    out = writer.output
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call", "function_call"]
    assert out[0]["id"].startswith("rs_") and out[1]["id"].startswith("msg_") and out[2]["id"].startswith("fc_")
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == out
    # the SDK's accumulator: each call's last arguments snapshot is the whole reply's arguments
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    created = api_responses.response_body("resp_1", 0, _Ctx(), {}, "in_progress", [], None)
    snapshots: dict[str, str] = {}
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for raw in [{"type": "response.created", "sequence_number": -1, "response": created}, *events]:
        for event in state.handle_event(adapter.validate_python(raw)):
            if event.type == "response.function_call_arguments.delta":
                snapshots[event.item_id] = event.snapshot
    parsed = whole(TWO_CALLS)
    calls = [(i["name"], snapshots[i["id"]]) for i in out[2:]]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]
    assert [c["id"] for c in writer.reply().tool_calls] == [i["call_id"] for i in out[2:]] and all(i["call_id"].startswith("call_") for i in out[2:])
    assert (out[0]["content"][0]["text"], out[1]["content"][0]["text"]) == (parsed.reasoning, parsed.content)


class _Ctx:
    class model:
        model_id = "m"


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


def test_a_loosely_written_call_is_a_tool_use_block_and_a_function_call_item() -> None:
    from mlxcel_compat.chat.lenient_calls import collect_schemas

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    options = ReplyOptions(tools=True, lenient_schemas=collect_schemas(tools))
    reply = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    for writer in (api_anthropic.ContentBlocks(), api_responses.ResponseEvents()):
        splitter = ReplyStream(HERMES, options)
        chunks = [c for piece in reply for field, value in splitter.push(piece) for c in writer.feed(field, value)]
        assert chunks == []  # held while it may be the call
        chunks = [c for field, value in splitter.finish() for c in writer.feed(field, value)] + writer.close()
        events = sse_payloads(chunks)
        if isinstance(writer, api_anthropic.ContentBlocks):
            assert writer.content == [{"type": "tool_use", "id": writer.content[0]["id"], "name": "get_weather", "input": {"city": "Paris"}}]
            assert anthropic_message(chunks).content[0].input == {"city": "Paris"}
        else:
            assert [(i["type"], i["name"], i["arguments"]) for i in writer.output] == [("function_call", "get_weather", '{"city": "Paris"}')]
            assert not any(e["type"] == "response.output_text.delta" for e in events)
