"""Deterministic tiny models for tests, benchmarks and the server's demo mode.

``ensure_model("llama", "tiny")`` returns a cached model directory that
``mlx_lm.utils.load`` accepts; see ``models.py`` for the families and sizes.
Importing this package does not import MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models import FAMILIES, SIZES, build_model, describe, ensure_model, is_complete

__all__ = ["FAMILIES", "SIZES", "build_model", "describe", "ensure_model", "is_complete"]


def __getattr__(name: str) -> Any:
    # Imported on first use so `python -m mlxcel_compat.testing.models` does not
    # find its own module already imported by the package (a runpy warning).
    if name in __all__:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
