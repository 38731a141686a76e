"""Tests for mlxcel_compat.chat.request, .render, .reasoning, .tool_calls and .stream_splitter: request validation, prompt rendering, output parsing (in the Hermes/``<think>`` syntax; every family's syntax: tests/chat/test_tool_syntax.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from mlxcel_compat.chat.render import render_chat, render_history_boundary
from mlxcel_compat.chat.request import ChatRequestError, parse_chat_request
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.chat.stream_splitter import ReplyStream
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.syntax_formats import FALLBACK_REASONING, FALLBACK_TOOLS
from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply, parse_tool_calls

# A ChatML template in the style of Qwen3, written for these tests (tools in the system prompt,
# Hermes tool calls, tool responses, enable_thinking). Independent of the tiny-model factory.
TEMPLATE = r"""
{%- if tools -%}
{{- '<|im_start|>system\n# Tools\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools><|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content -}}
{%- for tc in m.tool_calls or [] -%}
{{- '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look up", "parameters": {"type": "object"}},
}


def make_body(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return body


def user(content: Any = "Hi") -> dict[str, Any]:
    return {"role": "user", "content": content}


# --- validation: every llama-server rule, with its wording ----------------------------------

MEDIA_HINT = "hint: if this is unexpected, you may need to provide the mmproj"

VALIDATION_CASES = [
    ({}, "'messages' is required"),
    ({"messages": {"role": "user"}}, "Expected 'messages' to be an array"),
    ({"messages": ["hello"]}, "Failed to parse messages: Expected 'message' to be an object"),
    ({"messages": [{"role": "user"}]}, "All non-assistant messages must contain 'content'"),
    ({"messages": [{"role": "system"}]}, "All non-assistant messages must contain 'content'"),
    (
        {"messages": [{"role": "assistant"}]},
        "Assistant message must contain either 'content' or 'tool_calls'!",
    ),
    ({"messages": [user(42)]}, "Expected 'content' to be a string or an array"),
    ({"messages": [user({"text": "x"})]}, "Expected 'content' to be a string or an array"),
    (
        {"messages": [user([{"type": "image_url", "image_url": {"url": "data:,"}}])]},
        f"image input is not supported - {MEDIA_HINT}",
    ),
    (
        {"messages": [user([{"type": "input_audio", "input_audio": {}}])]},
        f"audio input is not supported - {MEDIA_HINT}",
    ),
    (
        {"messages": [user([{"type": "input_video", "input_video": {}}])]},
        f"video input is not supported - {MEDIA_HINT}",
    ),
    ({"messages": [user([{"type": "file", "file": {}}])]}, "unsupported content[].type"),
    ({"messages": [user([{"text": "no type"}])]}, "unsupported content[].type"),
    ({"messages": [user([{"type": "text"}])]}, "Failed to parse messages: Missing 'text'"),
    ({"messages": [{"content": "x"}]}, "Failed to parse messages: Missing 'role' in message"),
    ({"messages": [{"role": 1, "content": "x"}]}, "Failed to parse messages: 'role' must be a string"),
    (
        {"messages": [{"role": "assistant", "tool_calls": {"id": "x"}}]},
        "Failed to parse messages: Expected 'tool_calls' to be an array",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        "Failed to parse messages: Missing tool call type",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"type": "code"}]}]},
        "Failed to parse messages: Unsupported tool call type",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
        "Failed to parse messages: Missing tool call function",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}
            ]
        },
        "Failed to parse messages: Missing tool call name",
    ),
    (
        {"messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}]},
        "Failed to parse messages: 'reasoning_content' must be a string",
    ),
    (make_body(tools={"type": "function"}), "Failed to parse tools: Expected 'tools' to be an array"),
    (make_body(tools=[{"type": "retrieval"}]), "Failed to parse tools: Unsupported tool type"),
    (make_body(tools=[{"type": "function"}]), "Failed to parse tools: Missing tool function"),
    (make_body(tools=[{"type": "function", "function": {}}]), "Failed to parse tools: Missing tool name"),
    (make_body(tool_choice="sometimes"), "Invalid tool_choice: sometimes"),
    (make_body(tool_choice={"type": "function"}), "Invalid tool_choice"),
    (
        make_body(chat_template_kwargs={"enable_thinking": "false"}),
        'invalid type for "enable_thinking" (expected boolean, got string)',
    ),
    (
        make_body(chat_template_kwargs={"enable_thinking": 1}),
        'invalid type for "enable_thinking" (expected boolean, got number)',
    ),
    (make_body(chat_template_kwargs=["x"]), "'chat_template_kwargs' must be an object"),
    (make_body(add_generation_prompt="yes"), "'add_generation_prompt' must be a boolean"),
    (
        make_body(continue_final_message=True),
        "Cannot use both add_generation_prompt and continue_final_message",
    ),
    (
        make_body(continue_final_message="everything", add_generation_prompt=False),
        "'continue_final_message' must be a boolean",
    ),
    (
        {
            "messages": [
                user(),
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"},
            ]
        },
        "Cannot have 2 or more assistant messages at the end of the list.",
    ),
]


