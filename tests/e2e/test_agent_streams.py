"""Agent clients' tool calls, streamed and whole, under real templates on real servers.

The factory's Qwen3 model is served with three of llama.cpp's templates whose call syntax is
Hermes' own (``--chat-template-file``); a forced call (``tool_choice``: required / ``any`` / a named
function) is asked for through each SDK the agents use: the openai SDK's chat completions with
tools and streaming, the anthropic SDK's ``tool_use`` (and its stream), and the Responses API
(``client.responses``). Each must yield a call of an offered tool, and what the SDK's own stream
accumulator builds must equal the non-streamed response of the same greedy request. The
default suite runs each template and each API once (``matrix``); ``--slow`` runs all nine.

A loosely written call (``--lenient-tool-calls``) is checked end to end on the same servers: the
model is made to answer with a bare call object (the response format allows only that, and
``logit_bias`` bans the ``<tool_call>`` marker so the grammar's call branch is closed), and the
answer comes back as the call, whole and streamed, with ``tool_choice`` ``auto``; with ``none``
it stays text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.chat.conftest import read_llama_cpp_templates
from tests.conftest import ServerProcess, matrix

pytestmark = pytest.mark.e2e

TEMPLATES = ("Qwen-Qwen3-0.6B", "Qwen-Qwen2.5-7B-Instruct", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use")
APIS = ("chat", "anthropic", "responses")
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["zone"], "additionalProperties": False}
QUESTION = "What is the weather in Paris?"
SAMPLING = {"temperature": 0, "cache_prompt": False}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def servers(server_factory, qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Template name -> a server of the factory's Qwen3 model under it. The first is started
    before the others, which then start together: the first start builds the model's tokenizer
    into the session's cache, which the others then read."""
    sources = read_llama_cpp_templates()
    folder = tmp_path_factory.mktemp("agent-templates")
    started: dict[str, ServerProcess] = {}
    for name in TEMPLATES:
        path = folder / f"{name}.jinja"
        path.write_text(sources[name], encoding="utf-8")
        args = ["-m", str(qwen3_dir), "-np", "1", "-c", "2048", "--chat-template-file", str(path)]
        started[name] = server_factory(args, wait=False)
        if name == TEMPLATES[0]:
            started[name].wait_healthy()

    def serve(name: str) -> ServerProcess:
        started[name].wait_healthy()
        return started[name]

    return serve


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}},
            {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]


def check_calls(calls: list[tuple[str, Any]]) -> None:
    """Calls of offered tools whose arguments are what the tool's schema allows."""
    assert calls, "no call"
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        key, allowed = ("city", CITY) if name == "get_weather" else ("zone", TIME)
        assert isinstance(arguments, dict) and arguments[key] in allowed["properties"][key]["enum"], arguments


def run_chat(server: ServerProcess) -> None:
    client = openai_client(server)
    body: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=chat_tools(),
                                tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS, extra_body=SAMPLING)
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        chunks = list(stream)
        streamed = stream.get_final_completion().choices[0]
    names = [c.function.name for c in whole.message.tool_calls or []]
    check_calls([(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []])
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    rebuilt = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
    assert rebuilt == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert (streamed.message.content or "") == (whole.message.content or "")
    # the name came in a delta of its own, before the arguments were whole
    deltas = [c for c in chunks if c.type == "chunk" and c.chunk.choices and c.chunk.choices[0].delta.tool_calls]
    first = deltas[0].chunk.choices[0].delta.tool_calls[0]
    assert first.function.name == names[0] and first.id
    assert len(deltas) > 1


def run_anthropic(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": CITY},
             {"name": "get_time", "description": "Time in a zone", "input_schema": TIME}]
    body: dict[str, Any] = dict(model="tiny", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}], tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=SAMPLING)
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    uses = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    check_calls(uses)
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == [b.type for b in whole.content]
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == uses
    assert [b.id.startswith("toolu_") for b in streamed.content if b.type == "tool_use"] == [True] * len(uses)
    texts = [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in whole.content if b.type != "tool_use"]
    assert [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in streamed.content if b.type != "tool_use"] == texts
    kinds = [e.type for e in events]
    start = kinds.index("content_block_start")
    assert "input_json" in kinds[start:]  # the SDK's own event for each input_json_delta


def run_responses(server: ServerProcess) -> None:
    client = openai_client(server)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": CITY},
             {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": TIME}]
    body: dict[str, Any] = dict(model="tiny", input=QUESTION, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=MAX_TOKENS, extra_body=SAMPLING)
    whole = client.responses.create(**body)
    snapshots: dict[str, str] = {}
    with client.responses.stream(**body) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                snapshots[event.item_id] = event.snapshot
        streamed = stream.get_final_response()
    calls = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    check_calls([(name, json.loads(arguments)) for name, arguments in calls])
    streamed_calls = [i for i in streamed.output if i.type == "function_call"]
    assert [(i.name, i.arguments) for i in streamed_calls] == calls
    assert [snapshots[i.id] for i in streamed_calls] == [a for _, a in calls]  # the deltas add up to the arguments
    assert [i.type for i in streamed.output] == [i.type for i in whole.output]
    assert streamed.output_text == whole.output_text


RUNS = {"chat": run_chat, "anthropic": run_anthropic, "responses": run_responses}


@pytest.mark.parametrize(("template", "api"), matrix(TEMPLATES, APIS))
def test_forced_call_streamed_equals_whole(servers, template: str, api: str) -> None:
    RUNS[api](servers(template))


# ---------------------------------------------------------------------- loosely written calls

BARE_CALL = {  # the response format: exactly a call object naming get_weather
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "arguments": CITY},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def loose_request(server: ServerProcess, tool_choice: str) -> dict[str, Any]:
    """The openai SDK's arguments of a request whose answer can only be a bare call object."""
    with httpx.Client(base_url=server.base_url) as http:
        marker = http.post("/tokenize", json={"content": "<tool_call>", "parse_special": True}).json()["tokens"]
    assert len(marker) == 1  # banning it closes the grammar's call branch and nothing else
    extra = {"logit_bias": [[marker[0], False]], "chat_template_kwargs": {"enable_thinking": False}, **SAMPLING}
    return dict(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=chat_tools(), tool_choice=tool_choice,
                response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": BARE_CALL}},
                max_tokens=MAX_TOKENS, extra_body=extra)


def test_a_bare_call_object_is_the_call_whole_and_streamed(servers) -> None:
    server = servers(TEMPLATES[0])
    client = openai_client(server)
    whole = client.chat.completions.create(**loose_request(server, "auto")).choices[0]
    assert [c.function.name for c in whole.message.tool_calls or []] == ["get_weather"], whole.message
    assert not whole.message.content and whole.finish_reason == "tool_calls"
    check_calls([("get_weather", json.loads(whole.message.tool_calls[0].function.arguments))])
    with client.chat.completions.stream(**loose_request(server, "auto")) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        streamed = stream.get_final_completion().choices[0]
    assert text == ""  # held back while it could be the call, never sent as text
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # tool_choice none: the same object stays text
    plain = client.chat.completions.create(**loose_request(server, "none")).choices[0]
    assert not plain.message.tool_calls and json.loads(plain.message.content)["name"] == "get_weather"
