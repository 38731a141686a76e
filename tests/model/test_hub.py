"""``-hf user/repo[:quant]``: llama-server's file choice, split files, offline errors (model/hub.py).

No network: the repositories live in a hub cache directory laid out exactly as huggingface-hub
writes it (``models--user--name/{blobs,refs,snapshots}``), read by the real huggingface-hub in
offline mode.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mlxcel_compat.model import hub
from mlxcel_compat.model.loader import ModelNotFoundError, resolve_model_path

LISTING = [
    "README.md",
    "mmproj-model-f16.gguf",
    "model-IQ4_XS.gguf",
    "model-Q4_K_M.gguf",
    "model-Q4_K_S.gguf",
    "model-Q8_0.gguf",
    "model.imatrix.gguf",
    "split/model-Q6_K-00001-of-00002.gguf",
    "split/model-Q6_K-00002-of-00002.gguf",
]


def test_model_files_skip_projectors_and_imatrix() -> None:
    assert hub.model_files(LISTING) == ["model-IQ4_XS.gguf", "model-Q4_K_M.gguf", "model-Q4_K_S.gguf",
                                        "model-Q8_0.gguf", "split/model-Q6_K-00001-of-00002.gguf",
                                        "split/model-Q6_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("tag, expected", [
    ("Q8_0", "model-Q8_0.gguf"),
    ("q4_k_s", "model-Q4_K_S.gguf"),  # case-insensitive
    ("Q4_K", None),  # "Q4_K" must be followed by '.' or '-': Q4_K_M does not match
    ("Q6_K", "split/model-Q6_K-00001-of-00002.gguf"),  # "TAG-" matches the split name
    (None, "model-Q4_K_M.gguf"),  # default: Q4_K_M first
])
def test_tag_picks_the_first_matching_file(tag: str | None, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(hub.HubError) as info:
            hub.choose_gguf(LISTING, tag)
        assert str(info.value).startswith(f"no GGUF file matches the tag ':{tag}'; available: model-IQ4_XS.gguf, ")
        assert "mmproj" not in str(info.value)
    else:
        assert hub.choose_gguf(LISTING, tag) == expected


def test_the_projector_is_picked_as_llama_servers_find_best_mmproj() -> None:
    """A ``.gguf`` with ``mmproj`` in its name, in the model's folder or above it, the deepest
    first, then the type closest in bits to the model's (``extract_quant_bits``), first on a tie."""
    assert hub.quant_bits("model-Q4_K_M.gguf") == 4 and hub.quant_bits("mmproj-model-f16.gguf") == 16
    assert hub.quant_bits("split/model-Q6_K-00001-of-00002.gguf") == 6 and hub.quant_bits("mmproj.gguf") == 0
    assert hub.choose_mmproj(LISTING, "model-Q4_K_M.gguf") == "mmproj-model-f16.gguf"
    both = ["mmproj-m-F16.gguf", "mmproj-m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-BF16.gguf"]
    assert hub.choose_mmproj(both, "m-Q4_K_M.gguf") == "mmproj-m-Q8_0.gguf"  # 8 bits is closer to 4 than 16
    assert hub.choose_mmproj(both, "m-BF16.gguf") == "mmproj-m-F16.gguf"
    nested = ["mmproj-top-f16.gguf", "v2/mmproj-v2-f32.gguf", "v2/m-Q8_0.gguf", "other/mmproj-o-q8_0.gguf"]
    assert hub.choose_mmproj(nested, "v2/m-Q8_0.gguf") == "v2/mmproj-v2-f32.gguf"  # its own folder first
    assert hub.choose_mmproj(nested, "m-Q8_0.gguf") == "mmproj-top-f16.gguf"  # never a folder below the model's
    assert hub.choose_mmproj(["m-Q8_0.gguf", "mmproj.bin"], "m-Q8_0.gguf") is None


def test_defaults_fall_back_to_q8_0_then_the_first_file() -> None:
    assert hub.choose_gguf(["a-Q5_K_M.gguf", "a-Q8_0.gguf"], None) == "a-Q8_0.gguf"
    assert hub.choose_gguf(["a-Q5_K_M.gguf", "a-Q6_K.gguf", "mmproj-a.gguf"], None) == "a-Q5_K_M.gguf"
    assert hub.choose_gguf(["config.json", "model.safetensors"], None) is None  # an MLX repository
    with pytest.raises(hub.HubError, match="no GGUF files in the repository"):
        hub.choose_gguf(["config.json", "model.safetensors"], "Q4_K_M")


def test_split_siblings_and_repo_parsing() -> None:
    assert hub.split_siblings("split/model-Q6_K-00001-of-00002.gguf", LISTING) == LISTING[-2:]
    assert hub.split_siblings("model-Q8_0.gguf", LISTING) == ["model-Q8_0.gguf"]
    with pytest.raises(hub.HubError, match="missing split/model-Q6_K-00002-of-00002.gguf"):
        hub.split_siblings("split/model-Q6_K-00001-of-00002.gguf", LISTING[:-1])
    assert hub.parse_repo("user/repo:Q4_K_M") == ("user/repo", "Q4_K_M")
    assert hub.parse_repo("user/repo") == ("user/repo", None)
    with pytest.raises(hub.HubError, match="expected user/model"):
        hub.parse_repo("just-a-name")


