"""The server as a router's worker: /health, /get_load, /get_server_info, /get_model_info,
/flush_cache, the session headers routers hash on, and the default fields routers add to bodies.

The bodies in ROUTER_* are what vllm-router 0.1.17 forwarded to a worker for a plain client body
(captured from the router on loopback): the defaults it adds must change nothing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import ServerProcess

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short."
)
# What vllm-router adds to a chat and to a completions body (and keeps every other field).
ROUTER_CHAT_DEFAULTS = {
    "stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
    "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION_DEFAULTS = {
    "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}


@pytest.fixture(scope="module")
def worker(server_factory, llama_dir: Path) -> ServerProcess:
    return server_factory(["-m", str(llama_dir), "-np", "2", "-c", "4096", "-b", "64", "--metrics",
                           "--prompt-cache-min-prefix", "16"])


@pytest.fixture()
def http(worker: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=worker.base_url, timeout=60) as c:
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def test_get_load_idle(http) -> None:
    assert http.get("/get_load").json() == {"load": 0, "running": 0, "waiting": 0, "total_slots": 2, "is_sleeping": False}


def test_get_load_counts_busy_slots_and_the_queue(worker, http) -> None:
    """Three long generations on two slots: two run, one waits; all three are load."""
    stop = threading.Event()
    started = threading.Barrier(4)

    def generate(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "n_predict": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=worker.base_url, timeout=60) as c, c.stream("POST", "/completion", json=body) as r:
            started.wait()
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream cancels the generation

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=30)
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen.append(http.get("/get_load").json())
            if seen[-1]["running"] == 2 and seen[-1]["waiting"] == 1:
                break
            time.sleep(0.01)
        assert seen[-1] == {"load": 3, "running": 2, "waiting": 1, "total_slots": 2, "is_sleeping": False}, seen[-5:]
        assert "\nllamacpp:requests_processing 2\n" in http.get("/metrics").text  # printed as C++ prints it
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    deadline = time.monotonic() + 10
    while http.get("/get_load").json()["load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/get_load").json()["load"] == 0


def test_server_and_model_info_agree_with_props_and_models(http) -> None:
    props = http.get("/props").json()
    model = http.get("/v1/models").json()["data"][0]
    info = http.get("/get_server_info").json()
    assert info["served_model_name"] == model["id"] == props["model_alias"]
    assert info["model_path"] == props["model_path"]
    assert info["n_ctx"] == props["default_generation_settings"]["n_ctx"] == model["meta"]["n_ctx"]
    assert info["total_slots"] == props["total_slots"] == 2
    assert info["version"] == props["build_info"]
    assert info["load"]["total_slots"] == 2
    cache = info["prompt_cache"]
    assert cache["enabled"] is True and cache["capacity_bytes"] > 0 and cache["max_entries"] == 1024
    assert cache["session_headers"][0] == "x-session-id" and "x-user-id" in cache["session_headers"]
    m = http.get("/get_model_info").json()
    assert m["model_path"] == m["tokenizer_path"] == props["model_path"]
    assert m["is_generation"] is True
    assert m["served_model_name"] == model["id"]
    assert (m["vocab_size"], m["n_ctx_train"], m["n_params"]) == (model["meta"]["n_vocab"], model["meta"]["n_ctx_train"], model["meta"]["n_params"])


def test_flush_cache_empties_the_prompt_cache(http) -> None:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}], "max_tokens": 2}
    http.post("/v1/chat/completions", json=body).raise_for_status()
    assert http.get("/v1/cache/stats").json()["entries"] >= 1
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["success"] is True
    assert flushed.json()["cleared_entries"] >= 1
    assert http.get("/v1/cache/stats").json()["entries"] == 0


def _stage_hits(http: httpx.Client) -> dict[str, int]:
    return http.get("/v1/cache/stats").json()["hits_by_stage"]


def test_x_user_id_names_the_session_and_per_request_ids_do_not(http) -> None:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}],
            "max_tokens": 2, "temperature": 0}

    def send(headers: dict[str, str]) -> dict[str, int]:
        http.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()
        return _stage_hits(http)

    send({"X-User-ID": "reader-a"})
    s0 = _stage_hits(http)
    s1 = send({"X-User-ID": "reader-b"})  # another session stored it: a cross-session hit
    assert s1["cross_session"] == s0["cross_session"] + 1
    s2 = send({"X-User-ID": "reader-b"})  # reader-b's own entry now
    assert s2["session"] == s1["session"] + 1
    # X-Session-ID outranks X-User-ID: a new session although the user is reader-b.
    s3 = send({"X-User-ID": "reader-b", "X-Session-ID": "conversation-9"})
    assert s3["cross_session"] == s2["cross_session"] + 1
    # A per-request id (vllm-router hashes it when nothing else is given) names no session: the
    # request is anonymous, and anonymous has not stored this prompt yet.
    s4 = send({"X-Request-ID": "reader-b"})
    assert s4["cross_session"] == s3["cross_session"] + 1


def test_router_default_fields_change_nothing(http) -> None:
    chat = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 8, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=chat).json()
    routed = http.post("/v1/chat/completions", json={**chat, **ROUTER_CHAT_DEFAULTS}).json()
    assert routed["choices"][0]["message"] == plain["choices"][0]["message"]
    assert routed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 8
    completion = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    plain = http.post("/v1/completions", json=completion).json()
    routed = http.post("/v1/completions", json={**completion, **ROUTER_COMPLETION_DEFAULTS}).json()
    assert routed["choices"][0]["text"] == plain["choices"][0]["text"]
    # max_completion_tokens (what OpenAI's newer clients send) limits the reply like max_tokens.
    short = http.post("/v1/chat/completions", json={**chat, "max_tokens": None, "max_completion_tokens": 3}).json()
    assert short["usage"]["completion_tokens"] == 3


def test_separate_reasoning_false_keeps_thinking_in_content(http) -> None:
    think_end = 8191  # </think> in the generated tokenizer (see mlxcel_compat.testing.tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {str(think_end): 100}}
    separated = http.post("/v1/chat/completions", json={**body, "separate_reasoning": True}).json()["choices"][0]["message"]
    inline = http.post("/v1/chat/completions", json={**body, "separate_reasoning": False}).json()["choices"][0]["message"]
    explicit = http.post("/v1/chat/completions", json={**body, "separate_reasoning": False, "reasoning_format": "deepseek"}).json()
    assert "</think>" not in separated["content"]
    assert inline["content"] == "</think>" and "reasoning_content" not in inline
    assert "</think>" not in explicit["choices"][0]["message"]["content"]  # an explicit format wins


def test_get_load_is_public_but_info_needs_the_key(server_factory, llama_dir) -> None:
    srv = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "512", "--api-key", "k1"])
    try:
        assert httpx.get(srv.base_url + "/get_load").json()["total_slots"] == 1
        for path in ("/get_server_info", "/get_model_info"):
            assert httpx.get(srv.base_url + path).status_code == 401
            assert httpx.get(srv.base_url + path, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert httpx.post(srv.base_url + "/flush_cache").status_code == 401
    finally:
        srv.stop()


def test_health_is_503_once_the_engine_thread_stops(llama_dir) -> None:
    """In process: the same app and engine the server runs; stopping the engine fails /health."""
    from starlette.testclient import TestClient

    from mlxcel_compat.server.instance import build_server
    from mlxcel_compat.server.app import model_info
    from mlxcel_compat.settings import resolve_settings

    settings = resolve_settings(["-m", str(llama_dir), "-c", "512"], {})
    app = build_server(settings, str(llama_dir), [])
    ctx = app.state.ctx
    ctx.engine.start()
    assert ctx.engine.wait_ready(60)
    ctx.model = model_info(ctx.engine, ctx.settings)  # what start-up does once the engine is ready
    client = TestClient(app)  # outside a `with`: no lifespan, the engine is managed here
    try:
        assert client.get("/health").json() == {"status": "ok"}
        ctx.engine.stop()
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["error"] == {"code": 503, "message": "Engine stopped", "type": "unavailable_error"}
        assert client.get("/get_load").status_code == 200  # still answers: a router sees load 0 and health 503
    finally:
        ctx.engine.stop()
