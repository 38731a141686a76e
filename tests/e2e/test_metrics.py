"""``/metrics`` after a scripted workload, checked against what llama-server (b11312) reports.

llama-server's rules (``server-context.cpp``, ``server-task.cpp``, ``server-common.h``):

- prompt tokens taken from the cache count at admission, computed prompt tokens at every
  ``llama_decode``, generated tokens when the generation ends;
- one ``llama_decode`` per batch of at most ``--batch-size`` tokens, so a cold prompt of P
  tokens costs ceil(P / batch) calls and every further token one;
- a generation of n tokens took n - 1 decode steps (the first comes from the prompt's last
  batch): ``timings.predicted_per_second`` and the ``predicted_tokens_seconds`` gauge are steps
  per second, and one generated token reports 0.0;
- the two throughput gauges cover the window since the previous scrape (a scrape resets them),
  asleep or not;
- an idle slot shows its last task with reset counts.

Timings differ between the two servers, so those are checked through their relations. The same
workload was run against llama-server b11312 on the factory's GGUF file (``llama:f32``): the
counters moved by the same amounts at each step. One difference remains by design: the prompt
cache here does not adopt a one-token prefix (llama-server's slot reused the BOS token of a new
prompt). Requests that only count tokens (and ``/slots``) wake a sleeping server as llama-server's
do (it unloads the vocabulary with the model), and the wake reports no bucket a scrape already
reported.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest

from tests.e2e.helpers import metric, wait_idle

pytestmark = pytest.mark.e2e

BATCH = 64
# llama-server's llamacpp:* families, in its order, with their types and help texts.
FAMILIES = [
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    ("n_decode_total", "counter", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter", "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
]
COUNTERS = [name for name, kind, _ in FAMILIES if kind == "counter"]
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the field. " * 6


@pytest.fixture(scope="module")
def server(server_factory, llama_dir):
    return server_factory(["-m", str(llama_dir), "-np", "1", "-c", "2048", "-b", str(BATCH), "--metrics", "--sleep-idle-seconds", "2"])


class Scraper:
    """Scrapes ``/metrics`` and reports what moved since the previous scrape."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.start_header: str | None = None
        self.last = self.scrape()

    def scrape(self) -> dict[str, float]:
        response = self.client.get("/metrics")
        assert response.status_code == 200
        header = response.headers["Process-Start-Time-Unix"]
        assert header.isdigit()
        if self.start_header is None:
            self.start_header = header
        assert header == self.start_header  # the same process, the same value
        return {name: metric(response.text, f"llamacpp:{name}") for name, _, _ in FAMILIES}

    def delta(self) -> tuple[dict[str, float], dict[str, float]]:
        """(what each counter moved, the gauges) since the previous scrape."""
        now = self.scrape()
        moved = {name: now[name] - self.last[name] for name in COUNTERS}
        self.last = now
        return moved, now


