"""The disk tier on the engine, with real models and real files.

Exactness: an entry read back from disk holds bit-identical arrays (tests/cache/test_disk_payloads.py),
so a disk hit continues exactly like a RAM hit of the same entry. Where a test compares with a cold
run instead, the adopted length sits on a prefill chunk boundary the cold run also uses
(prompt length = k * CHUNK + 1), which makes the two computations identical.
"""

from __future__ import annotations

import os
import queue
import random
import time
from pathlib import Path
from typing import Any

import pytest

from mlxcel_compat.cache.disk_format import EntryHeader, read_header
from mlxcel_compat.cache.disk_write import commit, write_temp
from mlxcel_compat.engine import disk_tier, prefix_cache
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness

pytestmark = pytest.mark.engine

CHUNK = 16
ENTRY_BYTES = 2 * 2 * 2 * 16 * 4  # KV bytes per token of the tiny llama: 2 (k, v) x 2 layers x 2 heads x 16 dims x f32


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


def disk_of(h: EngineHarness) -> Any:
    return h.engine.prefix_cache.disk


def settle(h: EngineHarness) -> dict[str, Any]:
    """Wait for the writer, then return the disk tier's stats."""
    assert h.on_engine(lambda: disk_of(h).wait_written(30))
    return h.stats()["tiers"]["disk"]


def files(h: EngineHarness) -> list[Path]:
    return sorted(disk_of(h).index.directory.glob("*.safetensors"))


