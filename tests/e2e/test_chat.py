"""End to end: ``/v1/completions`` and ``/v1/chat/completions`` over raw HTTP (OpenAI shapes).

Expected values follow llama-server (docs/llama-server-api.md §6).
"""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from tests.e2e.helpers import DONE, TIMINGS_KEYS, ascii_stop_string, post_stream

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Say something nice."}]
GREEDY = {"temperature": 0, "cache_prompt": False}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def post(http, path, **body):
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_usage(usage: dict, completion_tokens: int | None = None) -> None:
    assert list(usage) == ["completion_tokens", "prompt_tokens", "total_tokens", "prompt_tokens_details"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int) and not isinstance(cached, bool)
    assert 0 <= cached < usage["prompt_tokens"]
    if completion_tokens is not None:
        assert usage["completion_tokens"] == completion_tokens


# ---------------------------------------------------------------------- /v1/completions


def test_v1_completions_shape(http):
    body = post(http, "/v1/completions", prompt="Hello world", max_tokens=4, ignore_eos=True)
    assert list(body) == ["choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings"]
    assert body["object"] == "text_completion"
    assert body["model"] == "tiny-llama"
    assert body["id"].startswith("chatcmpl-")
    assert len(body["id"]) == len("chatcmpl-") + 32
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert list(choice) == ["text", "index", "logprobs", "finish_reason"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert_usage(body["usage"], completion_tokens=4)
    assert list(body["timings"]) == TIMINGS_KEYS


def test_v1_completions_matches_native_greedy_text(http):
    native = post(http, "/completion", prompt="The weather", n_predict=6, ignore_eos=True, **GREEDY)
    oai = post(http, "/v1/completions", prompt="The weather", max_tokens=6, ignore_eos=True, **GREEDY)
    assert oai["choices"][0]["text"] == native["content"]
    assert oai["usage"]["prompt_tokens"] == native["tokens_evaluated"]


def test_v1_completions_finish_reason_stop_on_stop_string(http):
    first = post(http, "/v1/completions", prompt="Once upon a time", max_tokens=16, ignore_eos=True, **GREEDY)
    text = first["choices"][0]["text"]
    stop = ascii_stop_string(text)
    body = post(http, "/v1/completions", prompt="Once upon a time", max_tokens=16, ignore_eos=True, stop=stop, **GREEDY)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[: text.index(stop)]


def test_v1_completions_stream(http):
    _, events = post_stream(http, "/v1/completions", {"prompt": "Hello world", "max_tokens": 3, "ignore_eos": True, **GREEDY})
    assert events[-1] == DONE
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["choices"][0]["text"] == ""
    assert_usage(final["usage"], completion_tokens=3)
    assert "timings" in final
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    whole = post(http, "/v1/completions", prompt="Hello world", max_tokens=3, ignore_eos=True, **GREEDY)
    assert streamed == whole["choices"][0]["text"]


def test_v1_completions_n_and_integer_logprobs(http):
    body = post(http, "/v1/completions", prompt="Hello", max_tokens=2, n=2, logprobs=3, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 4
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 2
        assert all(len(entry["top_logprobs"]) == 3 for entry in content)


# ---------------------------------------------------------------------- /v1/chat/completions


def test_chat_shape(http):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4, ignore_eos=True)
    assert list(body) == ["choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings"]
    assert body["object"] == "chat.completion"
    assert body["model"] == "tiny-llama"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert "logprobs" not in choice
    assert_usage(body["usage"], completion_tokens=4)
    assert list(body["timings"]) == TIMINGS_KEYS
    assert body["timings"]["predicted_n"] == 4


def test_chat_prompt_tokens_match_the_rendered_template(http):
    # As llama-server: the rendered prompt leaves out the BOS the tokenizer adds (the factory's
    # template writes it), and the chat prompt is tokenized with the special tokens added.
    rendered = post(http, "/apply-template", messages=MESSAGES)["prompt"]
    bos = http.get("/props").json()["bos_token"]
    assert bos and not rendered.startswith(bos)
    tokens = http.post("/tokenize", json={"content": rendered, "add_special": True}).json()["tokens"]
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=1)
    assert body["usage"]["prompt_tokens"] == len(tokens)


