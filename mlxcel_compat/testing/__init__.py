"""Deterministic tiny models for tests, benchmarks and the server's demo mode.

``ensure_model("llama", "tiny")`` returns a cached model directory that
``mlx_lm.utils.load`` accepts; see ``families.py`` for the families and sizes,
``model_directory.py`` for the directories and ``models.py`` for the command line.
Importing this package does not import MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .families import FAMILIES, SIZES
    from .model_directory import build_model, ensure_model, is_complete
    from .models import describe

__all__ = ["FAMILIES", "SIZES", "build_model", "describe", "ensure_model", "is_complete"]


def __getattr__(name: str) -> Any:
    # Imported on first use so `python -m mlxcel_compat.testing.models` does not
    # find its own module already imported by the package (a runpy warning).
    if name in ("FAMILIES", "SIZES"):
        from . import families

        return getattr(families, name)
    if name in ("build_model", "ensure_model", "is_complete"):
        from . import model_directory

        return getattr(model_directory, name)
    if name == "describe":
        from . import models

        return models.describe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
