"""End to end: ``scripts/load_test.py``'s phases for a few seconds, and issue 54's leak check.

A storm of streams (30 % hanging up mid-stream), then steady clients, against a server whose
prompt cache evicts all the time and whose sessions share long system prompts (two KV blocks and
a part each: hits lease shared blocks, hung-up streams cancel sequences that hold them). Nothing
may be lost, no reference on a KV block may be held by neither an entry nor a running sequence,
and after a reset the pool holds nothing. The full run (200 streams, ten steady minutes, the RSS)
is the script's: docs/benchmarks/load-test.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.conftest import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.e2e

SCRIPTS = REPO_ROOT / "scripts"
CACHE_BYTES = 1_500_000  # about four entries of the tiny llama (512 KV bytes a token, ~700 tokens each)


@pytest.fixture(scope="module")
def load_test() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))  # the script imports benchlib as a top-level module
    try:
        spec = importlib.util.spec_from_file_location("load_test", SCRIPTS / "load_test.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["load_test"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


@pytest.fixture(scope="module")
def load_server(server_factory, llama_dir: Path) -> ServerProcess:
    return server_factory(["-m", str(llama_dir), "-np", "4", "-c", "8192", "-b", "256", "--metrics",
                           "--prompt-cache-capacity-bytes", str(CACHE_BYTES)])


def stats(base_url: str) -> dict:
    return httpx.get(base_url + "/v1/cache/stats", timeout=60).json()


def test_a_storm_with_hang_ups_and_eviction_leaks_no_block(load_test: ModuleType, load_server: ServerProcess) -> None:
    base = load_server.base_url
    storm = asyncio.run(load_test.storm(base, 16, 0.3, 8, seed=5))
    steady = asyncio.run(load_test.steady(base, 3, 1.5, 0.3, 8, seed=6))
    for tally in (storm, steady):
        assert tally.lost() == [], tally.summary()
    outcomes = storm.outcomes + steady.outcomes
    assert any(o.hung_up for o in outcomes) and any(o.cached > 0 for o in outcomes)  # cancels, and hits on shared blocks
    assert load_test.wait_idle(base) is not None
    held = stats(base)
    assert held["kv_block_stray_refs"] == 0 and held["kv_block_leases"] == 0
    assert held["evictions"]["lru"] > 0 and held["bytes"] <= held["capacity_bytes"]
    assert held["kv_blocks"] > 0 and held["sharing_ratio"] > 1.0  # the entries do share blocks
    assert load_test.pool_after_reset(base) == dict.fromkeys(load_test.POOL_FIELDS, 0)
    metrics = httpx.get(base + "/metrics", timeout=60).text
    for name in ("kv_blocks", "kv_block_leases", "kv_block_stray_refs"):
        assert f"mlxcel_prompt_cache_{name} 0.0" in metrics