@pytest.mark.parametrize(("body", "message"), VALIDATION_CASES)
def test_validation_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ChatRequestError) as info:
        parse_chat_request(body)
    assert info.value.message.startswith(message), info.value.message


def test_media_errors_keep_llama_server_status() -> None:
    body = {"messages": [user([{"type": "image_url", "image_url": {"url": "x"}}])]}
    with pytest.raises(ChatRequestError) as info:
        parse_chat_request(body)
    assert info.value.status_code == 500
    with pytest.raises(ChatRequestError) as info:
        parse_chat_request({})
    assert info.value.status_code == 400


def test_error_messages_dump_the_offending_json_compactly() -> None:
    with pytest.raises(ChatRequestError) as info:
        parse_chat_request({"messages": [{"content": "é"}]})
    assert info.value.message == 'Failed to parse messages: Missing \'role\' in message: {"content":"é"}'


# --- normalization ---------------------------------------------------------------------------


def test_messages_are_normalized_like_llama_cpp() -> None:
    chat = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": None, "extra": "dropped"},
                user([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
                {
                    "role": "assistant",
                    "reasoning_content": "thought",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": {"q": "x"}},
                        }
                    ],
                },
                {"role": "tool", "content": "result", "tool_call_id": "call_9", "name": ""},
                user("next"),
            ]
        }
    )
    assert chat.messages == [
        {"role": "system", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q":"x"}'},
                    "id": "call_9",
                }
            ],
            "reasoning_content": "thought",
        },
        {"role": "tool", "content": "result", "tool_call_id": "call_9"},
        {"role": "user", "content": "next"},
    ]
    assert chat.add_generation_prompt is True
    assert chat.continue_final_message is False
    assert chat.prefill is False


def test_tools_are_normalized_with_defaults() -> None:
    chat = parse_chat_request(
        make_body(tools=[{"type": "function", "function": {"name": "f", "strict": True}}])
    )
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}
    ]
    assert chat.tool_choice == "auto"
    assert chat.render_tools == chat.tools


@pytest.mark.parametrize(
    ("choice", "effective"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "function": {"name": "lookup"}}, "lookup"),
    ],
)
def test_tool_choice_effective_string(choice: Any, effective: str) -> None:
    body = make_body(tools=[TOOL])
    if choice is not None:
        body["tool_choice"] = choice
    assert parse_chat_request(body).tool_choice == effective


def test_tool_choice_changes_what_may_be_called_not_the_prompt() -> None:
    # llama-server renders the tools whatever tool_choice says ("none" included): tool_choice
    # constrains what is generated, so the prompt (and the prompt cache's key) stays the same.
    template = ChatTemplate(TEMPLATE)
    prompts = {}
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "lookup"}}):
        chat = parse_chat_request(make_body(tools=[TOOL], tool_choice=choice))
        prompts[str(choice)] = render_chat(template, chat)
        assert chat.render_tools == chat.tools
        assert (chat.callable_tools is None) == (choice == "none")
    assert len(set(prompts.values())) == 1
    assert "<tools>" in prompts["auto"] and '"name": "lookup"' in prompts["auto"]


def test_template_kwargs_merge_over_server_defaults() -> None:
    chat = parse_chat_request(
        make_body(chat_template_kwargs={"enable_thinking": False, "custom": {"b": 1}}),
        default_template_kwargs={"enable_thinking": True, "keep": "yes"},
    )
    assert chat.template_kwargs == {"enable_thinking": False, "keep": "yes", "custom": {"b": 1}}
    assert chat.enable_thinking is False


