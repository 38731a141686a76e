"""End to end: the small routes (health, props, models, slots, tokenize, templates, metrics),
settings read from the environment, and cancellation when a client goes away.

Expected values follow llama-server (docs/llama-server-api.md §1, §2, §7.3, §8, §9, §10, §11.1).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest

from tests.e2e.helpers import metric, wait_idle

pytestmark = pytest.mark.e2e

JSON_TYPE = "application/json; charset=utf-8"
LLAMACPP_FAMILIES = [
    ("prompt_tokens_total", "counter"),
    ("prompt_seconds_total", "counter"),
    ("tokens_predicted_total", "counter"),
    ("tokens_predicted_seconds_total", "counter"),
    ("n_decode_total", "counter"),
    ("prompt_tokens_seconds", "gauge"),
    ("predicted_tokens_seconds", "gauge"),
    ("requests_processing", "gauge"),
    ("requests_deferred", "gauge"),
    ("n_busy_slots_per_decode", "gauge"),
]


def client_for(server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


@pytest.fixture(scope="module")
def env_server(server_factory, llama_dir) -> Iterator:
    """Context size and slot count come from llama.cpp's environment variables only."""
    srv = server_factory(["-m", str(llama_dir)], env={"LLAMA_ARG_CTX_SIZE": "512", "LLAMA_ARG_N_PARALLEL": "3"})
    yield srv
    srv.stop()


# ---------------------------------------------------------------------- health


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_health(http, path):
    response = http.get(path)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert response.headers["content-type"] == JSON_TYPE
    assert response.headers.get_list("server") == ["llama.cpp"]


# ---------------------------------------------------------------------- props


def test_props_fields(http):
    props = http.get("/props").json()
    for key in ("default_generation_settings", "total_slots", "model_alias", "model_path", "modalities", "chat_template", "chat_template_caps", "bos_token", "eos_token", "build_info", "is_sleeping"):
        assert key in props, key
    assert list(props)[:3] == ["default_generation_settings", "total_slots", "model_alias"]
    settings = props["default_generation_settings"]
    assert list(settings) == ["params", "n_ctx"]
    assert settings["n_ctx"] == 1024  # -c 2048 split between 2 slots
    assert props["total_slots"] == 2
    assert props["model_alias"] == "tiny-llama"
    assert props["endpoint_slots"] is True
    assert props["endpoint_props"] is True
    assert props["endpoint_metrics"] is True
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert "<|im_start|>" in props["chat_template"]
    caps = props["chat_template_caps"]
    assert caps["supports_tools"] is True
    assert caps["supports_system_role"] is True
    assert all(isinstance(v, bool) for v in caps.values())
    assert props["bos_token"] == "<|begin_of_text|>"
    assert props["eos_token"] == "<|im_end|>"
    assert props["is_sleeping"] is False


