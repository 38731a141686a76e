"""Structured output through the real server: grammar, json_schema, response_format, tool calls.

The models have random weights: every valid output below is the constraint's doing.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from mlxcel_compat.testing.families import FAMILIES
from tests.conftest import ServerProcess, tiny_model
from tests.e2e.helpers import DONE, assert_serving, post_stream

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "country": {"enum": ["FR", "DE", "JP"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 10000000},
        "coastal": {"type": "boolean"},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "country", "population", "coastal", "districts"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"], "additionalProperties": False},
    },
}
TOOLS = {t["function"]["name"]: t for t in (WEATHER_TOOL, TIME_TOOL)}


@pytest.fixture(scope="module")
def structured_server(server_factory, llama_dir) -> ServerProcess:
    return server_factory(["-m", str(llama_dir), "-np", "8", "-c", "4096", "-b", "64", "--alias", "tiny"])


@pytest.fixture()
def http(structured_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=structured_server.base_url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def valid_city(text: str) -> dict[str, Any]:
    data = json.loads(text)
    jsonschema.validate(data, CITY)
    return data


# ---------------------------------------------------------------------- grammar and json_schema


def test_exact_grammar_on_every_route(http):
    grammar = 'root ::= "a"{5,5}'
    native = post(http, "/completion", prompt="Say a", n_predict=30, grammar=grammar)
    assert native["content"] == "aaaaa" and native["stop_type"] == "eos"
    assert native["generation_settings"]["grammar"].startswith("%llguidance")
    assert post(http, "/v1/completions", prompt="Say a", max_tokens=30, grammar=grammar)["choices"][0]["text"] == "aaaaa"
    chat = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=30, grammar=grammar)
    assert chat["choices"][0]["message"]["content"] == "aaaaa"
    assert chat["choices"][0]["finish_reason"] == "stop"
    _, events = post_stream(http, "/completion", {"prompt": "Say a", "n_predict": 30, "grammar": grammar})
    assert "".join(e["content"] for e in events) == "aaaaa"
    assert events[-1]["stop_type"] == "eos"


def test_json_schema_on_the_completion_routes(http):
    for seed in range(3):
        native = post(http, "/completion", prompt="City:", n_predict=300, seed=seed, json_schema=CITY)
        assert native["stop_type"] == "eos"
        valid_city(native["content"])
    _, events = post_stream(http, "/completion", {"prompt": "City:", "n_predict": 300, "seed": 9, "json_schema": CITY})
    valid_city("".join(e["content"] for e in events))
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    body = post(http, "/v1/completions", prompt="City:", max_tokens=300, response_format=rf)
    valid_city(body["choices"][0]["text"])


def test_response_format_json_schema_chat_stream_and_not(http):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=300, seed=1, response_format=rf)
    assert body["choices"][0]["finish_reason"] == "stop"
    valid_city(body["choices"][0]["message"]["content"])
    _, events = post_stream(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 300, "seed": 2, "response_format": rf})
    assert events[-1] == DONE
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    valid_city(text)


def test_json_object_means_any_object(http):
    for rf in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=400, seed=4, response_format=rf)
        choice = body["choices"][0]
        if choice["finish_reason"] == "stop":  # an unbounded object may run out of tokens
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["message"]["content"].lstrip().startswith("{")
    object_schema = {"type": "json_object", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=50, response_format=object_schema)
    assert isinstance(json.loads(body["choices"][0]["message"]["content"])["ok"], bool)


def test_n3_choices_each_follow_the_schema(http):
    rf = {"type": "json_schema", "json_schema": {"schema": CITY}}
    body = post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=300, n=3, seed=5, response_format=rf)
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(texts) == 3
    for text in texts:
        valid_city(text)
    assert len(set(texts)) > 1


def test_eight_concurrent_constrained_requests(http, structured_server):
    rf = {"type": "json_schema", "json_schema": {"schema": CITY}}

    def one(seed: int) -> str:
        with httpx.Client(base_url=structured_server.base_url, timeout=120) as client:
            return post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=300, seed=seed, response_format=rf)["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    for text in texts:
        valid_city(text)


def test_grammar_wins_over_json_schema_on_completion(http):
    body = post(http, "/completion", prompt="x", n_predict=20, grammar='root ::= "yes" | "no"', json_schema=CITY)
    assert body["content"] in ("yes", "no")


def test_unsatisfiable_within_n_predict_ends_on_the_limit(http):
    body = post(http, "/completion", prompt="x", n_predict=6, grammar='root ::= "xy"{100,100}')
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 6
    assert body["content"] and ("xy" * 100).startswith(body["content"])


def test_lazy_grammar_with_a_token_trigger(http):
    tool_open = http.post("/tokenize", json={"content": "<tool_call>"}).json()["tokens"]
    assert len(tool_open) == 1
    body = post(
        http,
        "/completion",
        prompt="x",
        n_predict=40,
        grammar='root ::= "<tool_call>" [0-9]{3} "!"',
        grammar_lazy=True,
        grammar_triggers=[{"type": 1, "value": "<tool_call>"}],
        preserved_tokens=["<tool_call>"],
        logit_bias=[[tool_open[0], 40]],
    )
    assert body["generation_settings"]["grammar_triggers"] == [{"type": 0, "value": "<tool_call>", "token": tool_open[0]}]
    assert re.search(r"<tool_call>[0-9]{3}!$", body["content"]) and body["stop_type"] == "eos"


def test_constrained_requests_hit_the_prompt_cache(http):
    body = {"prompt": "A long enough prompt to be cached by the server: " * 4, "n_predict": 200, "temperature": 0, "json_schema": CITY}
    cold = post(http, "/completion", **body, cache_prompt=False)
    first = post(http, "/completion", **body)
    warm = post(http, "/completion", **body)
    assert warm["timings"]["cache_n"] == warm["tokens_evaluated"] - 1 > 0
    assert warm["content"] == first["content"] == cold["content"]
    valid_city(warm["content"])


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "extra", "message"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, 'response_format type must be one of "text", "json_object" or "json_schema", but got: yaml'),
        ("/v1/chat/completions", {"json_schema": CITY, "grammar": 'root ::= "x"'}, "Cannot use both json_schema and grammar"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "grammar": 'root ::= "x"'}, 'Either "json_schema" or "grammar" can be specified'),
        ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "grammar": 'root ::= "x"'}, "Cannot use custom grammar constraints with tools."),
        ("/completion", {"grammar": 'root ::= "x"', "grammar_lazy": True}, "Error: no triggers set for lazy grammar!"),
        ("/completion", {"grammar": "root ::= undefined"}, "Failed to parse grammar: Rule 'undefined' not found"),
        ("/completion", {"json_schema": {"type": "object", "properties": {"a": {"type": "imaginary"}}}}, '"json_schema": Invalid type: imaginary'),
        ("/completion", {"json_schema": {"type": "object", "not": {"required": ["a"]}}}, '"json_schema": Unimplemented keys: ["not"]'),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/gone"}}}}, "Pointer '/$defs/gone' does not exist"),
        ("/completion", {"grammar": 'root ::= "x"', "grammar_lazy": True, "grammar_triggers": [{"type": 9, "value": "x"}]}, "Unknown grammar trigger type"),
        ("/completion", {"grammar": 'root ::= "x"', "grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": "<tool_call>"}]}, "Grammar trigger word should be marked as preserved token: <tool_call>"),
        ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice names the function 'nope'"),
    ],
)
def test_errors(http, path, extra, message):
    body = {"prompt": "x", "n_predict": 4} if path == "/completion" else {"messages": MESSAGES, "max_tokens": 4}
    response = http.post(path, json={**body, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert message in error["message"]
    assert_serving(http)


# ---------------------------------------------------------------------- OpenAI SDK


class City(BaseModel):
    name: str = Field(max_length=10)
    country: str = Field(pattern="^[A-Z]{2}$")
    population: int = Field(ge=0, le=1000000)
    coastal: bool


def test_openai_sdk_parse_with_a_pydantic_model(structured_server):
    client = openai.OpenAI(base_url=structured_server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=City, max_tokens=300, seed=3)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City)
    assert re.fullmatch("[A-Z]{2}", city.country) and 0 <= city.population <= 1000000


# ---------------------------------------------------------------------- tool calls per family


@pytest.fixture(scope="module")
def family_servers(server_factory, structured_server) -> dict[str, ServerProcess]:
    """One server per factory family, all started at once (they load in parallel); the tiny llama's
    is the module's own server, already running."""
    return {family: structured_server if family == "llama" else
            server_factory(["-m", str(tiny_model(family)), "-np", "2", "-c", "2048", "-b", "64"], wait=False)
            for family in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, family_servers) -> ServerProcess:
    server = family_servers[request.param]
    server.wait_healthy()
    return server


