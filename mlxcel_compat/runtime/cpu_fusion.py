"""Fewer and cheaper element-wise operations for MLX's CPU backend, installed into loaded models.

On the CPU a decode step is a graph of many small operations (~920 for the small llama with every
lever on), and each costs a few microseconds of dispatch whatever its size; prompt chunks, on the
other hand, spend their non-matmul time in MLX's scalar transcendental loops (``exp`` costs ~20 ns
an element, ``power`` about a third of that). Three levers, each measured by
``scripts/bench_cpu_kernels.py`` (docs/benchmarks/cpu.md):

- **SiLU gating through a power of 2.** ``silu(gate) * x`` is computed as
  ``gate * x / (1 + 2 ** (-gate * log2 e))`` in one compiled loop, instead of mlx-lm's
  ``sigmoid`` (an ``exp``): about 3.5x faster on a prompt's MLP activations. The two agree to a
  few 1e-7 relative (float32 rounding of ``2 ** y`` against ``exp``); tests bound it. A prompt
  chunk's gating is computed the same way by NumPy's vectorized loops (:func:`swiglu`).
- **Compiled small-input modules.** RMS norms, RoPE and the MLPs run as ``mx.compile``-d
  functions when their input has at most ``SMALL_ELEMENTS`` elements (a decode step's, or a short
  prompt chunk's): MLX fuses their element-wise chains (RoPE and RMS norm are chains of ~6-15
  operations on the CPU, ``mx.fast`` has no CPU kernels), which halves their cost in a decode step.
  The results are bit-identical to the plain modules. Larger inputs keep the plain operations:
  there MLX's separate kernels are as fast or faster.
- **RoPE angles shared across layers.** With an integer offset (one sequence's cache), a step's
  RoPE angles are computed once, by ``mx.fast.rope`` itself, and every layer's queries and keys
  are rotated with them by one compiled function (:func:`shared_angles`), bit-identical to
  ``mx.fast.rope``: in decode steps and in prompt chunks.

  ``mx.compile`` keeps one trace per input shape for the life of the process (~0.15 MiB each on
  the tiny llama), and prompt chunks come in every length, so a shape-specialized compile made RSS
  grow without bound under varied traffic. So a decode step's inputs (one token per row) are
  compiled per shape, which the batch sizes bound, and norms and MLPs of prompt chunks are
  compiled ``shapeless`` (one trace; nothing in them depends on the sequence length), as is a
  prompt chunk's RoPE rotation (its positions come in as the angles).

``mx.compile`` generates C++ and builds it with the system compiler (``g++``); without one MLX runs
the same operations unfused, so nothing here can fail for lack of a compiler.
"""

from __future__ import annotations

import sys
from functools import lru_cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

LOG2E = 1.4426950408889634

# Inputs up to this many elements (decode steps: 768 for one row of the small llama) take the
# compiled modules; a 512-token chunk's RMS norm was 2x slower compiled than plain.
SMALL_ELEMENTS = 16384
# Shape-specialized traces per compiled module: enough for every decode batch size up to 16 rows.
MAX_SPECIALIZED_SHAPES = 16
# SiLU gating of at least this many elements (prompt chunks) runs in NumPy (see :func:`swiglu`).
NUMPY_MIN = 1 << 16
# A step's RoPE computes its positions' angles once for every layer (see :func:`shared_angles`).
SHARED_ROPE_ANGLES = True


def evaluated_numpy(*arrays: Any) -> tuple[np.ndarray, ...] | None:
    """NumPy views of ``arrays``, evaluated now (mid-step), or None inside an ``mx.compile`` trace,
    where nothing can be evaluated and the caller stays in MLX. The views share MLX's buffers:
    read them, never write them."""
    try:
        mx.eval(*arrays)
    except ValueError:  # being traced by mx.compile
        return None
    return tuple(np.asarray(a) for a in arrays)


@partial(mx.compile, shapeless=True)
def _swiglu_mlx(gate: Any, x: Any) -> Any:
    return gate * x / (1.0 + mx.power(2.0, gate * -LOG2E))