@pytest.fixture(params=["llama", "llama:q4_0"])
def llama(tmp_path: Path, request: pytest.FixtureRequest):
    # RAM holds about one 100-token entry: every new entry pushes the previous one to disk. The
    # same on a quantized GGUF (weights in their blocks): its KV goes to disk and back unchanged.
    h = EngineHarness(tiny_model(request.param), batch_size=CHUNK, capacity_bytes=130 * ENTRY_BYTES, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    yield h
    h.close()


def test_an_evicted_entry_is_written_and_a_miss_reads_it_back_exactly(llama: EngineHarness) -> None:
    a, b = tokens(6 * CHUNK + 1, seed=1), tokens(6 * CHUNK + 1, seed=2)
    first = llama.run(a, n_predict=10)
    assert first.finish.n_cached == 0
    llama.run(b, n_predict=10)  # evicts a's entry from RAM
    disk = settle(llama)
    assert disk["writes"] == 1 and disk["entries"] == 1 and disk["write_queue_bytes"] == 0
    assert len(files(llama)) == 1 and files(llama)[0].stat().st_size == disk["bytes"]
    again = llama.run(a, n_predict=10)
    assert again.finish.n_cached == len(a) - 1  # from disk (RAM holds only b's entry)
    assert again.tokens == first.tokens
    stats = llama.stats()
    assert stats["tiers"]["disk"]["hits"] == 1 and stats["tiers"]["disk"]["tokens_loaded_total"] == len(a) - 1
    assert stats["hits"] == 1 and stats["tiers"]["ram"]["hits"] == 0  # counted once, as a disk hit
    assert stats["tiers"]["disk"]["loads"] == 1 and stats["tiers"]["disk"]["load_ms_total"] > 0
    # a's entry went back to RAM; b's was pushed out and written in turn.
    assert settle(llama)["entries"] == 2


def test_ram_wins_when_it_matches_as_much(llama: EngineHarness) -> None:
    a = tokens(6 * CHUNK + 1, seed=3)
    llama.run(a, n_predict=4)
    entry = llama.on_engine(lambda: llama.engine.prefix_cache.store.entries()[0])
    llama.on_engine(lambda: disk_of(llama).spill("kv", entry))  # now in RAM and on disk
    settle(llama)
    assert llama.run(a, n_predict=4).finish.n_cached == len(a) - 1
    assert llama.stats()["tiers"]["disk"]["loads"] == 0


def spilled(h: EngineHarness, seed: int) -> tuple[list[int], Any, Path]:
    """A prompt whose entry was pushed to disk, its cold run, and the entry's file."""
    a, b = tokens(6 * CHUNK + 1, seed=seed), tokens(6 * CHUNK + 1, seed=seed + 1)
    cold = h.run(a, n_predict=8, cache=False)
    h.run(a, n_predict=8)
    h.run(b, n_predict=8)  # pushes a's entry out of RAM
    settle(h)
    (path,) = files(h)
    return a, cold, path


def test_the_writer_paces_itself_while_the_engine_is_busy(llama: EngineHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spills are written at full speed while the engine is idle, and at BUSY_WRITE_BYTES_PER_S
    while a request runs (lowered here so that one small entry takes half a second)."""
    first, second = tokens(6 * CHUNK + 1, seed=11), tokens(6 * CHUNK + 1, seed=12)
    llama.run(first, n_predict=4)
    entry = llama.on_engine(lambda: llama.engine.prefix_cache.store.entries()[0])
    started = time.monotonic()
    llama.on_engine(lambda: disk_of(llama).spill("kv", entry))
    assert settle(llama)["write_paced_ms_total"] == 0  # idle: no pause
    idle_seconds = time.monotonic() - started
    llama.run(second, n_predict=4)
    entry = llama.on_engine(lambda: next(e for e in llama.engine.prefix_cache.store.entries() if list(e.tokens[:8]) == second[:8]))
    monkeypatch.setattr(disk_tier, "BUSY_WRITE_BYTES_PER_S", entry.nbytes / 0.5)
    events: queue.Queue = queue.Queue()
    running = llama.submit(tokens(40, seed=13), events.put, n_predict=3000, ignore_eos=True)
    while events.empty():  # the long request is decoding
        time.sleep(0.01)
    started = time.monotonic()
    assert llama.on_engine(lambda: (disk_of(llama).spill("kv", entry), llama.engine.busy)) == (True, True)
    disk = settle(llama)
    busy_seconds = time.monotonic() - started
    llama.engine.cancel(running.task_id)
    assert disk["writes"] == 2
    assert 450 <= disk["write_paced_ms_total"] <= 600  # the entry's bytes at the lowered rate
    assert busy_seconds >= 0.45 > idle_seconds
    assert llama.run(second, n_predict=4).finish.n_cached > 0  # the engine serves on


def test_a_ram_reset_hands_memory_back_only_when_it_freed_something(llama: EngineHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handing memory back (MLX's buffer cache, a collection, malloc_trim) costs ~0.1 s, so a RAM
    reset does it only when entries were dropped; an empty reset returns at once."""
    handed_back: list[int] = []
    real = prefix_cache.release_free_memory
    monkeypatch.setattr(prefix_cache, "release_free_memory", lambda: (handed_back.append(1), real())[1])
    llama.run(tokens(3 * CHUNK + 1, seed=21), n_predict=2)
    first = llama.on_engine(lambda: llama.engine.prefix_cache.reset("ram"))
    assert first["tiers"]["ram"]["cleared_entries"] == 1 and handed_back == [1]
    again = llama.on_engine(lambda: llama.engine.prefix_cache.reset("ram"))
    assert again["cleared_entries"] == 0 and handed_back == [1]


def test_a_corrupted_payload_is_rejected_removed_and_never_adopted(llama: EngineHarness) -> None:
    a, cold, path = spilled(llama, seed=4)
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x10  # one bit of the KV tensors
    path.write_bytes(bytes(data))
    again = llama.run(a, n_predict=8)
    assert again.finish.n_cached == 0 and again.tokens == cold.tokens
    disk = llama.stats()["tiers"]["disk"]
    assert disk["rejections"]["payload_checksum"] == 1 and disk["hits"] == 0
    assert disk["last_reject"]["reason"] == "payload_checksum" and not path.exists()


def test_tokens_are_checked_not_only_the_key(llama: EngineHarness) -> None:
    """A well-formed file under an indexed entry's name whose tokens differ is refused."""
    a, cold, path = spilled(llama, seed=6)
    good, _ = read_header(path)
    forged = EntryHeader(**{**vars(good), "tokens": tuple(t + 1 for t in good.tokens), "tensors": ()})
    from mlxcel_compat.cache import kv_io  # the payload is rewritten from the genuine file

    payload = kv_io.decode(good.layout, kv_io.load_arrays(path, good))
    _, tensors = kv_io.encode(payload)
    commit(write_temp(path, forged, tensors), path)
    again = llama.run(a, n_predict=8)
    assert again.finish.n_cached == 0 and again.tokens == cold.tokens
    assert llama.stats()["tiers"]["disk"]["rejections"]["token_mismatch"] == 1


def test_the_budget_holds_under_churn(tmp_path: Path) -> None:
    one_file = None
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, capacity_bytes=70 * ENTRY_BYTES, disk_dir=str(tmp_path), disk_capacity_bytes=10**9)
    try:
        h.run(tokens(3 * CHUNK + 1, seed=100), n_predict=4)
        h.run(tokens(3 * CHUNK + 1, seed=101), n_predict=4)
        settle(h)
        one_file = files(h)[0].stat().st_size
    finally:
        h.close()
    budget = 3 * one_file + one_file // 2  # three entries fit, a fourth does not
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, capacity_bytes=70 * ENTRY_BYTES, disk_dir=str(tmp_path), disk_capacity_bytes=budget)
    try:
        for i in range(12):
            h.run(tokens(3 * CHUNK + 1, seed=200 + i), n_predict=4)
            disk = settle(h)
            on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
            assert on_disk <= budget and disk["bytes"] <= budget, (i, on_disk, disk)
        assert disk["evictions"] >= 8 and disk["entries"] == 3
        # The newest survive: the last entry pushed out of RAM comes back from disk.
        last_spilled = tokens(3 * CHUNK + 1, seed=210)
        assert h.run(last_spilled, n_predict=4).finish.n_cached == len(last_spilled) - 1
    finally:
        h.close()


