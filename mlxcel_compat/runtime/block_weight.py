"""A weight kept in ggml's block format on the CPU, and its products (``mlxcel_block_matmul``).

A GGUF tensor of a quantized type (or F16/BF16) is served as it is stored: ``data`` is a view
of the memory-mapped file, so loading copies nothing, the pages are shared with the page cache
and a restart finds them there. Products go through the native layer's block products
(``mlxcel_block_matmul``) in the BLAS shim's library, with ggml's per-type kernels
(``ggml_cpu.py``): few activation rows by ``vec_dot`` or the shim's own kernels, many rows
(``tiles``: a prompt chunk's path) by tiles expanded to float32 for the BLAS's sgemm, or by the
shim's own lane kernels where they take prompt chunks too (``BlockLibrary.lane_prompts``: Q8_0,
and the rows split or grouped at load). Q4_K, Q6_K, Q8_0, Q4_1, Q5_0, Q5_1 and MXFP4 weights of
linear layers and expert stacks are grouped at load (``group_rows``: 16 rows' blocks side by side;
the last four in whole groups only), the other Q4_1, Q5_0, Q5_1 and MXFP4 weights split
(``split_rows``: factors ahead of nibbles). Nothing here imports MLX; the MLX modules that hold
these weights are in ``block_layers.py``, and the CPU decode runtime calls them directly
(``cpu_decode.py``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from mlxcel_compat.runtime.native import blas_shim
from mlxcel_compat.runtime import ggml_cpu

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float

# ``BlockWeight.matmul``'s default path by row count: up to this many rows ggml's vec_dot, more
# float32 tiles and the BLAS's sgemm (a crossover measured on the small llama's Q4_K_M). The
# model's layers choose by sequence instead (``block_layers``: decode steps vec_dot, prompt
# chunks tiles), and the CPU decode runtime always takes vec_dot.
VEC_DOT_ROWS_MAX = 8
# Types whose rows ``split_rows`` rearranges at load for the shim's own kernels (``mlxcel_rows_kernel``):
# each type's block fields (byte ranges) in their order in a group of SPLIT_GROUP blocks of a
# split row, and the code (SPLIT_TYPE_BASE + the ggml type) that names the split form there.
SPLIT_FIELDS = {
    3: ((0, 2), (2, 4), (4, 20)),  # GGML_TYPE_Q4_1: d, m, qs[16]
    6: ((0, 2), (2, 6), (6, 22)),  # GGML_TYPE_Q5_0: d, qh[4], qs[16]
    7: ((0, 2), (2, 4), (4, 8), (8, 24)),  # GGML_TYPE_Q5_1: d, m, qh[4], qs[16]
    39: ((0, 1), (1, 17)),  # GGML_TYPE_MXFP4: e (E8M0), qs[16]
}
SPLIT_GROUP = 16  # blocks a group of a split row
SPLIT_TYPES = tuple(SPLIT_FIELDS)
SPLIT_TYPE_BASE = 1000
# Types whose rows ``group_rows`` groups at load (16 rows' blocks side by side, a vector lane a
# row: the lane kernels then read each group front to back, with no transposes): each type's
# block bytes and its whole dwords (the other bytes, Q6_K's d after them, Q8_0's and Q5_0's d
# ahead of them, go as the 16 rows' in turn: after the dwords where the block starts a cache line,
# else ahead of them, so that no vector straddles two lines), and the code (GROUPED_TYPE_BASE +
# the ggml type) that names the grouped form there. The 32-value types' grouped kernels, Q8_0's
# aside, take whole groups only (``group_rows`` leaves a weight of other row counts as it was).
GROUPED_BLOCKS = {
    12: (144, 36),  # GGML_TYPE_Q4_K: d, dmin, scales[12], qs[128]
    14: (210, 52),  # GGML_TYPE_Q6_K: ql[128], qh[64], scales[16], then d
    8: (34, 8),  # GGML_TYPE_Q8_0: d (ahead: GROUPED_LEAD), qs[32]
    3: (20, 5),  # GGML_TYPE_Q4_1: d and m (one dword), qs[16]
    6: (22, 5),  # GGML_TYPE_Q5_0: d (ahead), qh[4], qs[16]
    7: (24, 6),  # GGML_TYPE_Q5_1: d and m, qh[4], qs[16]
    39: (17, 4),  # GGML_TYPE_MXFP4: e (ahead), qs[16]; 16 x 17 bytes: half the blocks' dwords straddle lines
}
# The bytes of a block ahead of its whole dwords (a 2-byte d, MXFP4's exponent): they go with the bytes past them.
GROUPED_LEAD = {8: 2, 6: 2, 39: 1}
# Where the lanes read a grouped super-block's quads of dwords (4 q .. 4 q + 3, a vector load each)
# out of order, the order they are stored in: slot s holds quad QUAD_ORDER[type][s], so that a
# super-block is read front to back (the native layer's q6_K_quad_slot, the other way round).
QUAD_ORDER = {14: (12, 0, 2, 8, 1, 3, 9, 4, 6, 10, 5, 7, 11)}
GROUP_ROWS = 16
GROUPED_TYPE_BASE = 2000


class _WeightStruct(ctypes.Structure):
    """``struct mlxcel_block_weight`` (the native layer's block products)."""

    _fields_ = [("type", _P), ("data", _P), ("row_bytes", _L), ("rows", _P), ("group_bias", _P),
                ("bias_group", _I), ("n", _I), ("k", _I), ("float_prompts", _I)]


def own_kernels_enabled() -> bool:
    """``MLXCEL_OWN_KERNELS=0`` multiplies decode rows by ggml's vec_dot for every type (for
    comparison: ``scripts/bench_quant_rows.py``, ``scripts/bench_quantized.py --mlxcel-env``)."""
    return os.environ.get("MLXCEL_OWN_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class BlockLibrary:
    """The shim's block-product functions and ggml's kernels: what a :class:`BlockWeight` needs."""

    matmul: Any  # mlxcel_block_matmul
    rows: Any  # mlxcel_block_rows
    ggml: ggml_cpu.GGMLKernels
    matmul_held: Any  # mlxcel_block_matmul called holding the GIL: for short calls
    own_kernels: frozenset[int]  # types whose decode rows the shim's own kernels multiply (mlxcel_rows_kernel)
    quantizers: dict[int, int]  # activation types the shim quantizes itself (byte for byte ggml's), to the function
    dequantizers: dict[int, int]  # weight types the shim expands to float32 itself (ggml's is scalar), to the function
    split_kinds: dict[int, ggml_cpu.BlockType]  # types whose rows split_rows rearranges, to their kernels
    # own-kernel codes (a ggml type; SPLIT_TYPE_BASE or GROUPED_TYPE_BASE + the type) whose lane
    # kernel takes prompt chunks too, 8-bit activations as llama.cpp's (mlxcel_lanes_take_prompts)
    lane_prompts: frozenset[int] = frozenset()
    split_layout: Any = None  # mlxcel_split_layout: split_rows's rearrangement, in C
    # types whose rows group_rows groups, to their kernels (GROUPED_TYPE_BASE + the type)
    grouped_kinds: dict[int, ggml_cpu.BlockType] = field(default_factory=dict)
    group_layout: Any = None  # mlxcel_group_layout: grouped_copy's rearrangement, in C

    def serves(self, ggml_type: int) -> bool:
        """Whether weights of this type are served from their blocks: a block type whose kernels
        this build of ggml has (``GGMLKernels.supports``)."""
        return ggml_type in ggml_cpu.BLOCK_TYPES and self.ggml.supports(ggml_type)

    def block_type(self, ggml_type: int) -> ggml_cpu.BlockType:
        """ggml's kernels of the type, with the shim's own rows kernel and activation quantizer
        where it has them."""
        kind = self.ggml.block_type(ggml_type)
        kind.own_kernel = int(ggml_type) if int(ggml_type) in self.own_kernels else -1
        own_quantizer = self.quantizers.get(self.ggml.activation_type(ggml_type))
        if own_quantizer:
            kind.quantize = own_quantizer
        own_dequantizer = self.dequantizers.get(int(ggml_type))
        if own_dequantizer:
            kind.to_float = own_dequantizer
        return kind

    def describe(self, ggml_type: int, split: bool = False, grouped: bool = False) -> str:
        """What the start-up log says multiplies a type (its rows ``split`` or ``grouped`` at load
        or not): ggml's kernels, and the shim's own for decode rows where it has one."""
        text = self.ggml.describe(ggml_type)
        if grouped:
            return text + ("; rows grouped at load (16 rows' blocks side by side): decode rows and prompt chunks by "
                           "mlxcel's AVX-512 VNNI lanes (8-bit activations, as llama.cpp's)")
        if int(ggml_type) in self.own_kernels:
            text += "; decode rows by mlxcel's AVX-512 kernel"
        if int(ggml_type) in self.lane_prompts:
            text += ", prompt chunks too (8-bit activations, as llama.cpp's)"
        if split:  # every split form's lanes take prompts (mlxcel_lanes_take_prompts)
            text += ("; rows split at load (factors ahead of nibbles): decode rows and prompt chunks by mlxcel's "
                     "AVX-512 VNNI kernel (8-bit activations, as llama.cpp's)")
        elif int(ggml_type) in self.dequantizers:
            text += "; float32 tiles expanded by mlxcel's AVX-512 code"
        return text


@lru_cache(maxsize=1)
def library() -> BlockLibrary | str:
    """The block products, or why there are none (the loader then expands weights to float32)."""
    from mlxcel_compat.runtime import backend

    ggml = ggml_cpu.kernels()
    if isinstance(ggml, str):
        return ggml
    shim = backend.matmul_shim()
    if shim is None:
        return "the BLAS shim (which runs ggml's kernels on its threads) is not loaded"
    try:
        matmul, rows = shim.lib.mlxcel_block_matmul, shim.lib.mlxcel_block_rows
        matmul_held = blas_shim.holding_the_gil(shim.lib).mlxcel_block_matmul
        own, quantizer, dequantizer = shim.lib.mlxcel_rows_kernel, shim.lib.mlxcel_quantizer, shim.lib.mlxcel_dequantizer
        lanes_take_prompts = shim.lib.mlxcel_lanes_take_prompts
        split_layout, group_layout = shim.lib.mlxcel_split_layout, shim.lib.mlxcel_group_layout
    except AttributeError:
        return "the loaded BLAS shim has no block products (built from an older source)"
    matmul.restype = rows.restype = matmul_held.restype = None
    matmul.argtypes = matmul_held.argtypes = [_P, _I, _P, _L, _P, _L, _F, _I]
    rows.argtypes = [_P, _P, _I, _P]
    own.restype = quantizer.restype = dequantizer.restype = _P
    own.argtypes = quantizer.argtypes = dequantizer.argtypes = lanes_take_prompts.argtypes = [_I]
    lanes_take_prompts.restype = _I
    split_layout.restype, split_layout.argtypes = None, [_P, _P, _L, _I, _I, _I, _P, _P]
    group_layout.restype, group_layout.argtypes = None, [_P, _P, _L, _I, _I, _I, _I, _P]
    own_kernels: frozenset[int] = frozenset()
    quantizers: dict[int, int] = {}
    dequantizers: dict[int, int] = {}
    if own_kernels_enabled():
        served = [int(t) for t in ggml_cpu.BLOCK_TYPES if ggml.supports(t)]
        own_kernels = frozenset(t for t in served if own(t))
        acts = {ggml.activation_type(t) for t in served}
        quantizers = {a: quantizer(a) for a in acts if quantizer(a)}
        dequantizers = {t: dequantizer(t) for t in served if dequantizer(t)}
    split_kinds: dict[int, ggml_cpu.BlockType] = {}
    for ggml_type in SPLIT_TYPES if own_kernels_enabled() else ():
        code = SPLIT_TYPE_BASE + int(ggml_type)
        if own(code) and dequantizer(code):
            plain = ggml.block_type(ggml_type)
            split_kinds[int(ggml_type)] = ggml_cpu.BlockType(plain.vec_dot, plain.quantize, dequantizer(code),
                                                             plain.act_block, plain.act_block_bytes, code)
    grouped_kinds: dict[int, ggml_cpu.BlockType] = {}
    for ggml_type in GROUPED_BLOCKS if own_kernels_enabled() else ():
        code = GROUPED_TYPE_BASE + ggml_type
        if own(code) and ggml.supports(ggml_type):
            plain = ggml.block_type(ggml_type)
            quantize = quantizers.get(ggml.activation_type(ggml_type)) or plain.quantize
            grouped_kinds[ggml_type] = ggml_cpu.BlockType(plain.vec_dot, quantize, plain.to_float, plain.act_block,
                                                          plain.act_block_bytes, code)
    codes = [*own_kernels, *(kind.own_kernel for kind in split_kinds.values()),
             *(kind.own_kernel for kind in grouped_kinds.values())]
    lane_prompts = frozenset(code for code in codes if lanes_take_prompts(code))
    return BlockLibrary(matmul, rows, ggml, matmul_held, own_kernels, quantizers, dequantizers, split_kinds,
                        lane_prompts, split_layout, grouped_kinds, group_layout)


def row_bytes(ggml_type: int, k: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if k % block:
        raise ValueError(f"rows of {k} values do not fill whole {GGMLQuantizationType(ggml_type).name} blocks")
    return k // block * size


@dataclass(eq=False)
class BlockWeight:
    """``n`` rows of ``k`` values in GGML type ``ggml_type``: a linear layer's (out, in) weight
    or an embedding table.

    ``rows``: output row r is stored row ``rows[r]`` (llama.cpp's permuted query and key rows,
    read in the model's order). ``group_bias``: per stored row, one bias per ``bias_group``
    inputs, added to the blocks' values (MLX affine 8-bit weights, held as Q8_0 blocks).
    """

    data: np.ndarray  # uint8 (n, row_bytes): a view of the mapped file, or a repacked copy
    ggml_type: int
    n: int
    k: int
    lib: BlockLibrary
    rows: np.ndarray | None = None  # int32 (n,)
    group_bias: np.ndarray | None = None  # float32 (n, k / bias_group)
    bias_group: int = 0
    # ggml's repacked copy (``ggml_repack.py``) where it multiplies faster: every product goes there
    repacked: Any = None
    # ggml's own mul_mat over these blocks (``ggml_repack.PromptProduct``) where it multiplies
    # prompt chunks faster than float32 tiles: the ``tiles`` path goes there
    prompt: Any = None
    # rows rearranged by ``split_rows`` (factors ahead of nibbles): only this library's kernels read them
    split: bool = False
    # rows grouped by ``group_rows`` (16 rows' super-blocks side by side): only the lanes read them
    grouped: bool = False
    # prompt chunks by float32 tiles, never by an 8-bit-activation GEMM: MLX affine weights
    # (``mlx_affine.py``), whose prompts promise MLX's float32 result; a GGUF's blocks take
    # llama.cpp's 8-bit activations
    float_prompts: bool = False
    address: int = field(init=False)  # of the C struct, passed on every call
    _struct: _WeightStruct = field(init=False, repr=False)

    def __post_init__(self) -> None:
        expected = row_bytes(self.ggml_type, self.k)
        if self.data.dtype != np.uint8 or self.data.shape != (self.n, expected) or not self.data.flags.c_contiguous:
            raise ValueError(f"block data of shape {self.data.shape} does not hold {self.n} rows of {expected} bytes")
        if self.rows is not None:
            self.rows = np.ascontiguousarray(self.rows, dtype=np.int32)
            if self.rows.shape != (self.n,) or self.n and not (0 <= self.rows.min() and self.rows.max() < self.n):
                raise ValueError("the row order must name each of the weight's rows")
        if self.group_bias is not None:
            self.group_bias = np.ascontiguousarray(self.group_bias, dtype=np.float32)
            if not self.bias_group or self.k % self.bias_group or self.group_bias.shape != (self.n, self.k // self.bias_group):
                raise ValueError("group biases must hold one value per row and group of inputs")
        self._describe()

    def _describe(self) -> None:
        if self.grouped:
            kind = self.lib.grouped_kinds[int(self.ggml_type)]
        else:
            kind = self.lib.split_kinds[int(self.ggml_type)] if self.split else self.lib.block_type(self.ggml_type)
        self._struct = _WeightStruct(
            ctypes.addressof(kind), self.data.ctypes.data, self.data.shape[1],
            self.rows.ctypes.data if self.rows is not None else None,
            self.group_bias.ctypes.data if self.group_bias is not None else None,
            self.bias_group, self.n, self.k, int(self.float_prompts))
        self.address = ctypes.addressof(self._struct)

    def reorder(self, mapped: np.ndarray | None = None, offset: int = 0) -> None:
        """Store the rows in output order (a copy): for products that read the rows as stored.
        The file's pages of the weight (``mapped``, at ``offset``) are dropped, as a repacked
        weight's are: the weight still takes the file's size."""
        if self.rows is None:
            return
        rows, self.rows = self.rows, None
        self.data = np.ascontiguousarray(self.data[rows])
        if self.group_bias is not None:
            self.group_bias = np.ascontiguousarray(self.group_bias[rows])
        self._describe()
        if mapped is not None:
            from mlxcel_compat.runtime.ggml_repack import release_pages

            release_pages(mapped, offset, self.data.nbytes)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        extra = [a.nbytes for a in (self.rows, self.group_bias) if a is not None]
        blocks = 0 if self.repacked is not None else self.data.nbytes  # its pages are released
        return blocks + sum(extra) + (self.repacked.nbytes if self.repacked is not None else 0)

    def matmul_into(self, m: int, x: int, ldx: int, out: int, ldo: int, beta: float = 0.0, tiles: bool = False) -> None:
        """out[i, :] = x[i, :] @ W^T (+ beta * out) for i < m, on raw float32 addresses (row
        strides in elements), by ggml's vec_dot or the shim's own kernel, or (``tiles``) the prompt
        path: ggml's repacked GEMM or mul_mat where the weight has one, the shim's lane kernels
        where they take prompts (``lane_prompts``), else float32 tiles and the BLAS. What the CPU
        decode runtime calls, ~7 times a layer."""
        if self.repacked is not None:
            self.repacked.matmul_into(m, x, ldx, out, ldo, beta, per_row=not tiles)
        elif tiles and self.prompt is not None:
            self.prompt.matmul_into(m, x, ldx, out, ldo, beta)
        else:
            short = m <= blas_shim.GIL_HELD_ROWS_MAX and not tiles
            (self.lib.matmul_held if short else self.lib.matmul)(self.address, m, x, ldx, out, ldo, beta, int(tiles))

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None, beta: float = 0.0,
               tiles: bool | None = None) -> np.ndarray:
        """``x`` (m, k) float32 times the weight's transpose: (m, n) float32. ``tiles`` picks the
        path (default: by the row count, ``VEC_DOT_ROWS_MAX``). Each row's result depends only
        on the path, never on how many rows share the call."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"activations of shape {x.shape} do not have {self.k} columns")
        if out is None:
            out = np.empty((x.shape[0], self.n), dtype=np.float32)
        elif out.shape != (x.shape[0], self.n) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError("the output must be a contiguous float32 (m, n) array")
        if tiles is None:
            tiles = x.shape[0] > VEC_DOT_ROWS_MAX
        self.matmul_into(x.shape[0], x.ctypes.data, self.k, out.ctypes.data, self.n, beta, tiles)
        return out

    def take(self, ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``ids`` as float32 (count, k): an embedding lookup."""
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        if ids.size and not (0 <= ids.min() and ids.max() < self.n):
            raise ValueError(f"row ids must be in 0..{self.n - 1}")
        if self.grouped:  # rows of their own again, then expanded as stored
            plain = BlockWeight(ungrouped_rows(self.data, self.ggml_type, ids), self.ggml_type, ids.size, self.k, self.lib)
            return plain.take(np.arange(ids.size), out)
        if out is None:
            out = np.empty((ids.size, self.k), dtype=np.float32)
        elif out.shape != (ids.size, self.k) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError("the output must be a contiguous float32 (count, k) array")
        self.lib.rows(self.address, ids.ctypes.data, ids.size, out.ctypes.data)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole weight as float32 (n, k), in output order: for tests and references only."""
        return self.take(np.arange(self.n))


def in_output_order(weight: BlockWeight, mapped: np.ndarray | None = None, offset: int = 0) -> bool:
    """Copy a weight whose rows are read permuted (llama's query and key projections) into
    output order where the shim's own kernels multiply its type (``own_kernels``, ``split_kinds``):
    they take a band of rows in one call only when its rows are stored in order (``mlxcel_block_matmul``
    calls them once a row otherwise, and a split row's kernel then copies the activations out for
    every row). The file's pages of the weight (``mapped``, at ``offset``) are dropped
    (``BlockWeight.reorder``). Whether it was copied."""
    kind = int(weight.ggml_type)
    if (weight.rows is None or weight.repacked is not None or weight.prompt is not None
            or (kind not in weight.lib.own_kernels and kind not in weight.lib.split_kinds)):
        return False
    weight.reorder(mapped, offset)
    return True


def split_rows(weight: BlockWeight, mapped: np.ndarray | None = None, offset: int = 0) -> bool:
    """Rearrange each row of ``weight`` (a linear layer's or embedding's blocks of a type in
    ``SPLIT_TYPES``, where the library has the kernels) into a copy: the blocks in groups of 16,
    each group as its blocks' factors, minimums, fifth bits, then nibbles (``SPLIT_FIELDS``),
    the same bytes (the split rows' kernels: 16 blocks' factors are then one load, and a row is read
    front to back). The file's pages of the weight (``mapped``, at ``offset``) are dropped, as a
    repacked weight's are: the weight still takes the file's size. Whether it was split."""
    if (int(weight.ggml_type) not in weight.lib.split_kinds or weight.split or weight.grouped
            or weight.group_bias is not None or weight.repacked is not None or weight.prompt is not None):
        return False
    fields = SPLIT_FIELDS[int(weight.ggml_type)]  # in C: NumPy's strided copies of short fields took seconds a stack
    starts = np.array([a for a, _ in fields], dtype=np.int32)
    widths = np.array([b - a for a, b in fields], dtype=np.int32)
    split = np.empty_like(weight.data)
    weight.lib.split_layout(weight.data.ctypes.data, split.ctypes.data, weight.n, weight.k // 32,
                            row_bytes(weight.ggml_type, 32), len(fields), starts.ctypes.data, widths.ctypes.data)
    weight.data = split
    weight.split = True
    weight._describe()
    if mapped is not None:
        from mlxcel_compat.runtime.ggml_repack import release_pages

        release_pages(mapped, offset, weight.data.nbytes)
    return True


def _tails_ahead(groups: int, nb: int, block: int) -> np.ndarray:
    """Per whole group and super-block, (groups, nb): whether its rows' last bytes go ahead of
    their dwords (it starts mid-line in a 64-byte-aligned weight: the native layer's
    GROUP_TAILS_AHEAD). Never for a block of whole dwords, whose groups start lines."""
    starts = np.arange(groups * nb, dtype=np.int64).reshape(groups, nb) * (GROUP_ROWS * block)
    return starts % 64 != 0


def grouped_copy(data: np.ndarray, ggml_type: int, lib: BlockLibrary | None = None) -> np.ndarray:
    """``data`` (n rows of a type in ``GROUPED_BLOCKS``) with its whole groups of 16 rows grouped,
    in a 64-byte-aligned copy (the vectors' loads must not cross cache lines): per group and
    super-block, dword t of row r at 64 t + 4 r (its quads in ``QUAD_ORDER`` where the type has
    one), and the rows' bytes past their whole dwords in turn, after the dwords or ahead of them
    (``_tails_ahead``); the rows after the last whole group as they are. By the library's C loop
    (``lib``), else by NumPy (a reference for tests)."""
    block, dwords = GROUPED_BLOCKS[int(ggml_type)]
    lead = GROUPED_LEAD.get(int(ggml_type), 0)
    n, row = data.shape
    nb, whole = row // block, n // GROUP_ROWS * GROUP_ROWS
    groups, lanes, tail = whole // GROUP_ROWS, 64 * dwords, GROUP_ROWS * (block - 4 * dwords)
    raw = np.empty(data.nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + data.nbytes].reshape(data.shape)
    order = QUAD_ORDER.get(int(ggml_type))
    if lib is not None:
        quads = np.array(order, dtype=np.int8) if order else None
        lib.group_layout(np.ascontiguousarray(data).ctypes.data, out.ctypes.data, n, nb, block, lead, dwords,
                         None if quads is None else quads.ctypes.data)
        return out
    src = data[:whole].reshape(groups, GROUP_ROWS, nb, block)
    dst = out[:whole].reshape(groups, nb, GROUP_ROWS * block)
    dword_bytes = src[..., lead:lead + 4 * dwords]
    head = np.ascontiguousarray(dword_bytes).view(np.uint32).transpose(0, 2, 3, 1)  # (groups, nb, dwords, 16)
    if order:
        head = head.reshape(groups, nb, dwords // 4, 4, GROUP_ROWS)[:, :, list(order)]
    head = np.ascontiguousarray(head).reshape(groups, nb, -1).view(np.uint8)
    rest = np.concatenate([src[..., :lead], src[..., lead + 4 * dwords:]], axis=-1)
    tails = rest.transpose(0, 2, 1, 3).reshape(groups, nb, -1)
    ahead = _tails_ahead(groups, nb, block)
    dst[~ahead, :lanes], dst[~ahead, lanes:] = head[~ahead], tails[~ahead]
    dst[ahead, :tail], dst[ahead, tail:] = tails[ahead], head[ahead]
    out[whole:] = data[whole:]
    return out


def ungrouped_rows(data: np.ndarray, ggml_type: int, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of grouped ``data`` (``grouped_copy``'s) as stored before: (len(ids), row bytes)."""
    block, dwords = GROUPED_BLOCKS[int(ggml_type)]
    lead = GROUPED_LEAD.get(int(ggml_type), 0)
    n, row = data.shape
    nb, whole = row // block, n // GROUP_ROWS * GROUP_ROWS
    lanes, tail = 64 * dwords, GROUP_ROWS * (block - 4 * dwords)
    out = np.empty((ids.size, row), dtype=np.uint8)
    grouped = data[:whole].reshape(whole // GROUP_ROWS, nb, GROUP_ROWS * block)
    inside = ids < whole
    g, r = ids[inside] // GROUP_ROWS, ids[inside] % GROUP_ROWS
    picked = grouped[g]  # (count, nb, 16 * block)
    ahead = _tails_ahead(whole // GROUP_ROWS, nb, block)[g][..., None]  # (count, nb, 1)
    head = np.where(ahead, picked[..., tail:], picked[..., :lanes])
    rest = np.where(ahead, picked[..., :tail], picked[..., lanes:])
    lanes_of = np.ascontiguousarray(head).view(np.uint32).reshape(g.size, nb, dwords, GROUP_ROWS)
    if int(ggml_type) in QUAD_ORDER:
        back = list(np.argsort(QUAD_ORDER[int(ggml_type)]))
        lanes_of = lanes_of.reshape(g.size, nb, dwords // 4, 4, GROUP_ROWS)[:, :, back].reshape(g.size, nb, dwords, GROUP_ROWS)
    tails = rest.reshape(g.size, nb, GROUP_ROWS, block - 4 * dwords)
    rows = np.empty((g.size, nb, block), dtype=np.uint8)
    rows[..., lead:lead + 4 * dwords] = lanes_of[np.arange(g.size), :, :, r].view(np.uint8).reshape(g.size, nb, 4 * dwords)
    own_tail = tails[np.arange(g.size), :, r]
    rows[..., :lead], rows[..., lead + 4 * dwords:] = own_tail[..., :lead], own_tail[..., lead:]
    out[inside] = rows.reshape(g.size, row)
    out[~inside] = data[ids[~inside]]
    return out


def group_rows(weight: BlockWeight, mapped: np.ndarray | None = None, offset: int = 0) -> bool:
    """Group the rows of ``weight`` (a linear layer's blocks, or an expert stack's whose experts
    are whole groups of 16 rows, of a type in ``GROUPED_BLOCKS`` whose grouped kernel the library
    has; Q4_1, Q5_0, Q5_1 and MXFP4 in whole groups only) into a copy (``grouped_copy``; rows read
    permuted are put in output order first). Every product of it then takes the lanes
    (``rows_q4_K_grouped``, ``rows_q6_K_grouped``, ``rows_q8_0_grouped``, ``rows_q4_1_grouped``
    ..., ``rows_mxfp4_grouped``): decode rows at every row count, and prompt chunks 16 rows at a
    time, instead of ggml's mul_mat or the lanes over rows stored apart or split. Why: stored
    apart, the lanes spent more on gathering 16 rows' bytes into lane order than on their
    arithmetic; grouped, a group is read front to back with no transposes. On this project's
    AVX-512 machine (docs/benchmarks/quantized.md, "Grouped rows"): Q4_K decode rows 1.3-2.2x the
    speed over rows stored apart, Q6_K's 2-8 rows 1.1-2.2x (a lone Q6_K row 0.91-1.56x); prompt
    chunks 1.0-3.9x ggml's mul_mat (16-256 rows); the 32-value types 1.5-2x at one to four rows
    of cached weights, 1.1-1.5x at 8-16 rows and in prompt chunks, a lone memory-bound row
    0.93-1.0x (Q8_0 0.94-0.97x); MXFP4 1.6x at one row, 1.4x at four, 1.1x at 8-16 and in prompt
    chunks (gpt-oss's 2880-wide experts and 4096 x 11008). Each pair's result is the same bits as
    over rows stored apart or split (the lanes' arithmetic). The file's pages of the weight (``mapped``, at ``offset``) are dropped, as
    a repacked weight's are. Whether it was grouped."""
    if (int(weight.ggml_type) not in weight.lib.grouped_kinds or weight.grouped or weight.split
            or weight.group_bias is not None or weight.repacked is not None or weight.prompt is not None
            or weight.n < GROUP_ROWS or (int(weight.ggml_type) in SPLIT_FIELDS and weight.n % GROUP_ROWS)):
        return False
    weight.reorder()  # rows read permuted (llama's q and k) into output order first
    weight.data = grouped_copy(weight.data, weight.ggml_type, weight.lib)
    weight.grouped = True
    weight._describe()
    if mapped is not None:
        from mlxcel_compat.runtime.ggml_repack import release_pages

        release_pages(mapped, offset, weight.data.nbytes)
    return True


__all__ = ["GROUPED_BLOCKS", "QUAD_ORDER", "SPLIT_FIELDS", "SPLIT_TYPES", "VEC_DOT_ROWS_MAX", "BlockLibrary", "BlockWeight", "group_rows",
           "grouped_copy", "in_output_order", "library", "row_bytes", "split_rows", "ungrouped_rows"]