def swiglu(gate: Any, x: Any) -> Any:
    """silu(gate) * x, with the sigmoid as 1 / (1 + 2 ** (-gate * log2 e)).

    A prompt chunk's activations (``NUMPY_MIN`` elements or more, several tokens a row) are
    computed by NumPy, whose float32 ``exp2`` and arithmetic are vectorized on x86 where MLX's
    CPU loops are scalar: 11x faster than mlx-lm's on a 512-token chunk of the small llama (the
    compiled loop: 3.6x; scripts/bench_cpu_kernels.py section 4), for one evaluation in
    the middle of the step and one copy back (see ``runtime/attention.py``, which does the same
    for the softmax). Inside an ``mx.compile`` trace (a compiled MLP) it stays in MLX.
    """
    views = None
    if gate.ndim >= 2 and gate.shape[-2] > 1 and gate.size >= NUMPY_MIN and gate.dtype == mx.float32:
        views = evaluated_numpy(gate, x)
    if views is None:
        return _swiglu_mlx(gate, x)
    g, xs = views
    out = np.multiply(g, np.float32(-LOG2E))
    with np.errstate(over="ignore"):  # 2 ** y overflows to inf for gates below -88: silu = -0, as in MLX
        np.exp2(out, out=out)
    out += np.float32(1.0)
    np.divide(g, out, out=out)
    out *= xs
    return mx.array(out)


# Abramowitz and Stegun 7.1.26: erf(a) = 1 - t (c1 + t (c2 + ... t c5)) e^(-a^2), t = 1 / (1 + p a),
# |error| <= 1.5e-7 in exact arithmetic (6e-7 in float32).
_ERF_P = np.float32(0.3275911)
_ERF_C = tuple(np.float32(c) for c in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592))


def gelu(x: Any) -> Any:
    """GELU with the exact (erf) form, ``0.5 x (1 + erf(x / sqrt 2))``, as BERT-family encoders use it.

    MLX's CPU ``erf`` is a scalar loop (~30 ns an element: 0.66 s of a 0.96 s pass of 64 short
    texts through a bge-small-shaped encoder). Prompt-sized inputs (``NUMPY_MIN`` elements or
    more) are computed by NumPy instead, erf from Abramowitz and Stegun's 7.1.26 through the
    vectorized ``exp2``: 3-5x faster, within 6e-7 of the exact erf (the GELU within
    ``3e-7 |x|``). Smaller inputs, and inputs inside an ``mx.compile`` trace, keep ``nn.gelu``.
    """
    views = None
    if x.ndim >= 2 and x.size >= NUMPY_MIN and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        views = evaluated_numpy(x)
    if views is None:
        return nn.gelu(x)
    (xs,) = views
    flat = xs.reshape(-1)
    out = np.empty_like(flat)
    parts = np.array_split(np.arange(flat.size), _gelu_pool()._max_workers)  # NumPy's loops release the GIL
    list(_gelu_pool().map(lambda idx: _gelu_into(flat[idx[0]: idx[-1] + 1], out[idx[0]: idx[-1] + 1]), parts))
    return mx.array(out.reshape(xs.shape))


def _gelu_into(xs: np.ndarray, out: np.ndarray) -> None:
    a = np.abs(xs) * np.float32(1.0 / np.sqrt(2.0))  # erf's argument, made positive (erf is odd)
    np.multiply(a, _ERF_P, out=out)
    out += np.float32(1.0)
    np.reciprocal(out, out=out)  # t
    poly = out * _ERF_C[0]
    for c in _ERF_C[1:]:
        poly += c
        poly *= out
    np.square(a, out=a)
    a *= np.float32(-LOG2E)
    np.exp2(a, out=a)
    poly *= a  # 1 - erf(|x| / sqrt 2)
    np.subtract(np.float32(1.0), poly, out=poly)
    np.copysign(poly, xs, out=poly)  # erf(x / sqrt 2)
    poly += np.float32(1.0)
    np.multiply(poly, xs, out=out)
    out *= np.float32(0.5)


