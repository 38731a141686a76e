"""Calls written loosely (``chat/lenient_calls.py``): an answer that is only a call object is the call.

The measured case: a real Qwen2.5-Coder-0.5B wrote ``{"name": "get_weather", "arguments": {"city":
"Paris"}}`` without its ``<tool_call>`` tags, once inside a json fence. Each reply is parsed whole
and streamed in several chunkings; all must agree, and an object that names no offered tool, fails
its schema or is not the whole answer stays text.
"""

from __future__ import annotations

import json
import random

import pytest

from mlxcel_compat.chat.lenient_calls import collect_schemas, recover_call
from mlxcel_compat.chat.stream_splitter import ReplyStream
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.syntax_formats import FALLBACK_REASONING, FALLBACK_TOOLS
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply

HERMES = ChatSyntax("JSON call", reasoning=FALLBACK_REASONING, tools=(FALLBACK_TOOLS,))
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
LENIENT = ReplyOptions(tools=True, lenient_schemas=collect_schemas(TOOLS))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def chunkings(text: str) -> list[list[str]]:
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    return [list(text), [text[i: i + 4] for i in range(0, len(text), 4)], [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]]


def streamed(text: str, pieces: list[str], options: ReplyOptions = LENIENT):
    stream = ReplyStream(HERMES, options)
    deltas = [d for piece in pieces for d in stream.push(piece)] + stream.finish()
    fields = {"content": "", "reasoning_content": ""}
    for field, value in deltas:
        if field != "tool_calls":
            fields[field] += value
    return fields["reasoning_content"] or None, fields["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in stream.tool_calls]


def read(text: str, options: ReplyOptions = LENIENT):
    """The reply parsed whole, after checking every streamed chunking gives the same."""
    parsed = parse_reply(HERMES, text, options)
    result = parsed.reasoning, parsed.content, [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]
    for pieces in chunkings(text):
        assert streamed(text, pieces, options) == result, pieces
    return result


@pytest.mark.parametrize("text", [
    CALL,
    "  " + CALL + "\n",
    "```json\n" + CALL + "\n```",
    "```\n" + CALL + "\n```\n",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
])
def test_a_bare_or_fenced_call_object_is_the_call(text: str) -> None:
    assert read(text) == (None, "", [("get_weather", '{"city": "Paris"}')])


def test_after_reasoning_and_with_a_tool_without_parameters() -> None:
    assert read("<think>Use the tool.</think>\n\n" + CALL) == ("Use the tool.", "", [("get_weather", '{"city": "Paris"}')])
    assert read('{"name": "get_time", "arguments": {}}') == (None, "", [("get_time", "{}")])


@pytest.mark.parametrize("text", [
    '{"name": "get_forecast", "arguments": {"city": "Paris"}}',  # not an offered tool
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # "city" is required
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": "two"}}',  # days is an integer
    '{"name": "get_weather", "arguments": ["Paris"]}',  # arguments are an object
    '{"name": "get_weather"}',  # no arguments
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # the name comes first
    CALL + " That is the call.",  # not the whole answer
    "Here it is: " + CALL,
    "```json\n" + CALL + "\n``` done",
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut short
])
def test_anything_else_stays_text(text: str) -> None:
    assert read(text) == (None, text.strip(), [])


def test_off_without_schemas_and_real_calls_are_untouched() -> None:
    assert read(CALL, ReplyOptions(tools=True)) == (None, CALL, [])
    tagged = "<tool_call>" + CALL + "</tool_call>"
    assert read(tagged) == (None, "", [("get_weather", '{"city": "Paris"}')])
    assert read(CALL + "\n" + tagged) == (None, CALL, [("get_weather", '{"city": "Paris"}')])  # the real call wins


def test_a_schema_it_cannot_read_proves_nothing() -> None:
    schemas = {"get_weather": {"type": "no-such-type"}, "f": {"$ref": "#/nowhere"}}
    assert recover_call(CALL, schemas) is None
    assert recover_call('{"name": "f", "arguments": {}}', schemas) is None


def test_streamed_content_is_held_only_while_it_may_be_a_call() -> None:
    stream = ReplyStream(HERMES, LENIENT)
    assert stream.push("Hello") == [("content", "Hello")]  # cannot be a call: streams at once
    stream = ReplyStream(HERMES, LENIENT)
    assert stream.push('{"name": "get_weather", "arguments": {"city": "Par') == []  # may be one: held
    assert stream.push('is"}}') == []
    assert stream.push(" and more") == [("content", '{"name": "get_weather", "arguments": {"city": "Paris"}} and more')]
    stream = ReplyStream(HERMES, LENIENT)
    assert stream.push('{"title": "x"}') == [("content", '{"title": "x"}')]  # another first key: released


def test_the_call_id_has_the_shape_the_template_takes_back(llama_cpp_templates) -> None:
    syntax = ChatTemplate(llama_cpp_templates["Mistral-Small-3.2-24B-Instruct-2506"]).for_tools(TOOLS).syntax()
    options = ReplyOptions(tools=True, lenient_schemas=collect_schemas(TOOLS))
    parsed = parse_reply(syntax, CALL, options)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]
    assert len(parsed.tool_calls[0]["id"]) == 9 and parsed.tool_calls[0]["id"].isalnum()
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
