"""Pick the compute backend before MLX is imported.

MLX's Linux CPU wheel links the *reference* BLAS, which runs float32 matmul at a few GFLOP/s.
Loading an optimized BLAS (OpenBLAS) with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported
makes MLX resolve its BLAS symbols against it instead: prefill gets ~25x faster. This module must
therefore be imported, and :func:`load_optimized_blas` called, before anything imports MLX.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Most specific first: the pthread build is what Debian's libopenblas0-pthread installs.
_BLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
)


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX will use on this process."""

    name: str  # "openblas", "blis", "reference", "accelerate" (macOS), "mlx-bundled"
    path: str | None
    optimized: bool


_loaded: BlasInfo | None = None


def _candidates() -> list[str]:
    override = os.environ.get("MLXCEL_BLAS_PATH")
    found = [override] if override else []
    found += [p for p in _BLAS_CANDIDATES if os.path.exists(p)]
    found += sorted(glob.glob(os.path.join(sys.prefix, "lib", "libopenblas*.so*")))
    return found


def load_optimized_blas() -> BlasInfo:
    """Load an optimized BLAS globally, once; return what is active.

    Safe to call many times. On macOS MLX uses Accelerate/Metal and nothing is needed.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if platform.system() != "Linux":
        _loaded = BlasInfo("accelerate", None, True)
        return _loaded
    if "mlx.core" in sys.modules:
        log.warning("mlx.core was imported before the BLAS was chosen; it may use the reference BLAS")
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        name = "blis" if "blis" in path else "openblas"
        _loaded = BlasInfo(name, path, True)
        return _loaded
    _loaded = BlasInfo("reference", None, False)
    return _loaded


def log_blas(info: BlasInfo) -> None:
    """Say which BLAS is active; warn loudly when only the reference BLAS is there."""
    if info.optimized:
        log.info("BLAS: %s (%s)", info.name, info.path or "system")
        return
    log.warning(
        "BLAS: only the REFERENCE BLAS is available: prefill will be ~25x slower. "
        "Install an optimized BLAS (Debian: apt-get install libopenblas0-pthread) "
        "or point MLXCEL_BLAS_PATH at one."
    )
