"""End to end: every per-request quantity is bounded and no request stalls the others.

The first three tests are the regressions of issue 11 (each took the server down, or stalled
every other client, before the limits existed):

- ``{"prompt": "x", "n_probs": 100000000}`` generated to the end of the context with a
  vocabulary-wide probability list per token;
- a 64 MiB body was read, parsed and tokenized in full;
- tokenizing a large prompt ran on the event loop, so ``/health`` stopped answering meanwhile.

The assertions are about answers and their order (a 4xx; ``/health`` answered while the large
request was still in flight), never about how fast something ran.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.e2e.helpers import assert_serving

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def assert_error(response: httpx.Response, status: int, type_: str, field: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert list(error)[:3] == ["code", "message", "type"]
    assert error["code"] == status and error["type"] == type_
    assert field in error["message"]
    return error


# ---------------------------------------------------------------------- the three regressions


def test_huge_n_probs_is_refused(http: httpx.Client) -> None:
    """No n_predict, n_probs far above any vocabulary: a 400 naming the field, at once."""
    response = http.post("/completion", json={"prompt": "x", "n_probs": 100000000}, timeout=20)
    error = assert_error(response, 400, "invalid_request_error", "n_probs")
    assert "100" in error["message"]  # the cap is stated
    assert_serving(http)


def test_64_mib_body_is_413(http: httpx.Client) -> None:
    body = b'{"prompt": "' + b"a" * (64 * MIB) + b'"}'
    response = http.post("/completion", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert_error(response, 413, "invalid_request_error", "--max-body-bytes")
    assert_serving(http)


def test_oversized_body_on_an_anthropic_route_is_413_in_anthropics_shape(http: httpx.Client) -> None:
    body = b'{"max_tokens": 4, "messages": [{"role": "user", "content": "' + b"a" * (8 * MIB) + b'"}]}'
    response = http.post("/v1/messages", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413
    data = response.json()
    assert data["type"] == "error" and "--max-body-bytes" in data["error"]["message"], data
    assert_serving(http)


def test_infill_sampler_over_the_whole_vocabulary_answers(http: httpx.Client) -> None:
    """Found by the schemathesis fuzz (``"samplers": "tattimtt"``): a chain with infill and no
    top-k hands infill the whole vocabulary, whose prefix merge compared every pair of tokens in
    Python, minutes a step on the engine thread, and no other request was served meanwhile."""
    body = {"prompt": "x", "samplers": "i", "n_predict": 4, "ignore_eos": True}
    response = http.post("/completion", json=body, timeout=60)
    assert response.status_code == 200, response.text[:500]
    assert response.json()["tokens_predicted"] == 4
    assert_serving(http)


@pytest.fixture(scope="module")
def long_context(server_factory, llama_dir) -> Iterator[str]:
    """The model's whole context (32k tokens) in one slot: a prompt of half a million characters
    passes the character bound (32k x the longest vocabulary entry) and has to be tokenized."""
    server = server_factory(["-m", str(llama_dir), "-np", "1", "--metrics"])
    yield server.base_url


def _health_answers_while(base_url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """Send ``body`` and, once it is fully uploaded, poll /health until its response arrives.

    Returns the big request's response and how many /health polls were answered before it.
    """
    uploaded = threading.Event()
    done = threading.Event()
    result: dict[str, Any] = {}
    import orjson

    payload = orjson.dumps(body)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(payload), MIB):
            yield payload[i : i + MIB]
        uploaded.set()

    def send() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            result["response"] = client.post(path, content=chunks(), headers={"content-type": "application/json"})
        done.set()

    sender = threading.Thread(target=send)
    sender.start()
    assert uploaded.wait(60)
    answered = 0
    with httpx.Client(base_url=base_url, timeout=120) as health:
        while not done.is_set():
            response = health.get("/health")
            if not done.is_set():
                assert response.status_code == 200
                answered += 1
            time.sleep(0.02)
    sender.join()
    return result["response"], answered


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_health_answers_while_a_large_prompt_is_tokenized(long_context: str, path: str) -> None:
    """Half a megabyte of words: under the character bound of the 32k context, so the server has
    to render and tokenize it to find it too long (about 180k tokens). /health answers meanwhile."""
    text = "the quick brown fox jumps over a lazy dog " * 12_000
    body: dict[str, Any] = {"n_predict": 1}
    if path == "/completion":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    response, answered = _health_answers_while(long_context, path, body)
    error = assert_error(response, 400, "exceed_context_size_error")
    assert error["n_prompt_tokens"] > error["n_ctx"] and "at least" not in error["message"]  # counted, not bounded
    assert answered >= 1, "/health did not answer while the prompt was being tokenized"


# ---------------------------------------------------------------------- every other cap


@pytest.mark.parametrize(
    ("path", "extra", "field", "flag"),
    [
        ("/completion", {"stop": [f"s{i}" for i in range(33)]}, "stop", "--max-stop-strings"),
        ("/completion", {"stop": "x" * 1025}, "stop", "--max-stop-chars"),
        ("/completion", {"dry_sequence_breakers": ["a"] * 33}, "dry_sequence_breakers", "--max-stop-strings"),
        ("/completion", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "--max-logit-bias"),
        ("/completion", {"logit_bias": [[i, 1] for i in range(1025)]}, "logit_bias", "--max-logit-bias"),
        ("/completion", {"samplers": ["top_k"] * 33}, "samplers", "--max-samplers"),
        ("/completion", {"samplers": "k" * 33}, "samplers", "--max-samplers"),
        ("/completion", {"prompt": ["a"] * 65}, "prompt", "--max-prompts"),
        ("/v1/completions", {"logprobs": 101}, "logprobs", "--n-probs-max"),
        ("/completion", {"min_keep": 2**40}, "min_keep", "2147483647"),
        ("/completion", {"n_cmpl": 3}, "n_cmpl", "2"),  # more than the slots
    ],
)
def test_each_cap_is_a_400_naming_the_field(http: httpx.Client, path: str, extra: dict[str, Any], field: str, flag: str) -> None:
    body = {"prompt": "Hi", "n_predict": 1, **extra}
    error = assert_error(http.post(path, json=body), 400, "invalid_request_error", f"'{field}'")
    assert flag in error["message"]


def test_top_logprobs_is_capped_at_openais_20(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True}
    assert_error(http.post("/v1/chat/completions", json={**body, "top_logprobs": 21}), 400, "invalid_request_error", "top_logprobs")
    ok = http.post("/v1/chat/completions", json={**body, "top_logprobs": 20})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_n_predict_max_lowers_requests(server_factory, llama_dir) -> None:
    url = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "512", "--n-predict-max", "3", "--n-probs-max", "5"]).base_url
    with httpx.Client(base_url=url, timeout=60) as client:
        for n_predict in (100, -1):
            body = client.post("/completion", json={"prompt": "Hi", "n_predict": n_predict, "ignore_eos": True}).json()
            assert body["tokens_predicted"] == 3
        assert client.post("/completion", json={"prompt": "Hi", "n_predict": 2, "ignore_eos": True}).json()["tokens_predicted"] == 2
        assert_error(client.post("/completion", json={"prompt": "Hi", "n_probs": 6}), 400, "invalid_request_error", "n_probs")


def test_a_prompt_proven_too_long_is_refused_before_tokenizing(http: httpx.Client) -> None:
    """2048-token slots: a 1 MB prompt is at least 60k tokens by its length alone."""
    response = http.post("/completion", json={"prompt": "word " * 200_000, "n_predict": 1})
    error = assert_error(response, 400, "exceed_context_size_error")
    assert "at least" in error["message"] and error["n_prompt_tokens"] >= error["n_ctx"]


def test_body_without_length_is_cut_at_the_cap(http: httpx.Client) -> None:
    """A chunked body (no Content-Length) is counted as it arrives and refused once over the cap."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(16):
            yield b"a" * MIB
        yield b'"}'

    response = http.post("/completion", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error", "--max-body-bytes")
    assert response.headers.get("connection") == "close"
    assert_serving(http)