def test_chat_request_model_is_not_echoed(http):
    body = post(http, "/v1/chat/completions", model="gpt-4o", messages=MESSAGES, max_tokens=1)
    assert body["model"] == "tiny-llama"


def test_chat_path_without_v1(http):
    body = post(http, "/chat/completions", messages=MESSAGES, max_tokens=2, ignore_eos=True)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_token_limit_fields(http, field):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, ignore_eos=True, **{field: 3})
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_finish_reason_stop_on_stop_string(http):
    first = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=16, ignore_eos=True, **GREEDY)
    text = first["choices"][0]["message"]["content"]
    stop = ascii_stop_string(text)
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=16, ignore_eos=True, stop=[stop], **GREEDY)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == text[: text.index(stop)]


def test_chat_finish_reason_stop_on_eos(http):
    eos = http.post("/tokenize", json={"content": http.get("/props").json()["eos_token"]}).json()["tokens"][0]
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=5, logit_bias={str(eos): 100})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == ""  # "" when empty, not null
    assert body["usage"]["completion_tokens"] == 1


def test_chat_n_gives_several_choices(http):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, n=2, max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6
    # The prompt is counted once: both choices share it.
    single = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=3, ignore_eos=True)
    assert body["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]


def test_chat_logprobs_with_top_logprobs(http):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=3, ignore_eos=True, **GREEDY)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert list(entry) == ["id", "token", "bytes", "logprob", "top_logprobs"]
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]


def test_chat_logprobs_default_to_twenty(http):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, logprobs=True)
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_chat_top_logprobs_without_logprobs_is_rejected(http):
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "top_logprobs": 2})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_chat_native_fields_pass_through(http):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, n_predict=2, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 2


def test_chat_stream_format(http):
    response, events = post_stream(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, **GREEDY})
    assert events[-1] == DONE
    assert response.text.endswith("data: [DONE]\n\n")
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    first, final = chunks[0], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert final["choices"][0]["delta"] == {}
    assert final["choices"][0]["finish_reason"] == "length"
    assert "usage" not in final  # include_usage defaults to false
    assert "timings" in final  # timings ride on the last chunk
    middle = chunks[1:-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in middle)
    whole = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=3, ignore_eos=True, **GREEDY)
    assert streamed == whole["choices"][0]["message"]["content"]


def test_chat_stream_include_usage(http):
    _, events = post_stream(
        http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == DONE
    usage_chunk, finish_chunk = events[-2], events[-3]
    assert usage_chunk["choices"] == []
    assert_usage(usage_chunk["usage"], completion_tokens=2)
    assert "timings" in usage_chunk
    assert finish_chunk["choices"][0]["finish_reason"] == "length"
    assert "timings" not in finish_chunk


def test_chat_stream_logprobs(http):
    _, events = post_stream(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    with_logprobs = [c for c in events[:-1] if c["choices"] and "logprobs" in c["choices"][0]]
    assert len(with_logprobs) == 2
    assert all(len(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2 for c in with_logprobs)


def test_chat_tools_are_rendered_into_the_prompt(http):
    plain = post(http, "/apply-template", messages=MESSAGES)["prompt"]
    with_tools = post(http, "/apply-template", messages=MESSAGES, tools=[WEATHER_TOOL])["prompt"]
    assert "get_current_weather" in with_tools
    assert "get_current_weather" not in plain
    body = post(http, "/v1/chat/completions", messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=1)
    tokens = http.post("/tokenize", json={"content": with_tools, "add_special": True}).json()["tokens"]
    assert body["usage"]["prompt_tokens"] == len(tokens)


def test_chat_system_message_is_rendered(http):
    messages = [{"role": "system", "content": "You are terse."}, *MESSAGES]
    prompt = post(http, "/apply-template", messages=messages)["prompt"]
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in prompt


# ---------------------------------------------------------------------- chat_template_kwargs (Qwen3-style template)


@pytest.fixture(scope="module")
def qwen3_http(server_factory, qwen3_dir) -> Iterator[httpx.Client]:
    """A Qwen3 server: its template switches thinking with ``enable_thinking``. Its context is
    long enough that a stream the reasoning-control tests leave running lasts for seconds (a
    1024-token slot is full in about half a second) while they act on it."""
    qwen = server_factory(["-m", str(qwen3_dir), "-np", "1", "-c", "16384"])
    with httpx.Client(base_url=qwen.base_url, timeout=60) as client:
        yield client
    qwen.stop()


def test_chat_template_kwargs_reach_the_template(qwen3_http):
    thinking = post(qwen3_http, "/apply-template", messages=MESSAGES)["prompt"]
    no_thinking = post(qwen3_http, "/apply-template", messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})["prompt"]
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking.endswith("<|im_start|>assistant\n")
    on = post(qwen3_http, "/v1/chat/completions", messages=MESSAGES, max_tokens=1)
    off = post(qwen3_http, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]


def test_chat_template_kwargs_enable_thinking_must_be_boolean(qwen3_http):
    response = qwen3_http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "no"}})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_reasoning_effort_none_disables_thinking(qwen3_http):
    prompt = post(qwen3_http, "/apply-template", messages=MESSAGES, reasoning_effort="none")["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n")