def test_props_params_are_the_metrics_only_set(http):
    params = http.get("/props").json()["default_generation_settings"]["params"]
    for missing in ("stop", "logit_bias", "grammar", "dry_sequence_breakers"):
        assert missing not in params
    assert params["n_predict"] == -1
    assert params["temperature"] == pytest.approx(0.8)
    assert params["seed"] == 4294967295
    assert list(params)[:2] == ["seed", "temperature"]
    assert params["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


def test_post_props_with_props_flag(http):
    response = http.post("/props", json={"whatever": 1})
    assert response.status_code == 200
    assert response.json() == {"success": True}


# ---------------------------------------------------------------------- models


def test_models_both_paths_same_body(http):
    a = http.get("/models").json()
    b = http.get("/v1/models").json()
    assert a == b
    assert list(a) == ["models", "object", "data"]
    assert a["object"] == "list"
    entry = a["data"][0]
    assert entry["id"] == "tiny-llama"
    assert entry["aliases"] == ["tiny-llama"]
    assert entry["object"] == "model"
    assert entry["owned_by"] == "llamacpp"
    assert entry["meta"]["n_ctx"] == 1024
    assert entry["meta"]["n_vocab"] > 0
    assert a["models"][0]["name"] == a["models"][0]["model"] == "tiny-llama"
    assert a["models"][0]["capabilities"] == ["completion"]


# ---------------------------------------------------------------------- slots


def test_slots_per_slot_state(http):
    wait_idle(http)
    http.post("/completion", json={"prompt": "Slot state", "n_predict": 3, "id_slot": 1, "ignore_eos": True})
    wait_idle(http)  # the final response may leave before the slot is released (as in llama-server)
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    for slot in slots:
        assert list(slot)[:4] == ["id", "n_ctx", "speculative", "is_processing"]
        assert slot["n_ctx"] == 1024
        assert slot["is_processing"] is False
    used = slots[1]
    assert isinstance(used["id_task"], int)
    assert used["n_prompt_tokens"] >= 1  # the slot keeps its tokens; its counts are reset
    assert (used["n_prompt_tokens_cache"], used["n_prompt_tokens_processed"]) == (0, 0)
    assert used["params"]["seed"] != 4294967295  # the seed actually drawn for the task
    assert isinstance(used["next_token"], list) and len(used["next_token"]) == 1
    assert used["next_token"][0]["has_next_token"] is False


def test_slots_params_are_the_metrics_only_set(http):
    # Same key set as /props' default params (task_params::to_json(true)), with the task's values.
    wait_idle(http)
    http.post("/completion", json={"prompt": "Params", "n_predict": 3, "id_slot": 1, "ignore_eos": True})
    wait_idle(http)
    params = http.get("/slots").json()[1]["params"]
    assert list(params) == list(http.get("/props").json()["default_generation_settings"]["params"])
    assert params["n_predict"] == 3
    assert params["ignore_eos"] is True


def test_idle_slot_shows_the_reset_counts(http):
    # llama-server resets a slot's counts when its task ends (server_slot::reset): no budget
    # (n_remain -1), nothing decoded, no newline pending; the last task's id and params stay.
    wait_idle(http)
    http.post("/completion", json={"prompt": "Count\n", "n_predict": 3, "id_slot": 1, "ignore_eos": True})
    wait_idle(http)
    next_token = http.get("/slots").json()[1]["next_token"][0]
    assert next_token == {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}


def test_slots_n_prompt_tokens_is_the_slot_cache_size(http):
    # llama-server reports prompt.tokens.size(): the tokens held in the slot after the task,
    # which is the response's tokens_cached (prompt + generated - 1).
    wait_idle(http)
    body = http.post("/completion", json={"prompt": "Cache size", "n_predict": 3, "id_slot": 1, "ignore_eos": True}).json()
    wait_idle(http)
    assert http.get("/slots").json()[1]["n_prompt_tokens"] == body["tokens_cached"]
    assert body["tokens_cached"] == body["tokens_evaluated"] + body["tokens_predicted"] - 1


def test_slots_busy_while_generating(http):
    with http.stream("POST", "/completion", json={"prompt": "Busy", "n_predict": 100000, "ignore_eos": True, "stream": True, "id_slot": 0}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        slots = http.get("/slots").json()
        assert slots[0]["is_processing"] is True
        assert slots[0]["next_token"][0]["has_next_token"] is True
        busy = http.get("/slots", params={"fail_on_no_slot": 1})
        assert busy.status_code == 200  # slot 1 is still idle
    wait_idle(http)


def test_fresh_server_slots_have_no_params(env_server):
    with client_for(env_server) as client:
        slots = client.get("/slots").json()
    assert len(slots) == 3
    for slot in slots:
        assert slot["is_processing"] is False
        assert slot["n_ctx"] == 256  # 512 / 3 slots, padded to 256 as llama.cpp does
        assert "params" not in slot


def test_no_slots_flag_disables_slots(small_server):
    with client_for(small_server) as client:
        response = client.get("/slots")
    assert response.status_code == 501
    assert response.json()["error"]["type"] == "not_supported_error"


# ---------------------------------------------------------------------- settings from the environment


def test_settings_from_env(env_server):
    with client_for(env_server) as client:
        props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert props["total_slots"] == 3


def test_cli_overrides_env(small_server):
    with client_for(small_server) as client:
        props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert props["total_slots"] == 1
    assert props["endpoint_slots"] is False
    assert props["endpoint_metrics"] is False


def test_env_server_model_name_is_the_directory(env_server, llama_dir):
    with client_for(env_server) as client:
        models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == llama_dir.name


# ---------------------------------------------------------------------- tokenize / detokenize / apply-template


def test_tokenize_plain_and_with_special(http):
    plain = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    special = http.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    bos = http.post("/tokenize", json={"content": "<|begin_of_text|>"}).json()["tokens"]
    assert len(bos) == 1  # special tokens are parsed by default
    assert special == bos + plain
    assert all(isinstance(t, int) for t in plain)


def test_tokenize_with_pieces(http):
    tokens = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    pieces = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert all(list(p) == ["id", "piece"] for p in pieces)
    assert "".join(p["piece"] for p in pieces) == "Hello world"


def test_tokenize_mixed_content_and_missing_content(http):
    world = http.post("/tokenize", json={"content": " world"}).json()["tokens"]
    mixed = http.post("/tokenize", json={"content": ["Hello", *world]}).json()["tokens"]
    assert mixed == http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert http.post("/tokenize", json={}).json() == {"tokens": []}


def test_detokenize_round_trip(http):
    text = "Hello world, how are you?"
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
    with_bos = http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": with_bos}).json()["content"] == "<|begin_of_text|>" + text
    assert http.post("/detokenize", json={}).json() == {"content": ""}


def test_apply_template_renders_chatml(http):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    response = http.post("/apply-template", json={"messages": messages})
    assert response.status_code == 200
    # The template writes the BOS; the tokenizer adds it, so the text leaves it out (llama-server).
    assert response.json() == {
        "prompt": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    }


def test_apply_template_without_generation_prompt(http):
    prompt = http.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}).json()["prompt"]
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


