"""APC through real server processes: flags and env reach the stats and metrics; bad values stop start-up.

Every server is started without waiting, so they load side by side; each test then waits for its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess

TEXT = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short."
)
FIRST = TEXT + " Question one: when does the library open on Saturday mornings?"
SECOND = TEXT + " Another matter entirely: may I renew a book online?"
BASE = ["-np", "1", "-c", "2048", "-b", "64", "--prompt-cache-min-prefix", "8"]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


@pytest.fixture(scope="module")
def servers(server_factory, llama_dir: Path) -> dict[str, ServerProcess]:
    model = ["-m", str(llama_dir), *BASE]
    return {
        "apc": server_factory([*model, "--metrics", "--apc-hash", "blake3", "--apc-block-size", "8"], wait=False),
        "flag_off": server_factory([*model, "--metrics", "--apc-enabled=false"], wait=False),
        "env_off": server_factory(model, {"APC_ENABLED": "0"}, wait=False),
        "cache_off": server_factory([*model, "--prompt-cache-enabled=false"], wait=False),
        "bad_hash": server_factory([*model, "--apc-hash", "md5"], wait=False),
        "bad_block": server_factory(model, {"APC_BLOCK_SIZE": "0"}, wait=False),
    }


@contextmanager
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    server.wait_healthy()
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def completion(c: httpx.Client, prompt: str) -> dict:
    response = c.post("/completion", json={"prompt": prompt, "n_predict": 2, "temperature": 0})
    response.raise_for_status()
    return response.json()


def common_prefix_len(c: httpx.Client, a: str, b: str) -> int:
    ta, tb = (c.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"] for text in (a, b))
    n = 0
    while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
        n += 1
    return n


def test_apc_flags_reach_stats_and_metrics_and_reset_clears_chains(servers: dict[str, ServerProcess]) -> None:
    with client(servers["apc"]) as c:
        stats = c.get("/v1/cache/stats").json()
        assert (stats["apc_enabled"], stats["apc_disabled_reason"], stats["hash"], stats["block_size"]) == (True, None, "blake3", 8)
        first = completion(c, FIRST)
        second = completion(c, SECOND)
        shared = common_prefix_len(c, FIRST, SECOND)
        assert shared >= 16
        # Token-granular APC adopts exactly the common token prefix of the stored entry.
        assert first["timings"]["cache_n"] == 0 and second["timings"]["cache_n"] == shared
        stats = c.get("/v1/cache/stats").json()
        assert stats["apc_active_entries"] == 2 and stats["apc_hits"] == 1
        assert stats["total_blocks_stored"] - stats["unique_block_hashes"] == shared // 8  # the shared full blocks
        text = c.get("/metrics").text
        assert metric(text, "mlxcel_prompt_cache_apc_enabled") == 1
        assert metric(text, "mlxcel_prompt_cache_apc_blocks_stored") == stats["total_blocks_stored"]
        assert metric(text, "mlxcel_prompt_cache_apc_unique_block_hashes") == stats["unique_block_hashes"]
        assert metric(text, "mlxcel_prompt_cache_apc_active_entries") == 2
        assert metric(text, "mlxcel_prompt_cache_partial_hits_total") == stats["partial_hits"] >= 1
        assert metric(text, "mlxcel_prompt_cache_apc_hits_total") == 1
        assert c.post("/v1/cache/reset").json()["cleared_entries"] == 2
        stats = c.get("/v1/cache/stats").json()
        assert (stats["total_blocks_stored"], stats["unique_block_hashes"], stats["apc_active_entries"]) == (0, 0, 0)
        assert metric(c.get("/metrics").text, "mlxcel_prompt_cache_apc_blocks_stored") == 0
    assert "APC enabled: block size 8, hash blake3" in servers["apc"].log()


def test_apc_disabled_by_flag_reuses_whole_prefixes_only(servers: dict[str, ServerProcess]) -> None:
    with client(servers["flag_off"]) as c:
        stats = c.get("/v1/cache/stats").json()
        assert (stats["enabled"], stats["apc_enabled"], stats["apc_disabled_reason"]) == (True, False, "flag")
        completion(c, FIRST)
        assert completion(c, SECOND)["timings"]["cache_n"] == 0  # partial overlap: not eligible
        repeat = completion(c, FIRST)
        assert repeat["timings"]["cache_n"] == 0  # the entry holds FIRST + a generated token: longer than the request
        text = c.get("/metrics").text
        assert metric(text, "mlxcel_prompt_cache_apc_enabled") == 0
        assert metric(text, "mlxcel_prompt_cache_apc_blocks_stored") == 0
    assert "APC disabled (flag)" in servers["flag_off"].log()


def test_apc_disabled_by_env(servers: dict[str, ServerProcess]) -> None:
    with client(servers["env_off"]) as c:
        stats = c.get("/v1/cache/stats").json()
        assert (stats["enabled"], stats["apc_enabled"], stats["apc_disabled_reason"]) == (True, False, "flag")


def test_apc_is_inactive_while_the_prompt_cache_is_off(servers: dict[str, ServerProcess]) -> None:
    with client(servers["cache_off"]) as c:
        stats = c.get("/v1/cache/stats").json()
        assert (stats["enabled"], stats["apc_enabled"], stats["apc_disabled_reason"]) == (False, False, "cache_off")
        assert stats["total_blocks_stored"] == 0
    assert "APC disabled (cache_off)" in servers["cache_off"].log()


@pytest.mark.parametrize(
    "name, message",
    [
        ("bad_hash", "invalid value for --apc-hash: 'md5'; expected one of sha256, blake3"),
        ("bad_block", "invalid value for APC_BLOCK_SIZE: '0'; must be >= 1"),
    ],
)
def test_invalid_apc_values_stop_start_up(servers: dict[str, ServerProcess], name: str, message: str) -> None:
    server = servers[name]
    assert server.proc is not None
    code = server.proc.wait(timeout=120)
    assert code != 0
    assert message in server.log()
