"""``-hf user/repo[:quant]``: choose and fetch model files from the Hugging Face hub.

The choice follows llama-server's rules, so a deployment's ``-hf`` line picks the same file:

- model files are the ``.gguf`` files that are not ``mmproj`` or ``imatrix`` files;
- ``-hff FILE`` names the file outright;
- a ``:quant`` tag picks the first model file whose name contains ``TAG.`` or ``TAG-``
  (case-insensitive); a tag that matches nothing is an error listing the files;
- without a tag: Q4_K_M, then Q8_0, then the first model file;
- a split file (``…-00001-of-00003.gguf``) brings all its parts.

A repository without any GGUF (an MLX or safetensors repository) is fetched as a model
directory instead, so ``-hf mlx-community/…`` works as well.

The repository's projector (``mmproj``) comes with the model unless ``--no-mmproj`` or
``--mmproj FILE`` says otherwise, picked as llama-server's ``find_best_mmproj`` picks it
(:func:`choose_mmproj`). ``--mmproj-url URL`` downloads a projector as llama.cpp does
(:func:`fetch_url`, into :func:`url_cache_path`).

Files go to the standard hub cache layout through huggingface-hub (``$LLAMA_CACHE`` when set,
else the hub's own cache, ``$HF_HUB_CACHE``). ``--offline`` (or ``HF_HUB_OFFLINE=1``) only
looks in that cache; what is missing there is a clear error, never a network call.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mlxcel_compat.gguf.reader import SPLIT_NAME

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
EXCLUDED = ("mmproj", "imatrix")
# What mlx-lm needs from a model directory snapshot (weights, config, tokenizer, templates).
DIRECTORY_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class HubError(RuntimeError):
    """The requested hub model could not be chosen or fetched; the message says why."""


@dataclass(frozen=True)
class HubRequest:
    repo: str  # "user/name"
    tag: str | None = None  # the ":quant" suffix
    file: str | None = None  # -hff
    token: str | None = None
    offline: bool = False
    cache_dir: Path | None = None  # $LLAMA_CACHE; None = the hub's default cache

    @property
    def label(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


def parse_repo(value: str) -> tuple[str, str | None]:
    """``user/repo:Q4_K_M`` -> ("user/repo", "Q4_K_M"); the tag is optional."""
    repo, _, tag = value.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(f"invalid Hugging Face repository '{value}': expected user/model[:quant]")
    return repo, tag or None


def model_files(files: list[str]) -> list[str]:
    """The GGUF model files of a listing (no projector or importance-matrix files), in order."""
    return [f for f in files if f.lower().endswith(".gguf") and not any(x in f.lower() for x in EXCLUDED)]


def _matches(name: str, tag: str) -> bool:
    return re.search(re.escape(tag.lower()) + r"[.-]", name.lower()) is not None


def choose_gguf(files: list[str], tag: str | None) -> str | None:
    """The file llama-server would pick for ``tag``; None when the repo has no GGUF model file.

    Raises ``HubError`` when a tag matches none of the files.
    """
    candidates = model_files(files)
    if not candidates:
        if tag:
            raise HubError(f"no GGUF files in the repository, so the tag ':{tag}' cannot be resolved")
        return None
    if tag:
        for name in candidates:
            if _matches(name, tag):
                return name
        raise HubError(f"no GGUF file matches the tag ':{tag}'; available: {', '.join(candidates)}")
    for default in DEFAULT_TAGS:
        for name in candidates:
            if _matches(name, default):
                return name
    return candidates[0]


_QUANT_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_SPLIT_STEM = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)


def quant_bits(name: str) -> int:
    """llama.cpp's bits of a file's type tag (``x-Q4_K_M.gguf`` -> 4, ``mmproj-x-f16.gguf`` -> 16; 0: none)."""
    stem = name.removesuffix(".gguf")
    if (split := _SPLIT_STEM.match(stem)) is not None:
        stem = split.group(1)
    tag = _QUANT_TAG.search(stem)
    digits = re.search(r"[0-9]+", tag.group(1)) if tag else None
    return int(digits.group(0)) if digits else 0


def choose_mmproj(files: list[str], model: str) -> str | None:
    """The projector llama-server takes with ``model`` (its ``find_best_mmproj``): a ``.gguf``
    whose name contains ``mmproj``, in the model's folder or one above it, the deepest such folder
    first, then the type closest in bits to the model's (the first file on a tie); None if none."""
    model_dir = model.split("/")[:-1]
    model_bits = quant_bits(model)
    best: tuple[int, int] | None = None
    chosen = None
    for name in files:
        if not name.endswith(".gguf") or "mmproj" not in name:
            continue
        directory = name.split("/")[:-1]
        if model_dir[: len(directory)] != directory:
            continue  # not the model's folder nor one above it
        rank = (-len(directory), abs(quant_bits(name) - model_bits))
        if best is None or rank < best:
            best, chosen = rank, name
    return chosen


