"""End to end: error bodies, API keys, the "Loading model" gate and CORS.

Expected values follow llama-server (docs/llama-server-api.md §1, §3.1, §3.2, §6.2). One
deliberate difference: a body that is not JSON is a 400 here (llama-server answers 500).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import pytest

from tests.e2e.helpers import assert_serving

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Hi"}]
INVALID_KEY_BODY = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
LOADING_BODY = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def assert_error(response: httpx.Response, status: int, type_: str, message_part: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert list(error)[:3] == ["code", "message", "type"]
    assert error["code"] == status
    assert error["type"] == type_
    assert message_part in error["message"]
    return error


# ---------------------------------------------------------------------- bad requests


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/apply-template"])
def test_invalid_json_is_400(http, path):
    response = http.post(path, content=b'{"prompt": "Hi",', headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error")
    assert_serving(http)


def test_body_must_be_an_object(http):
    assert_error(http.post("/completion", json=[1, 2, 3]), 400, "invalid_request_error")
    assert_serving(http)


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_missing_prompt_is_400(http, path):
    assert_error(http.post(path, json={"n_predict": 2}), 400, "invalid_request_error", "prompt")
    assert_serving(http)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_predict", "abc"),
        ("temperature", "hot"),
        ("stream", "yes"),
        ("top_k", [1]),
        ("stop", 5),
        ("samplers", 3),
    ],
)
def test_wrong_type_names_the_field(http, field, value):
    error = assert_error(http.post("/completion", json={"prompt": "Hi", field: value}), 400, "invalid_request_error")
    assert error["message"].startswith(f"Field '{field}'")
    assert_serving(http)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repeat_last_n", -2),
        ("n_predict", -5),
        ("n_keep", -2),
        ("dry_allowed_length", -1),
        ("n_cmpl", 3),  # more than the 2 slots
        ("n", 5),
        ("n_cmpl", 0),
    ],
)
def test_out_of_range_hard_limit_is_400(http, field, value):
    error = assert_error(http.post("/completion", json={"prompt": "Hi", "n_predict": 1, field: value}), 400, "invalid_request_error")
    assert "Value must be between" in error["message"]
    assert f"but got {value}" in error["message"]
    assert_serving(http)


def test_soft_limit_is_clamped(http):
    response = http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "top_p": 7, "temperature": -3})
    assert response.status_code == 200
    settings = response.json()["generation_settings"]
    assert settings["top_p"] == 1.0
    assert settings["temperature"] == 0.0


def test_empty_dry_sequence_breakers_is_400(http):
    assert_error(http.post("/completion", json={"prompt": "Hi", "dry_sequence_breakers": []}), 400, "invalid_request_error", "dry_sequence_breakers")
    assert_serving(http)


def test_null_field_means_default(http):
    response = http.post("/completion", json={"prompt": "Hi", "n_predict": 2, "ignore_eos": True, "temperature": None, "stop": None})
    assert response.status_code == 200
    assert response.json()["generation_settings"]["temperature"] == pytest.approx(0.8)
    assert response.json()["tokens_predicted"] == 2


def test_unknown_fields_are_ignored(http):
    response = http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "frobnicate": {"x": 1}})
    assert response.status_code == 200


def test_lora_without_adapters_is_read_as_llama_server_reads_it(http):
    # No adapter is loaded: ids out of range are ignored (construct_lora_list), a non-array is a 400.
    base = http.post("/completion", json={"prompt": "Hi", "n_predict": 3, "temperature": 0})
    ignored = http.post("/completion", json={"prompt": "Hi", "n_predict": 3, "temperature": 0, "lora": [{"id": 0, "scale": 1.0}]})
    assert ignored.status_code == 200 and ignored.json()["content"] == base.json()["content"]
    assert ignored.json()["generation_settings"]["lora"] == []
    assert_error(http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "lora": {"id": 0}}), 400, "invalid_request_error", "lora")
    assert_serving(http)


def test_neutral_values_of_unsupported_features_pass(http):
    response = http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "grammar": "", "lora": [], "json_schema": None})
    assert response.status_code == 200


@pytest.mark.parametrize("response_format", [{"type": "yaml"}, "json"])
def test_response_format_of_an_unknown_type_is_400(http, response_format):
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "response_format": response_format})
    assert_error(response, 400, "invalid_request_error", "response_format type must be one of")
    assert_serving(http)


def test_response_format_text_is_accepted(http):
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "response_format": {"type": "text"}})
    assert response.status_code == 200


@pytest.mark.parametrize("prompt", [[999999], [-1], ["Hi", 10**7], [[1, 2], [5, -3]]])
def test_invalid_token_ids_are_400(http, prompt):
    assert_error(http.post("/completion", json={"prompt": prompt}), 400, "invalid_request_error", "Prompt contains invalid tokens")
    assert_serving(http)


@pytest.mark.parametrize("prompt", [True, 12.5, [True], [{"a": 1}]])
def test_malformed_prompt_is_400(http, prompt):
    assert_error(http.post("/completion", json={"prompt": prompt}), 400, "invalid_request_error")
    assert_serving(http)


def test_bad_parameter_on_a_stream_is_a_plain_json_error(http):
    response = http.post("/completion", json={"prompt": "Hi", "stream": True, "n_predict": "abc"})
    assert_error(response, 400, "invalid_request_error", "n_predict")
    assert not response.headers["content-type"].startswith("text/event-stream")
    assert_serving(http)


@pytest.mark.parametrize("body", [{}, {"messages": "Hi"}, {"messages": {"role": "user"}}, {"messages": [{"role": "user"}]}])
def test_bad_messages_are_400(http, body):
    assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error")
    assert_serving(http)


def test_top_logprobs_without_logprobs_is_400(http):
    assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 3}), 400, "invalid_request_error")
    assert_serving(http)


@pytest.mark.parametrize(("method", "path"), [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/completion"), ("DELETE", "/health")])
def test_unknown_route_is_404_with_llama_body(http, method, path):
    response = http.request(method, path)
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("application/json")
    assert response.text == '{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
    assert_serving(http)


# ---------------------------------------------------------------------- context size


def test_prompt_longer_than_context_is_rejected(small_server):
    prompt = "hello world " * 100
    with httpx.Client(base_url=small_server.base_url, timeout=60) as client:
        n_tokens = len(client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"])
        assert n_tokens > 256
        for path, body in [
            ("/completion", {"prompt": prompt}),
            ("/completion", {"prompt": prompt, "stream": True}),
            ("/v1/completions", {"prompt": prompt}),
        ]:
            error = assert_error(client.post(path, json=body), 400, "exceed_context_size_error")
            assert error["message"] == f"request ({n_tokens} tokens) exceeds the available context size (256 tokens), try increasing it"
            assert error["n_prompt_tokens"] == n_tokens
            assert error["n_ctx"] == 256  # -c 128 is padded to 256, as llama.cpp pads it
        assert_serving(client)


def test_chat_longer_than_context_is_rejected(small_server):
    messages = [{"role": "user", "content": "hello world " * 150}]
    with httpx.Client(base_url=small_server.base_url, timeout=60) as client:
        for stream in (False, True):
            error = assert_error(client.post("/v1/chat/completions", json={"messages": messages, "stream": stream}), 400, "exceed_context_size_error")
            assert error["n_ctx"] == 256
            assert error["n_prompt_tokens"] > 256
        assert_serving(client)


def test_prompt_of_exactly_the_context_is_rejected(small_server):
    with httpx.Client(base_url=small_server.base_url, timeout=60) as client:
        token = client.post("/tokenize", json={"content": " hello"}).json()["tokens"][0]
        error = assert_error(client.post("/completion", json={"prompt": [token] * 256}), 400, "exceed_context_size_error")
        assert error["n_prompt_tokens"] == 256
        fits = client.post("/completion", json={"prompt": [token] * 200, "n_predict": 2, "ignore_eos": True})
        assert fits.status_code == 200


def test_generation_stops_when_the_context_is_full(small_server):
    # Context shift is off by default: generation ends with "limit" and truncated once the prompt
    # and the generated tokens fill the slot (llama-server: 8 prompt tokens, n_ctx 256 -> 248).
    with httpx.Client(base_url=small_server.base_url, timeout=60) as client:
        body = client.post("/completion", json={"prompt": "Hello", "n_predict": -1, "ignore_eos": True}).json()
    assert body["stop_type"] == "limit"
    assert body["truncated"] is True
    assert body["tokens_predicted"] == 256 - body["tokens_evaluated"]


# ---------------------------------------------------------------------- API keys


@pytest.fixture(scope="module")
def key_server(server_factory, llama_dir) -> Iterator:
    srv = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "512", "--metrics", "--api-key", "k1,k2"])
    yield srv
    srv.stop()


@pytest.mark.parametrize("path", ["/props", "/slots", "/metrics", "/models", "/v1/models"])
def test_no_key_is_401(key_server, path):
    response = httpx.get(key_server.base_url + path)
    assert response.status_code == 401
    assert response.json() == INVALID_KEY_BODY
    assert list(response.json()["error"]) == ["message", "type", "code"]


def test_wrong_key_is_401(key_server):
    response = httpx.post(key_server.base_url + "/completion", json={"prompt": "Hi", "n_predict": 1}, headers={"Authorization": "Bearer k3"})
    assert response.status_code == 401
    assert response.json() == INVALID_KEY_BODY


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": "Bearer k2"}, {"Authorization": "Bearer k1"}, {"X-Api-Key": "k1"}, {"Authorization": "k2"}],
)
def test_valid_key_forms(key_server, headers):
    response = httpx.post(key_server.base_url + "/completion", json={"prompt": "Hi", "n_predict": 1}, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["tokens_predicted"] == 1


@pytest.mark.parametrize("path", ["/props", "/slots", "/metrics", "/models", "/v1/models"])
def test_protected_paths_open_with_a_key(key_server, path):
    assert httpx.get(key_server.base_url + path, headers={"Authorization": "Bearer k1"}).status_code == 200


def test_cache_admin_routes_need_the_key(key_server):
    base = key_server.base_url
    assert httpx.get(base + "/v1/cache/stats").status_code == 401
    assert httpx.post(base + "/v1/cache/reset").status_code == 401
    auth = {"Authorization": "Bearer k2"}
    assert httpx.get(base + "/v1/cache/stats", headers=auth).json()["enabled"] is True
    assert httpx.post(base + "/v1/cache/reset", headers=auth).json()["success"] is True


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/", "/index.html", "/ui/main.js", "/ui/vendor/marked.esm.js"])
def test_public_paths_need_no_key(key_server, path):
    assert httpx.get(key_server.base_url + path).status_code == 200


def test_preflight_needs_no_key(key_server):
    response = httpx.options(
        key_server.base_url + "/completion", headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    )
    assert response.status_code == 200


@dataclass
class Observed:
    """What a client polling a starting server saw before it became healthy."""

    server: Any  # conftest.ServerProcess
    health: list[tuple[int, Any]] = field(default_factory=list)
    raw_health: list[tuple[int, str]] = field(default_factory=list)
    props_without_key: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def keyfile_server(server_factory, llama_dir, tmp_path_factory) -> Iterator[Observed]:
    """Keys from a file and from LLAMA_API_KEY; polled from the moment the process starts."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# a comment line\n\nfile-key\nsecond-file-key\n")
    srv = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "512", "--api-key-file", str(key_file)], env={"LLAMA_API_KEY": "env-key"}, wait=False)
    seen = Observed(srv)
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=srv.base_url, timeout=5) as client:
        while time.monotonic() < deadline:
            assert srv.proc is not None and srv.proc.poll() is None, srv.log()
            try:
                health = client.get("/health")
                props = client.get("/props")
            except httpx.TransportError:
                time.sleep(0.01)  # not listening yet
                continue
            seen.health.append((health.status_code, health.json()))
            seen.raw_health.append((health.status_code, health.text))
            seen.props_without_key.append(props.status_code)
            if health.status_code == 200:
                break
    yield seen
    srv.stop()


