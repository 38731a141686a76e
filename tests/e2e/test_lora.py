"""LoRA adapters through real servers: llama-server's API shapes, outputs against a fused model,
and a prompt cache that never mixes scales (RAM, disk tier, slot files).

Adapters come from the factory (``testing/adapters.py``): adapter 0 a GGUF LoRA file, adapter 1
an mlx-lm directory. The fused reference is a copy of the model directory whose weights this test
fuses itself (``W + scale * multiplier * B @ A``); with greedy sampling the texts agree.
"""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxcel_compat.testing import adapters as factory
from tests.conftest import MODEL_CACHE, ServerProcess, tiny_model

PROMPT = ("The keeper of the lighthouse walked up the spiral stairs every evening, counting the steps and "
          "listening to the sea below, and then he wrote in his book")
OTHER = "A short note about the weather on the island, written by a tired fisherman at dawn"


def gguf_adapter() -> Path:
    return factory.ensure_adapter("llama", "tiny", "gguf", cache_dir=MODEL_CACHE)


def mlx_adapter() -> Path:
    return factory.ensure_adapter("llama", "tiny", "mlx", cache_dir=MODEL_CACHE, seed=7)


def fused_dir(tmp: Path, scale: float) -> Path:
    """The tiny llama with adapter 0 fused into its weights at ``scale``, computed here."""
    base = tiny_model("llama")
    out = tmp / f"fused-{scale}"
    shutil.copytree(base, out)
    weights = dict(mx.load(str(base / "model.safetensors")))
    factors, multiplier = factory.adapter_factors("llama", "tiny")
    for path, (a, b) in factors.items():
        name = path + ".weight"
        weights[name] = weights[name] + np.float32(scale * multiplier) * (mx.array(b) @ mx.array(a))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "mlxcel_testing.json").unlink()
    return out


def lora_args(*extra: str) -> list[str]:
    return ["-m", str(tiny_model("llama")), "-np", "2", "-c", "2048", "-b", "64", "--prompt-cache-min-prefix", "8",
            "--lora", str(gguf_adapter()), "--lora-scaled", f"{mlx_adapter()}:0.5", *extra]


@pytest.fixture(scope="module")
def lora_server(server_factory, tmp_path_factory) -> ServerProcess:
    slots = tmp_path_factory.mktemp("lora-slots")
    return server_factory(lora_args("--props", "--slot-save-path", str(slots)))


@pytest.fixture()
def http(lora_server: ServerProcess):
    with httpx.Client(base_url=lora_server.base_url, timeout=60) as c:
        c.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]).raise_for_status()
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def complete(c: httpx.Client, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, "temperature": 0, "n_predict": 8, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_get_and_post_lora_adapters_have_llama_servers_shapes(http) -> None:
    listing = http.get("/lora-adapters").json()
    assert listing == [
        {"id": 0, "path": str(gguf_adapter()), "scale": 1.0, "task_name": "", "prompt_prefix": ""},
        {"id": 1, "path": str(mlx_adapter()), "scale": 0.5, "task_name": "", "prompt_prefix": ""},
    ]
    r = http.post("/lora-adapters", json=[{"id": 1, "scale": 0.25}, {"id": 9, "scale": 3.0}])
    assert r.status_code == 200 and r.json() == {"success": True}
    assert [a["scale"] for a in http.get("/lora-adapters").json()] == [0.0, 0.25]  # not listed: 0
    for body in ({"id": 0, "scale": 1.0}, "x", 3):
        r = http.post("/lora-adapters", json=body)
        assert r.status_code == 400
        assert r.json()["error"] == {"code": 400, "message": "Request body must be an array", "type": "invalid_request_error"}
    assert http.post("/lora-adapters", content=b"[{").status_code == 400
    assert [a["scale"] for a in http.get("/lora-adapters").json()] == [0.0, 0.25]  # refused: unchanged


def test_props_and_generation_settings_report_the_adapters(http) -> None:
    params = http.get("/props").json()["default_generation_settings"]["params"]
    assert params["lora"] == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]
    out = complete(http, lora=[{"id": 1, "scale": 2.0}])
    assert out["generation_settings"]["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 2.0}]
    assert complete(http, lora=[])["generation_settings"]["lora"] == params["lora"]  # empty: the global scales
    r = http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "lora": {"id": 0}})
    assert r.status_code == 400 and "'lora' must be an array" in r.json()["error"]["message"]


def test_output_equals_a_model_with_fused_weights(server_factory, lora_server, server, tmp_path) -> None:
    fused = server_factory(["-m", str(fused_dir(tmp_path, 0.75)), "-np", "2", "-c", "2048", "-b", "64"])
    ours = openai.OpenAI(base_url=lora_server.base_url + "/v1", api_key="x", max_retries=0)
    theirs = openai.OpenAI(base_url=fused.base_url + "/v1", api_key="x", max_retries=0)
    plain = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)  # the session's tiny llama: no adapters
    for prompt in (PROMPT, OTHER):
        kw: dict[str, Any] = dict(model="x", prompt=prompt, max_tokens=12, temperature=0)
        adapted = ours.completions.create(**kw, extra_body={"lora": [{"id": 0, "scale": 0.75}]}).choices[0].text
        assert adapted == theirs.completions.create(**kw).choices[0].text
        off = ours.completions.create(**kw, extra_body={"lora": [{"id": 0, "scale": 0.0}]}).choices[0].text
        assert off == plain.completions.create(**kw).choices[0].text  # all scales 0: the base model
        assert adapted != off
    chat = dict(model="x", messages=[{"role": "user", "content": OTHER}], max_tokens=10, temperature=0)
    with httpx.Client(base_url=lora_server.base_url, timeout=60) as c:
        c.post("/lora-adapters", json=[{"id": 0, "scale": 0.75}]).raise_for_status()
        try:
            assert (ours.chat.completions.create(**chat).choices[0].message.content
                    == theirs.chat.completions.create(**chat).choices[0].message.content)
        finally:
            c.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]).raise_for_status()