# A prefilled assistant turn that opens the block: the random-weight model would rarely open it itself.
THINKING = [*MESSAGES, {"role": "assistant", "content": "<think>\n"}]


def _stream_until(lines, want) -> tuple[str, list[tuple[str, str]]]:
    """Read chat chunks from the ``lines`` iterator until ``want(deltas)``; the completion id and the
    (field, text) deltas. The iterator is kept by the caller: closing it would close the connection."""
    cid, deltas = "", []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        cid = chunk["id"]
        for field, text in chunk["choices"][0]["delta"].items():
            if field in ("content", "reasoning_content") and text:
                deltas.append((field, text))
        if want(deltas):
            break
    return cid, deltas


def test_reasoning_end_closes_the_block_and_the_model_answers(qwen3_http):
    body = {"messages": THINKING, "max_tokens": 100000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=str(qwen3_http.base_url), timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "reasoning_control": True}) as response:
            lines = response.iter_lines()
            cid, before = _stream_until(lines, lambda d: len(d) >= 3)
            assert cid.startswith("chatcmpl-") and [f for f, _ in before] == ["reasoning_content"] * 3
            ended = qwen3_http.post("/v1/chat/completions/control", json={"id": cid, "action": "reasoning_end"})
            assert ended.json() == {"success": True}
            _, after = _stream_until(lines, lambda d: sum(f == "content" for f, _ in d) >= 3)
    fields = [f for f, _ in before + after]
    first_content = fields.index("content")
    # The forced </think> follows the tokens already generated when the control came; then only the answer.
    assert set(fields[first_content:]) == {"content"}
    # Without the control the same greedy reply is still thinking at that point: the control cut
    # that very reasoning short.
    thought = "".join(t for f, t in before + after if f == "reasoning_content")
    alone = post(qwen3_http, "/v1/chat/completions", **{**body, "max_tokens": len(fields) + 8})["choices"][0]["message"]
    assert alone["content"] == "" and alone["reasoning_content"].startswith(thought.strip())
    assert len(alone["reasoning_content"]) > len(thought)