# ---------------------------------------------------------------------- metrics


def test_metrics_families_and_content_type(http):
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name, kind in LLAMACPP_FAMILIES:
        assert f"# HELP llamacpp:{name} " in text
        assert f"# TYPE llamacpp:{name} {kind}" in text
        metric(text, f"llamacpp:{name}")


def test_metrics_counters_increase(http):
    wait_idle(http)
    before = http.get("/metrics").text
    body = http.post("/completion", json={"prompt": "Metrics please", "n_predict": 3, "ignore_eos": True, "cache_prompt": False}).json()
    after = http.get("/metrics").text
    predicted = metric(after, "llamacpp:tokens_predicted_total") - metric(before, "llamacpp:tokens_predicted_total")
    prompt = metric(after, "llamacpp:prompt_tokens_total") - metric(before, "llamacpp:prompt_tokens_total")
    assert predicted == 3
    assert prompt == body["timings"]["prompt_n"]
    assert metric(after, "llamacpp:n_decode_total") > metric(before, "llamacpp:n_decode_total")
    assert metric(after, "llamacpp:requests_processing") == 0


def test_metrics_without_flag_is_501(small_server):
    with client_for(small_server) as client:
        response = client.get("/metrics")
    assert response.status_code == 501
    assert response.json() == {
        "error": {"code": 501, "message": "This server does not support metrics endpoint. Start it with `--metrics`", "type": "not_supported_error"}
    }


def test_post_props_without_flag_is_501(small_server):
    with client_for(small_server) as client:
        response = client.post("/props", json={})
        assert response.status_code == 501
        assert response.json()["error"]["type"] == "not_supported_error"
        assert client.get("/props").status_code == 200  # GET /props never needs --props


# ---------------------------------------------------------------------- cancellation


def test_stream_disconnect_cancels_generation(http):
    wait_idle(http)
    before = metric(http.get("/metrics").text, "llamacpp:tokens_predicted_total")
    with httpx.Client(base_url=str(http.base_url), timeout=30) as other:
        with other.stream("POST", "/completion", json={"prompt": "Go on forever", "n_predict": 100000, "ignore_eos": True, "stream": True}) as response:
            seen = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break
    assert wait_idle(http, timeout=2.0) < 2.0
    text = http.get("/metrics").text
    assert metric(text, "llamacpp:requests_processing") == 0
    # The slot context holds 2048 tokens: a generation left running would have produced far more.
    assert metric(text, "llamacpp:tokens_predicted_total") - before < 1500


def test_non_stream_client_timeout_cancels_generation(http):
    wait_idle(http)
    before = metric(http.get("/metrics").text, "llamacpp:tokens_predicted_total")
    with httpx.Client(base_url=str(http.base_url), timeout=0.5) as impatient:
        with pytest.raises(httpx.TimeoutException):
            impatient.post("/completion", json={"prompt": "Go on forever", "n_predict": 100000, "ignore_eos": True})
    started = time.monotonic()
    wait_idle(http, timeout=2.0)
    assert time.monotonic() - started < 2.0
    text = http.get("/metrics").text
    assert metric(text, "llamacpp:requests_processing") == 0
    assert metric(text, "llamacpp:tokens_predicted_total") - before < 1500


