"""Resumable streams (``X-Conversation-Id``): a generation outlives its client, is replayed from
any byte offset, looked up only by the ids one knows, replaced by a newer request and stopped by
``DELETE /v1/stream``. On the shared default server (tiny llama)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import metric, wait_idle

pytestmark = pytest.mark.e2e

BODY = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
VOLATILE = ("id", "created", "timings")  # per-run values: the answer's id, its second, its timings
# A generation that runs until its 1024-token slot is full, for the tests that act while it runs:
# log-probabilities take it off the plain greedy fast path (~0.2 s for the slot), to ~0.6 s.
LONG = {"max_tokens": 100000, "n_probs": 10}


def events(raw: bytes) -> list[Any]:
    """The SSE data payloads of a stream, per-run fields dropped."""
    out = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            out.append(payload)
            continue
        chunk = json.loads(payload)
        out.append({k: v for k, v in chunk.items() if k not in VOLATILE})
    return out


def read_some(client: httpx.Client, conv: str, n_events: int, body: dict[str, Any] = BODY) -> bytes:
    """Start a resumable stream, read its first ``n_events`` data lines, then drop the connection."""
    received = b""
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv}) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            received += piece
            if received.count(b"data: ") >= n_events:
                break
    return received


def wait_done(client: httpx.Client, conv: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        (status,) = client.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json()
        if status["is_done"] or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_a_dropped_stream_runs_to_its_end_and_resumes_byte_for_byte(http):
    wait_idle(http)
    whole = http.post("/v1/chat/completions", json=BODY).content
    conv = f"conv-{uuid.uuid4()}"
    with httpx.Client(base_url=str(http.base_url), timeout=30) as dropping:
        first = read_some(dropping, conv, 3)
    status = wait_done(http, conv)
    assert status["is_done"] and status["total_bytes"] > len(first)  # the generation went on without its client
    rest = http.get("/v1/stream", params={"conv_id": conv, "from": len(first)})
    assert rest.status_code == 200 and rest.headers["content-type"].startswith("text/event-stream")
    resumed = first + rest.content
    assert resumed == http.get("/v1/stream", params={"conv_id": conv}).content  # a replay from 0: the same bytes
    assert len(resumed) == status["total_bytes"] == status["buffered_bytes"]
    assert events(resumed) == events(whole)  # greedy: the same answer as an uninterrupted run
    assert events(resumed)[-1] == "[DONE]"


def test_a_reader_follows_a_live_stream(http):
    wait_idle(http)
    conv = f"conv-{uuid.uuid4()}"
    body = {**BODY, **LONG}
    with httpx.Client(base_url=str(http.base_url), timeout=30) as dropping:
        read_some(dropping, conv, 2, body)
    # Attached while it still runs: replayed from 0, then followed live to its end.
    with http.stream("GET", "/v1/stream", params={"conv_id": conv}) as live:
        assert not wait_done(http, conv, timeout=0)["is_done"]
        followed = b"".join(live.iter_raw())
    assert events(followed)[-1] == "[DONE]"
    assert followed == http.get("/v1/stream", params={"conv_id": conv}).content


def test_lookup_answers_only_for_the_ids_asked(http):
    wait_idle(http)
    conv = f"conv-{uuid.uuid4()}"
    with httpx.Client(base_url=str(http.base_url), timeout=30) as client:
        read_some(client, conv, 1, {**BODY, "max_tokens": 4})
    wait_done(http, conv)
    assert http.post("/v1/streams/lookup", json={"conversation_ids": []}).json() == []
    assert http.post("/v1/streams/lookup", json={}).json() == []
    assert http.post("/v1/streams/lookup", json={"conversation_ids": ["someone-else", 3, None]}).json() == []
    (found,) = http.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json()
    assert found["conversation_id"] == conv and found["is_done"] and found["completed_at"] >= found["started_at"] > 0
    bad = http.post("/v1/streams/lookup", content=b"{not json")
    assert bad.status_code == 400


def test_bad_reads_get_clear_errors(http):
    assert http.get("/v1/stream").status_code == 400
    missing = http.get("/v1/stream", params={"conv_id": "never-seen"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Stream not found or expired"
    conv = f"conv-{uuid.uuid4()}"
    with httpx.Client(base_url=str(http.base_url), timeout=30) as client:
        read_some(client, conv, 1, {**BODY, "max_tokens": 2})
    wait_done(http, conv)
    bad = http.get("/v1/stream", params={"conv_id": conv, "from": "-1"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "Invalid 'from' offset"
    beyond = http.get("/v1/stream", params={"conv_id": conv, "from": 10**9})
    assert beyond.status_code == 200 and beyond.content == b""  # nothing past the end of a finished stream
    assert http.delete("/v1/stream").status_code == 400
    assert http.get("/health").status_code == 200


def test_delete_stops_the_generation_and_a_newer_request_replaces_the_older(http):
    wait_idle(http)
    endless = {**BODY, **LONG}
    before = metric(http.get("/metrics").text, "llamacpp:tokens_predicted_total")
    conv = f"conv-{uuid.uuid4()}"
    with httpx.Client(base_url=str(http.base_url), timeout=30) as client:
        read_some(client, conv, 2, endless)
    assert not wait_done(http, conv, timeout=0)["is_done"]  # still generating without a client
    # A newer request of the same conversation stops the older one and takes its place.
    with httpx.Client(base_url=str(http.base_url), timeout=30) as client:
        read_some(client, conv, 2, endless)
    (status,) = http.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json()
    assert not status["is_done"]
    assert metric(http.get("/metrics").text, "llamacpp:requests_processing") == 1
    assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204
    assert wait_idle(http, timeout=5.0) < 5.0
    assert http.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json() == []
    assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204  # idempotent
    # The slot context holds 1024 tokens: generations left running would have produced far more.
    assert metric(http.get("/metrics").text, "llamacpp:tokens_predicted_total") - before < 1000


def test_a_stream_without_the_header_still_stops_with_its_client(http):
    wait_idle(http)
    with httpx.Client(base_url=str(http.base_url), timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={**BODY, **LONG}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break
    assert wait_idle(http, timeout=3.0) < 3.0
