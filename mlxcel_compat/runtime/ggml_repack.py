"""Weights repacked by ggml into its interleaved layouts, and their products (``mlxcel_repack_matmul``).

ggml's CPU backend keeps some types in a second, interleaved layout (its ``CPU_REPACK`` buffer
type: on x86 Q4_0, Q4_K, IQ4_NL and MXFP4, plus Q2_K with AVX-512, as 8 rows whose blocks
alternate), with GEMV and GEMM kernels that multiply them faster than the row-by-row ``vec_dot``
of the native layer's block products: llama-server uses them by default. This module compiles the small C library
that reaches them through ggml's public API (linked to the ggml libraries ``ggml_cpu.py`` loads,
built like the BLAS shim on the machine that runs it) and repacks a weight when ggml has a layout
for its type on this CPU; :class:`~mlxcel_compat.runtime.block_weight.BlockWeight` then sends its
products there. Nothing here imports MLX.

A repacked weight computes every product from the copy: decode steps (each activation row its
own GEMV, so a row never depends on the batch) and prompt chunks (GEMM). The copy replaces the
mapped file's pages in memory: after repacking, the pages of the tensor are dropped from the
process (``madvise(MADV_DONTNEED)``; they stay in the page cache), so a repacked model takes what
a mapped one takes. ``--no-repack`` (the ``repack`` setting, ``load_gguf(repack=False)``) keeps
every weight in the file's blocks.

Prompt products (:func:`prompt_product`): with ggml 0.25 or later (what ``scripts/setup.sh``
builds), a K-quant or 256-value i-quant weight (``PROMPT_TYPES``) is not repacked but multiplies
prompt chunks as stored, by ggml's own ``mul_mat`` (one graph on ggml's threads, ``mlxcel_plain_matmul``), whose
tiled int8 kernels beat both the float32 tiles (2-4x) and, for Q4_K, the repacked GEMM (1.8x);
its decode rows stay ``vec_dot``, about as fast as the repacked GEMV.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from gguf import GGMLQuantizationType as T

from mlxcel_compat.runtime.native import blas_shim
from mlxcel_compat.runtime import ggml_cpu

# The types repacked (ggml's layouts on x86: Q4_0 and Q4_K 8x8, IQ4_NL and MXFP4 8x8 with AVX2;
# measured on this project's AVX-512 machines, docs/benchmarks/quantized.md): a prompt chunk of
# Q4_K by ggml's int8 GEMM 1.4-2.1x faster than float32 tiles, Q4_0 2.2-5.7x; a decode step by
# its GEMV about as fast as vec_dot on a Llama-7B layer (0.88x on 11008 x 4096, 1.30x on 4096 x
# 11008: 4 % in all) and 1.1-1.4x on small matrices. MXFP4 (gpt-oss's experts) and IQ4_NL:
# prompt chunks 1.6-1.8x the tiles' speed (2048 x 768, 1024 rows; ggml's mul_mat on the stored
# blocks 0.5-0.9x), decode rows 1.2-1.7x vec_dot's (768 x 2048 to 2880 x 2880, 1 and 4 rows):
# llama-server repacks both too. Q2_K's GEMM is slower than the float32 tiles: not repacked.
REPACKED_TYPES = frozenset({T.Q4_0, T.Q4_K, T.IQ4_NL, T.MXFP4})
# The types whose prompt chunks go through ggml's own mul_mat on the stored blocks: ggml 0.25's
# tiled K-quant kernels (AVX-512 VNNI int8, Q8_K activations), what llama.cpp runs for prompts,
# 1.9-2.6x faster than float32 tiles on a 2048 x 768 weight and 1024 rows, and Q8_0 through
# llamafile's GEMM (8-bit activations, as llama.cpp's prompts), 1.06-1.09x the tiles and no
# float32 tile or BLAS buffers (a 1K prompt on the small llama's Q8_0: 0.84x -> 0.96x
# llama-server's, its greedy continuations still closer to the float32 reference than
# llama-server's). The i-quants of 256-value blocks (IQ4_XS, IQ3_*, IQ2_*, IQ1_*) too: ggml
# multiplies them by their vec_dot over Q8_K rows, 1.8-2.7x the tiles (whose expansion is
# ggml's scalar to_float). The rest keep the tiles and the BLAS: ggml's path (llamafile's GEMM
# for Q5_0, vec_dot for Q4_1) measured 0.44-1.0x of them (scripts/bench_prompt_products.py,
# docs/benchmarks/quantized.md). Q8_0 takes the shim's own lane kernel instead where it has one
# (``BlockLibrary.lane_prompts``, AVX-512 VNNI; prompt_product).
PROMPT_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0,
                          T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS, T.IQ1_M, T.IQ1_S})
PROMPT_GGML_MIN = (0, 25)  # the first ggml with the tiled kernels
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float



@dataclass(frozen=True)
class RepackLibrary:
    """The compiled library's functions."""

    new: Any
    free: Any
    bytes: Any
    matmul: Any
    path: Path
    matmul_held: Any  # mlxcel_repack_matmul called holding the GIL: for short calls
    plain_new: Any  # mlxcel_plain_new: a weight as stored, for ggml's own mul_mat
    plain_matmul: Any  # mlxcel_plain_matmul: a prompt chunk through it


