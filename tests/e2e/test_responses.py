"""The OpenAI Responses API and the token-counting routes through the official ``openai`` SDK.

Greedy outputs on the tiny Qwen3 model: the same conversation through ``/v1/chat/completions``
must give the same text and token counts, which proves the translation.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ServerProcess

INSTRUCTIONS = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short."
)
QUESTION = "When does the library open on Saturday?"
FUNCTION = {
    "type": "function",
    "name": "get_opening_hours",
    "description": "Opening hours of a branch",
    "parameters": {"type": "object", "properties": {"branch": {"type": "string"}}, "required": ["branch"]},
}
COLD = {"cache_prompt": False}


@pytest.fixture(scope="module")
def responses_server(server_factory, qwen3_dir) -> ServerProcess:
    return server_factory(["-m", str(qwen3_dir), "-np", "2", "-c", "4096", "-b", "64", "--prompt-cache-min-prefix", "16"])


@pytest.fixture()
def client(responses_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=responses_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def raw(responses_server: ServerProcess):
    with httpx.Client(base_url=responses_server.base_url, timeout=60) as c:
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def chat(raw: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": INSTRUCTIONS}, *messages], "max_tokens": 8, "temperature": 0, **COLD, **extra}
    response = raw.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_create_matches_chat_completions(client, raw) -> None:
    response = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8, temperature=0, extra_body=COLD)
    reference = chat(raw, [{"role": "user", "content": QUESTION}])
    assert response.id.startswith("resp_") and response.object == "response"
    message = response.output[-1]
    assert message.type == "message" and message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert response.output_text == reference["choices"][0]["message"]["content"]
    assert response.status == "completed"  # llama-server's, also when max_output_tokens cut it
    assert response.incomplete_details is None
    u = response.usage
    assert (u.input_tokens, u.output_tokens) == (reference["usage"]["prompt_tokens"], reference["usage"]["completion_tokens"])
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    # /responses (no /v1) is the same route.
    bare = raw.post("/responses", json={"instructions": INSTRUCTIONS, "input": QUESTION, "max_output_tokens": 8, "temperature": 0, **COLD})
    assert bare.status_code == 200 and bare.json()["output"][-1]["content"][0]["text"] == response.output_text


def test_stream_event_sequence(client, raw) -> None:
    whole = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8, temperature=0, extra_body=COLD)
    events = list(client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8, temperature=0, stream=True, extra_body=COLD))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_function_call_round_trip(client, raw) -> None:
    """function_call → function_call_output → the model answers; the prompt holds both."""
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Is the central branch open now?"},
        {"type": "function_call", "call_id": "call_7", "name": "get_opening_hours", "arguments": '{"branch": "central"}'},
        {"type": "function_call_output", "call_id": "call_7", "output": "09:00-18:00"},
    ]
    answer = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=items, tools=[FUNCTION], max_output_tokens=8, temperature=0, extra_body=COLD)
    messages = [
        {"role": "user", "content": "Is the central branch open now?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "get_opening_hours", "arguments": '{"branch": "central"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "09:00-18:00"},
    ]
    tools = [{"type": "function", "function": {k: FUNCTION[k] for k in ("name", "description", "parameters")}}]
    reference = chat(raw, messages, tools=tools)
    assert answer.usage.input_tokens == reference["usage"]["prompt_tokens"]
    if answer.output[-1].type == "message":
        assert answer.output_text == reference["choices"][0]["message"]["content"]
    prompt = raw.post("/apply-template", json={"messages": messages, "tools": tools}).json()["prompt"]
    assert "09:00-18:00" in prompt and '"branch": "central"' in prompt
    for choice in ("required", {"type": "function", "name": "get_opening_hours"}, "none"):
        assert client.responses.create(model="tiny", input=QUESTION, tools=[FUNCTION], tool_choice=choice, max_output_tokens=2).status


def test_prompt_cache_turn_two_reports_cached_tokens(client, raw) -> None:
    first = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8, temperature=0, prompt_cache_key="patron-3")
    turn2: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And on Sunday?"},
    ]
    before = raw.get("/v1/cache/stats").json()
    second = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=turn2, max_output_tokens=8, temperature=0, prompt_cache_key="patron-3")
    after = raw.get("/v1/cache/stats").json()
    cold = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=turn2, max_output_tokens=8, temperature=0, extra_body=COLD)
    reused = after["prefix_tokens_reused_total"] - before["prefix_tokens_reused_total"]
    assert second.usage.input_tokens_details.cached_tokens == reused > first.usage.input_tokens
    assert second.usage.input_tokens == cold.usage.input_tokens  # Responses counts cached tokens in input
    assert after["hits_by_stage"]["session"] == before["hits_by_stage"]["session"] + 1
    assert second.output_text == cold.output_text


def test_previous_response_id_and_unsupported_inputs_are_clear_400s(client, raw) -> None:
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="again", previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError, match="'input_file' is not supported by llamacpp"):
        client.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}])
    with pytest.raises(openai.BadRequestError, match="item type"):
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "msg_1"}])
    missing = raw.post("/v1/responses", json={"instructions": "x"})
    assert missing.status_code == 400 and "input" in missing.json()["error"]["message"]
    assert raw.get("/health").status_code == 200


def test_other_tool_types_are_skipped(client, raw) -> None:
    plain = raw.post("/v1/responses/input_tokens", json={"input": QUESTION, "tools": [FUNCTION]}).json()["input_tokens"]
    mixed = raw.post("/v1/responses/input_tokens", json={"input": QUESTION, "tools": [FUNCTION, {"type": "web_search"}]}).json()["input_tokens"]
    assert mixed == plain
    response = client.responses.create(model="tiny", input=QUESTION, tools=[{"type": "web_search"}], max_output_tokens=2)  # type: ignore[list-item]
    assert response.status == "completed"


def test_text_format_json_schema_constrains_the_output(client) -> None:
    # The random-weight model never writes JSON by itself: valid output proves the constraint.
    schema = {"type": "object", "properties": {"open": {"type": "string", "maxLength": 8}}, "required": ["open"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "hours", "schema": schema, "strict": True}}
    response = client.responses.create(model="tiny", input=QUESTION, text=fmt, max_output_tokens=300, temperature=0)  # type: ignore[arg-type]
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)


def test_token_counting_routes_agree(client, raw) -> None:
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    counts = [raw.post(path, json={"messages": messages}).json() for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens")]
    counts += [raw.post(path, json={"instructions": INSTRUCTIONS, "input": QUESTION}).json() for path in ("/v1/responses/input_tokens", "/responses/input_tokens")]
    assert len({c["input_tokens"] for c in counts}) == 1 and counts[2]["object"] == "response.input_tokens"
    run = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=1)
    assert run.usage.input_tokens == counts[0]["input_tokens"]
    bad = raw.post("/v1/chat/completions/input_tokens", json={"messages": "nope"})
    assert bad.status_code == 400