@lru_cache(maxsize=1)
def _gelu_pool() -> Any:
    """Threads for :func:`gelu`'s NumPy loops, one per core (NumPy runs an operation on one)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="mlxcel-gelu")


def _fused_call(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The compiled module for small inputs, the plain one otherwise.

    A decode step's input (one row per sequence: ``x.shape[1] == 1``) takes a shape-specialized
    compile, a few microseconds faster per call than a shapeless one; other inputs take the
    shapeless compile, one trace whatever their length. A per-head norm of a model with one KV
    head sees (B, 1, L, Dh) for every chunk length L, so the specialized shapes are also capped
    per module (``MAX_SPECIALIZED_SHAPES``); past the cap, new shapes go shapeless."""
    plain = super(type(self), self).__call__
    if args or kwargs or x.size > SMALL_ELEMENTS or _adapting(self):
        return plain(x, *args, **kwargs)
    shapes = self.__dict__.setdefault("_mlxcel_shapes", set())  # the shapes given a specialized trace
    shape = x.shape
    specialized = x.ndim >= 3 and shape[1] == 1 and (shape in shapes or len(shapes) < MAX_SPECIALIZED_SHAPES)
    if specialized:
        shapes.add(shape)
    slot = "_mlxcel_fused" if specialized else "_mlxcel_fused_shapeless"
    fused = self.__dict__.get(slot)
    if fused is None:
        fused = mx.compile(plain, shapeless=not specialized)
        object.__setattr__(self, slot, fused)
    return fused(x)


def _adapting(module: Any) -> bool:
    """Whether a LoRA adapter inside ``module`` applies to this pass (then no trace may run it).
    Whether the module holds one is looked up once, at its first call."""
    from mlxcel_compat.runtime import lora_rows

    holds = module.__dict__.get("_mlxcel_lora_inside")
    if holds is None:
        holds = lora_rows.holds_lora(module)
        object.__setattr__(module, "_mlxcel_lora_inside", holds)
    return holds and lora_rows.current() is not None


def rope_compiles(x: Any) -> bool:
    """Whether RoPE's input (B, H, L, Dh) takes the compiled path: one token per row, small."""
    return x.ndim == 4 and x.shape[-2] == 1 and x.size <= SMALL_ELEMENTS


def _rotation(x1: Any, x2: Any, cos: Any, sin: Any) -> Any:
    """The rotation of non-traditional RoPE from the two halves of the input, in the same
    operations and order as MLX's CPU ``mx.fast.rope`` (bit-identical to it, tested)."""
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@mx.compile
def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """:func:`_rotation` for a decode step's input, one trace per shape (the batch sizes bound
    them): a few microseconds a call faster than the shapeless form."""
    half = x.shape[-1] // 2
    return _rotation(x[..., :half], x[..., half:], cos, sin)


# A prompt chunk's rotation: one trace for every chunk length (MLX cannot slice inside a shapeless
# trace, so the halves are taken outside it).
_rotate_halves = mx.compile(_rotation, shapeless=True)

# (dims, base, scale) -> (offset, length, cos, sin): the angles of the positions the last step used.
_rope_angles: dict[tuple[Any, ...], tuple[int, int, Any, Any]] = {}


def shared_angles(rope: Any, offset: int, length: int = 1) -> tuple[Any, Any]:
    """cos and sin of the RoPE angles of positions ``offset`` .. ``offset + length - 1``,
    computed once for every layer of a step, each (1, 1, length, dims / 2).

    On the CPU each ``mx.fast.rope`` call recomputes them (an arange, an exp, cos and sin: ~9 of
    the ~15 operations a call; 24 calls a step of a 12-layer model). They are taken from
    ``mx.fast.rope`` itself, applied to (1, .., 1, 0, .., 0) at each position: its two halves
    are then exactly the cosines and sines it multiplies by (``1 * cos - 0 * sin`` is ``cos``),
    so nothing about how MLX computes the angles is assumed here."""
    key = (rope.dims, rope.base, rope.scale)
    cached = _rope_angles.get(key)
    if cached is None or cached[:2] != (offset, length):
        half = rope.dims // 2
        unit = _unit(rope.dims)
        if length > 1:
            unit = mx.broadcast_to(unit, (1, 1, length, rope.dims))
        probe = mx.fast.rope(unit, rope.dims, traditional=False, base=rope.base, scale=rope.scale, offset=offset)
        cached = _rope_angles[key] = (offset, length, probe[..., :half], probe[..., half:])
    return cached[2], cached[3]