@lru_cache(maxsize=1)
def library() -> RepackLibrary | str:
    """The repacking library, or why there is none (weights then stay in the file's blocks)."""
    from mlxcel_compat.runtime import backend

    kernels = ggml_cpu.kernels()
    if isinstance(kernels, str):
        return kernels
    if backend.matmul_shim() is None:
        return "the BLAS shim (whose threads run the products) is not loaded"
    if not (kernels.directory.parent / "include" / "ggml.h").exists():
        return f"ggml's headers are not beside {kernels.directory}"
    built = blas_shim.build(recipe=blas_shim.repack_recipe(kernels.directory))
    if built.path is None:
        return built.reason
    try:
        lib = ctypes.CDLL(str(built.path))
        new, free, nbytes, matmul = lib.mlxcel_repack_new, lib.mlxcel_repack_free, lib.mlxcel_repack_bytes, lib.mlxcel_repack_matmul
        matmul_held = blas_shim.holding_the_gil(lib).mlxcel_repack_matmul
        plain_new, plain_matmul = lib.mlxcel_plain_new, lib.mlxcel_plain_matmul
    except (OSError, AttributeError) as exc:
        return f"loading {built.path} failed: {exc}"
    new.restype, new.argtypes = _P, [_I, _P, _I, _I]
    free.restype, free.argtypes = None, [_P]
    nbytes.restype, nbytes.argtypes = _L, [_P]
    for fn in (matmul, matmul_held):
        fn.restype, fn.argtypes = None, [_P, _I, _P, _L, _P, _L, _F, _I]
    plain_new.restype, plain_new.argtypes = _P, [_I, _P, _I, _I]
    plain_matmul.restype, plain_matmul.argtypes = None, [_P, _I, _P, _L, _P, _L, _F]
    return RepackLibrary(new, free, nbytes, matmul, built.path, matmul_held, plain_new, plain_matmul)


@dataclass(eq=False)
class Repacked:
    """One weight in ggml's repacked layout (freed with this object)."""

    handle: int
    nbytes: int
    lib: RepackLibrary

    def matmul_into(self, m: int, x: int, ldx: int, out: int, ldo: int, beta: float, per_row: bool) -> None:
        short = m <= blas_shim.GIL_HELD_ROWS_MAX and per_row
        (self.lib.matmul_held if short else self.lib.matmul)(self.handle, m, x, ldx, out, ldo, beta, int(per_row))

    def __del__(self) -> None:
        if self.handle:
            self.lib.free(self.handle)
            self.handle = 0


def repack(data: np.ndarray, ggml_type: int, n: int, k: int, rows: np.ndarray | None = None) -> Repacked | None:
    """``data`` (n rows of ggml blocks; output row r is stored row ``rows[r]``) in ggml's
    repacked layout for this CPU, or None when ggml has none for the type and shape, or it is
    not worth it (``REPACKED_TYPES``)."""
    lib = library()
    if isinstance(lib, str) or ggml_type not in REPACKED_TYPES:
        return None
    source = np.ascontiguousarray(data[rows] if rows is not None else data)
    handle = lib.new(int(ggml_type), source.ctypes.data, n, k)
    if not handle:
        return None
    return Repacked(handle, int(lib.bytes(handle)), lib)


