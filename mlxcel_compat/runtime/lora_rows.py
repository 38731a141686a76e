"""The LoRA terms the runtime computes: each adapted module's factors, and the scales in force.

Adapters are served unfused (``lora/layers.py`` reads the files and installs them): every
adapted linear adds ``scale * B (A x)`` to its output, at per-row scales. This module is the
runtime's side of that contract, kept below both rooms so neither imports the other's upper
floor: the factors a module carries (:class:`Factor`, :func:`factors_of`), which the CPU decode
runtime adds with the shim's kernels, and the rows' scales of the current forward pass
(:func:`applied`, a per-thread setting of the engine thread), which ``cpu_fusion`` reads before
compiling a module (``mx.compile`` would bake the scales in: :func:`holds_lora`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

Rows = Sequence[Sequence[float]]

_state = threading.local()
_LORA_ATTR = "_mlxcel_lora"  # where a module keeps its factors, outside its parameters


@dataclass
class Factor:
    """One adapter's factors on one module: NumPy (for the CPU decode runtime) and MLX."""

    adapter: int  # the adapter id (index into a row's scales)
    multiplier: float  # alpha / r, mlx-lm's scale, ...: the file's own factor
    a: np.ndarray  # (r, in) float32, C-contiguous
    b: np.ndarray  # (out, r)
    a_mx: Any  # mx.array (r, in) in the module's compute dtype
    b_mx: Any  # mx.array (out, r)


@contextlib.contextmanager
def applied(rows: Rows | None) -> Iterator[None]:
    """Forward passes in this block apply the adapters at ``rows``' scales (one tuple per batch
    row, one scale per adapter id); ``None`` or all zeros: the base model."""
    previous = getattr(_state, "rows", None)
    _state.rows = rows if rows and any(any(r) for r in rows) else None
    try:
        yield
    finally:
        _state.rows = previous


def current() -> Rows | None:
    return getattr(_state, "rows", None)


def factors_of(module: Any) -> list[Factor]:
    """The adapters installed on ``module`` (empty for a plain one)."""
    return module.__dict__.get(_LORA_ATTR, [])


def holds_lora(module: Any) -> bool:
    """Whether ``module`` or a module inside it carries an adapter."""
    return any(factors_of(m) for _, m in module.named_modules())


def add_factor(module: Any, factor: Factor) -> None:
    """Install one adapter's factors on ``module`` (``lora/layers.py`` wraps its ``__call__``)."""
    module.__dict__.setdefault(_LORA_ATTR, []).append(factor)