def populate_cache(cache: Path, repo: str, files: dict[str, Path | bytes]) -> Path:
    """Lay files out as huggingface-hub's cache does (blobs by hash, a snapshot of symlinks)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from tests.conftest import MODEL_CACHE, tiny_model
    from mlxcel_compat.testing.gguf_writer import ensure_gguf, write_gguf

    cache = tmp_path / "hub"
    q8 = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    q4 = ensure_gguf("qwen3", "tiny", "q4_0", cache_dir=MODEL_CACHE)
    parts = write_gguf("qwen3", "tiny", tmp_path / "w" / "tiny-Q6_K.gguf", "q8_0", split_max_tensors=12,
                       model_dir=tiny_model("qwen3"))
    populate_cache(cache, "acme/tiny-GGUF", {
        "tiny-Q4_K_M.gguf": q4, "tiny-Q8_0.gguf": q8, "mmproj-tiny-f16.gguf": b"not a model",
        **{f"split/{p.name}": p for p in parts},
    })
    directory = tiny_model("llama")
    populate_cache(cache, "acme/tiny-mlx", {p.name: p for p in directory.iterdir() if p.is_file()})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # LLAMA_CACHE must win
    return cache


def test_offline_fetch_picks_files_from_the_cache(hub_cache: Path) -> None:
    def get(model: str, hf_file: str | None = None) -> Path:
        return resolve_model_path(model, offline=True, hf_file=hf_file, cache_dir=hub_cache)

    assert get("acme/tiny-GGUF").name == "tiny-Q4_K_M.gguf"
    assert get("acme/tiny-GGUF:q8_0").name == "tiny-Q8_0.gguf"
    assert get("acme/tiny-GGUF", hf_file="tiny-Q8_0.gguf").name == "tiny-Q8_0.gguf"
    first = get("acme/tiny-GGUF:Q6_K")
    assert first.name == "tiny-Q6_K-00001-of-00002.gguf" and first.with_name("tiny-Q6_K-00002-of-00002.gguf").exists()
    assert str(first).startswith(str(hub_cache / "models--acme--tiny-GGUF" / "snapshots"))
    directory = get("acme/tiny-mlx")
    assert directory.is_dir() and (directory / "config.json").exists()


def test_offline_errors_say_what_is_missing(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("acme/absent-GGUF:Q4_K_M", offline=True, cache_dir=hub_cache)
    assert "is not in the local Hugging Face cache" in str(info.value) and "--offline" in str(info.value)
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file matches the tag ':Q2_K'; available: "
                                                 r"split/tiny-Q6_K-00001-of-00002.gguf, .*tiny-Q4_K_M.gguf"):
        resolve_model_path("acme/tiny-GGUF:Q2_K", offline=True, cache_dir=hub_cache)
    with pytest.raises(ModelNotFoundError, match="'nope.gguf' is not in 'acme/tiny-GGUF'"):
        resolve_model_path("acme/tiny-GGUF", offline=True, hf_file="nope.gguf", cache_dir=hub_cache)
    # Only the first part of a split model in the cache: the model cannot be complete.
    for part in (hub_cache / "models--acme--tiny-GGUF" / "snapshots").glob("*/split/*00002-of-00002.gguf"):
        part.unlink()
    with pytest.raises(ModelNotFoundError, match="split model 'split/tiny-Q6_K-00001-of-00002.gguf' is incomplete"):
        resolve_model_path("acme/tiny-GGUF:Q6_K", offline=True, cache_dir=hub_cache)


def test_local_paths_are_checked_before_the_hub(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    other = tmp_path / "notes.txt"
    other.write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf model"):
        resolve_model_path(str(other))


def test_mmproj_url_downloads_once_into_llama_cpps_cache_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mmproj-url``: the URL's file name (no query) in ``$LLAMA_CACHE``; written whole, used
    again without a request; a 404, or ``--offline`` without the file, is an error saying so."""
    import functools
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    (served / "mmproj-x-f16.gguf").write_bytes(b"GGUF projector bytes")
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        url = f"{base}/mmproj-x-f16.gguf?download=true"
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        assert hub.url_cache_path(url) == Path.home() / ".cache" / "llama.cpp" / "mmproj-x-f16.gguf"
        target = hub.url_cache_path(url, tmp_path / "cache")
        assert target == tmp_path / "cache" / "mmproj-x-f16.gguf"
        assert hub.fetch_url(url, target).read_bytes() == b"GGUF projector bytes"
        assert hub.fetch_url(url, target, offline=True) == target and len(requests) == 1  # no second request
        with pytest.raises(hub.HubError, match="HTTP 404"):
            hub.fetch_url(f"{base}/missing.gguf", tmp_path / "cache" / "missing.gguf")
        assert not list((tmp_path / "cache").glob("missing*"))
        with pytest.raises(hub.HubError, match="--offline forbids downloading"):
            hub.fetch_url(url, tmp_path / "other.gguf", offline=True)
    finally:
        server.shutdown()
