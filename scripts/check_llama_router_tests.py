"""Run llama.cpp's own router tests (``tools/server/tests/unit/test_router.py``) against this server.

llama.cpp's test harness (``tools/server/tests/utils.py``) starts ``$LLAMA_SERVER_BIN_PATH`` with
llama-server's flags; here that is a small wrapper script that runs ``python -m mlxcel_compat``.
The hub repositories the tests name are laid out in a fresh ``$LLAMA_CACHE`` as ``-hf`` would have
downloaded them, with the factory's tiny models standing in for the real files:

- ``ggml-org/tinygemma3-GGUF`` (``tinygemma3-Q8_0.gguf``): the factory's tiny Gemma 3 text model, Q8_0;
- ``ggml-org/test-model-stories260K`` (``stories260K-F32.gguf``): the tiny llama, F32;
- ``ggml-org/test-model-stories260K-infill`` (``stories260K-infill-F32.gguf``): the tiny qwen3, F32.

The hub itself is ``tests/fake_hub.py`` on loopback (``HF_ENDPOINT``), holding the one repository
the download tests add with ``POST /models``: ``ggml-org/test-model-router-download``
(``test-model-router-download-F16.gguf``: the tiny llama, F16). The harness's session fixture,
which starts every preset server once to fill the cache from the real hub, is left out (the run
uses a copy of the tests directory whose ``conftest.py`` keeps the rest), and its ``wget`` import
is satisfied by a stub that refuses to download. The harness sets llama-server's debug variable
``LLAMA_SERVER_DEBUG_FAKE_TIMING`` for every server it starts; this server honours it as
llama-server does (docs/router.md). ``test_router_remote_preset`` starts the server with
``-hf ggml-org/test-preset-ci`` and no ``-m``: the loopback hub holds that repository with a
``preset.ini`` standing in for the real one (two sections naming the stand-in repositories above,
which the hub serves too, since that test runs online). All 17 tests run.

    python scripts/check_llama_router_tests.py            # all of unit/test_router.py
    python scripts/check_llama_router_tests.py -- -k queue  # some of it (pytest arguments after --)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_TREE = Path("~/.cache/llama-peer/llama.cpp").expanduser()
# What POST /models downloads from the loopback hub: (repository, file, family, kind).
HUB_DOWNLOAD = ("ggml-org/test-model-router-download", "test-model-router-download-F16.gguf", "llama", "f16")
# The preset repository test_router_remote_preset starts from (-hf with no -m): its preset.ini names
# two models of the stand-in repositories below, which the hub serves too (the test runs online).
PRESET_REPO = "ggml-org/test-preset-ci"
PRESET_INI = """version = 1

[tinygemma3-preset]
hf-repo = ggml-org/tinygemma3-GGUF:Q8_0

[stories260K-test]
hf-repo = ggml-org/test-model-stories260K:F32
"""
STANDINS = {
    "ggml-org/tinygemma3-GGUF": ("tinygemma3-Q8_0.gguf", "gemma3_text", "q8_0"),
    "ggml-org/test-model-stories260K": ("stories260K-F32.gguf", "llama", "f32"),
    "ggml-org/test-model-stories260K-infill": ("stories260K-infill-F32.gguf", "qwen3", "f32"),
}


def populate_cache(cache: Path) -> None:
    """The hub cache layout huggingface-hub writes: blobs by hash, a snapshot of links, refs/main."""
    sys.path.insert(0, str(ROOT))
    from mlxcel_compat.testing.gguf_writer import ensure_gguf

    for repo, (name, family, kind) in STANDINS.items():
        data = ensure_gguf(family, "tiny", kind).read_bytes()
        base = cache / ("models--" + repo.replace("/", "--"))
        commit = hashlib.sha1(repo.encode()).hexdigest()
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / "main").write_text(commit)
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = base / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-tree", default=str(LLAMA_TREE))
    parser.add_argument("--all", action="store_true", help="kept for older commands: every test runs anyway")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    source = Path(args.llama_tree) / "tools" / "server" / "tests"
    work = Path(tempfile.mkdtemp(prefix="llama_router_tests_"))
    tests = work / "tests"
    shutil.copytree(source, tests, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    conftest = (tests / "conftest.py").read_text()
    start = conftest.index('@pytest.fixture(scope="session", autouse=True)\ndef load_server_presets')
    (tests / "conftest.py").write_text(conftest[:start])  # no hub downloads; the rest kept as it is
    (tests / "tmp").mkdir(exist_ok=True)  # utils.TMP_DIR, where the reload tests write their presets
    stubs = work / "stubs"
    stubs.mkdir()
    (stubs / "wget.py").write_text("def download(*args, **kwargs):\n    raise RuntimeError('no downloads here')\n")
    wrapper = work / "llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m mlxcel_compat \"$@\"\n")
    wrapper.chmod(0o755)
    cache = work / "llama-cache"
    populate_cache(cache)
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from tests.fake_hub import FakeHub

    repo, name, family, kind = HUB_DOWNLOAD
    hub = FakeHub()
    hub.add(repo, {name: ensure_gguf(family, "tiny", kind)})
    hub.add(PRESET_REPO, {"preset.ini": PRESET_INI.encode(), "README.md": b"a preset repository\n"})
    for standin_repo, (standin_name, standin_family, standin_kind) in STANDINS.items():
        hub.add(standin_repo, {standin_name: ensure_gguf(standin_family, "tiny", standin_kind)})
    hub.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "MLXCEL_", "HF_"))}
    env.update(LLAMA_SERVER_BIN_PATH=str(wrapper), LLAMA_CACHE=str(cache), HF_ENDPOINT=hub.url,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(stubs)]))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "unit/test_router.py",
               *args.pytest_args]
    print("running", " ".join(command), "in", tests, flush=True)
    try:
        return subprocess.call(command, cwd=tests, env=env)
    finally:
        hub.stop()


if __name__ == "__main__":
    raise SystemExit(main())
