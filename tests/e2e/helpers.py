"""Small helpers shared by the end-to-end tests (SSE parsing, metrics, waiting for idle slots)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx

DONE = "[DONE]"

# llama-server's native non-streaming /completion keys, in its order (§3.5).
NATIVE_KEYS = [
    "index",
    "content",
    "tokens",
    "id_slot",
    "stop",
    "model",
    "tokens_predicted",
    "tokens_evaluated",
    "generation_settings",
    "prompt",
    "has_new_line",
    "truncated",
    "stop_type",
    "stopping_word",
    "tokens_cached",
    "timings",
]
PARTIAL_KEYS = ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"]
TIMINGS_KEYS = [
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
]


# pip pointed at a closed port with no local wheel directories: the registry "cannot be reached".
NO_REGISTRY = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "",
               "PIP_EXTRA_INDEX_URL": ""}


def parse_sse(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body: decoded JSON, or the literal ``[DONE]``.

    Every event must be a single ``data: ...`` line followed by a blank line.
    """
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue  # a keep-alive comment
        assert len(lines) == 1 and lines[0].startswith("data: "), f"malformed SSE event: {block!r}"
        payload = lines[0][len("data: ") :]
        events.append(DONE if payload == DONE else json.loads(payload))
    return events


def post_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    """POST with ``stream: true`` and return the response and its parsed events."""
    response = client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return response, parse_sse(response.text)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not found")


def wait_idle(client: httpx.Client, timeout: float = 2.0) -> float:
    """Wait until every slot is idle; return how long it took (fails after ``timeout``)."""
    start = time.monotonic()
    while True:
        slots = client.get("/slots").json()
        if not any(slot["is_processing"] for slot in slots):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"slots still busy after {timeout} s: {slots}")
        time.sleep(0.05)


def assert_serving(client: httpx.Client) -> None:
    """The server still answers /health and a normal completion."""
    assert client.get("/health").status_code == 200
    response = client.post("/completion", json={"prompt": "Still alive?", "n_predict": 2, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["tokens_predicted"] == 2


def ascii_stop_string(text: str, min_start: int = 3, length: int = 3) -> str:
    """A stop string taken from ``text`` (plain ASCII letters, not at the very start)."""
    for start in range(min_start, len(text) - length + 1):
        candidate = text[start : start + length]
        if candidate.isascii() and candidate.isalpha():
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")
