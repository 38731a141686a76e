"""End to end: ``return_progress`` and ``timings_per_token`` as llama-server streams them (issue
35.3 on the completion and chat routes, 29.2 on the Responses API).

llama-server (``server-context.cpp``) reports a slot's prompt progress once when the prompt
starts, ``processed`` = ``cache`` = the reused prefix, then after each logical batch of ``-b``
tokens from there, the last prompt token included; ``processed`` counts the cached tokens,
``time_ms`` is an integer. With ``timings_per_token`` the reports carry the running ``timings``.
So for a prompt of P tokens, c of them cached, the ``processed`` counts are
``c, c+b, c+2b, ..., P``, whatever this engine's own chunking: the tests check exactly that, for
cold prompts and for prompt-cache hits (which split the prompt off llama-server's points).

The default server runs with ``-b 64`` (and ``-c 2048``, so n_batch stays 64).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.helpers import parse_sse

pytestmark = pytest.mark.e2e

BATCH = 64  # the default server's -b
TEXT = "one two three four five six seven eight nine ten " * 16  # several batches of 64 tokens


def llama_schedule(total: int, cache: int, batch: int = BATCH) -> list[int]:
    """llama-server's ``processed`` counts: the start, then one per logical batch."""
    return [cache] + [min(cache + k * batch, total) for k in range(1, math.ceil((total - cache) / batch) + 1)]


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    return [e for e in parse_sse(text) if isinstance(e, dict)]


def check_reports(events: list[dict[str, Any]], cache: int | None = None, timings: bool = False) -> list[dict[str, Any]]:
    """The progress reports follow llama-server's schedule; returns them."""
    reports = [e for e in events if "prompt_progress" in e]
    progress = [e["prompt_progress"] for e in reports]
    assert progress, events[:3]
    total, first = progress[0]["total"], progress[0]["cache"]
    if cache is not None:
        assert first == cache
    assert [p["processed"] for p in progress] == llama_schedule(total, first)
    assert all(list(p) == ["total", "cache", "processed", "time_ms"] for p in progress)
    assert all(p["total"] == total and p["cache"] == first and isinstance(p["time_ms"], int) for p in progress)
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times)
    for event in reports:
        if not timings:
            assert "timings" not in event
            continue
        t = event["timings"]
        assert list(event)[-2:] == ["timings", "prompt_progress"]  # llama-server's order
        assert t["cache_n"] == first and t["prompt_n"] == event["prompt_progress"]["processed"] - first
        assert t["predicted_n"] == 0 and "prompt_per_second" in t and "predicted_per_second" in t
    return reports


# ---------------------------------------------------------------------- completion and chat routes


def test_native_completion_reports_llama_servers_counts(http: httpx.Client) -> None:
    events = stream(http, "/completion", {"prompt": TEXT, "n_predict": 2, "return_progress": True, "cache_prompt": False})
    reports = check_reports(events, cache=0)
    total = events[-1]["tokens_evaluated"]
    assert reports[-1]["prompt_progress"]["processed"] == total > 2 * BATCH
    assert len(reports) == 1 + math.ceil(total / BATCH)
    for report in reports:  # a partial of an empty token, before any token is predicted
        assert report["content"] == "" and report["tokens"] == [0] and report["tokens_predicted"] == 0
        assert report["tokens_evaluated"] == total and report["stop"] is False
    first_token = next(i for i, e in enumerate(events) if "prompt_progress" not in e)
    assert all("prompt_progress" in e for e in events[:first_token])


def test_cache_hit_reports_start_at_the_reused_prefix(http: httpx.Client) -> None:
    """A second send reuses all but the last token: llama-server's reports are then P-1 and P;
    a shorter shared prefix starts the batches at its end, off this engine's aligned chunks."""
    body = {"prompt": TEXT, "n_predict": 1, "return_progress": True, "timings_per_token": True}
    stream(http, "/completion", body)
    events = stream(http, "/completion", body)
    final = events[-1]
    cached = final["timings"]["cache_n"]
    assert cached == final["tokens_evaluated"] - 1
    reports = check_reports(events, cache=cached, timings=True)
    assert [r["prompt_progress"]["processed"] for r in reports] == [cached, cached + 1]
    longer = stream(http, "/completion", {**body, "prompt": TEXT + "eleven twelve " * 60})
    final = longer[-1]
    assert 0 < final["timings"]["cache_n"] < final["tokens_evaluated"] - BATCH
    check_reports(longer, cache=final["timings"]["cache_n"], timings=True)