def test_loading_model_is_503_before_healthy(keyfile_server):
    statuses = [status for status, _ in keyfile_server.health]
    assert statuses[-1] == 200
    assert 503 in statuses
    first_ok = statuses.index(200)
    assert set(statuses[:first_ok]) == {503}
    for status, body in keyfile_server.health[:first_ok]:
        assert body == LOADING_BODY


def test_loading_check_comes_before_the_key_check(keyfile_server):
    # While loading, a protected path without a key answers 503, not 401.
    assert 503 in keyfile_server.props_without_key
    assert set(keyfile_server.props_without_key) <= {503, 401}


def test_loading_body_is_exact_json(keyfile_server):
    raw = [text for status, text in keyfile_server.raw_health if status == 503]
    assert raw
    assert set(raw) == {'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'}


@pytest.mark.parametrize("key", ["file-key", "second-file-key", "env-key"])
def test_keys_from_file_and_env(keyfile_server, key):
    url = keyfile_server.server.base_url
    response = httpx.post(url + "/completion", json={"prompt": "Hi", "n_predict": 1}, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def test_comment_lines_are_not_keys(keyfile_server):
    url = keyfile_server.server.base_url
    response = httpx.get(url + "/props", headers={"Authorization": "# a comment line"})
    assert response.status_code == 401
    assert httpx.get(url + "/props").status_code == 401


# ---------------------------------------------------------------------- CORS


def test_cors_echoes_the_origin(http):
    response = http.get("/health", headers={"Origin": "http://my-ui.example"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://my-ui.example"
    assert response.headers["access-control-allow-credentials"] == "true"


def test_cors_preflight(http):
    response = http.options(
        "/v1/chat/completions",
        headers={"Origin": "http://my-ui.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"},
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://my-ui.example"
    assert response.headers["access-control-allow-credentials"] == "true"
    methods = [m.strip() for m in response.headers["access-control-allow-methods"].split(",")]
    assert methods == ["GET", "POST", "DELETE", "OPTIONS"]
    assert response.headers["access-control-allow-headers"] == "*"  # llama-server's default, as is


def test_every_response_carries_the_llama_server_header(http):
    responses = [
        http.get("/health"),
        http.get("/nope"),
        http.post("/completion", json={}),
        http.options("/completion", headers={"Origin": "http://my-ui.example", "Access-Control-Request-Method": "POST"}),
    ]
    for response in responses:
        assert response.headers.get_list("server") == ["llama.cpp"], (response.request.method, response.request.url)


def test_server_exits_with_usage_error_on_unknown_flag():
    result = subprocess.run([sys.executable, "-m", "mlxcel_compat", "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--no-such-flag" in result.stderr