def test_a_clean_shutdown_writes_ram_and_a_restart_indexes_it(tmp_path: Path) -> None:
    a = tokens(6 * CHUNK + 1, seed=8)
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    first = h.run(a, n_predict=10)
    assert h.stats()["tiers"]["disk"]["writes"] == 0  # nothing left RAM yet
    h.close()
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    try:
        disk = h.stats()["tiers"]["disk"]
        assert disk["startup"]["indexed"] == 1 and disk["entries"] == 1
        again = h.run(a, n_predict=10)
        assert again.finish.n_cached == len(a) - 1 and again.tokens == first.tokens
    finally:
        h.close()


def test_the_shutdown_flush_makes_one_whole_copy_at_a_time(tmp_path: Path) -> None:
    """Entries sharing blocks are each written whole; the flush gathers the next one only once the
    previous file is written, so memory never holds more than one entry's copy."""
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, kv_block_tokens=CHUNK, disk_dir=str(tmp_path),
                      disk_capacity_bytes=1 << 30)
    system = tokens(8 * CHUNK, seed=20)
    for s in range(4):
        h.run(system + tokens(CHUNK + 3, seed=21 + s), n_predict=2, session=f"s{s}")
    assert h.stats()["sharing_ratio"] > 2.0
    disk = disk_of(h)
    waiting: list[int] = []  # entries queued, not yet written, each time the flush makes a copy
    spill = disk.spill

    def counting_spill(kind: str, entry: Any, force: bool = False) -> bool:
        waiting.append(disk.stats()["write_queue_entries"])
        return spill(kind, entry, force)

    disk.spill = counting_spill
    directory = disk.index.directory
    h.close()
    assert waiting == [0, 0, 0, 0]
    assert len(list(directory.glob("*.safetensors"))) == 4


