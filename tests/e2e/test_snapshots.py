"""Multi-turn chat through the real server on models whose state cannot be cut to a prefix.

Three servers per family: everything on, boundary snapshots only (MLXCEL_DISABLE_CACHE_WARMUP=1),
and completion snapshots only (both kill switches). The same 6-turn conversation runs against
each; the prefilled-token totals show what each mechanism contributes.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short."
)
QUESTIONS = [
    "When does the library open on Saturday?",
    "How do I renew a book online?",
    "Can I borrow a laptop?",
    "Is the reading room quiet after six?",
    "Do you keep old newspapers?",
    "Where is the nearest branch?",
]
CONFIGS = {
    "full": {},
    "boundary_only": {"MLXCEL_DISABLE_CACHE_WARMUP": "1"},
    "completion_only": {"MLXCEL_DISABLE_CACHE_WARMUP": "1", "MLXCEL_DISABLE_BOUNDARY_SNAPSHOT": "1"},
}


def wait_for_warmup(client: httpx.Client, done_before: int) -> None:
    """A real client thinks between turns; the test waits until the engine handled the warm-up."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.get("/v1/cache/stats").json()
        if stats["snapshot_warmups_run"] + stats["snapshot_warmups_skipped"] > done_before:
            return
        time.sleep(0.02)
    raise AssertionError("warm-up never ran")


def history_tokens(client: httpx.Client, messages: list[dict[str, Any]]) -> int:
    """Token length of the conversation rendered as closed history (what a snapshot can hold)."""
    text = client.post("/apply-template", json={"messages": messages, "add_generation_prompt": False}).json()["prompt"]
    return len(client.post("/tokenize", json={"content": text}).json()["tokens"])


def converse(client: httpx.Client, warmup: bool) -> list[dict[str, int]]:
    client.post("/v1/cache/reset").raise_for_status()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for question in QUESTIONS:
        history = history_tokens(client, messages)
        messages.append({"role": "user", "content": question})
        warmups = client.get("/v1/cache/stats").json()["snapshot_warmups_run"]
        reply = client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, "temperature": 0, "prompt_cache_key": "reader"},
        ).json()
        usage = reply["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        turns.append({"prompt": usage["prompt_tokens"], "cached": cached, "prefilled": usage["prompt_tokens"] - cached, "history": history})
        assert reply["timings"]["prompt_n"] == usage["prompt_tokens"] - cached
        messages.append(reply["choices"][0]["message"])
        if warmup:
            wait_for_warmup(client, warmups)
    return turns


@pytest.fixture(scope="module", params=["qwen3_next", "gemma3_text"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def runs(family: str, server_factory) -> dict[str, list[dict[str, int]]]:
    from tests.conftest import tiny_model

    model = tiny_model(family)
    out = {}
    servers = {name: server_factory(["-m", str(model), "-b", "64", "-c", "4096", "--prompt-cache-min-prefix", "16"],
                                    env=env, wait=False) for name, env in CONFIGS.items()}  # start together
    for name, server in servers.items():
        server.wait_healthy()
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            out[name] = converse(client, warmup=name == "full")
            out[name + "_stats"] = client.get("/v1/cache/stats").json()
        server.stop()
    return out


def test_boundary_snapshots_cover_the_previous_history(runs) -> None:
    for name in ("full", "boundary_only"):
        turns = runs[name]
        assert turns[0]["cached"] == 0
        for previous, turn in zip(turns, turns[1:]):
            # The snapshot taken at the previous turn's history boundary (or better) is restored.
            assert turn["cached"] >= previous["history"], (name, turns)


def test_warm_up_leaves_only_the_new_user_message_to_prefill(runs) -> None:
    turns = runs["full"]
    for turn in turns[1:]:
        # Everything of the conversation up to the reply is restored; what is left is the new
        # user message and its template scaffolding (nothing of the history).
        new_part = turn["prompt"] - turn["history"]
        assert turn["cached"] >= turn["history"] - 1
        assert turn["prefilled"] <= new_part + 1
    stats = runs["full_stats"]
    assert stats["snapshot_warmups_run"] >= len(QUESTIONS) - 1
    assert stats["snapshot_hits_by_origin"]["boundary"] >= len(QUESTIONS) - 1


def test_each_mechanism_contributes(runs) -> None:
    total = {name: sum(t["prefilled"] for t in runs[name][1:]) for name in CONFIGS}
    assert total["full"] < total["boundary_only"] < total["completion_only"], total
    assert runs["boundary_only_stats"]["snapshot_warmups_run"] == 0
    assert runs["completion_only_stats"]["snapshot_inserts_by_origin"]["boundary"] == 0
    assert runs["boundary_only_stats"]["snapshot_inserts_by_origin"]["boundary"] > 0


def test_metrics_and_reset_cover_snapshots(family: str, server_factory) -> None:
    from tests.conftest import tiny_model

    server = server_factory(["-m", str(tiny_model(family)), "--metrics", "--prompt-cache-min-prefix", "16"])
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0}).raise_for_status()
        wait_for_warmup(client, 0)  # the background warm-up inserts a snapshot of its own
        stats = client.get("/v1/cache/stats").json()
        metrics = client.get("/metrics").text
        assert f"mlxcel_prompt_cache_snapshot_entries {float(stats['snapshot_entries'])}" in metrics
        assert 'mlxcel_prompt_cache_snapshot_rejections_total{reject="no_candidate"} 1.0' in metrics
        assert stats["snapshot_entries"] >= 1
        cleared = client.post("/v1/cache/reset").json()
        assert cleared["cleared_entries"] == stats["snapshot_entries"] + stats["entries"]
        assert cleared["cleared_bytes"] == stats["snapshot_bytes"] + stats["bytes"]
        after = client.get("/v1/cache/stats").json()
        assert after["snapshot_entries"] == 0 and after["snapshot_bytes"] == 0
        # cache_explain: a snapshot serves its own session only, so another session's request names it.
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        client.post("/v1/chat/completions", json=body).raise_for_status()
        explained = client.post("/v1/chat/completions", json={**body, "prompt_cache_key": "someone-else", "cache_explain": True}).json()["cache_explain"]
        assert explained["reason"] == "session" and explained["tokens_reused"] == 0
        assert explained["candidate"]["same_bucket"] and not explained["candidate"]["same_session"]
