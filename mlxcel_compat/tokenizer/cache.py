"""Tokenizers built by transformers once, in a child process, and cached as ``tokenizer.json``.

Two sources need transformers to get today's exact tokenizer: a GGUF vocabulary (its GGUF
converter, ``gguf_tokenizer.py``) and a Hugging Face directory whose tokenizer class rebuilds the
Rust object rather than taking ``tokenizer.json`` as it is (transformers 5's ``Qwen2Tokenizer``
applies Qwen2's own split regex and NFC, and sets ``unk_token``, whatever the file says), or
that has only a SentencePiece ``tokenizer.model``. Either way the child process loads it with
transformers and saves it with ``save_pretrained``: the saved ``tokenizer.json`` is the Rust
object transformers ended up with, and its ``tokenizer_config.json`` the special tokens it
settled on; ``tokenizer.from_files`` reads those back exactly. The serving process never
imports transformers (nor torch, which importing transformers imports where it is installed).

Entries live under ``$XDG_CACHE_HOME/mlxcel_compat/`` (else ``~/.cache/...``), one directory per
key; the key hashes the source (the GGUF header, the directory's tokenizer files), the code
that converts it and the transformers/tokenizers versions, read from the installed
distributions (importing transformers to read its version would defeat the point). The least
recently used beyond ``MAX_CACHED`` are deleted. An unusable cache means converting every time
into a temporary directory; an entry that does not load is rebuilt.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

from mlxcel_compat.tokenizer.served import ServedTokenizer, from_files

log = logging.getLogger(__name__)

MAX_CACHED = 64  # converted tokenizers kept per cache directory (a few MB each; more than a router's models)
CONVERT_TIMEOUT_S = 600


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mlxcel_compat`` (else ``~/.cache/mlxcel_compat``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxcel_compat"


def directory_cache_dir() -> Path:
    """Where tokenizers of Hugging Face directories, as transformers builds them, are kept."""
    return cache_root() / "hf-tokenizers"


# The files of a model directory that decide what transformers builds (config.json: model_type).
DIRECTORY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "added_tokens.json", "generation_config.json")


def directory_key(directory: Path) -> str:
    """Changes whenever transformers could build another tokenizer from ``directory``."""
    from blake3 import blake3

    digest = blake3(Path(__file__).read_bytes() + Path(__file__).with_name("convert.py").read_bytes())
    digest.update(library_versions().encode())
    names = list(DIRECTORY_FILES) + sorted(str(p.relative_to(directory)) for p in directory.glob("additional_chat_templates/*"))
    names += sorted(p.name for p in directory.glob("*.tiktoken"))
    for name in names:
        file = directory / name
        if file.is_file():
            data = file.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:32]


def library_versions() -> str:
    """The libraries a conversion depends on, for cache keys."""
    from importlib import metadata

    parts = []
    for name in ("transformers", "tokenizers"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} absent")
    return "; ".join(parts)


def usable_cache(cache_dir: Path) -> bool:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        return os.access(cache_dir, os.W_OK)
    except OSError:
        return False


def _keep(directory: Path, entry: Path, cache_dir: Path) -> None:
    """Move a freshly saved tokenizer into the cache (atomically) and drop the oldest entries."""
    try:
        os.rename(directory, entry)
    except OSError:  # another process cached the same tokenizer first
        return
    entries = sorted((p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_CACHED:]:
        shutil.rmtree(old, ignore_errors=True)


def convert_in_child(program: str, source: Path, out: Path, extra_args: Sequence[str] = ()) -> None:
    """Run ``python -m PROGRAM SOURCE OUT [EXTRA...]``: a child that builds the tokenizer of ``source`` with
    transformers and saves it into ``out`` (``tokenizer/convert.py`` for a directory,
    ``gguf/tokenizer.py`` for a GGUF file; each source's room owns its conversion)."""
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the mlxcel_compat package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    done = subprocess.run([sys.executable, "-m", program, str(source), str(out), *extra_args],
                          env=env, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    if done.returncode != 0 or not (out / "tokenizer.json").is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"building the tokenizer of '{source}' with transformers failed (exit {done.returncode}): "
                           + " | ".join(tail))


def load_converted(key: str, cache_dir: Path, convert: Callable[[Path], None],
                   eos_token_ids: Iterable[int] = ()) -> ServedTokenizer:
    """The cached tokenizer under ``key``, else ``convert(out_dir)`` then that (cached).

    ``convert`` writes a tokenizer directory (normally :func:`convert_in_child`).
    """
    eos = list(eos_token_ids)
    cached = usable_cache(cache_dir)
    entry = cache_dir / key if cached else None
    if entry is not None and entry.is_dir():
        try:
            tokenizer = from_files(entry, eos)
            os.utime(entry)  # recently used: kept by the pruning
            return tokenizer
        except Exception as exc:  # a damaged entry: convert again
            log.warning("cached tokenizer %s does not load (%s); converting again", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    directory = Path(tempfile.mkdtemp(prefix=".convert-" if cached else "mlxcel-tokenizer-",
                                      dir=cache_dir if cached else None))
    try:
        convert(directory)
        tokenizer = from_files(directory, eos)
        if entry is not None:
            _keep(directory, entry, cache_dir)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return tokenizer


def load_directory(directory: str | Path, eos_token_ids: Iterable[int] = (), cache_dir: Path | None = None
                   ) -> ServedTokenizer:
    """The tokenizer of a model directory, as transformers' ``AutoTokenizer`` builds it.

    transformers builds it once, in a child process, and the result is cached
    (``py``): its tokenizer class may rebuild the Rust object from the
    vocabulary (``Qwen2Tokenizer``) or convert a SentencePiece ``tokenizer.model``. When that
    fails (no transformers), ``tokenizer.json`` is read as it is, and the log says so.
    """
    directory = Path(directory)
    eos = list(eos_token_ids)

    def convert(out: Path) -> None:
        log.info("building the tokenizer of %s with transformers, in a child process (cached for later starts)",
                 directory)
        convert_in_child("mlxcel_compat.tokenizer.convert", directory, out)

    cache_dir = cache_dir if cache_dir is not None else directory_cache_dir()
    try:
        return load_converted(directory_key(directory), cache_dir, convert, eos)
    except Exception as exc:
        if not (directory / "tokenizer.json").is_file():
            raise
        log.warning("%s; reading %s/tokenizer.json as it is (a tokenizer class that rebuilds it may differ)",
                    exc, directory)
        return from_files(directory, eos)