def test_an_entry_read_back_shares_the_blocks_ram_still_holds(tmp_path: Path) -> None:
    """Session b adopted a's system prompt, so both entries share its blocks. a's entry then
    leaves RAM; read back from disk, its system prompt is the very same bits as b's blocks and is
    folded into them instead of stored twice, and the hit still equals a cold run."""
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, kv_block_tokens=CHUNK, disk_dir=str(tmp_path),
                      disk_capacity_bytes=1 << 30, disk_write_through=True)
    try:
        system = tokens(4 * CHUNK, seed=30)
        a = system + tokens(CHUNK + 7, seed=31)
        h.run(a, n_predict=2, session="a")
        assert h.run(system + tokens(9, seed=32), n_predict=2, session="b").finish.n_cached == len(system)
        settle(h)
        store = h.engine.prefix_cache.store
        h.on_engine(lambda: store.remove(next(e.id for e in store.entries() if e.session_key == "a")))
        before = h.stats()
        # a's first 80 tokens, where a's own prefill and a cold run of this prompt both ended a
        # chunk (the hit is exact there), then a rest the two split alike
        prompt = a[: 5 * CHUNK] + tokens(23, seed=33)
        warm = h.run(prompt, n_predict=6, n_probs=4, session="a")
        assert warm.finish.n_cached == 5 * CHUNK and h.stats()["tiers"]["disk"]["hits"] == 1  # a's entry, from disk
        merged = h.stats()["kv_blocks_merged"] - before["kv_blocks_merged"]
        assert merged == len(system) // CHUNK
        held = {e.session_key: e.payload.block_ids for e in h.on_engine(store.entries)}
        assert held["a"][:4] == held["b"][:4]
        cold = h.run(prompt, n_predict=6, n_probs=4, cache=False)
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    finally:
        h.close()


def test_recurrent_snapshots_spill_and_restore_like_a_ram_hit(tmp_path: Path) -> None:
    """qwen3_next: session snapshots that leave RAM come back from disk, bit for bit."""
    model = tiny_model("qwen3_next")
    history = tokens(90, seed=9)
    outputs = {}
    for where in ("ram", "disk"):
        roomy = where == "ram"
        h = EngineHarness(model, batch_size=32, disk_dir=str(tmp_path / where), disk_capacity_bytes=1 << 30)
        try:
            first = h.run(history, n_predict=4, session="alice")
            if not roomy:
                # Move alice's snapshot out of RAM the way eviction does, then clear RAM.
                h.on_engine(lambda: [disk_of(h).spill("snapshot", e) for e in h.engine.prefix_cache.snapshots.store.entries()])
                assert settle(h)["entries"] == 1
                h.on_engine(lambda: h.engine.prefix_cache.reset("ram"))
            follow_up = history + first.tokens[:-1] + tokens(20, seed=10)
            run = h.run(follow_up, n_predict=8, n_probs=4, session="alice")
            assert run.finish.n_cached == len(history) + len(first.tokens) - 1
            outputs[where] = (run.tokens, run.logprobs)
            stats = h.stats()
            assert stats["tiers"]["disk"]["hits"] == (0 if roomy else 1)
            assert stats["snapshot_hits"] == 1
        finally:
            h.close()
    assert outputs["disk"] == outputs["ram"]


