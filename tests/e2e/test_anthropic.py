"""The Anthropic Messages API through the official ``anthropic`` SDK against a real server.

Outputs are greedy on the tiny Qwen3 model (its template is a reasoning template), so the same
conversation through ``/v1/chat/completions`` must give the same text: that proves the translation.
Prompt-cache hits are proven by the reused tokens *and* output equal to a cold run.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import ServerProcess
from tests.e2e.helpers import ascii_stop_string, metric

SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short, "
    "polite and factual, and say so when you do not know something."
)
QUESTIONS = ["When does the library open on Saturday?", "How do I renew a book online?", "Can I borrow a laptop?"]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
GREEDY = {"temperature": 0}
COLD = {"temperature": 0, "cache_prompt": False}


@pytest.fixture(scope="module")
def agent_server(server_factory, qwen3_dir) -> ServerProcess:
    # Few entries, so a handful of unrelated requests evict a conversation's entry.
    return server_factory(
        ["-m", str(qwen3_dir), "-np", "2", "-c", "4096", "-b", "64", "--prompt-cache-min-prefix", "16", "--prompt-cache-max-entries", "4", "--metrics"]
    )


@pytest.fixture()
def client(agent_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.base_url, api_key="unused", max_retries=0)


@pytest.fixture()
def raw(agent_server: ServerProcess):
    with httpx.Client(base_url=agent_server.base_url, timeout=60) as c:
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def ask(client: anthropic.Anthropic, messages: list[dict[str, Any]], system: Any = SYSTEM, max_tokens: int = 8, **extra: Any) -> Any:
    body = {k: v for k, v in extra.items() if k in ("metadata", "tools", "tool_choice", "thinking", "stop_sequences", "extra_headers", "cache_control", "output_config")}
    return client.messages.create(
        model="tiny", max_tokens=max_tokens, system=system, messages=messages, extra_body={k: v for k, v in extra.items() if k not in body} or GREEDY, **body
    )


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def chat_text(raw: httpx.Client, messages: list[dict[str, Any]], max_tokens: int = 8) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": SYSTEM}, *messages], "max_tokens": max_tokens, **COLD}
    response = raw.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stats(raw: httpx.Client) -> dict[str, Any]:
    return raw.get("/v1/cache/stats").json()


def test_create_matches_chat_completions(client, raw) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    message = ask(client, messages, **COLD)
    chat = chat_text(raw, messages)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert text_of(message) == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == ("max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn")
    usage = message.usage
    assert usage.input_tokens == chat["usage"]["prompt_tokens"] and usage.output_tokens == chat["usage"]["completion_tokens"]
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, 0)


def test_stream_events_in_order_and_final_message(client, raw, agent_server) -> None:
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    whole = ask(client, messages, **COLD)
    with client.messages.stream(model="tiny", max_tokens=8, system=SYSTEM, messages=messages, extra_body=COLD) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason
    # The wire: event names equal payload types, blocks numbered from 0, the order Anthropic uses.
    body = {"model": "tiny", "max_tokens": 8, "system": SYSTEM, "messages": messages, "stream": True, **COLD}
    response = raw.post("/v1/messages", json=body)
    events = []
    for block in response.text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
            payload = httpx.Response(200, content=lines[1][len("data: ") :]).json()
            assert payload["type"] == lines[0][len("event: ") :]
            events.append(payload)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert all(e["index"] == 0 for e in events if e["type"].startswith("content_block"))
    assert events[0]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_count_tokens_needs_no_max_tokens_and_counts_the_rendered_prompt(client, raw) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages).input_tokens
    rendered = raw.post("/v1/chat/completions/input_tokens", json={"messages": [{"role": "system", "content": SYSTEM}, *messages]}).json()
    assert counted == rendered["input_tokens"] == ask(client, messages, max_tokens=1, **COLD).usage.input_tokens
    with_tools = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages, tools=[WEATHER]).input_tokens
    assert with_tools > counted + 20  # the schema is in the prompt


def test_tool_use_round_trip(client, raw) -> None:
    """tool_use (assistant) → tool_result (user) → the model answers; the prompt holds both."""
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "18 C, light rain"}]}]},
    ]
    answer = ask(client, history, tools=[WEATHER], tool_choice={"type": "auto"}, **COLD)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.output_tokens > 0
    # The same conversation in OpenAI form renders to the very same prompt and output.
    openai_history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "toolu_01", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C, light rain"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}]
    body = {"messages": [{"role": "system", "content": SYSTEM}, *openai_history], "tools": tools, "max_tokens": 8, **COLD}
    prompt = raw.post("/apply-template", json=body).json()["prompt"]
    assert "18 C, light rain" in prompt and '"city": "Paris"' in prompt
    chat = raw.post("/v1/chat/completions", json=body).json()
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"]
    if answer.stop_reason != "tool_use":
        assert text_of(answer) == chat["choices"][0]["message"]["content"]
    # is_error reaches the model; any / a named tool are accepted (constrained once structured output lands).
    errored = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "timeout", "is_error": True}]}]
    assert client.messages.count_tokens(model="tiny", system=SYSTEM, messages=errored, tools=[WEATHER]).input_tokens > 0
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "none"}):
        assert ask(client, history[:1], max_tokens=2, tools=[WEATHER], tool_choice=choice, **COLD).usage.output_tokens > 0


def test_tool_choice_any_forces_a_valid_tool_use(client) -> None:
    # tool_choice "any" becomes OpenAI's "required", which the grammar enforces: the random-weight
    # model could never produce a well-formed call by itself. Bounded arguments (no free strings, no extra keys) keep it short; whitespace between JSON tokens is allowed, hence the token budget.
    tool = {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"], "additionalProperties": False}}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        message = ask(client, messages, max_tokens=200, tools=[tool], tool_choice=choice, **COLD)
        calls = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(calls) == 1, message
        assert calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
        jsonschema.validate(calls[0].input, tool["input_schema"])


def test_output_config_format_constrains_the_reply(client) -> None:
    schema = {"type": "object", "properties": {"open": {"enum": ["9:00", "10:00"]}}, "required": ["open"], "additionalProperties": False}
    message = ask(client, [{"role": "user", "content": QUESTIONS[0]}], max_tokens=200, output_config={"format": {"type": "json_schema", "schema": schema}}, **COLD)
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(text_of(message)), schema)


def test_thinking_switches_the_reasoning_template(client, raw) -> None:
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    on = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages, thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    off = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages, thinking={"type": "disabled"}).input_tokens
    closed = len(raw.post("/tokenize", json={"content": "<think>\n\n</think>\n\n"}).json()["tokens"])
    assert off == on + closed  # disabled: the template closes an empty thinking block itself
    answer = ask(client, messages, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024}, **COLD)
    assert answer.usage.input_tokens == on
    # A thinking block in the history reaches the prompt (kept while the cache is on: preserve_thinking).
    thought = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Saturday hours are on the website.", "signature": ""}, {"type": "text", "text": "At nine."}]},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    plain = [thought[0], {"role": "assistant", "content": "At nine."}, thought[2]]
    assert client.messages.count_tokens(model="tiny", messages=thought).input_tokens > client.messages.count_tokens(model="tiny", messages=plain).input_tokens
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, messages=messages, thinking={"type": "enabled", "budget_tokens": -5})


def test_stop_sequences(client) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    free = text_of(ask(client, messages, max_tokens=24, **COLD))
    stop = ascii_stop_string(free)
    stopped = ask(client, messages, max_tokens=24, stop_sequences=[stop], **COLD)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == free[: free.index(stop)]


def test_errors_are_typed_and_in_anthropic_shape(client, raw, agent_server) -> None:
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [document]}])
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": info.value.body["error"]["message"]}}
    assert "document" in info.value.body["error"]["message"] and "not supported" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "word " * 5000}])
    with pytest.raises(anthropic.BadRequestError, match="cache_control"):
        marked = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": marked}])
    bad = raw.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"
    missing = raw.post("/v1/messages/count_tokens", json={"system": SYSTEM})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
    assert raw.get("/health").status_code == 200


def test_auth_accepts_x_api_key_and_answers_in_anthropic_shape(server_factory, llama_dir) -> None:
    server = server_factory(["-m", str(llama_dir), "-c", "512", "--api-key", "sekret"])
    good = anthropic.Anthropic(base_url=server.base_url, api_key="sekret", max_retries=0)  # sends x-api-key
    assert good.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    assert good.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]).usage.output_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Invalid API Key"}}
    # Other routes keep llama-server's shape.
    assert httpx.post(server.base_url + "/completion", json={"prompt": "x"}).json()["error"]["code"] == 401


def test_prompt_cache_turn_two_reports_cache_reads(client, raw) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    first = ask(client, messages, metadata={"user_id": "reader-7"}, temperature=0)
    before = stats(raw)
    messages += [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": QUESTIONS[1]}]
    second = ask(client, messages, metadata={"user_id": "reader-7"}, temperature=0)
    after = stats(raw)
    cold = ask(client, messages, **COLD)
    reused = after["prefix_tokens_reused_total"] - before["prefix_tokens_reused_total"]
    assert second.usage.cache_read_input_tokens == reused > first.usage.input_tokens
    assert second.usage.input_tokens == cold.usage.input_tokens - reused  # input_tokens excludes cached
    assert after["hits_by_stage"]["session"] == before["hits_by_stage"]["session"] + 1  # metadata.user_id is the session
    assert text_of(second) == text_of(cold)


def test_cache_control_breakpoint_survives_eviction_of_the_longer_entry(client, raw) -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = ask(client, [{"role": "user", "content": QUESTIONS[0]}], system=system, temperature=0)
    written = first.usage.cache_creation_input_tokens
    assert written > 30 and first.usage.cache_read_input_tokens == 0
    assert first.usage.input_tokens == client.messages.count_tokens(model="tiny", system=SYSTEM, messages=[{"role": "user", "content": QUESTIONS[0]}]).input_tokens - written
    s1 = stats(raw)
    assert (s1["pinned_entries"], s1["entries"]) == (1, 2)
    for i in range(4):  # unrelated conversations fill the 4-entry cache: the long entry goes
        ask(client, [{"role": "user", "content": f"Unrelated question number {i} about gardening and soil."}], system=f"You are gardener {i}.", temperature=0)
    s2 = stats(raw)
    assert s2["evictions"]["lru"] > s1["evictions"]["lru"] and s2["pinned_entries"] == 1
    # Shares only the breakpoint prefix (the system block): reads exactly what was pinned.
    other = [{"role": "user", "content": "Tell me about membership fees."}]
    hit = ask(client, other, system=system, temperature=0)
    s3 = stats(raw)
    assert hit.usage.cache_read_input_tokens == written == s3["prefix_tokens_reused_total"] - s2["prefix_tokens_reused_total"]
    assert hit.usage.cache_creation_input_tokens == 0 and s3["pin_hits"] == s2["pin_hits"] + 1
    assert text_of(hit) == text_of(ask(client, other, **COLD))
    text = raw.get("/metrics").text
    assert metric(text, "mlxcel_prompt_cache_pinned_entries") == 1 and metric(text, "mlxcel_prompt_cache_pin_hits_total") == s3["pin_hits"]


def test_chat_completions_read_cache_control_too(raw) -> None:
    """OpenRouter-style markers on chat content parts are breakpoints as well."""
    system = {"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]}
    body = {"messages": [system, {"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4, "temperature": 0}
    assert raw.post("/v1/chat/completions", json=body).status_code == 200
    pinned = stats(raw)
    assert pinned["pinned_entries"] == 1 and pinned["pins"] >= 1
    body["messages"][1] = {"role": "user", "content": "Something else entirely."}
    again = raw.post("/v1/chat/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 30
    bad = dict(body, messages=[{"role": "system", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}])
    assert raw.post("/v1/chat/completions", json=bad).status_code == 400


def test_top_level_cache_control_marks_the_last_block(client, raw) -> None:
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    first = ask(client, messages, cache_control={"type": "ephemeral"}, temperature=0)
    assert first.usage.cache_creation_input_tokens > first.usage.input_tokens  # all but the generation prompt
    assert stats(raw)["pinned_entries"] == 1


def test_session_header_feeds_the_prompt_cache_session(client, raw) -> None:
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    ask(client, messages, extra_headers={"X-Session-ID": "router-a"}, temperature=0)
    s0 = stats(raw)
    ask(client, messages, extra_headers={"X-Session-ID": "router-b"}, temperature=0)
    s1 = stats(raw)
    ask(client, messages, extra_headers={"x-session-affinity": "router-b"}, temperature=0)
    s2 = stats(raw)
    assert s1["hits_by_stage"]["cross_session"] == s0["hits_by_stage"]["cross_session"] + 1
    assert s2["hits_by_stage"]["session"] == s1["hits_by_stage"]["session"] + 1
