"""mlx-lm's models and loader without importing transformers (and so torch).

mlx-lm is the model zoo, but two of its imports pull in transformers for tokenizers this
server does not use (``tokenizer/served.py`` has its own): the package's ``__init__`` imports
``convert``, ``generate`` and ``utils``, and ``utils`` imports ``tokenizer_utils``, which imports
transformers at module level. Importing ``mlx_lm.models.cache`` therefore cost ~55 MiB and,
with torch installed, ~2 s of CPU at every start.

- :func:`install` registers the ``mlx_lm`` package without running its ``__init__``: its
  submodules import as usual, and the first access to anything else on the package
  (``mlx_lm.load``, ``from mlx_lm import generate``, ``mlx_lm.__version__`` aside) runs the real
  ``__init__`` then, so callers see the same package. Called from ``mlxcel_compat/__init__.py``,
  before anything imports mlx-lm.
- :func:`utils` imports ``mlx_lm.utils`` with ``tokenizer_utils`` deferred: while ``utils`` is
  imported, a stand-in module gives it a placeholder ``TokenizerWrapper`` (used only in type
  hints there) and a ``load`` that imports the real one when called. ``mlx_lm.utils.load``,
  ``load_tokenizer`` and everything else keep working; only a tokenizer load imports
  transformers. If ``tokenizer_utils`` is already imported, the real one is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

_lock = threading.RLock()


def install() -> None:
    """Register ``mlx_lm`` lazily (no-op when it is imported already or not installed)."""
    with _lock:
        if "mlx_lm" in sys.modules:
            return
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return
        package = importlib.util.module_from_spec(spec)

        def __getattr__(name: str) -> Any:  # PEP 562: only for names the package lacks
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            with _lock:
                if package.__dict__.get("__getattr__") is __getattr__:
                    del package.__dict__["__getattr__"]
                    spec.loader.exec_module(package)  # type: ignore[union-attr]
            try:
                return package.__dict__[name]
            except KeyError:
                raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

        package.__getattr__ = __getattr__  # type: ignore[method-assign]
        sys.modules["mlx_lm"] = package
    from mlx_lm._version import __version__  # cheap; read by cache/kv_io.py's runtime tag

    package.__version__ = __version__


class _DeferredWrapper:
    """Stands for ``mlx_lm.tokenizer_utils.TokenizerWrapper`` in ``mlx_lm.utils``'s annotations."""


def _deferred_load(*args: Any, **kwargs: Any) -> Any:
    from mlx_lm.tokenizer_utils import load

    return load(*args, **kwargs)


def utils() -> types.ModuleType:
    """``mlx_lm.utils``, imported without importing transformers."""
    install()
    with _lock:
        if "mlx_lm.utils" in sys.modules or "mlx_lm.tokenizer_utils" in sys.modules:
            return importlib.import_module("mlx_lm.utils")
        stand_in = types.ModuleType("mlx_lm.tokenizer_utils")
        stand_in.TokenizerWrapper = _DeferredWrapper  # type: ignore[attr-defined]
        stand_in.load = _deferred_load  # type: ignore[attr-defined]
        sys.modules["mlx_lm.tokenizer_utils"] = stand_in
        try:
            return importlib.import_module("mlx_lm.utils")
        finally:
            if sys.modules.get("mlx_lm.tokenizer_utils") is stand_in:
                del sys.modules["mlx_lm.tokenizer_utils"]
            package = sys.modules.get("mlx_lm")
            if package is not None and package.__dict__.get("tokenizer_utils") is stand_in:
                del package.__dict__["tokenizer_utils"]  # the real submodule binds it when imported


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's ``(Model, ModelArgs)`` for a config.json dict (its ``_get_classes``, which maps
    other names of a ``model_type`` to mlx-lm's module)."""
    return utils()._get_classes(config)


def module_classes(module: str) -> tuple[Any, Any]:
    """``(Model, ModelArgs)`` of ``mlx_lm.models.<module>``, for a caller that already holds
    mlx-lm's module name (the GGUF architectures' table): without ``mlx_lm.utils``, whose
    ``huggingface_hub`` import (httpx, trio, ...) costs ~20 MiB of the serving process."""
    install()
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    return arch.Model, arch.ModelArgs


def load_model(path: Any, lazy: bool = False, model_config: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's ``load_model``: the weights and config of a model directory, no tokenizer.
    ``model_config``: keys that replace ``config.json``'s before the model is built."""
    from pathlib import Path

    return utils().load_model(Path(path), lazy=lazy, model_config=model_config)
