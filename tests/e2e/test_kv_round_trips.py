"""Slot files and the disk tier round-trip at every KV precision (``-ctk``/``-ctv``), on real servers.

Each precision's server (the tiny mistral: head size 32, one q8_0/q4_0 block a row) saves a slot,
erases it, clears every cache tier and restores the file: the next request adopts all but the last
prompt token and gives the uninterrupted run's greedy output. Then an entry written through to
the disk tier, with RAM cleared, is read back for a hit that gives the first run's output. A file
of another precision is refused both ways with llama-server's error shape (a 400 naming the
types), and the server serves on.

The default run keeps one q8_0 server (f16, the default precision, round-trips in test_slots.py and
test_disk_cache.py); f16 against real files of every other precision, bf16, q4_0 and two mixed
pairs are ``slow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel_compat.cache.disk_format import KV_TAG, read_header
from tests.cache.fakes import rewrite_record
from tests.conftest import ServerProcess, tiny_model
from tests.e2e.helpers import assert_serving

pytestmark = pytest.mark.e2e

STORY = ("The lighthouse keeper wrote every evening in a leather notebook: the colour of the sea, the ships "
         "that passed, the birds on the rocks and the weather that came from the west over the long grey water.")
GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One slot directory (every precision's files side by side) and one disk-tier directory."""
    return tmp_path_factory.mktemp("kv-slots"), tmp_path_factory.mktemp("kv-disk")


def start(server_factory, dirs: tuple[Path, Path], k: str, v: str) -> ServerProcess:
    slots, disk = dirs
    server = server_factory(["-m", str(tiny_model("mistral")), "-np", "1", "-c", "2048", "-b", "64",
                             "--slot-save-path", str(slots), "--prompt-cache-dir", str(disk),
                             "--prompt-cache-write-through", "--prompt-cache-min-prefix", "16", "-ctk", k, "-ctv", v],
                            wait=False)
    server.wait_healthy(timeout=600)  # a run's first server compiles the native library (minutes on a loaded machine)
    return server


@pytest.fixture(scope="module")
def reference(server_factory, dirs) -> ServerProcess:
    """The default precision's server, whose slot file every other precision must refuse."""
    server = start(server_factory, dirs, "f16", "f16")
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        complete(c, STORY + " At noon")
        assert action(c, "save", "f16-f16.bin").status_code == 200
    return server


def complete(c: httpx.Client, prompt: str, **extra: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, "id_slot": 0, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def action(c: httpx.Client, name: str, filename: str | None = None) -> httpx.Response:
    return c.post("/slots/0", params={"action": name}, json={"filename": filename} if filename else None)


def assert_refused(r: httpx.Response, theirs: str) -> None:
    """llama-server's error shape for a restore it cannot do, naming the file's KV types."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"]) == (400, "invalid_request_error")
    assert error["message"].startswith("Unable to restore slot: ") and "KV cache type" in error["message"]
    assert theirs in error["message"]


def settle(c: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """The disk tier's stats once its writer has nothing queued."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        d = c.get("/v1/cache/stats").json()["tiers"]["disk"]
        if d["write_queue_entries"] == 0 or time.monotonic() > deadline:
            return d
        time.sleep(0.05)


def round_trips(c: httpx.Client, k: str, v: str) -> None:
    """A slot file and a disk entry of this precision come back as they were."""
    prompt = STORY + " Tonight he wrote:"
    first = complete(c, prompt)
    n_prompt = first["tokens_evaluated"]
    saved = action(c, "save", f"{k}-{v}.bin")
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] >= n_prompt
    assert action(c, "erase").status_code == 200
    assert c.post("/v1/cache/reset").status_code == 200  # every tier: the file is all there is
    restored = action(c, "restore", f"{k}-{v}.bin")
    assert restored.status_code == 200, restored.text
    again = complete(c, prompt)
    assert again["timings"]["cache_n"] == n_prompt - 1 and again["content"] == first["content"]

    other = STORY.replace("lighthouse", "harbour") + " By morning"
    cold = complete(c, other, cache_prompt=False)
    c.post("/v1/cache/reset").raise_for_status()
    complete(c, other)  # written through to disk
    assert settle(c)["writes"] >= 1
    assert action(c, "erase").status_code == 200
    assert c.post("/v1/cache/reset", json={"tier": "ram"}).json()["tier"] == "ram"
    warm = complete(c, other)
    disk = c.get("/v1/cache/stats").json()["tiers"]["disk"]
    assert warm["timings"]["cache_n"] > 0 and disk["hits"] == 1 and disk["tokens_loaded_total"] == warm["timings"]["cache_n"]
    assert warm["content"] == cold["content"]
    stats = c.get("/v1/cache/stats").json()
    assert (stats["kv_cache_type_k"], stats["kv_cache_type_v"]) == (k, v)


def test_q8_0_round_trips_and_a_file_of_another_precision_is_refused(server_factory, dirs) -> None:
    """The default run's case: one q8_0 server. Its slot file with the header's KV types rewritten
    (f16/f16; the file well-formed, re-checksummed) stands for another precision's file."""
    slots, _ = dirs
    server = start(server_factory, dirs, "q8_0", "q8_0")
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        round_trips(c, "q8_0", "q8_0")
        runtime = read_header(slots / "q8_0-q8_0.bin")[0].compat.runtime
        assert runtime.endswith(KV_TAG + "q8_0/q8_0")
        (slots / "relabelled.bin").write_bytes((slots / "q8_0-q8_0.bin").read_bytes())
        rewrite_record(slots / "relabelled.bin", runtime=runtime.replace(KV_TAG + "q8_0/q8_0", KV_TAG + "f16/f16"))
        assert_refused(action(c, "restore", "relabelled.bin"), "f16/f16")
        assert_serving(c)
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("k,v", [("f16", "f16"), ("q8_0", "q8_0"), ("bf16", "bf16"), ("q4_0", "q4_0"),
                                 ("q8_0", "f16"), ("f16", "q4_0")])
def test_round_trips_and_real_files_of_other_precisions_are_refused(server_factory, dirs, reference, k: str,
                                                                     v: str) -> None:
    """Every precision and two mixed pairs; the f16 reference server's file is refused by every
    other precision and every other precision's file by the reference."""
    server = reference if (k, v) == ("f16", "f16") else start(server_factory, dirs, k, v)
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        round_trips(c, k, v)
        if server is not reference:
            assert_refused(action(c, "restore", "f16-f16.bin"), "f16/f16")
        assert_serving(c)
    if server is reference:
        return
    with httpx.Client(base_url=reference.base_url, timeout=120) as c:
        assert_refused(action(c, "restore", f"{k}-{v}.bin"), f"{k}/{v}")
        assert_serving(c)
    server.stop()