def split_siblings(name: str, files: list[str]) -> list[str]:
    """Every part of a split file, in order (just ``[name]`` when it is not split)."""
    directory, _, base = name.rpartition("/")
    match = SPLIT_NAME.match(base)
    if not match:
        return [name]
    count = int(match["count"])
    prefix = f"{directory}/" if directory else ""
    parts = [f"{prefix}{match['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise HubError(f"split model '{name}' is incomplete in the repository: missing {', '.join(missing)}")
    return parts


def _offline(request: HubRequest) -> bool:
    return request.offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _cached_snapshot(request: HubRequest) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(request.repo, cache_dir=request.cache_dir, local_files_only=True))
    except Exception as exc:  # hub errors come in many classes; the message is what matters
        raise HubError(f"'{request.repo}' is not in the local Hugging Face cache "
                       f"({request.cache_dir or 'the default hub cache'}) and --offline forbids downloading: "
                       f"{type(exc).__name__}") from exc


def list_files(request: HubRequest) -> list[str]:
    """The repository's files: from the hub, or from the cached snapshot when offline."""
    if _offline(request):
        snapshot = _cached_snapshot(request)
        return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    from huggingface_hub import HfApi

    try:
        return sorted(HfApi().list_repo_files(request.repo, token=request.token))
    except Exception as exc:
        raise HubError(f"cannot list the files of '{request.repo}' on the hub: {type(exc).__name__}: {exc}") from exc


def _download(request: HubRequest, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(request.repo, filename, cache_dir=request.cache_dir, token=request.token,
                                    local_files_only=_offline(request)))
    except Exception as exc:
        where = "in the local cache (--offline)" if _offline(request) else "on the hub"
        raise HubError(f"cannot get '{filename}' of '{request.repo}' {where}: {type(exc).__name__}: {exc}") from exc


def _download_directory(request: HubRequest) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(request.repo, allow_patterns=DIRECTORY_PATTERNS, cache_dir=request.cache_dir,
                                      token=request.token, local_files_only=_offline(request)))
    except Exception as exc:
        raise HubError(f"cannot get the model directory of '{request.repo}': {type(exc).__name__}: {exc}") from exc


def fetch_mmproj(request: HubRequest) -> Path | None:
    """The repository's projector for the model :func:`fetch` picks (``--mmproj-auto``, on by
    default as in llama-server), downloaded; None when it has none or serves a directory."""
    files = list_files(request)
    chosen = request.file if request.file else choose_gguf(files, request.tag)
    projector = choose_mmproj(files, chosen) if chosen else None
    return _download(request, projector) if projector else None


PRESET_FILE = "preset.ini"  # a repository holding this at its root is a preset, not a model


def fetch_preset(request: HubRequest) -> Path | None:
    """The repository's ``preset.ini``, downloaded, when it has one at its root; None otherwise.

    llama-server (``common_download_get_hf_plan``) treats ``-hf user/repo`` naming such a
    repository as ``--models-preset`` with that file: the server starts as a router over the
    preset's models instead of serving one model.
    """
    return _download(request, PRESET_FILE) if PRESET_FILE in list_files(request) else None


def url_cache_path(url: str, cache_dir: str | Path | None = None) -> Path:
    """Where llama.cpp keeps a file downloaded from ``url`` (``--mmproj-url``): the URL's last path
    segment (query and fragment dropped) in ``$LLAMA_CACHE``, else ``$XDG_CACHE_HOME/llama.cpp``,
    else ``~/.cache/llama.cpp``."""
    name = url.split("#")[0].split("?")[0].rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise HubError(f"'{url}' names no file")
    if cache_dir is None:
        xdg = os.environ.get("XDG_CACHE_HOME")
        cache_dir = Path(xdg) / "llama.cpp" if xdg else Path.home() / ".cache" / "llama.cpp"
    return Path(cache_dir).expanduser() / name


def fetch_url(url: str, target: Path, offline: bool = False, token: str | None = None) -> Path:
    """``url`` downloaded to ``target`` (written whole, then renamed into place); a file already
    there is used as it is; ``offline`` never downloads."""
    import httpx

    if target.is_file():
        return target
    if offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubError(f"'{target}' is not there and --offline forbids downloading {url}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".downloadInProgress")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as response:
            if response.status_code != 200:
                raise HubError(f"cannot download {url}: HTTP {response.status_code}")
            with open(partial, "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
        os.replace(partial, target)
    except httpx.HTTPError as exc:
        raise HubError(f"cannot download {url}: {type(exc).__name__}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)  # a failed download leaves nothing behind
    return target


def fetch(request: HubRequest) -> Path:
    """A local path for the request: the first part of the chosen GGUF, or a model directory."""
    files = list_files(request)
    if request.file:
        if request.file not in files:
            raise HubError(f"'{request.file}' is not in '{request.repo}'; available: {', '.join(model_files(files)) or 'no GGUF files'}")
        chosen: str | None = request.file
    else:
        chosen = choose_gguf(files, request.tag)
    if chosen is None:
        return _download_directory(request)
    paths = [_download(request, part) for part in split_siblings(chosen, files)]
    return paths[0]
