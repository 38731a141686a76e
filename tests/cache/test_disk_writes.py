"""How disk-tier files are written: O_DIRECT where the filesystem takes it, else through the
page cache; the two give byte-identical files that read back and check (pure Python, no model)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from mlxcel_compat.cache.disk_directory import entry_name
from mlxcel_compat.cache.disk_format import Compat, EntryHeader, Tensor, payload_checksum, read_header
from mlxcel_compat.cache.disk_write import DirectFile, NoDirectIO, commit, write_temp
from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket

BUCKET = Bucket("tiny", "", RAW_PROMPT_TEMPLATE_SIG, None, TEXT_ONLY_MM_DIGEST)
COMPAT = Compat("fp", "runtime")


def tensors() -> list[Tensor]:
    """Sizes that cross the 8 MiB write step and end off any 4096-byte boundary; one strided view
    (a KV cache buffer's first rows), as the adapter hands them over."""
    rng = np.random.default_rng(7)
    big = rng.standard_normal((3, 1_100_000), dtype=np.float32)  # 13.2 MB
    buffer = rng.standard_normal((2, 4, 900, 16), dtype=np.float32)
    rows = buffer[:, :, :333]  # not contiguous as a whole
    odd = rng.integers(0, 255, 4097, dtype=np.uint8)
    return [Tensor(name, dtype, a.shape, a, a.nbytes) for name, dtype, a in (("t0", "F32", big), ("t1", "F32", rows), ("t2", "U8", odd))]


def write(directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    header = EntryHeader("kv", COMPAT, BUCKET, "s", (1, 2, 3), "completion", True, 123, {}, created=1.0)
    path = directory / entry_name("kv", header.digest)
    commit(write_temp(path, header, tensors()), path)
    return path


def direct_io_works(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False


def test_direct_and_buffered_writes_make_the_same_checked_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = []
    real_open = DirectFile.open.__func__

    def spy(cls, path):  # noqa: ANN001, ANN202
        f = real_open(cls, path)
        opened.append(path)
        return f

    monkeypatch.setattr(DirectFile, "open", classmethod(spy))
    first = write(tmp_path / "direct")
    # Where this filesystem takes O_DIRECT, the first file was written with it.
    assert bool(opened) == direct_io_works(tmp_path)

    def refuse(cls, path):  # noqa: ANN001, ANN202
        raise NoDirectIO

    monkeypatch.setattr(DirectFile, "open", classmethod(refuse))
    second = write(tmp_path / "buffered")
    a, b = first.read_bytes(), second.read_bytes()
    assert len(a) == len(b) == first.stat().st_size  # the padding was truncated away
    assert a == b
    header, _ = read_header(first, COMPAT)
    expected = [np.ascontiguousarray(t.data).tobytes() for t in tensors()]
    assert header.payload_blake3 == payload_checksum(expected)
    assert a[-sum(map(len, expected)):] == b"".join(expected)
    assert not list(tmp_path.rglob(".tmp-*"))


def test_a_refusal_at_the_first_write_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some devices take the O_DIRECT open but refuse its alignment at the first write (EINVAL):
    the file is then written again through the page cache, whole and checked. (The direct file is
    opened without O_DIRECT here, so this runs on any filesystem; the refusal is injected.)"""
    direct_fds: list[int] = []

    def open_plain(cls, path):  # noqa: ANN001, ANN202
        f = cls(os.open(path, os.O_WRONLY))
        direct_fds.append(f.fd)
        return f

    real_pwrite = os.pwrite
    refused: list[int] = []

    def pwrite(fd, data, offset):  # noqa: ANN001, ANN202
        if fd in direct_fds:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(DirectFile, "open", classmethod(open_plain))
    monkeypatch.setattr(os, "pwrite", pwrite)
    path = write(tmp_path / "c")
    assert refused == [0]
    header, _ = read_header(path, COMPAT)
    expected = [np.ascontiguousarray(t.data).tobytes() for t in tensors()]
    assert header.payload_blake3 == payload_checksum(expected)
    assert path.read_bytes()[-sum(map(len, expected)):] == b"".join(expected)
    assert not list(tmp_path.rglob(".tmp-*"))
    # The directory is remembered: the next file there goes through the page cache at once.
    opened = len(direct_fds)
    path.unlink()
    write(tmp_path / "c")
    assert len(direct_fds) == opened and refused == [0]
