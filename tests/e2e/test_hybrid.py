"""A hybrid model served from GGUF by the real server: the factory's Qwen3.5, Q8_0 file.

One server (two slots, a slot-save path): the start-up log says its decode steps run on the CPU
decode runtime (the gated delta-net layers in its C loop, their state in the cache); a two-turn chat restores the first turn's snapshot (the
history is not prefilled again) and answers exactly as a fresh session does (same boundary
split, the same arithmetic); a slot saved, erased and restored continues the conversation exactly
as the slot's own state did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, tiny_model

pytestmark = pytest.mark.e2e

SYSTEM = "You are a terse assistant for a lighthouse museum. Answer in one short sentence."
GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-slots")


@pytest.fixture(scope="module")
def server(server_factory, slot_dir: Path) -> ServerProcess:
    return server_factory(["-m", str(tiny_model("qwen3_5:q8_0")), "-np", "2", "-c", "4096", "-b", "64",
                           "--prompt-cache-min-prefix", "16", "--slot-save-path", str(slot_dir)],
                          env={"MLXCEL_DISABLE_CACHE_WARMUP": "1"})


@pytest.fixture()
def client(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def test_the_start_up_log_says_decode_steps_run_on_the_cpu_runtime(server: ServerProcess) -> None:
    log = server.log()
    assert "arch qwen35" in log
    assert "decode step: CPU decode runtime" in log and "decode step: MLX" not in log


def chat(c: httpx.Client, messages: list[dict[str, Any]], key: str) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0,
                                             "prompt_cache_key": key})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_next_turn_restores_the_snapshot_and_answers_as_a_fresh_session(client: httpx.Client) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When was the lamp first lit?"}]
    first = chat(client, messages, "visitor")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And who kept it?"}]
    second = chat(client, messages, "visitor")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]  # the first turn's history is not prefilled again
    assert client.get("/v1/cache/stats").json()["snapshot_hits"] >= 1
    fresh = chat(client, messages, "someone-else")  # no snapshot of this session: prefilled in full
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


def test_a_restored_slot_continues_like_the_slot_itself(client: httpx.Client, slot_dir: Path) -> None:
    prompt = "The keeper climbed the tower at dusk and"
    first = client.post("/completion", json={"prompt": prompt, "id_slot": 0, **GREEDY}).json()
    saved = client.post("/slots/0", params={"action": "save"}, json={"filename": "keeper.bin"}).json()
    assert saved["n_saved"] == first["tokens_cached"] and (slot_dir / "keeper.bin").stat().st_size > 0
    follow_up = prompt + first["content"] + " Then the fog came in and"
    direct = client.post("/completion", json={"prompt": follow_up, "id_slot": 0, **GREEDY}).json()
    assert direct["timings"]["cache_n"] == saved["n_saved"]  # the slot's own state, extended

    assert client.post("/slots/0", params={"action": "erase"}).json()["n_erased"] > 0
    client.post("/v1/cache/reset").raise_for_status()  # nothing but the file can help now
    restored = client.post("/slots/0", params={"action": "restore"}, json={"filename": "keeper.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    again = client.post("/completion", json={"prompt": follow_up, "id_slot": 0, **GREEDY}).json()
    assert again["timings"]["cache_n"] == saved["n_saved"]
    assert again["content"] == direct["content"]
