"""Two replicas behind vllm-router (``scripts/cluster.sh``): sessions stick, later turns hit the
prompt cache, outputs equal a single server's, and SIGTERM stops every process.

vllm-router is the real Rust router from PyPI (the ``test`` extra installs it). Which replica
served a request is read from the replicas themselves: requests go one at a time, and exactly one
replica's prompt-cache lookup counter moves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from mlxcel_compat.testing.cluster import ClusterProcess
from tests.conftest import ServerProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

SERVER_FLAGS = ["-np", "2", "-c", "4096", "-b", "64", "--metrics", "--prompt-cache-min-prefix", "16"]
SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short."
)
QUESTIONS = ["When do you open on Saturday?", "How do I renew a book?", "Can I borrow a laptop?"]
N_SESSIONS = 12  # the router's hash puts all of them on one replica with probability 2^-11
GREEDY = {"temperature": 0}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def lookups(cluster: ClusterProcess) -> list[int]:
    return [httpx.get(url + "/v1/cache/stats", timeout=10).json()["lookups"] for url in cluster.replica_urls]


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProcess]:
    c = ClusterProcess(2, free_port(), tmp_path_factory.mktemp("cluster") / "logs", ["-m", str(llama_dir), *SERVER_FLAGS])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def single(server_factory, llama_dir: Path) -> ServerProcess:
    return server_factory(["-m", str(llama_dir), *SERVER_FLAGS])


def chat_turn(base_url: str, session: str, messages: list[dict[str, Any]], cache_prompt: bool = True) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, extra_headers={"X-Session-ID": session},
                                       extra_body={**GREEDY, "cache_prompt": cache_prompt})
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def messages_turn(base_url: str, session: str, messages: list[dict[str, Any]], cache_prompt: bool = True) -> tuple[str, int, int]:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    r = client.messages.create(model="tiny", max_tokens=6, system=messages[0]["content"], messages=messages[1:],
                               extra_headers={"X-Session-ID": session}, extra_body={**GREEDY, "cache_prompt": cache_prompt})
    text = "".join(block.text for block in r.content if block.type == "text")
    u = r.usage
    return text, u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens, u.cache_read_input_tokens


def test_sessions_stick_hit_the_cache_and_match_a_single_server(cluster: ClusterProcess, single: ServerProcess) -> None:
    # Half the sessions speak OpenAI chat, half the Anthropic Messages API (a route the router
    # forwards unchanged); all carry X-Session-ID, the header vllm-router's consistent_hash reads first.
    sessions = [(f"conversation-{i}", chat_turn if i % 2 == 0 else messages_turn) for i in range(N_SESSIONS)]
    history = {name: [{"role": "system", "content": SYSTEM}] for name, _ in sessions}
    served_by: dict[str, set[int]] = {name: set() for name, _ in sessions}
    last_prompt: dict[str, int] = {}
    for turn, question in enumerate(QUESTIONS):
        for name, send in sessions:  # interleaved: every session's turn t before any turn t+1
            messages = history[name] + [{"role": "user", "content": f"{question} (asks {name})"}]
            before = lookups(cluster)
            text, prompt_tokens, cached = send(cluster.url, name, messages)
            after = lookups(cluster)
            moved = [i for i in range(2) if after[i] != before[i]]
            assert len(moved) == 1, (before, after)
            served_by[name].add(moved[0])
            # The same conversation on one plain server, cold: the routed (and cached) reply is the same.
            cold_text, cold_prompt, cold_cached = send(single.base_url, name, messages, cache_prompt=False)
            assert (text, prompt_tokens) == (cold_text, cold_prompt), name
            assert cold_cached == 0
            if turn:
                # The replica that served the last turn serves this one, and reuses at least that prompt.
                assert cached >= last_prompt[name], (name, turn, cached, last_prompt[name])
            last_prompt[name] = prompt_tokens
            history[name] = messages + [{"role": "assistant", "content": text}]
    assert all(len(r) == 1 for r in served_by.values()), served_by
    assert {next(iter(r)) for r in served_by.values()} == {0, 1}, "both replicas serve sessions"


def test_router_forwards_native_routes_and_worker_endpoints(cluster: ClusterProcess) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        done = c.post("/completion", json={"prompt": "Hello", "n_predict": 3, "cache_prompt": True}, headers={"X-Session-ID": "n1"})
        assert done.status_code == 200 and done.json()["tokens_predicted"] == 3
        assert c.post("/tokenize", json={"content": "Hello"}).json()["tokens"]
        assert c.get("/get_model_info").json()["is_generation"] is True
        assert c.get("/get_server_info").json()["total_slots"] == 2
        assert c.get("/health").status_code == 200
        assert c.post("/flush_cache").status_code == 200  # the router sends it to every replica
    assert all(httpx.get(url + "/v1/cache/stats").json()["entries"] == 0 for url in cluster.replica_urls)
    for url in cluster.replica_urls:  # per-replica Prometheus, scraped from each replica directly
        assert "llamacpp:prompt_tokens_total" in httpx.get(url + "/metrics").text


def test_sigterm_stops_every_process_and_keeps_the_logs(cluster: ClusterProcess) -> None:
    assert all(alive(pid) for pid in cluster.pids)
    code = cluster.stop()
    assert code == 143
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in cluster.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in cluster.pids)
    for name in ("replica-0.log", "replica-1.log", "router.log"):
        assert (cluster.log_dir / name).stat().st_size > 0, name
    assert "Consistent hash routing" in (cluster.log_dir / "router.log").read_text(errors="replace")