def assert_valid_calls(calls: list[dict[str, Any]], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        function = call["function"]
        assert function["name"] in allowed
        jsonschema.validate(json.loads(function["arguments"]), TOOLS[function["name"]]["function"]["parameters"])


def test_required_tool_call_parses_and_validates(family_server):
    client = openai.OpenAI(base_url=family_server.base_url + "/v1", api_key="unused", max_retries=0)
    for seed in range(2):
        response = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = [c.model_dump() for c in choice.message.tool_calls]
        assert len(calls) == 1
        assert_valid_calls(calls, set(TOOLS))
    named = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=400,
        seed=0,
    )
    assert_valid_calls([c.model_dump() for c in named.choices[0].message.tool_calls], {"get_time"})


def test_required_tool_call_streams_as_tool_call_deltas(http):
    _, events = post_stream(
        http,
        "/v1/chat/completions",
        # A fixed seed: unseeded sampling on a random-weight model occasionally pads a call (bounded
        # whitespace, multi-byte characters) past any small budget; 50 seeds run in test_engine_grammar.
        {"messages": MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 400, "seed": 11},
    )
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    pieces = [tc for d in deltas for tc in d.get("tool_calls") or []]
    # OpenAI's stream shape: a call's first delta names it, the next ones carry its arguments.
    calls: dict[int, dict] = {}
    for piece in pieces:
        if piece["index"] not in calls:
            assert piece["id"] and piece["type"] == "function" and piece["function"]["name"]
            calls[piece["index"]] = {"id": piece["id"], "type": "function", "function": dict(piece["function"])}
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    assert len(pieces) > len(calls)  # the arguments came in increments
    assert_valid_calls(list(calls.values()), set(TOOLS))
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_call_is_constrained_once_opened(http):
    tool_open = http.post("/tokenize", json={"content": "<tool_call>"}).json()["tokens"][0]
    body = post(
        http,
        "/v1/chat/completions",
        messages=MESSAGES,
        tools=[WEATHER_TOOL, TIME_TOOL],
        parallel_tool_calls=False,
        max_tokens=400,
        seed=11,  # fixed, as above
        logit_bias={str(tool_open): 40},  # make the model open a call; the grammar does the rest
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert_valid_calls(choice["message"]["tool_calls"], set(TOOLS))


def test_auto_without_a_call_stays_free_text(http):
    body = post(http, "/v1/chat/completions", messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=12, seed=1)
    assert body["choices"][0]["message"]["content"]  # random text: no call was opened, nothing forced


# ---------------------------------------------------------------------- server-wide defaults


def test_server_wide_json_schema_applies_to_requests_without_their_own(server_factory, llama_dir, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(CITY))
    server = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "2048", "-jf", str(schema_file)])
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        valid_city(post(client, "/completion", prompt="x", n_predict=300)["content"])
        valid_city(post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=300)["choices"][0]["message"]["content"])
        assert post(client, "/completion", prompt="x", n_predict=20, grammar='root ::= "own"')["content"] == "own"


def test_invalid_server_wide_schema_stops_start_up(server_factory, llama_dir):
    server = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "512", "--json-schema", '{"not": {}}'], wait=False)
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.proc.poll() is not None, "the server kept running with an invalid --json-schema"
    assert '--json-schema: Unimplemented keys: ["not"]' in server.log()
