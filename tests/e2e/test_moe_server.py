"""A mixture-of-experts GGUF through a real server: the factory's qwen3_moe as Q8_0, with the
prompt cache and its disk tier, slot files, a LoRA adapter on the attention projections and two
slots decoding together.

Cache hits (RAM and disk) and restored slots are compared with cold runs of the same request:
on the tiny model greedy outputs agree (tests/engine/test_moe_engine.py holds the bit-exact
comparisons). The start-up log says what runs the experts, and that the CPU decode runtime
runs the steps (MoE layers included: runtime/decode_moe.py).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from mlxcel_compat.testing import adapters as factory
from tests.conftest import MODEL_CACHE, ServerProcess, tiny_model

pytestmark = pytest.mark.e2e

STORY = ("The lighthouse keeper wrote every evening in a leather notebook: the colour of the sea, the ships "
         "that passed, the birds on the rocks and the weather that came from the west over the long grey water.")
GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe_server(server_factory, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    adapter = factory.ensure_adapter("qwen3_moe", "tiny", "gguf", cache_dir=MODEL_CACHE)
    return server_factory([
        "-m", str(tiny_model("qwen3_moe:q8_0")), "-np", "2", "-c", "2048", "-b", "64", "--metrics",
        "--prompt-cache-min-prefix", "8", "--slot-save-path", str(tmp_path_factory.mktemp("moe-slots")),
        "--prompt-cache-dir", str(tmp_path_factory.mktemp("moe-disk")), "--prompt-cache-write-through",
        "--lora", str(adapter),
    ])


@pytest.fixture()
def http(moe_server: ServerProcess):
    with httpx.Client(base_url=moe_server.base_url, timeout=120) as c:
        c.post("/lora-adapters", json=[{"id": 0, "scale": 0.0}]).raise_for_status()  # off unless asked
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def complete(c: httpx.Client, prompt: str, **extra: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_start_up_log_names_the_experts_in_blocks_and_the_runtime_s_steps(moe_server: ServerProcess) -> None:
    log = moe_server.log()
    assert "arch qwen3moe" in log
    assert "experts in blocks q8_0" in log and "only the chosen experts' rows" in log
    assert "expanded" not in log
    assert "decode step: CPU decode runtime" in log and "CPU decode runtime not used" not in log


def test_prompt_cache_hits_from_ram_and_disk_equal_the_cold_run(http: httpx.Client) -> None:
    prompt = STORY + " Tonight he wrote:"
    cold = complete(http, prompt, cache_prompt=False)
    first = complete(http, prompt)
    warm = complete(http, prompt)
    assert first["timings"]["cache_n"] == 0 and warm["timings"]["cache_n"] > 0
    assert first["content"] == warm["content"] == cold["content"]
    deadline = time.monotonic() + 30
    while http.get("/v1/cache/stats").json()["tiers"]["disk"]["entries"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # --prompt-cache-write-through: wait for the writer
    http.post("/v1/cache/reset", json={"tier": "ram"}).raise_for_status()
    from_disk = complete(http, prompt)
    assert from_disk["timings"]["cache_n"] > 0 and from_disk["content"] == cold["content"]
    assert http.get("/v1/cache/stats").json()["tiers"]["disk"]["hits"] >= 1


def test_a_restored_slot_continues_as_the_uncut_run(http: httpx.Client) -> None:
    prompt = STORY + " The next morning"
    first = complete(http, prompt, id_slot=0)
    saved = http.post("/slots/0", params={"action": "save"}, json={"filename": "moe.bin"})
    assert saved.status_code == 200 and saved.json()["n_saved"] > 0, saved.text
    assert http.post("/slots/0", params={"action": "erase"}).status_code == 200
    http.post("/v1/cache/reset").raise_for_status()  # only the slot file holds the prompt now
    restored = http.post("/slots/0", params={"action": "restore"}, json={"filename": "moe.bin"})
    assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"]
    again = complete(http, prompt, id_slot=0)
    assert again["timings"]["cache_n"] > 0 and again["content"] == first["content"]


def test_lora_on_the_attention_projections_changes_the_output_and_never_mixes_cache_entries(
        http: httpx.Client) -> None:
    prompt = STORY + " In the margin"
    plain = complete(http, prompt)
    adapted = complete(http, prompt, lora=[{"id": 0, "scale": 0.75}])
    assert adapted["generation_settings"]["lora"] == [{"id": 0, "scale": 0.75}]
    assert adapted["timings"]["cache_n"] == 0  # the plain run's entry is another adapter set's
    assert adapted["content"] != plain["content"]
    again = complete(http, prompt, lora=[{"id": 0, "scale": 0.75}])
    assert again["timings"]["cache_n"] > 0 and again["content"] == adapted["content"]
    assert complete(http, prompt, cache_prompt=False)["content"] == plain["content"]


def test_two_slots_decoding_together_give_their_lone_outputs(http: httpx.Client) -> None:
    prompts = [STORY, "A short note about the weather on the island, written by a tired fisherman at dawn"]
    alone = [complete(http, p, cache_prompt=False, n_predict=24)["content"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: complete(http, p, cache_prompt=False, n_predict=24)["content"], prompts))
    assert together == alone