def test_reasoning_effort_none_disables_thinking() -> None:
    chat = parse_chat_request(
        make_body(reasoning_effort="none"), default_template_kwargs={"enable_thinking": True}
    )
    assert chat.template_kwargs["enable_thinking"] is False
    assert parse_chat_request(make_body(reasoning_effort="high")).enable_thinking is True
    # An explicit request kwarg is more specific than reasoning_effort.
    explicit = parse_chat_request(
        make_body(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    )
    assert explicit.enable_thinking is True


def test_null_enable_thinking_means_unset() -> None:
    chat = parse_chat_request(make_body(chat_template_kwargs={"enable_thinking": None}))
    assert "enable_thinking" not in chat.template_kwargs


# --- rendering -------------------------------------------------------------------------------


def test_render_chat_plain_conversation() -> None:
    chat = parse_chat_request(
        {"messages": [{"role": "system", "content": "S"}, user("Hi")]}
    )
    assert render_chat(ChatTemplate(TEMPLATE), chat) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_chat_enable_thinking_false() -> None:
    chat = parse_chat_request(make_body(chat_template_kwargs={"enable_thinking": False}))
    prompt = render_chat(ChatTemplate(TEMPLATE), chat)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Without the kwarg llama.cpp's default (thinking on) applies.
    assert render_chat(ChatTemplate(TEMPLATE), parse_chat_request(make_body())).endswith(
        "<|im_start|>assistant\n"
    )


def test_chat_template_kwargs_cannot_clobber_render_arguments() -> None:
    chat = parse_chat_request(
        make_body(chat_template_kwargs={"add_generation_prompt": False, "messages": []})
    )
    prompt = render_chat(ChatTemplate(TEMPLATE), chat)
    assert prompt.endswith("Hi<|im_end|>\n<|im_start|>assistant\n")


def test_prefill_trailing_assistant_message() -> None:
    chat = parse_chat_request(
        {"messages": [user("Count"), {"role": "assistant", "content": "1, 2,"}]}
    )
    assert chat.prefill is True
    prompt = render_chat(ChatTemplate(TEMPLATE), chat)
    assert prompt == (
        "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"
    )


def test_prefill_with_typed_parts_joins_them_with_a_blank_line() -> None:
    chat = parse_chat_request(
        {
            "messages": [
                user("Count"),
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "1,"}, {"type": "text", "text": " 2,"}],
                },
            ]
        }
    )
    assert render_chat(ChatTemplate(TEMPLATE), chat).endswith("<|im_start|>assistant\n1,\n\n 2,")


def test_no_prefill_assistant_closes_the_turn() -> None:
    chat = parse_chat_request(
        {"messages": [user("Count"), {"role": "assistant", "content": "1, 2,"}]},
        prefill_assistant=False,
    )
    assert chat.prefill is False
    prompt = render_chat(ChatTemplate(TEMPLATE), chat)
    assert prompt.endswith("1, 2,<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_renders_and_strips_end_of_turn() -> None:
    chat = parse_chat_request(
        {
            "messages": [user("Count"), {"role": "assistant", "content": "1, 2,"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
    )
    assert chat.continue_final_message is True and chat.prefill is False
    prompt = render_chat(ChatTemplate(TEMPLATE), chat)
    assert prompt == "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"
    assert "<|im_end|>" not in prompt[prompt.rindex("assistant") :]


def test_typed_content_is_joined_with_newlines_for_string_templates() -> None:
    chat = parse_chat_request(
        {"messages": [user([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]}
    )
    assert "<|im_start|>user\na\nb<|im_end|>" in render_chat(ChatTemplate(TEMPLATE), chat)


def test_string_arguments_become_objects_for_object_templates() -> None:
    chat = parse_chat_request(
        {
            "messages": [
                user("q"),
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "lookup", "arguments": '{"q": "é"}'}}
                    ],
                },
                {"role": "tool", "content": "r", "tool_call_id": "x"},
            ]
        }
    )
    prompt = render_chat(ChatTemplate(TEMPLATE), chat)
    assert '{"name": "lookup", "arguments": {"q": "é"}}' in prompt


def test_history_boundary_is_prefix_of_prompt() -> None:
    template = ChatTemplate(TEMPLATE)
    chat = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "S"},
                user("one"),
                {"role": "assistant", "content": "two"},
                user("three"),
            ]
        }
    )
    prompt = render_chat(template, chat)
    boundary = render_history_boundary(template, chat, prompt)
    assert prompt.startswith(boundary)
    assert boundary.endswith("two<|im_end|>\n")
    assert "three" not in boundary
    first_turn = parse_chat_request({"messages": [user("only")]})
    assert render_history_boundary(template, first_turn, render_chat(template, first_turn)) == ""


# --- output parsing --------------------------------------------------------------------------

ID_PATTERN = re.compile(r"^call_[A-Za-z0-9]{24}$")


