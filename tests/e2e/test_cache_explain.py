"""``cache_explain``: a request says why the prompt cache reused what it did, one test per cause of
docs/prompt-cache.md's "Why did my request miss?" (the media change is in test_vision.py).

One server for the module: the tiny llama with a LoRA adapter (a request's ``lora`` changes its
bucket), ``--prompt-cache-isolation salt`` (a ``cache_salt`` is a tenant) and room for 4 entries
(so that older entries are evicted). Each test sends its own prompts (a unique marker), so the
tests do not depend on each other's entries except where eviction is the point.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import httpx
import pytest

from mlxcel_compat.testing import adapters as factory
from tests.conftest import MODEL_CACHE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def http(server_factory, llama_dir) -> Iterator[httpx.Client]:
    adapter = factory.ensure_adapter("llama", "tiny", "gguf", cache_dir=MODEL_CACHE)
    srv = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "2048", "--lora", str(adapter),
                          "--prompt-cache-isolation", "salt", "--prompt-cache-max-entries", "4"])
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        yield client
    srv.stop()


def marker() -> str:
    return uuid.uuid4().hex[:8]


def system_prompt(time: str, tag: str) -> str:
    """A system prompt that starts with a timestamp: the most common real miss."""
    return f"Current time: 18:40:{time}. Conversation {tag}. You are a helpful assistant for a bicycle shop; answer briefly."


def chat(http: httpx.Client, system: str, user: str = "Hello there", *, explain: bool = True, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], "max_tokens": 4,
            "temperature": 0, **extra}
    if explain:
        body["cache_explain"] = True
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens(http: httpx.Client, system: str, user: str = "Hello there") -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    return http.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]


def test_a_timestamp_in_the_system_prompt_is_found_at_its_token(http):
    tag = marker()
    chat(http, system_prompt("01", tag), explain=False)
    explained = chat(http, system_prompt("05", tag))["cache_explain"]
    first, second = prompt_tokens(http, system_prompt("01", tag)), prompt_tokens(http, system_prompt("05", tag))
    at = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert explained["outcome"] == "miss" and explained["reason"] == "below_min_prefix" and explained["tokens_reused"] == 0
    assert explained["min_prefix"] == 32 and explained["first_divergence"] == at < 32
    assert explained["candidate"]["common_prefix"] == at and explained["candidate"]["same_bucket"]
    assert explained["request_window_tokens"] == {"before": second[max(0, at - 8):at], "after": second[at:at + 8]}
    assert explained["stored_window_tokens"] == {"before": first[max(0, at - 8):at], "after": first[at:at + 8]}
    assert explained["request_window"]["before"].endswith("18:40:") and explained["stored_window"]["before"] == explained["request_window"]["before"]
    assert explained["request_window"]["after"].startswith("05") and explained["stored_window"]["after"].startswith("01")


def test_the_first_request_and_then_a_hit(http):
    assert http.post("/v1/cache/reset", json={}).status_code == 200  # nothing stored: this request is the first
    system = system_prompt("00", marker())
    first = chat(http, system)["cache_explain"]
    assert first == {"outcome": "miss", "reason": "first_request", "tokens_reused": 0, "prompt_tokens": first["prompt_tokens"]}
    again = chat(http, system)
    explained = again["cache_explain"]
    assert explained["outcome"] == "hit" and explained["stage"] == "session"
    assert explained["tokens_reused"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] == explained["prompt_tokens"] - 1
    assert explained["first_divergence"] is None  # the stored prompt (and its answer) extends the request


def test_a_template_change_names_the_template(http):
    system = system_prompt("02", marker())
    chat(http, system, explain=False)
    explained = chat(http, system, chat_template_kwargs={"enable_thinking": False})["cache_explain"]
    assert explained["reason"] == "template_changed" and explained["candidate"]["differs"] == ["template"]
    assert explained["candidate"]["common_prefix"] == explained["prompt_tokens"]  # the very same text, another bucket


def test_a_lora_scale_change_names_the_lora(http):
    system = system_prompt("03", marker())
    chat(http, system, explain=False)
    explained = chat(http, system, lora=[{"id": 0, "scale": 0.5}])["cache_explain"]
    assert explained["reason"] == "lora_changed" and explained["candidate"]["differs"] == ["lora"]


def test_another_tenant_is_never_described(http):
    system = system_prompt("04", marker())
    chat(http, system, explain=False, cache_salt="tenant-a")
    explained = chat(http, system, cache_salt="tenant-b")["cache_explain"]
    assert explained["reason"] == "namespace" and explained["tokens_reused"] == 0
    assert not {"candidate", "stored_window", "first_divergence"} & set(explained)  # nothing of tenant a's entry
    # The tenant's own entries are explained as anyone's.
    assert chat(http, system, cache_salt="tenant-a")["cache_explain"]["outcome"] == "hit"


def test_an_evicted_entry_says_when_and_why(http):
    system = system_prompt("06", marker())
    chat(http, system, explain=False)
    for _ in range(4):  # room for 4 entries: these push it out
        chat(http, system_prompt("07", marker()), explain=False)
    explained = chat(http, system)["cache_explain"]
    assert explained["reason"] == "evicted" and explained["evicted"]["why"] == "lru"
    assert 0 <= explained["evicted"]["seconds_ago"] < 60 and explained["evicted"]["common_prefix"] == explained["prompt_tokens"]
    misses = http.get("/v1/cache/misses").json()
    assert misses["enabled"] and misses["misses"][0]["explained"] == "evicted" and misses["by_reason"]["evicted"] >= 1
    assert all("tokens" not in m for m in misses["misses"])


def test_cache_off_the_header_and_the_other_routes(http):
    system = system_prompt("08", marker())
    assert chat(http, system, cache_prompt=False)["cache_explain"]["reason"] == "cache_off"
    assert "cache_explain" not in chat(http, system, explain=False)
    body = {"messages": [{"role": "user", "content": system}], "max_tokens": 2, "temperature": 0}
    headed = http.post("/v1/chat/completions", json=body, headers={"X-Cache-Explain": "1"}).json()
    assert headed["cache_explain"]["prompt_tokens"] == headed["usage"]["prompt_tokens"]
    native = http.post("/completion", json={"prompt": system, "n_predict": 2, "cache_explain": True}).json()
    assert native["cache_explain"]["prompt_tokens"] == native["tokens_evaluated"]
    streamed = http.post("/completion", json={"prompt": system, "n_predict": 2, "cache_explain": True, "stream": True}).text
    assert '"cache_explain"' in streamed.strip().split("\n")[-1]  # on the final chunk
    anthropic = http.post("/v1/messages", json={"messages": [{"role": "user", "content": system}], "max_tokens": 2,
                                                "cache_explain": True}).json()
    assert anthropic["cache_explain"]["outcome"] in ("hit", "miss")
    openai_stream = http.post("/v1/chat/completions", json={**body, "stream": True, "cache_explain": True}).text
    assert openai_stream.count('"cache_explain"') == 1
    assert http.post("/v1/chat/completions", json={**body, "cache_explain": "yes"}).status_code == 400