def test_concurrent_requests_with_different_adapters_match_their_runs_alone(http) -> None:
    """Rows with different scales share batched passes, each scaled by its own."""
    sets = [[{"id": 0, "scale": 0.0}], [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 2.0}], [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 1.0}]]
    alone = [complete(http, n_predict=16, lora=s, cache_prompt=False)["content"] for s in sets]
    assert len(set(alone)) == len(sets)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda s: complete(http, n_predict=16, lora=s, cache_prompt=False)["content"], sets))
    assert together == alone


def test_a_scale_change_never_reuses_kv_of_the_old_scale(http) -> None:
    first = complete(http)
    assert first["timings"]["cache_n"] == 0
    assert complete(http)["timings"]["cache_n"] > 0  # the same scales: a hit
    http.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.5}]).raise_for_status()
    assert complete(http)["timings"]["cache_n"] == 0  # another scale: its own bucket
    http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]).raise_for_status()
    again = complete(http)
    assert again["timings"]["cache_n"] > 0 and again["content"] == first["content"]
    # Per-request lora behaves the same.
    override = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]
    assert complete(http, lora=override)["timings"]["cache_n"] > 0  # the same effective scales as the global
    assert complete(http, lora=[{"id": 0, "scale": 1.0}])["timings"]["cache_n"] == 0
    assert complete(http, lora=[{"id": 0, "scale": 1.0}])["timings"]["cache_n"] > 0
    stats = http.get("/v1/cache/stats").json()["entries_by_lora_id"]
    assert len(stats) == 3 and "" not in stats and all(v["entries"] >= 1 and v["bytes"] > 0 for v in stats.values())


def test_base_and_adapter_requests_never_adopt_each_others_entries(http) -> None:
    base = [{"id": 0, "scale": 0.0}]
    assert complete(http, lora=base)["timings"]["cache_n"] == 0
    assert complete(http)["timings"]["cache_n"] == 0  # the adapters' request: not the base entry
    assert complete(http, lora=base)["timings"]["cache_n"] > 0
    assert complete(http)["timings"]["cache_n"] > 0
    stats = http.get("/v1/cache/stats").json()["entries_by_lora_id"]
    assert "" in stats and len(stats) == 2


def test_slot_files_restore_only_into_their_own_scales(http) -> None:
    out = complete(http, id_slot=1, cache_prompt=True)
    saved = http.post("/slots/1?action=save", json={"filename": "adapted.bin"})
    assert saved.status_code == 200 and saved.json()["n_saved"] > 0
    http.post("/v1/cache/reset").raise_for_status()
    assert http.post("/slots/1?action=restore", json={"filename": "adapted.bin"}).status_code == 200
    assert complete(http, id_slot=1, lora=[{"id": 0, "scale": 0.0}])["timings"]["cache_n"] == 0  # base: recomputed
    assert complete(http, id_slot=1, lora=[{"id": 1, "scale": 0.5}])["timings"]["cache_n"] == 0  # other scales too
    http.post("/v1/cache/reset").raise_for_status()
    assert http.post("/slots/1?action=restore", json={"filename": "adapted.bin"}).status_code == 200
    hit = complete(http, id_slot=1)
    assert hit["timings"]["cache_n"] > 0 and hit["content"] == out["content"]


def test_a_restarted_server_with_other_scales_finds_nothing_on_disk(server_factory, tmp_path) -> None:
    disk = ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-write-through"]

    def stats(c: httpx.Client) -> dict[str, Any]:
        return c.get("/v1/cache/stats").json()["tiers"]["disk"]

    def settle(c: httpx.Client) -> None:
        import time

        deadline = time.monotonic() + 30
        while stats(c)["write_queue_entries"] and time.monotonic() < deadline:
            time.sleep(0.05)

    first = server_factory(lora_args(*disk))
    with httpx.Client(base_url=first.base_url, timeout=60) as c:
        cold = complete(c)
        complete(c, lora=[{"id": 0, "scale": 0.0}])  # and a base-model entry
        settle(c)
        assert stats(c)["writes"] >= 2
    first.stop()
    args = lora_args(*disk)
    args[args.index("--lora")] = "--lora-scaled"
    args[args.index(str(gguf_adapter()))] = f"{gguf_adapter()}:0.5"
    second = server_factory(args)  # adapter 0 at 0.5 now
    with httpx.Client(base_url=second.base_url, timeout=60) as c:
        assert stats(c)["startup"]["indexed"] >= 2
        assert complete(c)["timings"]["cache_n"] == 0
        assert stats(c)["hits"] == 0
        # The same effective scales as before, per request: the file is found again.
        hit = complete(c, lora=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}])
        assert hit["timings"]["cache_n"] > 0 and hit["content"] == cold["content"] and stats(c)["hits"] == 1
        assert complete(c, lora=[{"id": 0, "scale": 0.0}])["timings"]["cache_n"] > 0  # the base entry
    second.stop()
    base = server_factory(["-m", str(tiny_model("llama")), "-np", "1", "-c", "2048", "-b", "64",
                           "--prompt-cache-min-prefix", "8", *disk])
    with httpx.Client(base_url=base.base_url, timeout=60) as c:
        # A server without adapters adopts the base entry only, never an adapter's.
        assert complete(c)["timings"]["cache_n"] > 0
        assert c.get("/lora-adapters").json() == []