def test_snapshot_store_evictions_go_to_disk(tmp_path: Path) -> None:
    h = EngineHarness(tiny_model("qwen3_next"), batch_size=32, snapshot_capacity_bytes=60_000, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    try:
        for i in range(3):
            h.run(tokens(90, seed=20 + i), n_predict=3, session=f"s{i}")
        disk = settle(h)
        assert disk["writes"] >= 1 and disk["entries"] == disk["writes"]
        assert all(p.name.startswith("snapshot-") for p in files(h))
        assert h.stats()["snapshot_evictions_lru"] >= 1
    finally:
        h.close()


def test_start_up_with_many_files_reads_only_headers(tmp_path: Path) -> None:
    """Index rebuild cost does not depend on payload size: payload bytes are never read at start-up."""
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, capacity_bytes=70 * ENTRY_BYTES, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    try:
        for i in range(6):
            h.run(tokens(3 * CHUNK + 1, seed=300 + i), n_predict=2)
    finally:
        h.close()  # writes the last entry too
    paths = sorted(tmp_path.rglob("*.safetensors"))
    assert len(paths) == 6
    for p in paths:  # make the payload unreadable garbage: start-up must not notice
        data = bytearray(p.read_bytes())
        data[-8:] = os.urandom(8)
        p.write_bytes(bytes(data))
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    try:
        disk = h.stats()["tiers"]["disk"]
        assert disk["startup"] == dict(files=len(paths), indexed=len(paths), rejected=0, stale_temp=0, removed_by_budget=0)
    finally:
        h.close()


def test_write_through_shares_a_prefix_with_another_engine_on_the_directory(tmp_path: Path) -> None:
    """Two engines on one directory, as replicas behind a router: what one stores, the other
    finds while both run (no restart), from another session, and continues exactly as cold."""
    model = tiny_model("llama")
    system = tokens(6 * CHUNK, seed=30)  # a shared prefix ending on a chunk (and APC block) boundary
    mine, theirs = system + tokens(40, seed=31), system + tokens(40, seed=32)
    a = EngineHarness(model, batch_size=CHUNK, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30, disk_write_through=True)
    b = EngineHarness(model, batch_size=CHUNK, disk_dir=str(tmp_path), disk_capacity_bytes=1 << 30)
    try:
        assert a.stats()["tiers"]["disk"]["entries"] == b.stats()["tiers"]["disk"]["entries"] == 0
        a.run(mine, n_predict=6, session="alice")
        written = settle(a)
        assert written["writes"] == 1 and a.stats()["evictions"]["lru"] == 0  # written while still in RAM
        cold = b.run(theirs, n_predict=10, cache=False)
        warm = b.run(theirs, n_predict=10, session="bob")
        assert warm.finish.n_cached == len(system)  # the shared prefix, from a's file
        assert warm.tokens == cold.tokens
        disk = b.stats()["tiers"]["disk"]
        assert disk["picked_up"] == 1 and disk["hits"] == 1 and disk["tokens_loaded_total"] == len(system)
        assert disk["writes"] == 0  # b writes only what it evicts
        # a's RAM entry is already on disk: its eviction writes nothing again.
        assert a.on_engine(lambda: disk_of(a).spill("kv", a.engine.prefix_cache.store.entries()[0])) is False
    finally:
        a.close()
        b.close()


def test_write_through_off_writes_nothing_before_an_eviction(llama: EngineHarness) -> None:
    llama.run(tokens(3 * CHUNK + 1, seed=33), n_predict=4)
    assert settle(llama)["writes"] == 0 and not files(llama)


def test_write_through_of_recurrent_session_snapshots(tmp_path: Path) -> None:
    """qwen3_next: a session's snapshot written at once is continued by another engine like a RAM hit."""
    model = tiny_model("qwen3_next")
    history = tokens(90, seed=34)
    a = EngineHarness(model, batch_size=32, disk_dir=str(tmp_path / "shared"), disk_capacity_bytes=1 << 30, disk_write_through=True)
    b = EngineHarness(model, batch_size=32, disk_dir=str(tmp_path / "shared"), disk_capacity_bytes=1 << 30)
    try:
        first = a.run(history, n_predict=4, session="alice")
        assert settle(a)["writes"] >= 1
        follow_up = history + first.tokens[:-1] + tokens(20, seed=35)
        # b first: a's next run writes the session's longer snapshot at once and deletes this one
        # (superseded), which raced b's lookup when b came second.
        there = b.run(follow_up, n_predict=8, n_probs=4, session="alice")  # the session moved to b
        here = a.run(follow_up, n_predict=8, n_probs=4, session="alice")  # a RAM hit on a
        assert there.finish.n_cached == here.finish.n_cached == len(history) + len(first.tokens) - 1
        assert (there.tokens, there.logprobs) == (here.tokens, here.logprobs)
        assert b.stats()["tiers"]["disk"]["hits"] == 1
    finally:
        a.close()
        b.close()