def test_parse_tool_calls_single_and_multiple() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "lookup", "arguments": {"q": "Paris", "n": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "other", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["lookup", "other"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "Paris", "n": 2}
    assert calls[1]["function"]["arguments"] == '{"x": 1}'
    for call in calls:
        assert call["type"] == "function"
        assert ID_PATTERN.match(call["id"])
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_tool_calls_leaves_malformed_blocks_as_content() -> None:
    text = "<tool_call>{not json}</tool_call> tail"
    assert parse_tool_calls(text) == (text, [])
    missing_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(missing_name) == (missing_name, [])
    not_a_call = "x <tool_call>{unfinished"
    assert parse_tool_calls(not_a_call) == (not_a_call, [])
    mixed = '<tool_call>{bad}</tool_call>\n<tool_call>{"name": "f"}</tool_call>'
    content, calls = parse_tool_calls(mixed)
    assert content == "<tool_call>{bad}</tool_call>"
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_a_call_cut_short_after_its_name_is_still_a_call() -> None:
    # A streamed call is announced once its name is read, so a reply that stops before the call's
    # closing marker keeps the call (its arguments completed into JSON where they were cut).
    content, calls = parse_tool_calls('x <tool_call>{"name": "f", "arguments": {"a": [1, "t')
    assert content == "x"
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": [1, "t"]}'}


def test_parse_tool_calls_without_calls_returns_text_unchanged() -> None:
    assert parse_tool_calls("  plain answer \n") == ("  plain answer \n", [])


HERMES = ChatSyntax("JSON call", reasoning=FALLBACK_REASONING, tools=(FALLBACK_TOOLS,))


@pytest.mark.parametrize(
    ("text", "kwargs", "expected"),
    [
        ("<think>\nplan\n</think>\n\nAnswer", {}, ("plan", "Answer")),
        ("  <think>a</think>b", {}, ("a", "b")),
        ("Answer only", {}, (None, "Answer only")),
        ("<think>\n\n</think>\n\nAnswer", {}, (None, "Answer")),
        # The template already wrote <think>: the generation starts inside the block.
        ("plan\n</think>\n\nAnswer", {"in_reasoning": True}, ("plan", "Answer")),
        # A reply that starts by closing a block it never opened: the marker is dropped.
        ("</think>\nAnswer", {}, (None, "Answer")),
        # Cut short while thinking.
        ("<think>still going", {}, ("still going", "")),
        ("still going", {"in_reasoning": True}, ("still going", "")),
        ("Answer", {"in_reasoning": False}, (None, "Answer")),
        # A think tag later in the text is content, not reasoning.
        ("Use <think> tags like <think>x</think>", {}, (None, "Use <think> tags like <think>x</think>")),
        # reasoning_format "none": the block stays in the content.
        ("<think>a</think>b", {"reasoning": False}, (None, "<think>a</think>b")),
    ],
)
def test_reasoning_is_taken_out(text: str, kwargs: dict[str, Any], expected: tuple[Any, str]) -> None:
    reply = parse_reply(HERMES, text, ReplyOptions(**kwargs))
    assert (reply.reasoning, reply.content) == expected


def test_the_prompt_may_open_the_reasoning_block() -> None:
    assert HERMES.reply_starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not HERMES.reply_starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not HERMES.reply_starts_in_reasoning("<|im_start|>assistant\n")


def _split_stream(pieces: list[str], **kwargs) -> tuple[str, str, list[dict[str, Any]]]:
    stream = ReplyStream(HERMES, ReplyOptions(**kwargs))
    fields: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for delta in [d for piece in pieces for d in stream.push(piece)] + stream.finish():
        field, value = delta
        fields[field] += value
    return fields["reasoning_content"], fields["content"], fields["tool_calls"]


@pytest.mark.parametrize(
    "pieces, kwargs, expected",
    [
        (["<th", "ink>plan", " it</th", "ink>The answer"], {}, ("plan it", "The answer")),
        (["plan</thi", "nk>done"], {"in_reasoning": True}, ("plan", "done")),
        (["<think>x</think>a", "<tool_", 'call>{"name": "f"}</tool_call>', " b"], {"tools": True}, ("x", "a b")),
        (["a <tool_call>{unfinished"], {"tools": True}, ("", "a <tool_call>{unfinished")),
        (["<think>kept</think> as is"], {"reasoning": False}, ("", "<think>kept</think> as is")),
        (["less < than", " <t"], {"tools": True}, ("", "less < than <t")),
    ],
)
def test_stream_splitter(pieces, kwargs, expected) -> None:
    assert _split_stream(pieces, **kwargs)[:2] == expected


def test_stream_sends_the_name_first_then_the_arguments_in_pieces() -> None:
    text = 'ok<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    stream = ReplyStream(HERMES, ReplyOptions(tools=True))
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    calls = [value for field, value in deltas if field == "tool_calls"]
    first = calls[0][0]
    assert first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert first["id"].startswith("call_")
    pieces = [first["function"]["arguments"]] + [c["function"]["arguments"] for delta in calls[1:] for c in delta]
    assert len(pieces) > 5 and all("name" not in c.get("function", {}) for delta in calls[1:] for c in delta)
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 3}
    assert "".join(v for f, v in deltas if f == "content") == "ok"
    assert stream.tool_calls == [{"type": "function", "id": first["id"],
                                  "function": {"name": "get_weather", "arguments": "".join(pieces)}}]