def test_reasoning_control_answers_like_llama_server(qwen3_http):
    assert qwen3_http.post("/v1/chat/completions/control", json={"action": "reasoning_end"}).status_code == 400
    bad = qwen3_http.post("/v1/chat/completions/control", json={"id": "chatcmpl-x", "action": "think_harder"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "unknown control action"
    unknown = qwen3_http.post("/v1/chat/completions/control", json={"id": "chatcmpl-x", "action": "reasoning_end"})
    assert unknown.json() == {"success": False, "message": "no active completion for this id"}
    body = {"messages": THINKING, "max_tokens": 100000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(qwen3_http.base_url), timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            cid, _ = _stream_until(lines, lambda d: len(d) >= 1)
            unarmed = qwen3_http.post("/v1/chat/completions/control", json={"id": cid, "action": "reasoning_end"})
    assert unarmed.json() == {"success": False, "message": "reasoning control not enabled for this completion"}


def test_reasoning_format_none_keeps_thinking_in_content(http):
    think_end = 8191  # </think> in the generated tokenizer (see mlxcel_compat.testing.tokenizer)
    assert http.post("/detokenize", json={"tokens": [think_end]}).json()["content"] == "</think>"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {str(think_end): 100}}
    default = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    raw = http.post("/v1/chat/completions", json={**body, "reasoning_format": "none"}).json()["choices"][0]["message"]
    assert "</think>" not in default["content"]
    assert raw["content"] == "</think>" and "reasoning_content" not in raw


def test_verbose_adds_the_native_result(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "verbose": True}
    reply = http.post("/v1/chat/completions", json=body).json()
    native = reply["__verbose"]
    assert native["tokens_predicted"] == reply["usage"]["completion_tokens"]
    assert native["content"] == reply["choices"][0]["message"]["content"]
    assert "__verbose" not in http.post("/v1/chat/completions", json={**body, "verbose": False}).json()


def test_parallel_tool_calls_false_keeps_the_first_call():
    from mlxcel_compat.chat.syntax_formats import FALLBACK_TOOLS
    from mlxcel_compat.chat.syntax import ChatSyntax
    from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply

    syntax = ChatSyntax("JSON call", tools=(FALLBACK_TOOLS,))
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    calls = parse_reply(syntax, text, ReplyOptions(tools=True)).tool_calls
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    first = parse_reply(syntax, text, ReplyOptions(tools=True, parallel=False)).tool_calls
    assert [c["function"]["name"] for c in first] == ["a"]


def test_openai_sdk_streams_a_call_name_first_then_arguments_in_pieces(server):
    """The OpenAI SDK's own stream accumulator rebuilds the call from our deltas: its name arrives
    first, its arguments in several pieces. The forced call's grammar keeps them valid; an enum keeps
    a random-weight model's call short."""
    import openai

    unit_tool = {"type": "function", "function": {
        "name": "get_current_weather", "description": "Weather in Paris",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}}
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.chat.completions.stream(model="x", messages=question, tools=[unit_tool], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, seed=0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 1 and all(e.name == "get_current_weather" and e.index == 0 for e in pieces)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_current_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert "".join(e.arguments_delta for e in pieces) == call.function.arguments
    assert not (choice.message.content or "").strip()


# ---------------------------------------------------------------------- reasoning in the template's own syntax

THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}[INST]{{ m.content }}[/INST]"
    "{%- else -%}{%- if m.reasoning_content -%}[THINK]{{ m.reasoning_content }}[/THINK]{%- endif -%}{{ m.content }}</s>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}[THINK]{%- endif -%}"
)


@pytest.fixture(scope="module")
def think_http(server_factory, llama_dir, tmp_path_factory) -> Iterator[httpx.Client]:
    """A server whose template writes reasoning between [THINK] and [/THINK] and opens the block
    in its generation prompt (Mistral's reasoning models do)."""
    path = tmp_path_factory.mktemp("think") / "think.jinja"
    path.write_text(THINK_TEMPLATE)
    server = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "1024", "--chat-template-file", str(path)])
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    server.stop()


def test_reasoning_is_read_in_the_template_syntax_and_the_budget_counts_its_block(think_http):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "verbose": True}  # [/THINK] is several tokens here
    # The prompt opened [THINK]; a reply that never closes it is all reasoning.
    opened = post(think_http, "/v1/chat/completions", **body)
    raw = opened["__verbose"]["content"]
    assert opened["choices"][0]["message"]["reasoning_content"] == raw.strip() and opened["choices"][0]["message"]["content"] == ""
    # A budget of 0 forces the template's own end marker at once; what follows is the answer.
    closed = post(think_http, "/v1/chat/completions", **body, reasoning_budget_tokens=0)
    raw = closed["__verbose"]["content"]
    assert raw.startswith("[/THINK]")
    message = closed["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == raw[len("[/THINK]"):].lstrip()
    # reasoning_format none: the reply as written.
    kept = post(think_http, "/v1/chat/completions", **body, reasoning_budget_tokens=0, reasoning_format="none")
    assert kept["choices"][0]["message"]["content"] == kept["__verbose"]["content"]