def test_openai_completions_progress_chunks(http: httpx.Client) -> None:
    events = stream(http, "/v1/completions", {"prompt": TEXT, "max_tokens": 2, "return_progress": True, "timings_per_token": True, "cache_prompt": False})
    reports = check_reports(events, cache=0, timings=True)
    for report in reports:
        assert report["object"] == "text_completion"
        assert report["choices"] == [{"text": "", "index": 0, "logprobs": None, "finish_reason": None}]
    tokens = [e for e in events if "prompt_progress" not in e and e.get("choices") and e["choices"][0]["text"]]
    assert tokens and all(e["timings"]["predicted_n"] >= 1 for e in tokens)


def test_chat_progress_chunks_carry_timings(http: httpx.Client) -> None:
    """The llama-server web UI's request: stream, return_progress and timings_per_token."""
    body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 3, "return_progress": True, "timings_per_token": True, "cache_prompt": False}
    events = stream(http, "/v1/chat/completions", body)
    reports = check_reports(events, cache=0, timings=True)
    for report in reports:  # the role delta, as llama-server sends with each report
        assert report["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert report["object"] == "chat.completion.chunk"
    content = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert content and all("timings" in e and e["timings"]["predicted_n"] >= 1 for e in content)
    without = stream(http, "/v1/chat/completions", {**body, "timings_per_token": False})
    check_reports(without, cache=0, timings=False)


def test_chat_progress_through_the_openai_sdk(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": TEXT}], max_tokens=2, stream=True,
        extra_body={"return_progress": True, "cache_prompt": False},
    ))
    progress = [c.model_extra["prompt_progress"] for c in chunks if c.model_extra and "prompt_progress" in c.model_extra]
    assert [p["processed"] for p in progress] == llama_schedule(progress[0]["total"], 0)


# ---------------------------------------------------------------------- the Responses API


def responses_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    import json

    return [json.loads(d) for d in data]


def test_responses_telemetry_as_llama_cpp_tests_it(http: httpx.Client) -> None:
    """llama.cpp's own test_responses_stream_with_llama_telemetry request, and its checks, with
    llama-server's exact counts on top."""
    body = {"input": "This is a test" * 10, "max_output_tokens": 8, "temperature": 0.8, "stream": True,
            "timings_per_token": True, "return_progress": True, "cache_prompt": False}
    events = responses_events(http, body)
    kinds = [e["type"] for e in events]
    reports = check_reports(events, cache=0, timings=True)
    assert all(e["type"] == "response.in_progress" and e["response"]["status"] == "in_progress" for e in reports)
    assert kinds.count("response.in_progress") == len(reports)  # each in_progress event is a report
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("prompt_per_second" in e["timings"] and "predicted_per_second" in e["timings"] for e in deltas)
    completed = events[-1]
    assert completed["type"] == "response.completed"  # max_output_tokens cut it: still completed
    assert completed["response"]["status"] == "completed" and "usage" in completed["response"]
    assert completed["response"]["usage"]["output_tokens"] == 8
    assert completed["timings"]["predicted_n"] == 8 and completed["timings"]["prompt_n"] == reports[-1]["prompt_progress"]["total"]
    assert "response.incomplete" not in kinds


def test_responses_without_telemetry_fields(http: httpx.Client) -> None:
    events = responses_events(http, {"input": "This is a test" * 10, "max_output_tokens": 4, "stream": True, "cache_prompt": False})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds.count("response.in_progress") == 1
    assert not any("prompt_progress" in e for e in events)
    assert not any("timings" in e for e in events if e["type"] == "response.output_text.delta")
    assert kinds[-1] == "response.completed" and "timings" in events[-1]


def test_responses_stream_through_the_openai_sdk(server) -> None:
    """The SDK parses every event, the telemetry fields included, and a cut stream completes."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    events = list(client.responses.create(
        model="tiny", input="This is a test" * 10, max_output_tokens=8, stream=True,
        extra_body={"return_progress": True, "timings_per_token": True, "cache_prompt": False},
    ))
    progress = [e.model_extra["prompt_progress"] for e in events if e.type == "response.in_progress"]
    assert [p["processed"] for p in progress] == llama_schedule(progress[0]["total"], 0)
    final = events[-1]
    assert final.type == "response.completed" and final.response.status == "completed"
    assert final.model_extra["timings"]["predicted_n"] == final.response.usage.output_tokens == 8
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.response.output_text
