"""ggml's CPU kernels for GGUF's block formats, from the ``libggml-python`` wheel.

Why ggml: it is the reference implementation of every GGUF type, and its CPU library publishes
its kernels (``ggml-cpu.h``: ``ggml_get_type_traits_cpu(type)`` gives ``vec_dot``, a row of
weights times a row of activations, and ``from_float`` for the activations' ``vec_dot_type``;
``ggml.h``: ``ggml_get_type_traits(type)->to_float`` expands a row). Calling them computes
exactly llama.cpp's products (activations quantized to Q8_0/Q8_1/Q8_K, F16 or BF16 first), so
a greedy continuation here follows llama-server's arithmetic, not a float32 reference's: the two
differ only where the reference's top two candidates are near a tie (tests/e2e/test_real_model.py).

This module only finds and loads the two libraries (``libggml-base``, ``libggml-cpu``), calls
``ggml_cpu_init`` once, and turns a type's traits into the :class:`BlockType` that the native
layer's block products (compiled into the BLAS shim's library, whose threads call the kernels)
take. Nothing here imports MLX. Without the wheel (another platform), or with ``MLXCEL_GGML=0``,
:func:`kernels` says why and the loader expands quantized weights to float32 as before.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType as T

if TYPE_CHECKING:
    import numpy as np

# The types served from their blocks: every quantized type the loader reads, and the half floats.
# MXFP4 (gpt-oss's experts) and the i-quants: both builds this project loads (scripts/setup.sh's
# ggml 0.25, the libggml-python wheel's 0.20) have vec_dot and to_float for each, and the
# from_float of its vec_dot_type (Q8_0 for MXFP4 and IQ4_NL, Q8_K for the others);
# ``GGMLKernels.supports`` checks the loaded build before a type is served.
I_QUANTS = frozenset({T.IQ4_XS, T.IQ4_NL, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M})
BLOCK_TYPES = frozenset({T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                         T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, *I_QUANTS})

_FN = ctypes.c_void_p  # function pointers travel as plain addresses
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)  # ggml_to_float_t


class _TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", _FN), ("from_float_ref", _FN)]


class _CpuTraits(ctypes.Structure):
    """``struct ggml_type_traits_cpu`` (ggml-cpu.h)."""

    _fields_ = [("from_float", _FN), ("vec_dot", _FN), ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class BlockType(ctypes.Structure):
    """``struct mlxcel_block_type`` (the native layer's block products): one type's kernels."""

    _fields_ = [("vec_dot", _FN), ("quantize", _FN), ("to_float", _FN),
                ("act_block", ctypes.c_long), ("act_block_bytes", ctypes.c_long),
                ("own_kernel", ctypes.c_int)]  # set by block_weight.library(): mlxcel_rows_kernel's type, or -1


# What the start-up log and the benchmark report of a build (ggml-cpu.h's ggml_cpu_has_*).
_FEATURES = ("avx2", "avx512", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "neon", "dotprod")


def enabled() -> bool:
    """``MLXCEL_GGML=0`` expands quantized weights to float32 at load instead (as before)."""
    return os.environ.get("MLXCEL_GGML", "1").strip().lower() not in ("0", "off", "false", "no")


def library_dir() -> Path | None:
    """Where ggml's two CPU libraries are: ``$MLXCEL_GGML_LIB`` if set (another build, e.g. the
    prebuilt wheel's, which ``scripts/bench_ggml_build.py`` compares), else the environment's
    ``ggml/lib`` (scripts/setup.sh builds ggml 0.25 there for this CPU), else the ``libggml``
    package's (the libggml-python wheel: ggml 0.20 for AVX2)."""
    override = os.environ.get("MLXCEL_GGML_LIB", "").strip()
    if override:
        return Path(override) if (Path(override) / "libggml-cpu.so").exists() else None
    built = Path(sys.prefix) / "ggml" / "lib"  # scripts/setup.sh's build for this CPU
    if (built / "libggml-cpu.so").exists():
        return built
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for sub in ("lib64", "lib"):
            if (Path(root) / sub / "libggml-cpu.so").exists():
                return Path(root) / sub
    return None


@dataclass
class GGMLKernels:
    """ggml's two libraries, loaded, and the per-type kernels built from them so far."""

    base: ctypes.CDLL
    cpu: ctypes.CDLL
    directory: Path
    version: str
    _types: dict[int, BlockType] = field(default_factory=dict)
    _supported: dict[int, bool] = field(default_factory=dict)

    @property
    def features(self) -> list[str]:
        """The instruction sets this build of ggml's CPU library was compiled for (its
        ``ggml_cpu_has_*`` answers): a prebuilt wheel says AVX2, a build for this CPU (what
        scripts/setup.sh makes) says AVX512 and VNNI where the CPU has them."""
        found = []
        for name in _FEATURES:
            fn = getattr(self.cpu, f"ggml_cpu_has_{name}", None)
            if fn is not None:
                fn.restype = ctypes.c_int
                if fn():
                    found.append(name.upper())
        return found

    def activation_type(self, ggml_type: int) -> int:
        """The type ggml quantizes activations to for this weight type's products (vec_dot_type)."""
        return int(self.cpu.ggml_get_type_traits_cpu(int(ggml_type)).contents.vec_dot_type)

    def supports(self, ggml_type: int) -> bool:
        """Whether this build has the kernels of ``ggml_type``: its type traits name the type with
        gguf-py's block sizes, a ``vec_dot`` and ``to_float``, and the ``from_float`` of its
        ``vec_dot_type``. (ggml does not say how long its type table is: a build older than a
        type answers with a removed type's slot, or with what lies past its table, and the name
        and sizes are what tell.) Checked once per type."""
        known = self._supported.get(int(ggml_type))
        if known is None:
            known = self._check(int(ggml_type))
            self._supported[int(ggml_type)] = known
        return known

    def _check(self, ggml_type: int) -> bool:
        from gguf import GGML_QUANT_SIZES

        try:
            name, (block, size) = T(ggml_type).name, GGML_QUANT_SIZES[T(ggml_type)]
        except (ValueError, KeyError):
            return False
        traits = self.base.ggml_get_type_traits(ggml_type).contents
        if (traits.type_name or b"").decode(errors="replace").lower() != name.lower() or (
                traits.blck_size, traits.type_size) != (block, size):
            return False
        cpu = self.cpu.ggml_get_type_traits_cpu(ggml_type).contents
        if not (cpu.vec_dot and traits.to_float):
            return False
        return bool(self.cpu.ggml_get_type_traits_cpu(cpu.vec_dot_type).contents.from_float)

    def block_type(self, ggml_type: int) -> BlockType:
        """The kernels of ``ggml_type`` (kept alive here: the native layer holds their address)."""
        found = self._types.get(int(ggml_type))
        if found is None:
            if ggml_type not in BLOCK_TYPES:
                raise ValueError(f"GGML type {ggml_type} is not served from its blocks")
            if not self.supports(ggml_type):
                raise ValueError(f"ggml {self.version} ({self.directory}) has no CPU kernels for {T(ggml_type).name}")
            cpu = self.cpu.ggml_get_type_traits_cpu(int(ggml_type)).contents
            traits = self.base.ggml_get_type_traits(int(ggml_type)).contents
            act = self.base.ggml_get_type_traits(cpu.vec_dot_type).contents
            quantize = self.cpu.ggml_get_type_traits_cpu(cpu.vec_dot_type).contents.from_float
            if not (cpu.vec_dot and quantize and traits.to_float):
                raise ValueError(f"ggml has no CPU kernels for {traits.type_name.decode()}")
            found = BlockType(cpu.vec_dot, quantize, traits.to_float, act.blck_size, act.type_size, -1)
            self._types[int(ggml_type)] = found
        return found

    def quantize(self, ggml_type: int, values: "np.ndarray", importance: "np.ndarray | None" = None) -> "np.ndarray":
        """``values`` (rows, k) float32 in ``ggml_type``'s blocks, by ggml's own quantizer (what
        llama-quantize runs): uint8 (rows, row bytes). ``importance``: an importance matrix, one
        weight per column (llama-quantize's ``--imatrix``: the mean squared activation of each
        input), which ggml requires for IQ2_XXS, IQ2_XS and IQ1_S (``needs_importance``: an
        error here, where ggml would abort the process) and the others use where given. For the
        test factory's files; serving never quantizes."""
        import numpy as np

        values = np.ascontiguousarray(values, dtype=np.float32)
        rows, k = values.shape
        block = self.base.ggml_get_type_traits(int(ggml_type)).contents.blck_size
        if k % block:  # ggml's quantizers would write past the rows' end
            raise ValueError(f"rows of {k} values do not fill whole blocks of {block}")
        if importance is not None:
            importance = np.ascontiguousarray(importance, dtype=np.float32)
            if importance.shape != (k,):
                raise ValueError(f"an importance matrix holds one weight per column ({k}), not {importance.shape}")
        elif self.needs_importance(ggml_type):
            raise ValueError(f"ggml quantizes {T(ggml_type).name} only with an importance matrix")
        row_size = self.base.ggml_row_size(int(ggml_type), k)
        out = np.empty((rows, row_size), dtype=np.uint8)
        done = self.base.ggml_quantize_chunk(int(ggml_type), values.ctypes.data, out.ctypes.data, 0, rows, k,
                                             None if importance is None else importance.ctypes.data)
        if done != out.nbytes:
            raise ValueError(f"ggml quantized {done} bytes, expected {out.nbytes}")
        return out

    def needs_importance(self, ggml_type: int) -> bool:
        """ggml's ``ggml_quantize_requires_imatrix``: its quantizer asserts an importance matrix."""
        return bool(self.base.ggml_quantize_requires_imatrix(int(ggml_type)))

    def dequantize(self, ggml_type: int, blocks: "np.ndarray") -> "np.ndarray":
        """``blocks`` (uint8, whole blocks of ``ggml_type``) expanded by ggml's ``to_float``:
        float32 (blocks, values per block). The loader's float path for the types whose
        NumPy decoding is gguf-py's (``gguf/quants.py``), 5-30x faster than it."""
        import numpy as np

        traits = self.base.ggml_get_type_traits(int(ggml_type)).contents
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, traits.type_size)
        out = np.empty((len(blocks), traits.blck_size), dtype=np.float32)
        if len(blocks):
            _TO_FLOAT(traits.to_float)(blocks.ctypes.data, out.ctypes.data, out.size)
        return out

    def describe(self, ggml_type: int) -> str:
        """What the start-up log says serves a type, e.g. ``ggml q4_K x q8_K``."""
        cpu = self.cpu.ggml_get_type_traits_cpu(int(ggml_type)).contents
        name = self.base.ggml_type_name(int(ggml_type)).decode()
        act = self.base.ggml_type_name(cpu.vec_dot_type).decode()
        return f"ggml {name} x {act} ({'/'.join(self.features) or 'generic'})"