def _completion(client: httpx.Client, prompt: str, n: int) -> dict:
    body = client.post("/completion", json={"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0}).json()
    assert body["tokens_predicted"] == n
    return body["timings"]


def _close(a: float, b: float, rel: float = 2e-5) -> bool:
    """Equal up to the 6 significant digits llama-server prints (``rel``: a difference of two
    printed counters, whose rounding can weigh more)."""
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_families_names_types_and_help_are_llama_servers(server) -> None:
    response = httpx.get(server.base_url + "/metrics", timeout=30)
    assert response.headers["content-type"] == "text/plain; version=0.0.4"
    # llama-server's t_start: a monotonic clock in microseconds at start-up (not Unix time).
    start = int(response.headers["Process-Start-Time-Unix"])
    assert 0 < start <= time.monotonic_ns() // 1000
    # ... sent with llama-server's capitals: clients that copy headers into a plain dict (llama.cpp's
    # own tests do) look the name up so.
    assert (b"Process-Start-Time-Unix", str(start).encode()) in response.headers.raw
    text = response.text
    lines = [line for line in text.splitlines() if line.startswith("# TYPE llamacpp:") or line.startswith("# HELP llamacpp:")]
    expected = []
    for name, kind, doc in FAMILIES:
        expected += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}"]
    assert lines == expected
    # C++ stream formatting: integral values without a decimal point.
    assert "\nllamacpp:spec_decode_num_drafts_total 0\n" in text


def test_scripted_workload(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        n_prompt = len(client.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"])
        scraper = Scraper(client)

        # 1. Cold: every prompt token computed, ceil(P / batch) + (n - 1) decode calls.
        t = _completion(client, PROMPT, 4)
        moved, gauges = scraper.delta()
        assert (t["cache_n"], t["prompt_n"]) == (0, n_prompt)
        assert moved["prompt_tokens_total"] == n_prompt and moved["prompt_tokens_cached_total"] == 0
        assert moved["tokens_predicted_total"] == 4
        assert moved["n_decode_total"] == math.ceil(n_prompt / BATCH) + 3
        assert gauges["n_tokens_max"] >= n_prompt + 3  # the slot held prompt + 3 fed tokens
        assert _close(t["predicted_per_second"], 1000 * 3 / t["predicted_ms"])
        assert _close(t["predicted_per_token_ms"], t["predicted_ms"] / 3)
        assert _close(gauges["predicted_tokens_seconds"] * moved["tokens_predicted_seconds_total"], 3, rel=1e-2)
        assert _close(gauges["prompt_tokens_seconds"] * moved["prompt_seconds_total"], n_prompt, rel=1e-2)
        assert gauges["requests_processing"] == 0 and gauges["requests_deferred"] == 0
        assert gauges["n_busy_slots_per_decode"] == 1

        # 2. Full hit: all but the last prompt token come from the cache; one token -> rates 0.0.
        t = _completion(client, PROMPT, 1)
        moved, gauges = scraper.delta()
        assert (t["cache_n"], t["prompt_n"]) == (n_prompt - 1, 1)
        assert (t["predicted_per_second"], t["predicted_per_token_ms"]) == (0.0, 0.0)
        assert moved["prompt_tokens_cached_total"] == n_prompt - 1 and moved["prompt_tokens_total"] == 1
        assert moved["tokens_predicted_total"] == 1 and moved["n_decode_total"] == 1
        assert gauges["predicted_tokens_seconds"] == 0.0  # no decode step in this window

        # 3. Partial hit: a shared prefix from the cache, the rest computed.
        partial = PROMPT[: len(PROMPT) // 2] + "Then it stopped, looked around and went home for dinner."
        t = _completion(client, partial, 2)
        moved, _ = scraper.delta()
        assert 0 < t["cache_n"] < n_prompt // 2 + 1
        assert moved["prompt_tokens_cached_total"] == t["cache_n"]
        assert moved["prompt_tokens_total"] == t["prompt_n"]
        assert moved["tokens_predicted_total"] == 2

        # 4. Streamed: prompt counters move while it runs, the generation's once it ends.
        # 1000 tokens: the scrape below must land while they are still being written, and the
        # tiny model's greedy steps take ~0.25 ms (300 tokens in 70 ms in the engine): too little
        # margin for a scrape on a loaded machine.
        with client.stream("POST", "/completion", json={"prompt": "Stream " + PROMPT, "n_predict": 1000, "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            moved, gauges = scraper.delta()
            assert gauges["requests_processing"] == 1
            assert moved["prompt_tokens_total"] + moved["prompt_tokens_cached_total"] > 0
            assert moved["tokens_predicted_total"] == 0
            for _ in lines:
                pass
        wait_idle(client)
        moved, gauges = scraper.delta()
        assert moved["tokens_predicted_total"] == 1000
        assert gauges["predicted_tokens_seconds"] > 0

        # 5. Idle: a window without work reports zero throughput; asleep, nothing else changes;
        # a request that only counts tokens wakes the server, and the wake reports nothing again.
        moved, gauges = scraper.delta()
        assert all(v == 0 for v in moved.values())
        assert gauges["prompt_tokens_seconds"] == 0.0 and gauges["predicted_tokens_seconds"] == 0.0
        deadline = time.monotonic() + 30
        while not client.get("/props").json()["is_sleeping"]:
            assert time.monotonic() < deadline, "never went to sleep"
            time.sleep(0.2)
        messages = {"messages": [{"role": "user", "content": "How many tokens?"}]}
        for path, body in (("/tokenize", {"content": "count me"}), ("/apply-template", messages), ("/v1/chat/completions/input_tokens", messages)):
            assert client.post(path, json=body).status_code == 200
            assert client.get("/props").json()["is_sleeping"] is False, path
        moved, gauges = scraper.delta()
        assert all(v == 0 for v in moved.values()) and gauges["predicted_tokens_seconds"] == 0.0
        t = _completion(client, "Wake up and say something.", 40)  # wakes the model
        moved, gauges = scraper.delta()
        assert moved["tokens_predicted_total"] == 40 and moved["prompt_tokens_total"] == t["prompt_n"]
        assert _close(gauges["predicted_tokens_seconds"] * moved["tokens_predicted_seconds_total"], 39, rel=1e-2)


def test_idle_slot_after_a_completion(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        body = client.post("/completion", json={"prompt": "Slot check", "n_predict": 3, "ignore_eos": True}).json()
        wait_idle(client)
        slot = client.get("/slots").json()[0]
    assert slot["id_task"] >= 0 and slot["params"]["n_predict"] == 3
    assert slot["n_prompt_tokens"] == body["tokens_cached"]
    assert (slot["n_prompt_tokens_processed"], slot["n_prompt_tokens_cache"]) == (0, 0)
    assert slot["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]
