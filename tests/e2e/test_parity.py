"""End to end: llama-server behaviours of issue 12, against live servers.

Per-slot context, aliases and tags, built-in templates by name, assistant prefill with typed
parts, CORS header names as sent on the wire, sleep mode, the web-UI and Vertex AI routes, the
request fields t_max_predict_ms / n_indent / mirostat / reasoning budget, and the /props and
/slots shapes. Expected values follow llama-server's code (see each test).
"""

from __future__ import annotations

import re
import socket
import time
from typing import Iterator

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, free_port

pytestmark = pytest.mark.e2e


def client_for(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


@pytest.fixture(scope="module")
def split_server(server_factory, llama_dir) -> Iterator[ServerProcess]:
    """-c 512 -np 2: two slots of 256 tokens (llama.cpp splits the context among the slots)."""
    srv = server_factory(["-m", str(llama_dir), "-c", "512", "-np", "2", "--alias", "tiny-b,tiny-a,zz", "--tags", "t2,t1",
                          "--chat-template", "command-r"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def unified_server(server_factory, llama_dir) -> Iterator[ServerProcess]:
    srv = server_factory(["-m", str(llama_dir), "-c", "512", "-np", "2", "--kv-unified", "--no-ui", "--mirostat", "2",
                          "--sleep-idle-seconds", "1", "--adaptive-target", "0.4", "--adaptive-decay", "0.5"])
    yield srv
    srv.stop()


def long_prompt(client: httpx.Client, more_than: int) -> tuple[str, int]:
    prompt = "hello world " * (more_than // 2 + 10)
    n = len(client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"])
    assert n > more_than
    return prompt, n


# ---------------------------------------------------------------------- per-slot context


def test_context_is_split_among_slots(split_server) -> None:
    with client_for(split_server) as client:
        assert [s["n_ctx"] for s in client.get("/slots").json()] == [256, 256]
        assert client.get("/props").json()["default_generation_settings"]["n_ctx"] == 256
        assert client.get("/v1/models").json()["data"][0]["meta"]["n_ctx"] == 256
        prompt, n = long_prompt(client, 256)
        for path, body in [
            ("/completion", {"prompt": prompt}),
            ("/completion", {"prompt": prompt, "cache_prompt": False}),
            ("/completion", {"prompt": prompt, "stream": True, "cache_prompt": False}),
            ("/v1/completions", {"prompt": prompt, "cache_prompt": False}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "cache_prompt": False}),
        ]:
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 256
            assert error["n_prompt_tokens"] >= n - 1
        fits = client.post("/completion", json={"prompt": "hello world " * 50, "n_predict": 2, "cache_prompt": False})
        assert fits.status_code == 200


def test_kv_unified_gives_every_slot_the_whole_context(unified_server) -> None:
    with client_for(unified_server) as client:
        assert [s["n_ctx"] for s in client.get("/slots").json()] == [512, 512]
        assert client.get("/props").json()["default_generation_settings"]["n_ctx"] == 512
        prompt = "hello world " * 75  # about 300 tokens: over a split slot, within a unified one
        response = client.post("/completion", json={"prompt": prompt, "n_predict": 1, "cache_prompt": False})
        assert response.status_code == 200, response.text
        assert response.json()["tokens_evaluated"] > 256


# ---------------------------------------------------------------------- aliases and tags


def test_aliases_and_tags(split_server) -> None:
    with client_for(split_server) as client:
        body = client.get("/v1/models").json()
        assert client.get("/models").json() == body
    entry = body["data"][0]
    assert entry["id"] == "tiny-a"  # the first alias in sorted order
    assert entry["aliases"] == ["tiny-a", "tiny-b", "zz"]
    assert entry["tags"] == ["t1", "t2"]
    assert body["models"][0]["name"] == "tiny-a"
    oai = openai.OpenAI(base_url=split_server.base_url + "/v1", api_key="none")
    for alias in entry["aliases"]:
        reply = oai.chat.completions.create(model=alias, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.model == "tiny-a"
        assert reply.usage.completion_tokens == 2


# ---------------------------------------------------------------------- built-in templates and prefill


def test_builtin_template_by_name(split_server) -> None:
    messages = [
        {"role": "system", "content": "You are a bot."},
        {"role": "user", "content": " Hello "},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Why?"},
    ]
    with client_for(split_server) as client:
        prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        props = client.get("/props").json()
    assert prompt == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a bot.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Why?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )
    assert props["chat_template"] == "command-r"
    assert props["chat_template_caps"]["supports_system_role"] is True


def test_assistant_prefill_with_typed_parts(split_server) -> None:
    messages = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]},
    ]
    with client_for(split_server) as client:
        prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        reply = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert prompt.endswith("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Wh\n\nill")
    assert reply.status_code == 200, reply.text


# ---------------------------------------------------------------------- CORS, on the wire


def raw_request(port: int, request: str) -> tuple[str, list[tuple[str, str]], bytes]:
    """Send ``request`` on a raw socket; return the status line, the header lines as sent, the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request.encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = [tuple(line.split(": ", 1)) for line in lines[1:]]
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        while len(body) < length:
            body += sock.recv(65536)
    return lines[0], headers, body  # type: ignore[return-value]


@pytest.mark.parametrize("path", ["/completions", "/v1/chat/completions"])
def test_cors_preflight_header_names_and_values(split_server, path: str) -> None:
    """llama-server sends --cors-headers as configured, ``*`` by default, whatever the preflight
    asks for; browser apps written against it expect that literal ``*``."""
    status, headers, body = raw_request(
        split_server.port,
        f"OPTIONS {path} HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n"
        "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: Authorization, Content-Type, X-Custom\r\n"
        "Connection: close\r\n\r\n",
    )
    assert status.startswith("HTTP/1.1 200")
    sent = dict(headers)
    assert sent["Access-Control-Allow-Origin"] == "http://app.example"
    assert sent["Access-Control-Allow-Credentials"] == "true"
    assert sent["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert sent["Access-Control-Allow-Headers"] == "*"
    assert sent["Content-Type"] == "text/html"
    assert sent["Server"] == "llama.cpp"
    assert body == b""


@pytest.fixture(scope="module")
def cors_server(server_factory, llama_dir) -> Iterator[ServerProcess]:
    yield server_factory(["-m", str(llama_dir), "-c", "256", "-np", "1", "--no-cors-credentials",
                          "--cors-headers", "Authorization,Content-Type", "--cors-methods", "GET,POST"])


def test_cors_settings_go_out_as_configured(cors_server) -> None:
    """--cors-methods and --cors-headers verbatim; origins ``*`` without credentials is ``*``."""
    status, headers, _ = raw_request(
        cors_server.port,
        "OPTIONS /completions HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n"
        "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: X-Other\r\nConnection: close\r\n\r\n",
    )
    sent = dict(headers)
    assert status.startswith("HTTP/1.1 200")
    assert sent["Access-Control-Allow-Origin"] == "*"
    assert sent["Access-Control-Allow-Credentials"] == "false"
    assert sent["Access-Control-Allow-Methods"] == "GET,POST"
    assert sent["Access-Control-Allow-Headers"] == "Authorization,Content-Type"
    status, headers, _ = raw_request(cors_server.port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert dict(headers)["Access-Control-Allow-Origin"] == "*"


def test_cors_response_header_names(split_server) -> None:
    status, headers, body = raw_request(
        split_server.port, "GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\nConnection: close\r\n\r\n"
    )
    assert status.startswith("HTTP/1.1 200") and b'"ok"' in body
    names = [k for k, _ in headers]
    assert "Access-Control-Allow-Origin" in names and "access-control-allow-origin" not in names
    assert dict(headers)["Access-Control-Allow-Origin"] == "http://app.example"


# ---------------------------------------------------------------------- web UI routes


def test_tools_and_cors_proxy_are_forbidden(split_server) -> None:
    with client_for(split_server) as client:
        for method, path in [("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"), ("POST", "/cors-proxy")]:
            response = client.request(method, path)
            assert response.status_code == 403, path
            assert response.json() == {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}


def test_chat_page_and_no_ui(split_server, unified_server) -> None:
    with client_for(split_server) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="ui/main.js">' in page.text and "content-security-policy" in page.headers
        assert client.get("/ui/main.js").status_code == 200
        assert client.get("/props").json()["ui"] is True
    with client_for(unified_server) as client:
        for path in ("/", "/index.html", "/ui/main.js"):
            assert client.get(path).status_code == 404, path
        assert client.get("/props").json()["ui"] is False


def test_vertex_ai_predict(llama_dir, tmp_path) -> None:
    port = free_port()
    srv = ServerProcess(args=["-m", str(llama_dir), "-np", "2"], env={"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port),
                                                                        "AIP_HEALTH_ROUTE": "healthz"}, port=port)
    srv.start(tmp_path)  # AIP_HTTP_PORT, not --port, decides where it listens
    try:
        with client_for(srv) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            body = {
                "instances": [
                    {"@requestFormat": "chatCompletions", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
                    {"@requestFormat": "/completion", "prompt": "Hello", "n_predict": 3},
                    {"@requestFormat": "tokenize", "content": "hello"},
                    {"@requestFormat": "nope"},
                    {"messages": []},
                ]
            }
            response = client.post("/predict", json=body)
            assert response.status_code == 200, response.text
            chat, completion, tokens, unknown, missing = response.json()["predictions"]
            assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 2
            assert completion["tokens_predicted"] == 3
            assert tokens["tokens"] == client.post("/tokenize", json={"content": "hello"}).json()["tokens"]
            assert unknown["error"]["message"] == "no handler registered for @requestFormat: nope"
            assert missing["error"]["type"] == "invalid_request_error"
            assert client.post("/predict", json={"instances": [{}] * 129}).status_code == 400
            assert client.post("/predict", json={"x": 1}).status_code == 400
    finally:
        srv.stop()


# ---------------------------------------------------------------------- sleep


def test_sleep_unloads_and_the_next_request_reloads(unified_server) -> None:
    with client_for(unified_server) as client:
        deadline = time.monotonic() + 30
        while not client.get("/props").json()["is_sleeping"]:
            assert time.monotonic() < deadline, "never went to sleep"
            time.sleep(0.2)
        assert client.get("/health").status_code == 200
        log = unified_server.log()
        released = re.findall(r"model unloaded, (\d+) bytes of MLX memory released", log)
        assert released and int(released[-1]) > 1_000_000  # the tiny model's weights are ~4.5 MB
        response = client.post("/completion", json={"prompt": "Hello", "n_predict": 3, "ignore_eos": True})
        assert response.status_code == 200 and response.json()["tokens_predicted"] == 3
        assert "woke up: model" in unified_server.log()
        # Right after a request the model is loaded again (the timer restarts).
        assert client.get("/props").json()["is_sleeping"] is False


# ---------------------------------------------------------------------- request fields


def single_token(client: httpx.Client, text: str) -> int:
    tokens = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def test_t_max_predict_ms_stops_at_a_newline(split_server) -> None:
    with client_for(split_server) as client:
        nl = single_token(client, "\n")
        body = {"prompt": "Lines:", "n_predict": 40, "ignore_eos": True, "temperature": 0, "logit_bias": [[nl, 100]]}
        free = client.post("/completion", json=body).json()
        limited = client.post("/completion", json={**body, "t_max_predict_ms": 1}).json()
    assert free["tokens_predicted"] == 40
    assert limited["stop_type"] == "limit" and limited["tokens_predicted"] < 40
    assert limited["content"].endswith("\n")


def test_n_indent_stops_at_an_under_indented_line(split_server) -> None:
    with client_for(split_server) as client:
        nl, word = single_token(client, "\n"), single_token(client, "a")
        body = {"prompt": "def f():", "n_predict": 60, "ignore_eos": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                "min_p": 0.0, "seed": 7, "logit_bias": [[nl, 60], [word, 60]]}
        free = client.post("/completion", json=body).json()
        assert "\na" in free["content"]  # without n_indent, unindented lines are generated
        indented = client.post("/completion", json={**body, "n_indent": 2}).json()
    assert indented["stop_type"] == "limit" and indented["tokens_predicted"] < 60
    assert "\na" not in indented["content"]  # the shallow line is cut from the reply
    assert indented["content"].endswith("\n")
    assert free["content"].startswith(indented["content"])


def test_mirostat_fields(split_server, unified_server) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 8, "ignore_eos": True, "seed": 11, "mirostat": 2,
            "mirostat_tau": 3.0, "mirostat_eta": 0.2}
    with client_for(split_server) as client:
        first = client.post("/completion", json=body).json()
        again = client.post("/completion", json=body).json()
        other = client.post("/completion", json={**body, "mirostat": 1}).json()
        clamped = client.post("/completion", json={**body, "mirostat": 7}).json()
        slot_params = [s["params"] for s in client.get("/slots").json() if "params" in s]
    settings = first["generation_settings"]
    assert (settings["mirostat"], settings["mirostat_tau"], settings["mirostat_eta"]) == (2, 3.0, 0.2)
    assert first["content"] == again["content"]  # seeded
    assert other["generation_settings"]["mirostat"] == 1 and other["tokens_predicted"] == 8
    assert clamped["generation_settings"]["mirostat"] == 2  # soft limit [0, 2]
    assert any(p["mirostat"] in (1, 2) for p in slot_params)
    with client_for(unified_server) as client:  # --mirostat 2 is the server default
        assert client.get("/props").json()["default_generation_settings"]["params"]["mirostat"] == 2


def test_adaptive_p_fields(split_server, unified_server) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 8, "ignore_eos": True, "seed": 5, "top_k": 8,
            "samplers": ["top_k", "temperature", "adaptive_p"], "adaptive_target": 0.3, "adaptive_decay": 0.5}
    with client_for(split_server) as client:
        first = client.post("/completion", json=body).json()
        again = client.post("/completion", json=body).json()
        clamped = client.post("/completion", json={**body, "adaptive_target": 3}).json()
        bad = client.post("/completion", json={**body, "adaptive_decay": 1.5})
        assert client.get("/health").status_code == 200
    settings = first["generation_settings"]
    assert (settings["adaptive_target"], settings["adaptive_decay"]) == (0.3, 0.5)
    assert settings["samplers"] == ["top_k", "temperature", "adaptive_p"]
    assert first["tokens_predicted"] == 8 and first["content"] == again["content"]  # seeded
    assert clamped["generation_settings"]["adaptive_target"] == 1.0  # soft limit <= 1
    assert bad.status_code == 400 and "adaptive_decay" in bad.json()["error"]["message"]
    with client_for(unified_server) as client:  # --adaptive-target / --adaptive-decay are the server defaults
        params = client.get("/props").json()["default_generation_settings"]["params"]
        assert (params["adaptive_target"], params["adaptive_decay"]) == (0.4, 0.5)


def test_reasoning_budget_forces_the_end_tag(split_server) -> None:
    with client_for(split_server) as client:
        end = client.post("/tokenize", json={"content": "</think>"}).json()["tokens"]
        body = {"prompt": "Question? <think>", "n_predict": 12, "ignore_eos": True, "return_tokens": True, "seed": 3}
        for budget in (0, 4):
            out = client.post("/completion", json={**body, "reasoning_budget_tokens": budget}).json()
            assert out["tokens"][budget : budget + len(end)] == end, (budget, out["tokens"])
        message = client.post("/tokenize", json={"content": " Enough.</think>"}).json()["tokens"]
        out = client.post("/completion", json={**body, "reasoning_budget_tokens": 2, "reasoning_budget_message": " Enough."}).json()
        assert out["tokens"][2 : 2 + len(message)] == message
        # Not inside a thinking block: nothing is forced until a start tag is generated.
        plain = client.post("/completion", json={**body, "prompt": "Question?", "reasoning_budget_tokens": 0}).json()
        assert plain["tokens"][: len(end)] != end
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                          "thinking_budget_tokens": 1})
        assert chat.status_code == 200
        bad = client.post("/completion", json={**body, "reasoning_budget_tokens": -2})
        assert bad.status_code == 400


# ---------------------------------------------------------------------- /props and /slots shapes

PROPS_TYPES = {
    "default_generation_settings": dict, "total_slots": int, "model_alias": str, "model_ftype": str, "model_path": str,
    "modalities": dict, "media_marker": str, "endpoint_slots": bool, "endpoint_props": bool, "endpoint_metrics": bool,
    "ui": bool, "ui_settings": dict, "chat_template": str, "chat_template_caps": dict, "bos_token": str, "eos_token": str,
    "build_info": str, "is_sleeping": bool, "cors_proxy_enabled": bool,
}


def test_props_shape(split_server, llama_dir) -> None:
    from mlxcel_compat.compat import load_manifest

    with client_for(split_server) as client:
        props = client.get("/props").json()
    assert list(props) == list(PROPS_TYPES)
    assert [e["key"] for e in load_manifest()["props_fields"] if not e.get("optional")] == list(PROPS_TYPES)
    for key, kind in PROPS_TYPES.items():
        assert isinstance(props[key], kind), key
    assert props["model_path"] == str(llama_dir)
    assert re.fullmatch(r"b\d+-mlxcel_compat-[\w.]+", props["build_info"])
    assert set(props["modalities"]) == {"vision", "video", "audio"}
    assert list(props["default_generation_settings"]) == ["params", "n_ctx"]


def test_slots_shape(split_server) -> None:
    with client_for(split_server) as client:
        client.post("/completion", json={"prompt": "Lines:\n", "n_predict": 3, "id_slot": 1})
        slots = client.get("/slots").json()
    busy = slots[1]
    assert list(busy)[:4] == ["id", "n_ctx", "speculative", "is_processing"]
    for key, kind in [("id_task", int), ("n_prompt_tokens", int), ("n_prompt_tokens_processed", int),
                      ("n_prompt_tokens_cache", int), ("params", dict), ("next_token", list)]:
        assert isinstance(busy[key], kind), key
    token = busy["next_token"][0]
    assert set(token) == {"has_next_token", "has_new_line", "n_remain", "n_decoded"}
    # Idle again: llama-server's reset values (tests/e2e/test_metrics.py has the whole rule).
    assert token["has_new_line"] is False and (token["n_remain"], token["n_decoded"]) == (-1, 0)
    for key in ("mirostat", "mirostat_tau", "mirostat_eta", "samplers", "speculative.types"):
        assert key in busy["params"], key
