"""End to end: ``-hf user/repo[:quant]`` downloads from a hub and serves what it downloaded.

The hub is ``tests/fake_hub.py``, a loopback HTTP server named by ``HF_ENDPOINT``; the client is
the real huggingface-hub inside the real server process (nothing of it is mocked). Checked:

- ``-hf repo:Q8_0 -hft TOKEN``: only the chosen GGUF is fetched, into ``$LLAMA_CACHE`` in the hub's
  cache layout (not ``$HF_HUB_CACHE``), every call to the private repository carries the bearer
  token, and the server serves that file;
- ``HF_TOKEN`` instead of ``-hft``, and a split file: every part is fetched;
- a repository without GGUF files: its model directory is fetched (weights, config, tokenizer;
  not the README or other files) and served;
- a tag that matches nothing: start-up fails with the list of the repository's GGUF files; a
  private repository without a token fails with the hub's 401;
- without a tag: Q4_K_M, else Q8_0, else the first model file (``resolve_model_path`` in a child
  process with ``HF_ENDPOINT``, as the server runs it, without loading a model each time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxcel_compat.testing.gguf_writer import ensure_gguf, write_gguf
from tests.conftest import MODEL_CACHE, tiny_model
from tests.fake_hub import FakeHub

pytestmark = pytest.mark.e2e

TOKEN = "hf_fake_secret_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    q8 = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    q4 = ensure_gguf("qwen3", "tiny", "q4_0", cache_dir=MODEL_CACHE)
    parts = write_gguf("qwen3", "tiny", tmp_path_factory.mktemp("split") / "tiny-Q6_K.gguf", "q8_0",
                       split_max_tensors=12, model_dir=tiny_model("qwen3"))
    fake = FakeHub()
    fake.add("acme/tiny-GGUF", {
        "README.md": b"# tiny\n", "mmproj-tiny-f16.gguf": b"not a model", "tiny-Q4_K_M.gguf": q4, "tiny-Q8_0.gguf": q8,
        **{f"split/{p.name}": p for p in parts},
    }, token=TOKEN)
    directory = tiny_model("llama")
    fake.add("acme/tiny-mlx", {**{p.name: p for p in directory.iterdir() if p.is_file()},
                               "README.md": b"# mlx\n", "original/consolidated.bin": b"\0" * 64})
    fake.add("acme/q8-GGUF", {"x-IQ4_XS.gguf": b"iq4", "x-Q8_0.gguf": b"q8"})
    fake.add("acme/first-GGUF", {"mmproj-x-f16.gguf": b"m", "x-Q5_K_M.gguf": b"q5", "x-Q6_K.gguf": b"q6"})
    fake.start()
    yield fake
    fake.stop()


def _env(hub: FakeHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "LLAMA_CACHE": str(tmp_path / "llama-cache"),
            "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def _snapshot(cache: Path, repo: str) -> Path:
    root = cache / ("models--" + repo.replace("/", "--"))
    return root / "snapshots" / (root / "refs" / "main").read_text().strip()


def _repo_requests(hub: FakeHub, repo: str) -> list:
    return [r for r in hub.requests if f"/{repo}/" in r.path]


def _complete(base_url: str) -> dict:
    with httpx.Client(base_url=base_url, timeout=60) as http:
        response = http.post("/completion", json={"prompt": "Hello", "n_predict": 3, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()


def test_tag_downloads_only_the_chosen_file_with_the_token(server_factory, hub: FakeHub, tmp_path: Path) -> None:
    hub.requests.clear()
    # --no-mmproj: the repository's (placeholder) projector is not fetched (test_hf_fetches_the_projector_too)
    server = server_factory(["-hf", "acme/tiny-GGUF:Q8_0", "-hft", TOKEN, "--no-mmproj"], env=_env(hub, tmp_path))
    snapshot = _snapshot(tmp_path / "llama-cache", "acme/tiny-GGUF")
    assert sorted(p.name for p in snapshot.iterdir()) == ["tiny-Q8_0.gguf"]
    assert (snapshot / "tiny-Q8_0.gguf").read_bytes() == hub.repos["acme/tiny-GGUF"].files["tiny-Q8_0.gguf"]
    assert not (tmp_path / "hub-cache").exists()  # $LLAMA_CACHE wins over the hub's own cache
    assert hub.downloads("acme/tiny-GGUF") == ["tiny-Q8_0.gguf"]
    calls = _repo_requests(hub, "acme/tiny-GGUF")
    # listing (is it a preset repository? cli.use_remote_preset), listing, metadata, download
    assert [c.method for c in calls] == ["GET", "GET", "HEAD", "GET"]
    assert all(c.authorization == f"Bearer {TOKEN}" for c in calls)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/props").json()["model_path"] == str(snapshot / "tiny-Q8_0.gguf")
        assert http.get("/v1/models").json()["data"][0]["id"] == "acme/tiny-GGUF:Q8_0"
    assert _complete(server.base_url)["tokens_predicted"] == 3


def test_hf_token_env_and_every_part_of_a_split_file(server_factory, hub: FakeHub, tmp_path: Path) -> None:
    hub.requests.clear()
    server = server_factory(["-hf", "acme/tiny-GGUF:Q6_K", "--no-mmproj"], env=_env(hub, tmp_path, HF_TOKEN=TOKEN))
    snapshot = _snapshot(tmp_path / "llama-cache", "acme/tiny-GGUF")
    parts = ["split/tiny-Q6_K-00001-of-00002.gguf", "split/tiny-Q6_K-00002-of-00002.gguf"]
    assert sorted(hub.downloads("acme/tiny-GGUF")) == parts
    assert all((snapshot / p).read_bytes() == hub.repos["acme/tiny-GGUF"].files[p] for p in parts)
    assert all(c.authorization == f"Bearer {TOKEN}" for c in _repo_requests(hub, "acme/tiny-GGUF"))
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/props").json()["model_path"] == str(snapshot / parts[0])
    assert "loaded GGUF" in server.log() and "(2 files)" in server.log()
    assert _complete(server.base_url)["tokens_predicted"] == 3


def test_repository_without_gguf_downloads_the_model_directory(server_factory, hub: FakeHub, tmp_path: Path) -> None:
    hub.requests.clear()
    server = server_factory(["-hf", "acme/tiny-mlx"], env=_env(hub, tmp_path))
    snapshot = _snapshot(tmp_path / "llama-cache", "acme/tiny-mlx")
    fetched = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    expected = sorted(p.name for p in tiny_model("llama").iterdir() if p.is_file())
    assert fetched == expected and "config.json" in fetched and "model.safetensors" in fetched
    assert "README.md" not in fetched and not (snapshot / "original").exists()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        props = http.get("/props").json()
        assert props["model_path"] == str(snapshot)
        assert http.get("/v1/models").json()["models"][0]["details"]["format"] == "safetensors"
    assert _complete(server.base_url)["tokens_predicted"] == 3


def test_unmatched_tag_lists_the_files_and_a_missing_token_fails(server_factory, hub: FakeHub, tmp_path: Path) -> None:
    server = server_factory(["-hf", "acme/tiny-GGUF:Q2_K", "-hft", TOKEN], env=_env(hub, tmp_path), wait=False)
    assert server.proc.wait(60) == 1
    assert ("error: model 'acme/tiny-GGUF:Q2_K': no GGUF file matches the tag ':Q2_K'; available: "
            "split/tiny-Q6_K-00001-of-00002.gguf, split/tiny-Q6_K-00002-of-00002.gguf, tiny-Q4_K_M.gguf, "
            "tiny-Q8_0.gguf.") in server.log()
    assert not (tmp_path / "llama-cache" / "models--acme--tiny-GGUF" / "blobs").exists()  # nothing downloaded

    denied = server_factory(["-hf", "acme/tiny-GGUF:Q8_0"], env=_env(hub, tmp_path), wait=False)
    assert denied.proc.wait(60) == 1
    log = denied.log()
    assert "error: model 'acme/tiny-GGUF:Q8_0': cannot list the files of 'acme/tiny-GGUF' on the hub" in log
    assert "401" in log and "-hft / HF_TOKEN" in log


_RESOLVE = """
import json, sys
from mlxcel_compat.model.loader import resolve_model_path
print(json.dumps({repo: str(resolve_model_path(repo, cache_dir=sys.argv[1])) for repo in sys.argv[2:]}))
"""


def test_without_a_tag_q4_k_m_then_q8_0_then_the_first_file(hub: FakeHub, tmp_path: Path) -> None:
    hub.requests.clear()
    repos = ["acme/tiny-GGUF", "acme/q8-GGUF", "acme/first-GGUF"]
    env = {**os.environ, **_env(hub, tmp_path, HF_TOKEN=TOKEN)}
    done = subprocess.run([sys.executable, "-c", _RESOLVE, str(tmp_path / "llama-cache"), *repos],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    chosen = {repo: Path(path).name for repo, path in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    assert chosen == {"acme/tiny-GGUF": "tiny-Q4_K_M.gguf", "acme/q8-GGUF": "x-Q8_0.gguf",
                      "acme/first-GGUF": "x-Q5_K_M.gguf"}
    for repo, name in chosen.items():
        assert hub.downloads(repo) == [name]  # nothing else of the repository is fetched


@pytest.mark.slow
def test_hf_fetches_the_projector_too(server_factory, hub: FakeHub, tmp_path: Path) -> None:
    """As llama-server's ``--mmproj-auto`` (on by default): the model's projector is fetched beside
    it (not the one of another folder) and served: the server takes images."""
    from mlxcel_compat.testing.vision import ensure_vision_gguf

    text, mmproj = ensure_vision_gguf(MODEL_CACHE, "qwen2_5_vl", gguf_type="q8_0")
    # A projector in another folder is not the model's, however close its type (find_best_mmproj).
    hub.add("acme/tiny-vl-GGUF", {text.name: text, mmproj.name: mmproj, "other/mmproj-other-Q8_0.gguf": b"not it"})
    hub.requests.clear()
    server = server_factory(["-hf", "acme/tiny-vl-GGUF:Q8_0"], env=_env(hub, tmp_path))
    downloads = sorted(hub.downloads("acme/tiny-vl-GGUF"))
    assert downloads == ["mlxcel-qwen2-5-vl-tiny-Q8_0.gguf", "mmproj-mlxcel-qwen2-5-vl-tiny-F32.gguf"]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/props").json()["modalities"]["vision"] is True