def test_busy_slots_defer_requests_and_gauges_follow(http):
    wait_idle(http)
    long_body = {"prompt": "Keep going", "n_predict": 100000, "ignore_eos": True, "stream": True}
    pool = ThreadPoolExecutor(1)
    with httpx.Client(base_url=str(http.base_url), timeout=30) as a, httpx.Client(base_url=str(http.base_url), timeout=30) as b:
        with a.stream("POST", "/completion", json=long_body) as first, b.stream("POST", "/completion", json=long_body) as second:
            # Keep the line iterators alive: dropping one closes the connection (a disconnect).
            lines_first, lines_second = first.iter_lines(), second.iter_lines()
            next(line for line in lines_first if line.startswith("data: "))
            next(line for line in lines_second if line.startswith("data: "))
            busy = http.get("/slots", params={"fail_on_no_slot": 1})
            assert busy.status_code == 503
            assert busy.json()["error"]["message"] == "no slot available"
            waiting = pool.submit(http.post, "/completion", json={"prompt": "Me next", "n_predict": 1})
            deadline = time.monotonic() + 5
            while metric(http.get("/metrics").text, "llamacpp:requests_deferred") != 1:
                assert time.monotonic() < deadline, "the third request was never deferred"
                time.sleep(0.02)
            assert metric(http.get("/metrics").text, "llamacpp:requests_processing") == 2
            assert not waiting.done()
        # Both streams are closed: the deferred request gets a slot and finishes.
        assert waiting.result(timeout=5).json()["tokens_predicted"] == 1
    pool.shutdown()
    wait_idle(http)
    assert metric(http.get("/metrics").text, "llamacpp:requests_deferred") == 0


@pytest.fixture(scope="module")
def roomy_http(server_factory, llama_dir) -> Iterator[httpx.Client]:
    """Two slots with the model's whole context: a stream left running lasts for many seconds
    (in a 2048-token slot the tiny model reaches the end in about two)."""
    srv = server_factory(["-m", str(llama_dir), "-np", "2", "-c", "32768", "--metrics"])
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        yield client
    srv.stop()


def test_sse_ping_while_waiting_for_a_slot(roomy_http):
    # Both slots busy: a third stream waits in silence, so the server sends ":" keep-alive comments
    # (sse_ping_interval seconds apart); closing the waiting stream withdraws the deferred request.
    http = roomy_http
    wait_idle(http)
    long_body = {"prompt": "Keep going", "n_predict": 100000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=30) as a, httpx.Client(base_url=str(http.base_url), timeout=30) as b:
        with a.stream("POST", "/completion", json=long_body) as first, b.stream("POST", "/completion", json=long_body) as second:
            lines_first, lines_second = first.iter_lines(), second.iter_lines()
            next(line for line in lines_first if line.startswith("data: "))
            next(line for line in lines_second if line.startswith("data: "))
            with httpx.Client(base_url=str(http.base_url), timeout=30) as c:
                started = time.monotonic()
                body = {"prompt": "Waiting", "n_predict": 2, "stream": True, "sse_ping_interval": 1}
                with c.stream("POST", "/completion", json=body) as waiting:
                    assert waiting.status_code == 200
                    received = b""
                    # Keep the iterator alive: a dropped one closes the connection, which withdraws
                    # the request as soon as the server's next ping fails to send.
                    raw_chunks = waiting.iter_raw()
                    for chunk in raw_chunks:
                        received += chunk
                        if received.count(b":\n\n") >= 2:
                            break
                    elapsed = time.monotonic() - started
                    assert received == b":\n\n:\n\n", received  # only pings: the request has no slot yet
                    assert elapsed > 1.5  # two pings, one second of silence apart
                    # Counted as deferred (polled: the submission can trail the first bytes sent).
                    deadline = time.monotonic() + 5
                    while metric(metrics := http.get("/metrics").text, "llamacpp:requests_deferred") != 1:
                        assert time.monotonic() < deadline, metrics
                        time.sleep(0.05)
                    assert metric(metrics, "llamacpp:requests_processing") == 2, metrics
            # Withdrawn once the server notices the closed stream (busy streams may slow that down).
            deadline = time.monotonic() + 10
            while metric(http.get("/metrics").text, "llamacpp:requests_deferred") != 0:
                assert time.monotonic() < deadline, "the closed stream's request is still deferred"
                time.sleep(0.05)
    wait_idle(http)


def test_an_early_answer_keeps_the_connection_for_the_next_request(small_server):
    """POST /props without --props is refused (501) without its body being needed; the body here
    arrives after the headers, as a client's second write. The answer must still come, and the
    same connection must then serve the next request (server/app.py: EarlyAnswerMiddleware):
    without the middleware the server could close it unannounced, and a pooled client's next
    request failed with "server disconnected without sending a response"."""
    import re
    import socket
    import time

    host, port = small_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /props HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n")
        time.sleep(0.3)
        conn.sendall(b"{}")
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        seen = b""
        deadline = time.monotonic() + 30
        while seen.count(b"HTTP/1.1 ") < 2 and time.monotonic() < deadline:
            chunk = conn.recv(65536)
            if not chunk:
                break
            seen += chunk
    assert re.findall(rb"HTTP/1\.1 (\d{3})", seen) == [b"501", b"200"], seen[:400]
