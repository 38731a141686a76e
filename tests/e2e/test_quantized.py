"""End to end on a quantized GGUF (the factory's small llama as Q4_K_M: Q4_K and Q6_K blocks),
served from the file's blocks: what a llama-server user's Q4_K_M download gets.

The server keeps the weights in the mapped file and says what computes them; the prompt cache,
slot files and the disk tier work as on float models, and every cache hit gives the output of
a cold run exactly (prompt tokens are float32 math on the blocks' values however the prompt was
split, decode steps are ggml's arithmetic row by row; the splits here are on chunk multiples).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType

from mlxcel_compat.runtime import block_weight, ggml_repack
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, ServerProcess
from tests.e2e.test_disk_cache import disk_stats, start, text
from tests.e2e.test_slots import STORY, action

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def q4_k_m() -> Path:
    return ensure_gguf("llama", "small", "q4_k_m", cache_dir=MODEL_CACHE)


@pytest.fixture(scope="module")
def quantized_server(server_factory, q4_k_m: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    slots = tmp_path_factory.mktemp("quantized-slots")
    return server_factory(["-m", str(q4_k_m), "-np", "2", "-c", "2048", "-b", "32", "--props",
                           "--slot-save-path", str(slots)])


@pytest.fixture()
def client(quantized_server: ServerProcess):
    with httpx.Client(base_url=quantized_server.base_url, timeout=120) as c:
        yield c


def complete(c: httpx.Client, prompt: Any, **extra: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_weights_stay_in_the_files_blocks(quantized_server: ServerProcess, client: httpx.Client, q4_k_m: Path) -> None:
    log = quantized_server.log()
    assert "GGUF weights kept as:" in log and "blocks q4_k" in log and "blocks q6_k" in log
    assert "computed by ggml q4_K x q8_K" in log and "computed by ggml q6_K x q8_K" in log
    lib = block_weight.library()
    if not isinstance(lib, str) and int(GGMLQuantizationType.Q4_K) in lib.grouped_kinds:  # AVX-512 VNNI: the shim's lanes
        assert "grouped at load" in log and "repacked by ggml" not in log and "by ggml's mul_mat" not in log
    elif ggml_repack.takes_prompt_products(GGMLQuantizationType.Q4_K):  # ggml 0.25 (scripts/setup.sh)
        assert "; prompts of " in log and "by ggml's mul_mat" in log and "repacked by ggml" not in log
    assert "weights take" in log and "expanded to float32" not in log
    assert "decode step: CPU decode runtime" in log
    assert client.get("/props").json()["model_ftype"] == "Q4_K - Medium"


def test_a_prompt_cache_hit_gives_the_cold_output(client: httpx.Client) -> None:
    prompt = STORY + " Then he wrote:"
    cold = complete(client, prompt, cache_prompt=False)
    first = complete(client, prompt)
    warm = complete(client, prompt)
    # Adopted whole, first token from the entry's kept logits (docs/prompt-cache.md, lookup step 7).
    assert warm["timings"]["cache_n"] == warm["tokens_evaluated"] and warm["timings"]["prompt_n"] == 0
    assert first["content"] == cold["content"] and warm["content"] == cold["content"]

    # A longer prompt adopts the first one's KV (a split at a multiple of the 32-token chunk) and
    # continues exactly as its cold run.
    ids = client.post("/tokenize", json={"content": prompt}).json()["tokens"]
    longer = ids[:64] + client.post("/tokenize", json={"content": " Far out at sea, a bell rang."}).json()["tokens"]
    complete(client, ids[:64] + [ids[64]])  # leaves 64 prompt tokens in the cache
    hit = complete(client, longer)
    assert hit["timings"]["cache_n"] == 64
    assert hit["content"] == complete(client, longer, cache_prompt=False)["content"]


def test_slot_files_round_trip_on_a_quantized_model(client: httpx.Client) -> None:
    prompt = STORY + " Tonight he wrote:"
    first = complete(client, prompt, id_slot=0)
    assert action(client, 0, "save", "q.bin").status_code == 200
    action(client, 0, "erase").raise_for_status()
    client.post("/v1/cache/reset").raise_for_status()
    restored = action(client, 0, "restore", "q.bin")
    assert restored.status_code == 200, restored.text
    again = complete(client, prompt, id_slot=0)
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert again["content"] == first["content"]


def test_openai_chat_streams_on_a_quantized_model(quantized_server: ServerProcess) -> None:
    oai = openai.OpenAI(base_url=quantized_server.base_url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    stream = oai.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    whole = oai.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens == 8


def test_the_disk_tier_keeps_a_quantized_models_prompts_across_a_restart(server_factory, tmp_path: Path, q4_k_m: Path) -> None:
    prompt = text(90, seed=7)
    first = start(server_factory, tmp_path, model=q4_k_m)
    with httpx.Client(base_url=first.base_url, timeout=120) as c:
        cold = complete(c, prompt)
    first.stop()  # a clean shutdown writes RAM to the disk tier
    assert "entries written at shutdown" in first.log()
    second = start(server_factory, tmp_path, model=q4_k_m)
    with httpx.Client(base_url=second.base_url, timeout=120) as c:
        warm = complete(c, prompt)
        assert warm["timings"]["cache_n"] == warm["tokens_evaluated"] - 1
        assert warm["content"] == cold["content"]
        assert disk_stats(c)["hits"] == 1
