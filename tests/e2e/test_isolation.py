"""End to end: tenant isolation of the prompt cache (``--prompt-cache-isolation``).

With several API keys the default is ``api-key``: tenant B sending tenant A's exact prompt gets
``cached_tokens`` 0 and the cold output (no speed-up to observe), while A's repeat hits. The
``cache_salt`` field (vLLM's) partitions further. Raw HTTP and the official openai client.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are the support assistant of a small bicycle shop. You answer questions about repairs, "
    "opening hours, second-hand bikes and the spare parts in stock. Keep answers short."
)
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you fix punctures on Sundays?"}]
PROMPT = SYSTEM + " Question: how long does a full service take, and can I wait in the shop?"


@pytest.fixture(scope="module")
def two_keys(server_factory, qwen3_dir) -> str:
    server = server_factory(
        ["-m", str(qwen3_dir), "-np", "2", "-c", "4096", "--metrics", "--prompt-cache-min-prefix", "16", "--api-key", "key-a,key-b"]
    )
    return server.base_url


def completion(base_url: str, key: str | None, **body: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, **body}
    response = httpx.post(base_url + "/completion", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def reset(base_url: str, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    httpx.post(base_url + "/v1/cache/reset", headers=headers, timeout=30).raise_for_status()


def test_tenant_b_never_reuses_tenant_a_prompt(two_keys: str) -> None:
    reset(two_keys, "key-a")
    cold = completion(two_keys, "key-a", cache_prompt=False)
    a1 = completion(two_keys, "key-a")
    assert a1["timings"]["cache_n"] == 0
    b1 = completion(two_keys, "key-b")
    # No reuse: every prompt token was computed again, and the output is the cold one.
    assert b1["timings"]["cache_n"] == 0 and b1["timings"]["prompt_n"] == b1["tokens_evaluated"]
    assert b1["content"] == cold["content"]
    a2 = completion(two_keys, "key-a")
    assert a2["timings"]["cache_n"] > 16 and a2["content"] == cold["content"]
    b2 = completion(two_keys, "key-b")  # B's own entry now
    assert b2["timings"]["cache_n"] > 16 and b2["content"] == cold["content"]
    # cache_salt partitions a tenant further.
    salted = completion(two_keys, "key-a", cache_salt="project-x")
    assert salted["timings"]["cache_n"] == 0 and salted["content"] == cold["content"]
    stats = httpx.get(two_keys + "/v1/cache/stats", headers={"Authorization": "Bearer key-a"}).json()
    assert stats["isolation"] == "api-key"


def test_openai_clients_of_two_tenants(two_keys: str) -> None:
    reset(two_keys, "key-a")
    a = openai.OpenAI(base_url=two_keys + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=two_keys + "/v1", api_key="key-b", max_retries=0)

    def ask(client: openai.OpenAI) -> Any:
        return client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=6, temperature=0)

    first = ask(a)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    other = ask(b)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == first.choices[0].message.content
    again = ask(a)
    assert again.usage.prompt_tokens_details.cached_tokens > 16
    assert again.choices[0].message.content == first.choices[0].message.content


def test_cache_salt_must_be_a_string(two_keys: str) -> None:
    response = httpx.post(
        two_keys + "/completion", json={"prompt": "hi", "n_predict": 1, "cache_salt": 5}, headers={"Authorization": "Bearer key-a"}
    )
    assert response.status_code == 400 and "cache_salt" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def salted(server_factory, qwen3_dir) -> str:
    """No API key; requests are partitioned by their cache_salt only."""
    server = server_factory(
        ["-m", str(qwen3_dir), "-np", "2", "-c", "4096", "--prompt-cache-min-prefix", "16", "--prompt-cache-isolation", "salt"]
    )
    return server.base_url


def test_salt_isolation_without_keys(salted: str) -> None:
    reset(salted)
    completion(salted, None, cache_salt="s1")
    assert completion(salted, None, cache_salt="s2")["timings"]["cache_n"] == 0
    assert completion(salted, None)["timings"]["cache_n"] == 0  # no salt: the shared namespace
    assert completion(salted, None, cache_salt="s1")["timings"]["cache_n"] > 16
    # extra_body, as raw HTTP clients send it, works too
    assert completion(salted, None, extra_body={"cache_salt": "s1"})["timings"]["cache_n"] > 16


def test_one_key_shares_the_cache_by_default(server_factory, qwen3_dir) -> None:
    """A single key is one tenant: the default isolation is none, so a repeat hits whatever salt."""
    server = server_factory(["-m", str(qwen3_dir), "-np", "1", "-c", "4096", "--prompt-cache-min-prefix", "16", "--api-key", "only"])
    completion(server.base_url, "only")
    again = completion(server.base_url, "only", cache_salt="ignored")
    assert again["timings"]["cache_n"] > 16


def test_session_snapshots_are_per_tenant(server_factory) -> None:
    """A recurrent model: reuse goes through session snapshots (boundary, warm-up, completion).
    Tenant B, with A's session key and A's exact second turn, restores nothing; A restores."""
    from tests.conftest import tiny_model

    server = server_factory(
        ["-m", str(tiny_model("qwen3_next")), "-c", "4096", "--prompt-cache-min-prefix", "16", "--api-key", "key-a,key-b"]
    )
    url = server.base_url

    def turn(key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": 6, "temperature": 0, "prompt_cache_key": "shared-session"}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    first = turn("key-a", MESSAGES)
    second = MESSAGES + [first["choices"][0]["message"], {"role": "user", "content": "And on Mondays?"}]
    stats = lambda: httpx.get(url + "/v1/cache/stats", headers={"Authorization": "Bearer key-a"}).json()  # noqa: E731
    deadline = time.monotonic() + 30
    while stats()["snapshot_warmups_run"] + stats()["snapshot_warmups_skipped"] < 1:  # A's warm-up ran
        assert time.monotonic() < deadline
        time.sleep(0.02)
    other = turn("key-b", second)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    own = turn("key-a", second)
    assert own["usage"]["prompt_tokens_details"]["cached_tokens"] > 16
    assert own["choices"][0]["message"]["content"] == other["choices"][0]["message"]["content"]
