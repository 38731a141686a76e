"""The disk tier's bookkeeping: file format, rejections, index, budget, temporary files (no MLX).

Payload tensors are numpy arrays here; the engine's adapter (cache/kv_io.py) hands over numpy views
of MLX arrays the same way (tests/engine/test_disk_tier.py covers that side).
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from blake3 import blake3

from mlxcel_compat.cache import disk_index
from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.disk_directory import LOCK_NAME, enforce_budget, entry_name, remove_stale_temps
from mlxcel_compat.cache.disk_format import Compat, DiskReject, EntryHeader, Tensor, payload_checksum, read_header
from mlxcel_compat.cache.disk_index import RACY_NS, DiskIndex
from mlxcel_compat.cache.disk_write import byte_blocks, commit, write_temp
from mlxcel_compat.cache.key import ANON_SESSION
from tests.cache.fakes import make_bucket, rewrite_record

COMPAT = Compat(model="m" * 64, runtime="mlx 0.0; mlx-lm 0.0; cpu; float32")
BUCKET = make_bucket()


def tensors(n_tokens: int, seed: int = 0) -> list[Tensor]:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, 2, n_tokens + 8, 4)).astype(np.float32)[:, :, :n_tokens, :]  # strided view
    values = rng.standard_normal((1, 2, n_tokens, 4)).astype(np.float32)
    steps = np.arange(3, dtype=np.int32)
    return [Tensor(f"t{i}", code, a.shape, a, a.nbytes) for i, (code, a) in enumerate((("F32", keys), ("F32", values), ("I32", steps)))]


def header(tokens: tuple[int, ...], session: str = "s", kind: str = "kv", origin: str = "completion", compat: Compat = COMPAT) -> EntryHeader:
    return EntryHeader(
        kind=kind, compat=compat, bucket=BUCKET, session_key=session, tokens=tokens, origin=origin,
        trimmable=True, nbytes=123, layout={"version": 1, "layers": []}, extra={"note": "x"},
    )


def write(directory: Path, tokens: tuple[int, ...], session: str = "s", kind: str = "kv", seed: int = 0, compat: Compat = COMPAT) -> Path:
    h = header(tokens, session, kind, compat=compat)
    path = directory / entry_name(kind, h.digest)
    commit(write_temp(path, h, tensors(len(tokens), seed)), path)
    return path


def payload(path: Path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 + n :]


def test_round_trip_keeps_every_key_part_and_the_payload(tmp_path) -> None:
    tokens = tuple(range(100, 140))
    path = write(tmp_path, tokens)
    got, inode = read_header(path, COMPAT)
    assert inode == path.stat().st_ino
    assert (got.kind, got.bucket, got.session_key, got.tokens, got.origin) == ("kv", BUCKET, "s", tokens, "completion")
    assert (got.trimmable, got.nbytes, got.extra, got.compat) == (True, 123, {"note": "x"}, COMPAT)
    expected = b"".join(np.ascontiguousarray(t.data).tobytes() for t in tensors(len(tokens)))
    assert payload(path) == expected
    assert got.payload_bytes == len(expected) and got.payload_blake3 == blake3(expected).hexdigest()
    assert [(t.name, t.dtype, t.shape) for t in got.tensors] == [("t0", "F32", (1, 2, 40, 4)), ("t1", "F32", (1, 2, 40, 4)), ("t2", "I32", (3,))]
    # It is a plain safetensors file: the table is where the format says.
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0 and json.loads(path.read_bytes()[8 : 8 + n])["t2"]["data_offsets"] == [2560, 2572]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(os.urandom(5000)), "not_a_cache_file"),
        (lambda p: p.write_bytes(b""), "not_a_cache_file"),
        (lambda p: p.write_bytes(b'{"json": "but not safetensors"}'), "not_a_cache_file"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes()[:200]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 16), "size_mismatch"),
        (lambda p: p.write_bytes(p.read_bytes().replace(b'n_tokens\\":40', b'n_tokens\\":41')), "corrupt_header"),
        (lambda p: p.write_bytes(p.read_bytes().replace(b'"shape":[3]', b'"shape":[2]')), "corrupt_header"),
        (lambda p: rewrite_record(p, model="x" * 64), "foreign_model"),
        (lambda p: rewrite_record(p, runtime="mlx 9.9"), "incompatible_version"),
        (lambda p: rewrite_record(p, format_version=99), "incompatible_version"),
        (lambda p: rewrite_record(p, key_domain="mlxcel:prompt-cache:v2"), "incompatible_version"),
        (lambda p: rewrite_record(p, bucket={"extra_key_part": "x"}), "corrupt_header"),
    ],
)
def test_damaged_or_foreign_files_are_rejected_with_their_reason(tmp_path, damage, reason) -> None:
    path = write(tmp_path, tuple(range(40)))
    damage(path)
    with pytest.raises(DiskReject) as info:
        read_header(path, COMPAT)
    assert info.value.reason == reason, info.value


def test_a_flipped_payload_byte_passes_the_header_but_not_the_checksum(tmp_path) -> None:
    path = write(tmp_path, tuple(range(40)))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    got, _ = read_header(path, COMPAT)  # payloads are checked when loaded, not at start-up
    assert payload_checksum([payload(path)]) != got.payload_blake3


def test_kinds_are_enforced(tmp_path) -> None:
    path = write(tmp_path, tuple(range(40)), kind="slot")
    assert read_header(path, COMPAT, ("slot",))[0].kind == "slot"
    with pytest.raises(DiskReject) as info:
        read_header(path, COMPAT, ("kv",))
    assert info.value.reason == "not_a_cache_file"


def test_temporary_files_of_dead_writers_are_removed_and_live_ones_kept(tmp_path) -> None:
    dead = tmp_path / ".tmp-kv-abc-1-dead"
    dead.write_bytes(b"partial")
    live = tmp_path / ".tmp-kv-abc-2-live"
    live.write_bytes(b"partial")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer that is still running holds its lock
    try:
        assert remove_stale_temps(tmp_path) == 1
        assert not dead.exists() and live.exists()
    finally:
        os.close(fd)
    assert remove_stale_temps(tmp_path) == 1 and not live.exists()


def test_a_failed_write_leaves_nothing_behind(tmp_path) -> None:
    h = header(tuple(range(40)))
    bad = [Tensor("t0", "F32", (1,), np.zeros(3, np.float32), 4)]  # 12 bytes where 4 are declared
    with pytest.raises(ValueError):
        write_temp(tmp_path / entry_name("kv", h.digest), h, bad)
    assert list(tmp_path.iterdir()) == []


def test_budget_evicts_the_oldest_files_over_every_model_directory(tmp_path) -> None:
    paths = []
    for i, sub in enumerate(["a", "b", "a", "b"]):
        (tmp_path / sub).mkdir(exist_ok=True)
        p = write(tmp_path / sub, tuple(range(i, i + 40)), seed=i)
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    size = paths[0].stat().st_size
    removed = enforce_budget(tmp_path, 2 * size)
    assert removed == paths[:2]
    assert [p.exists() for p in paths] == [False, False, True, True]
    assert enforce_budget(tmp_path, 2 * size) == []


def make_index(root: Path, capacity: int = 1 << 30, compat: Compat = COMPAT) -> DiskIndex:
    index = DiskIndex(root, compat, capacity, min_prefix=4, apc=ApcConfig(block_size=4))
    index.open()
    return index


def index_write(index: DiskIndex, tokens: tuple[int, ...], session: str = "s", kind: str = "kv", seed: int = 0) -> Path:
    path = write(index.directory, tokens, session, kind, seed)
    h, _ = read_header(path, COMPAT)
    assert index.add(h, path, path.stat().st_size)
    return path


def test_index_finds_entries_by_the_ram_prefix_rules(tmp_path) -> None:
    index = make_index(tmp_path)
    index_write(index, tuple(range(40)), session="alice")
    store = index.stores["kv"]
    hit = store.lookup(BUCKET, "bob", list(range(40)) + [7, 8], record=False).hit
    assert hit is not None and hit.matched_len == 40 and hit.stage == "cross_session"
    hit = store.lookup(BUCKET, "alice", list(range(30)) + [999] * 5, record=False).hit  # APC partial overlap
    assert hit is not None and hit.matched_len == 30
    assert store.lookup(make_bucket(model_id="other"), "alice", list(range(45)), record=False).hit is None
    assert store.counters.lookups == 0  # probes do not count


def test_index_is_rebuilt_from_headers_and_bad_files_are_removed(tmp_path) -> None:
    index = make_index(tmp_path)
    good = [index_write(index, tuple(range(i, i + 40)), session=f"s{i}", seed=i) for i in range(3)]
    snap = index_write(index, tuple(range(500, 540)), kind="snapshot")
    d = index.directory
    garbage = d / entry_name("kv", b"\x01" * 32)
    garbage.write_bytes(os.urandom(300))
    truncated = d / entry_name("kv", b"\x02" * 32)
    truncated.write_bytes(good[0].read_bytes()[:-10])
    foreign = write(d, tuple(range(900, 940)), compat=Compat(model="f" * 64, runtime=COMPAT.runtime))
    renamed = d / entry_name("kv", b"\x03" * 32)
    renamed.write_bytes(good[1].read_bytes())  # a valid file under another key's name
    (d / ".tmp-kv-x-1-y").write_bytes(b"half")
    other_model = tmp_path / "someone-else"
    other_model.mkdir()
    theirs = write(other_model, tuple(range(40)))

    again = DiskIndex(tmp_path, COMPAT, 1 << 30, min_prefix=4, apc=None)
    found = again.open()
    assert found == dict(files=8, indexed=4, rejected=4, stale_temp=1, removed_by_budget=0)
    rejections = {k: v for k, v in again.counters.rejections.items() if v}
    assert rejections == {"not_a_cache_file": 1, "truncated": 1, "foreign_model": 1, "corrupt_header": 1, "stale_temp": 1}
    assert sorted(p.name for p in d.iterdir() if p.name != LOCK_NAME) == sorted(p.name for p in [*good, snap])
    assert not foreign.exists() and theirs.exists()  # another model's directory is not ours to judge
    assert (again.entries, len(again.stores["kv"]), len(again.stores["snapshot"])) == (4, 3, 1)
    assert again.nbytes == sum(p.stat().st_size for p in [*good, snap])


def test_start_up_applies_the_budget_oldest_first(tmp_path) -> None:
    index = make_index(tmp_path)
    paths = [index_write(index, tuple(range(i, i + 40)), session=f"s{i}", seed=i) for i in range(4)]
    for i, p in enumerate(paths):
        os.utime(p, (2000 - i, 2000 - i))  # the first written is the most recently used
    size = paths[0].stat().st_size
    again = DiskIndex(tmp_path, COMPAT, 2 * size, min_prefix=4, apc=None)
    assert again.open()["removed_by_budget"] == 2
    assert [p.exists() for p in paths] == [True, True, False, False]
    assert again.entries == 2


def test_supersede_in_the_index_deletes_the_dominated_file_but_a_rewrite_keeps_its_own(tmp_path) -> None:
    index = make_index(tmp_path)
    short = index_write(index, tuple(range(40)))
    longer = index_write(index, tuple(range(60)))
    assert not short.exists() and longer.exists() and index.entries == 1
    again = index_write(index, tuple(range(60)), seed=5)  # same key written again (same name)
    assert again == longer and longer.exists() and index.entries == 1
    other_session = index_write(index, tuple(range(30)), session="t")
    assert other_session.exists() and index.entries == 2


def test_start_up_counts_what_the_index_keeps_when_a_found_file_supersedes_another(tmp_path) -> None:
    """Two files of one session, one prompt a prefix of the other (a writer killed before it
    dropped the shorter): start-up indexes both, the longer supersedes the shorter, whose file
    goes; ``indexed`` is the one entry kept, the file on disk."""
    d = make_index(tmp_path).directory
    short, longer = write(d, tuple(range(40))), write(d, tuple(range(60)))
    os.utime(short, (1000, 1000))  # the shorter is older: indexed first, superseded by the longer
    again = DiskIndex(tmp_path, COMPAT, 1 << 30, min_prefix=4, apc=None)
    found = again.open()
    assert found == dict(files=2, indexed=1, rejected=0, stale_temp=0, removed_by_budget=0)
    assert not short.exists() and longer.exists() and again.entries == 1


def test_forget_drop_and_clear(tmp_path) -> None:
    index = make_index(tmp_path)
    a = index_write(index, tuple(range(40)))
    b = index_write(index, tuple(range(100, 140)), session="t")
    a.unlink()
    assert index.forget(a) and not index.forget(a) and index.entries == 1
    index.reject("payload_checksum", b, "test", remove=True)
    assert not b.exists() and index.entries == 0
    assert index.counters.last_reject == {"reason": "payload_checksum", "file": b.name, "detail": "test"}
    index_write(index, tuple(range(200, 240)), session="u")
    size = next(index.directory.glob("kv-*")).stat().st_size
    assert index.clear() == (1, size) and index.entries == 0 and not list(index.directory.glob("kv-*"))


def test_refresh_picks_up_what_another_process_wrote_and_deleted(tmp_path) -> None:
    mine, theirs = make_index(tmp_path), make_index(tmp_path)  # two servers on one directory
    long_ago = time.time_ns() - 5 * RACY_NS
    os.utime(mine.directory, ns=(long_ago, long_ago))
    assert mine.refresh() and mine.entries == 0  # changed since start-up: listed
    assert not mine.refresh()  # unchanged, and not racily: one stat, no listing
    assert mine.counters.refreshes == 1
    shared = index_write(theirs, tuple(range(40)), session="alice")  # its rename changes the directory
    assert mine.refresh() and mine.entries == 1 and mine.counters.picked_up == 1
    hit = mine.stores["kv"].lookup(BUCKET, "bob", list(range(40)) + [7], record=False).hit
    assert hit is not None and hit.matched_len == 40 and hit.entry.payload.path == shared
    # A change within the timestamp granularity of the listing leaves the mtime as it was: a
    # listing made that soon after the mtime it saw is repeated.
    racy = mine.listed_mtime_ns
    index_write(theirs, tuple(range(100, 140)), session="carol")
    os.utime(mine.directory, ns=(racy, racy))
    assert mine.refresh() and mine.entries == 2
    # Deleted by the other process (its budget): forgotten, counted as vanished.
    shared.unlink()
    assert mine.refresh() and mine.entries == 1 and mine.counters.vanished == 1
    # A bad file is rejected and removed, as at start-up; files being committed here are skipped.
    bad = mine.directory / entry_name("kv", b"\x05" * 32)
    bad.write_bytes(os.urandom(100))
    own = write(mine.directory, tuple(range(200, 240)), session="dave")
    assert mine.refresh(skip={own}) and not bad.exists() and mine.counters.rejections["not_a_cache_file"] == 1
    assert mine.entries == 1 and mine.counters.picked_up == 2


def test_refresh_indexes_a_bounded_number_of_new_files_per_call(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disk_index, "REFRESH_MAX_FILES", 3)
    mine, theirs = make_index(tmp_path), make_index(tmp_path)
    for i in range(7):
        index_write(theirs, tuple(range(i * 50, i * 50 + 40)), session=f"s{i}", seed=i)
    assert mine.refresh() and mine.entries == 3
    assert mine.refresh() and mine.entries == 6  # listed again although nothing changed since
    assert mine.refresh() and mine.entries == 7


def test_short_entries_are_not_indexed_and_their_files_go(tmp_path) -> None:
    index = make_index(tmp_path)
    path = write(index.directory, (1, 2))  # below min_prefix
    h, _ = read_header(path, COMPAT)
    assert not index.add(h, path, path.stat().st_size)
    assert not path.exists()


def test_session_key_default_round_trips(tmp_path) -> None:
    path = write(tmp_path, tuple(range(40)), session=ANON_SESSION)
    assert read_header(path, COMPAT)[0].session_key == ANON_SESSION


def test_large_strided_tensors_are_written_piece_by_piece_in_c_order(tmp_path) -> None:
    big = np.random.default_rng(3).standard_normal((1, 3, 9100, 8)).astype(np.float32)
    view = big[:, :, :9000, :]  # each head's rows are contiguous (288 kB), the whole is not
    assert not view.flags.c_contiguous
    assert [len(b) for b in byte_blocks(view)] == [9000 * 8 * 4] * 3
    h = header(tuple(range(40)))
    path = tmp_path / entry_name("kv", h.digest)
    commit(write_temp(path, h, [Tensor("t0", "F32", view.shape, view, view.nbytes)]), path)
    assert payload(path) == np.ascontiguousarray(view).tobytes()
    assert read_header(path, COMPAT)[0].payload_blake3 == blake3(payload(path)).hexdigest()
