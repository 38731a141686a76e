"""A loaded GGUF's header leaves the process (``gguf/load.py: release_headers``): the map is
populated up front, so without this the metadata and tensor table (a 262K vocabulary's strings,
scores and types: 6.2 MiB on Gemma 3) stayed in RSS, though nothing reads them after loading.
Residency is read from ``/proc/self/pagemap`` (the present bit, readable without privileges)."""

from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.gguf.reader import open_gguf
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/pagemap is Linux's")


def resident_pages(path: Path, start: int, end: int) -> tuple[int, int]:
    """(resident, total) pages of this process's map of ``path`` over file bytes ``start .. end``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path) and int(fields[2], 16) == 0:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            break
    else:
        raise AssertionError(f"{path} is not mapped from its start")
    first, last = (low + start) // mmap.PAGESIZE, min(low + end, high) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first) * 8)
    present = [(struct.unpack_from("<Q", raw, 8 * i)[0] >> 63) & 1 for i in range(last - first)]
    return sum(present), len(present)


def test_header_pages_leave_the_process_and_tensor_pages_stay() -> None:
    path = Path(tiny_model("qwen3:q8_0")).resolve()
    file = open_gguf(path)
    data_start = min(info.offset for info in file.tensors.values())
    assert data_start > 4 * mmap.PAGESIZE  # a header worth checking: the vocabulary's arrays
    model, *_ = load_gguf(str(path), on_cpu=True)
    header, header_pages = resident_pages(path, 0, data_start // mmap.PAGESIZE * mmap.PAGESIZE)
    assert header_pages > 0 and header == 0
    views = list(_views_of_the_map(model))
    assert views  # the token embedding at least
    for start, end in views:  # the weights served from their blocks in the map are still mapped in
        tensors, tensor_pages = resident_pages(path, -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE)
        assert tensors == tensor_pages
    del model


def _views_of_the_map(model) -> list[tuple[int, int]]:
    """File byte ranges of the model's block weights that are views of the file's map (the loader
    drops the pages of weights it rearranges into copies: grouped or split rows)."""
    from mlxcel_compat.runtime.block_weight import BlockWeight

    ranges = []
    for _, module in model.named_modules():
        weight = getattr(module, "block", None)
        if not isinstance(weight, BlockWeight):
            continue
        root = weight.data
        while isinstance(root.base, np.ndarray):
            root = root.base
        if isinstance(getattr(root.base, "obj", None), mmap.mmap):
            start = weight.data.ctypes.data - root.ctypes.data
            ranges.append((start, start + weight.data.nbytes))
    return ranges
