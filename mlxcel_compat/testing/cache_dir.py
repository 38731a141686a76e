"""Where the factory keeps what it builds, and how a build lands there whole.

Every factory output (model directories, GGUF files, adapters, encoders, vision models, the real
model's file) is cached under :func:`default_cache_dir` and written into a temporary path beside
its target, then renamed into place, so concurrent callers never see half a build.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def default_cache_dir() -> Path:
    """``$MLXCEL_CACHE_DIR`` if set, else ``~/.cache/mlxcel_compat/models``."""
    env = os.environ.get("MLXCEL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlxcel_compat" / "models"


def build_directory(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write(tmp)`` into a temporary directory beside it and renamed into
    place on first use; complete once its ``marker`` file exists (written last). Concurrent callers
    never see half a directory: a loser of the race discards its copy and uses the winner's."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)  # an incomplete leftover
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