@lru_cache(maxsize=8)
def _unit(dims: int) -> Any:
    """(1, .., 1, 0, .., 0) of ``dims`` elements, built once (evaluated with the first step)."""
    return mx.concatenate([mx.ones((1, 1, 1, dims // 2)), mx.zeros((1, 1, 1, dims - dims // 2))], axis=-1)


def fused_rope_call(self: Any, x: Any, offset: Any = 0) -> Any:
    """RoPE with the angles shared by every layer, and a compiled rotation.

    With an integer offset (one sequence's cache), a step's angles are computed once and shared
    by every layer (:func:`shared_angles`): about 200 fewer operations a decode step of the small
    llama (2-5 % of its time), and on a 512-token chunk the rotation of a layer's queries and
    keys in 1.6 ms instead of 2.8. With an array offset (a batch's), a decode step takes one
    compiled function with the offset as an input, which serves every position; a batch's
    prompt chunk runs plain."""
    plain = super(type(self), self).__call__
    if (SHARED_ROPE_ANGLES and isinstance(offset, int) and not self.traditional and x.ndim == 4
            and self.dims == x.shape[-1] and x.dtype == mx.float32):
        cos, sin = shared_angles(self, offset, x.shape[-2])
        if rope_compiles(x):
            return _rotate(x, cos, sin)
        half = self.dims // 2
        return _rotate_halves(x[..., :half], x[..., half:], cos, sin)
    if not rope_compiles(x):
        return plain(x, offset)
    fused = self.__dict__.get("_mlxcel_fused")
    if fused is None:
        fused = mx.compile(lambda x, offset: plain(x, offset=offset))
        object.__setattr__(self, "_mlxcel_fused", fused)
    return fused(x, offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32))


_FUSED_CLASSES: dict[type, type] = {}


def fuse(module: Any, call: Any) -> int:
    """Give ``module`` a subclass whose ``__call__`` is ``call``; 1 if switched now, else 0."""
    cls = type(module)
    if cls in _FUSED_CLASSES.values():
        return 0
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        fused = _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"__call__": call, "__module__": __name__})
    module.__class__ = fused
    return 1


def _is_norm(module: Any) -> bool:
    """nn.RMSNorm, or a model's own RMS norm (Gemma's 1 + w): one array in, one out."""
    return isinstance(module, nn.RMSNorm) or type(module).__name__ == "RMSNorm"


def _is_mlp(name: str, module: Any) -> bool:
    """A dense gated MLP of an mlx-lm model (``layers.N.mlp``, class ``MLP``), of float weights:
    one with block-format weights evaluates inside its call, which ``mx.compile`` cannot trace.
    One with a LoRA adapter is compiled too, but its trace serves only passes with no adapter
    active (its layers read their scales at call time, which a trace would bake in). Two kinds are
    left alone, since a shapeless trace cannot take them: one whose gate and up projections are
    fused (Phi-3's and GLM-4's ``gate_up_proj``: its output is split), and one with biases
    (StarCoder2's: ``nn.Linear`` then calls ``addmm``, which flattens a 3-D input to the traced
    shape)."""
    from mlxcel_compat.runtime.block_layers import holds_blocks

    if not (name.endswith(".mlp") and type(module).__name__ == "MLP") or holds_blocks(module):
        return False
    linears = [m for _, m in module.named_modules() if isinstance(m, nn.Linear)]
    return not hasattr(module, "gate_up_proj") and all("bias" not in m for m in linears)


def install(model: Any) -> dict[str, int]:
    """Switch the model's modules to the fused forms; idempotent. Returns what was switched."""
    counts = {"swiglu": 0, "norm": 0, "rope": 0, "mlp": 0}
    from mlx_lm.models import activations

    # The model modules import the function by name: switch each one's binding (not the
    # activations module's own, which stays mlx-lm's).
    for mod_name, module in list(sys.modules.items()):
        if module is activations or not mod_name.startswith("mlx_lm.models."):
            continue
        if getattr(module, "swiglu", None) is activations.swiglu:
            module.swiglu = swiglu
            counts["swiglu"] += 1
    for name, module in model.named_modules():
        if type(module) is nn.RoPE:
            counts["rope"] += fuse(module, fused_rope_call)
        elif _is_norm(module):
            counts["norm"] += fuse(module, _fused_call)
        elif _is_mlp(name, module):
            counts["mlp"] += fuse(module, _fused_call)
    return counts


__all__ = ["MAX_SPECIALIZED_SHAPES", "SMALL_ELEMENTS", "evaluated_numpy", "fuse", "fused_rope_call", "install",
           "rope_compiles", "shared_angles", "swiglu"]