@dataclass(eq=False)
class PromptProduct:
    """A weight as stored, multiplied for prompt chunks by ggml's own mul_mat (one graph on
    ggml's threads; freed with this object). ``data``: the blocks it reads, kept alive here."""

    handle: int
    data: np.ndarray
    lib: RepackLibrary

    def matmul_into(self, m: int, x: int, ldx: int, out: int, ldo: int, beta: float) -> None:
        self.lib.plain_matmul(self.handle, m, x, ldx, out, ldo, beta)

    def __del__(self) -> None:
        if self.handle:
            self.lib.free(self.handle)
            self.handle = 0


def prompt_product(weight: Any, mapped: np.ndarray | None = None, offset: int = 0) -> bool:
    """Give ``weight`` (a linear layer's BlockWeight, not repacked) ggml's mul_mat for its prompt
    chunks where that is faster than float32 tiles (``PROMPT_TYPES``, with a ggml that has
    them: ``PROMPT_GGML_MIN``). A weight whose rows are read permuted is first copied into the
    model's order (the file's pages of it dropped, as repacking does). Not where the shim's own
    lane kernel takes the type's prompt chunks (``BlockLibrary.lane_prompts``: Q8_0, 2x ggml's
    mul_mat). Whether it was."""
    lib = library()
    if (isinstance(lib, str) or not takes_prompt_products(weight.ggml_type) or weight.group_bias is not None
            or weight.repacked is not None or int(weight.ggml_type) in weight.lib.lane_prompts):
        return False
    weight.reorder(mapped, offset)
    handle = lib.plain_new(int(weight.ggml_type), weight.data.ctypes.data, weight.n, weight.k)
    if not handle:
        return False
    weight.prompt = PromptProduct(handle, weight.data, lib)
    return True


def takes_prompt_products(ggml_type: int) -> bool:
    """Whether weights of this type get ggml's mul_mat for prompt chunks (and are therefore
    not repacked: ggml's tiled kernels multiply a Q4_K prompt chunk ~1.8x faster than its
    repacked GEMM, and decode rows by vec_dot about as fast as by the repacked GEMV)."""
    kernels = ggml_cpu.kernels()
    return (ggml_type in PROMPT_TYPES and not isinstance(kernels, str)
            and _version(kernels.version) >= PROMPT_GGML_MIN)


def _version(text: str) -> tuple[int, ...]:
    """``"0.25.3"`` -> ``(0, 25, 3)``; an unknown version (``"?"``) -> ``()``, older than any."""
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return ()


def attach(weight: Any, mapped: np.ndarray | None = None, offset: int = 0) -> bool:
    """Give ``weight`` (a linear layer's :class:`~mlxcel_compat.runtime.block_weight.BlockWeight`)
    its repacked copy where that is worth it, which then computes all its products, and drop the
    file's pages of the weight (``mapped``, at ``offset``) from the process. Whether it was."""
    if weight.group_bias is not None or takes_prompt_products(weight.ggml_type):
        return False
    repacked = repack(weight.data, weight.ggml_type, weight.n, weight.k, weight.rows)
    if repacked is None:
        return False
    weight.repacked = repacked
    if mapped is not None:
        release_pages(mapped, offset, weight.data.nbytes)
    return True


def release_pages(mapped: np.ndarray, offset: int, length: int) -> None:
    """Drop bytes ``offset .. offset + length`` of a read-only file map (``gguf.map_file``) from the
    process: the pages stay in the page cache and come back on the next read. Only the whole pages
    inside the range, so a neighbouring tensor's pages are left alone."""
    base = mapped.base
    if isinstance(base, memoryview):  # np.frombuffer keeps the buffer's memoryview
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(base, "madvise"):
        return
    first = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        base.madvise(mmap.MADV_DONTNEED, first, end - first)


__all__ = ["PROMPT_TYPES", "PromptProduct", "REPACKED_TYPES", "Repacked", "RepackLibrary", "attach", "library",
           "prompt_product", "release_pages", "repack", "takes_prompt_products"]