@lru_cache(maxsize=1)
def kernels() -> GGMLKernels | str:
    """ggml's kernels, or why they cannot be used (logged at start-up)."""
    if not enabled():
        return "off (MLXCEL_GGML=0)"
    directory = library_dir()
    if directory is None:
        return "the libggml-python package (ggml's CPU library) is not installed"
    try:
        base = ctypes.CDLL(str(directory / "libggml-base.so"))
        cpu = ctypes.CDLL(str(directory / "libggml-cpu.so"))
        base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        base.ggml_get_type_traits.argtypes = [ctypes.c_int]
        base.ggml_type_name.restype = ctypes.c_char_p
        base.ggml_type_name.argtypes = [ctypes.c_int]
        base.ggml_row_size.restype = ctypes.c_size_t
        base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        base.ggml_quantize_chunk.restype = ctypes.c_size_t
        base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        base.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
        cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        cpu.ggml_cpu_init.restype = None
        cpu.ggml_cpu_init()  # fills the FP16 tables the kernels read
    except (OSError, AttributeError) as exc:
        return f"loading ggml's CPU library from {directory} failed: {exc}"
    try:  # the library's own version (the package's number is not ggml's)
        base.ggml_version.restype = ctypes.c_char_p
        ggml_version = base.ggml_version().decode()
    except AttributeError:
        ggml_version = "?"
    return GGMLKernels(base, cpu, directory, ggml_version)


__all__ = ["BLOCK_TYPES", "I_QUANTS", "BlockType", "GGMLKernels", "enabled", "kernels", "library_dir"]
