#!/usr/bin/env python
"""llama.cpp's own server tests (``tools/server/tests``, b11312) against llama-server and this server.

llama.cpp's suite starts ``$LLAMA_SERVER_BIN_PATH`` with llama-server's flags and names its models
as Hugging Face repositories (``--hf-repo ggml-org/test-model-stories260K``). No hub is reachable
here, so this script lays out a ``$LLAMA_CACHE`` holding local stand-ins for those repositories in
the hub cache's layout (``models--ORG--NAME/refs/main`` naming a commit,
``snapshots/COMMIT/FILE``), the layout both llama-server (``common/hf-cache.cpp``) and this server
(``model/hub.py`` through huggingface-hub) read offline. Both servers run offline
(``LLAMA_ARG_OFFLINE=1``, ``HF_HUB_OFFLINE=1``): each finds the same files.

The stand-ins are the deterministic factory's models (``mlxcel_compat.testing``), random weights
with a real BPE tokenizer, so tests that check what a *trained* model writes ("Ben", "lady") or
exact token counts of stories260K's 512-token vocabulary fail on both servers alike; the verdict
that matters is the per-file comparison. ``STAND_INS`` lists them:

- ``ggml-org/test-model-stories260K`` (``tinyllama2``): the factory's tiny llama, F32 GGUF;
- ``ggml-org/test-model-stories260K-infill``: the factory's tiny Qwen2.5-Coder (FIM tokens);
- ``ggml-org/models``: ``bert-bge-small/ggml-model-f16.gguf`` the factory's BERT of bge-small's
  shape (512 positions), and ``jina-reranker-v1-tiny-en/ggml-model-f16.gguf`` the tiny llama: a
  plain decoder, which both servers rerank with (llama-server pools ``rank`` on any model; the
  factory's cross-encoders hold 64 positions, fewer than the tests' documents);
- ``ggml-org/stories15M_MOE``: the factory's tiny Qwen3-MoE;
- ``ggml-org/tinygemma3-GGUF``: the factory's tiny Gemma 3 GGUF pair, ``tinygemma3-Q8_0.gguf`` and
  ``mmproj-tinygemma3.gguf`` beside it as the repository lays them out, so ``-hf`` picks the
  projector on both servers (random weights: the answers naming CIFAR-10 classes fail on both).

Files the tests fetch by URL (LoRA adapters, draft models) go through the ``wget`` module, which
this script stands in for with one that fails as a download without network does. The vision
tests' two images (``IMAGES``), which ``unit/test_vision_api.py`` fetches from huggingface.co with
``requests.get``, are local PNGs of the same names written by this script (32x32 seeded pixels);
``requests.get`` of those URLs returns them, every other request is untouched. The image *URLs*
the tests pass to the servers are passed as they are: without network both servers refuse them
(llama-server cannot download them, this server does not fetch media without ``--media-fetch``).
``ServerPreset.load_all`` (the suite's session fixture that downloads every preset once) is
skipped: the files are already in the cache.

The tests run from a copy of ``tools/server/tests`` (they write ``tmp/`` beside themselves), taken
from ``--llama-cpp`` (default ``~/.cache/llama-peer/llama.cpp``) or, where that tree is missing,
from the llama-cpp-python sdist (``.venv/sdist/llama_cpp_python-0.3.36.tar.gz``). This server runs
through a wrapper that executes ``python -m mlxcel_compat`` with the same arguments (the package on
``PYTHONPATH``: run from a checkout).

Usage::

    .venv/bin/python scripts/run_llama_cpp_server_tests.py                  # both servers, every file
    .venv/bin/python scripts/run_llama_cpp_server_tests.py --server mlxcel --files test_ctx_shift.py
    .venv/bin/python scripts/run_llama_cpp_server_tests.py --work /tmp/lcpp-tests --keep

It prints, per test file, how many tests pass on llama-server, on this server, and on both, then
the tests that pass on llama-server and fail here. ``--json FILE`` saves every test's outcome. The
exit status is 0 when every test llama-server passes also passes here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_LLAMA_CPP = Path("~/.cache/llama-peer/llama.cpp").expanduser()
SDIST = ROOT / ".venv" / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
SDIST_TESTS = "llama_cpp_python-0.3.36/vendor/llama.cpp"
TESTS_SUBDIR = Path("tools/server/tests")


@dataclass(frozen=True)
class StandIn:
    """One file of a hub repository, and the factory builder that writes its local stand-in."""

    repo: str
    filename: str
    build: Callable[[Path], Path]  # model cache -> the factory file


def _gguf(family: str, gguf_type: str = "f32") -> Callable[[Path], Path]:
    def build(cache: Path) -> Path:
        from mlxcel_compat.testing.gguf_writer import ensure_gguf

        return ensure_gguf(family, "tiny", gguf_type, cache_dir=cache)
    return build


def _vision_pair(part: int) -> Callable[[Path], Path]:
    """The factory's tiny Gemma 3 GGUF pair (Q8_0 text, F32 projector): part 0 the text, 1 the projector."""
    def build(cache: Path) -> Path:
        from mlxcel_compat.testing.vision import ensure_vision_gguf

        return ensure_vision_gguf(cache, "gemma3", gguf_type="q8_0")[part]
    return build


def _encoder(kind: str) -> Callable[[Path], Path]:
    def build(cache: Path) -> Path:
        from mlxcel_compat.testing.encoders import ensure_encoder_gguf

        return ensure_encoder_gguf(kind, cache_dir=cache)
    return build


STAND_INS = (
    StandIn("ggml-org/test-model-stories260K", "stories260K-f32.gguf", _gguf("llama")),
    StandIn("ggml-org/test-model-stories260K-infill", "stories260K-infill-f32.gguf", _gguf("qwen2_coder")),
    StandIn("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf", _encoder("bert-small")),
    StandIn("ggml-org/models", "jina-reranker-v1-tiny-en/ggml-model-f16.gguf", _gguf("llama")),
    StandIn("ggml-org/stories15M_MOE", "stories15M_MOE-F16.gguf", _gguf("qwen3_moe")),
    StandIn("ggml-org/tinygemma3-GGUF", "tinygemma3-Q8_0.gguf", _vision_pair(0)),
    StandIn("ggml-org/tinygemma3-GGUF", "mmproj-tinygemma3.gguf", _vision_pair(1)),
)
# The images unit/test_vision_api.py fetches with requests.get (the repository's test/ folder): local
# stand-ins of the same names, 32x32 like the CIFAR-10 pictures the trained tinygemma3 names.
IMAGE_URL = "https://huggingface.co/ggml-org/tinygemma3-GGUF/resolve/main/test/"
IMAGES = ("11_truck.png", "91_cat.png")

# Loaded into pytest with -p: skips the presets' download pass and stands in for ``wget``.
PLUGIN = '''\
"""Loaded by scripts/run_llama_cpp_server_tests.py: the models are already in $LLAMA_CACHE."""
import sys
import types

wget = types.ModuleType("wget")


def _download(url, out=None, bar=None):
    raise OSError(f"no network here: cannot download {url}")


wget.download = _download
sys.modules.setdefault("wget", wget)

import utils  # noqa: E402  (the suite's own module, from the tests directory)

utils.ServerPreset.load_all = staticmethod(lambda: None)

# --start-timeout: a longer wait for /health than the suite's 60 s, for both servers alike (a busy machine)
_start = utils.ServerProcess.start


def _start_patiently(self, timeout_seconds=utils.DEFAULT_HTTP_TIMEOUT):
    import os

    return _start(self, timeout_seconds=max(timeout_seconds, int(os.environ.get("LCPP_START_TIMEOUT") or 0)))


utils.ServerProcess.start = _start_patiently

# requests.get of the vision tests' images: the local stand-ins (other URLs go out as before, and fail
# without network); the suite's own requests to the servers are untouched.
import os  # noqa: E402

import requests  # noqa: E402

_get = requests.get


def _local_get(url, *args, **kwargs):
    name = str(url).removeprefix(os.environ.get("LCPP_IMAGE_URL") or "no-such-prefix:")
    folder = os.environ.get("LCPP_IMAGE_DIR", "")
    if name != str(url) and folder and os.path.isfile(os.path.join(folder, name)):
        response = requests.Response()
        response.status_code, response.url = 200, url
        with open(os.path.join(folder, name), "rb") as f:
            response._content = f.read()
        response.headers["Content-Type"] = "image/png"
        return response
    return _get(url, *args, **kwargs)


requests.get = _local_get
'''


def write_images(folder: Path) -> Path:
    """The vision tests' images (``IMAGES``): 32x32 PNGs of seeded random pixels."""
    import io

    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(IMAGES):
        out = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(out, "PNG")
        (folder / name).write_bytes(out.getvalue())
    return folder


def commit_of(repo: str) -> str:
    """A stable 40-hex commit name for a stand-in repository (the hub cache requires one)."""
    return hashlib.sha1(f"stand-in:{repo}".encode()).hexdigest()


def lay_out_cache(llama_cache: Path, model_cache: Path) -> None:
    """``llama_cache/models--ORG--NAME/{refs/main, snapshots/COMMIT/FILE}`` for every stand-in."""
    for stand_in in STAND_INS:
        repo_dir = llama_cache / ("models--" + stand_in.repo.replace("/", "--"))
        commit = commit_of(stand_in.repo)
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text(commit)
        target = repo_dir / "snapshots" / commit / stand_in.filename
        target.parent.mkdir(parents=True, exist_ok=True)
        source = stand_in.build(model_cache)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(source)


def tests_tree(llama_cpp: Path, work: Path) -> Path:
    """A fresh copy of llama.cpp's server tests under ``work`` (``models/templates`` beside it)."""
    tree = work / "llama.cpp"
    if tree.exists():
        shutil.rmtree(tree)
    if (llama_cpp / TESTS_SUBDIR).is_dir():
        source = llama_cpp
    else:
        if not SDIST.is_file():
            raise SystemExit(f"neither {llama_cpp / TESTS_SUBDIR} nor {SDIST} exists")
        unpacked = work / "sdist"
        with tarfile.open(SDIST) as archive:
            members = [m for m in archive.getmembers()
                       if m.name.startswith(f"{SDIST_TESTS}/{TESTS_SUBDIR}/")
                       or m.name.startswith(f"{SDIST_TESTS}/models/templates/")]
            archive.extractall(unpacked, members=members, filter="data")
        source = unpacked / SDIST_TESTS
    shutil.copytree(source / TESTS_SUBDIR, tree / TESTS_SUBDIR,
                    ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    (tree / TESTS_SUBDIR / "tmp").mkdir(exist_ok=True)  # utils.TMP_DIR: the router tests write presets there
    (tree / "models").mkdir(parents=True)
    (tree / "models" / "templates").symlink_to((source / "models" / "templates").resolve())
    return tree / TESTS_SUBDIR


def write_wrapper(work: Path) -> Path:
    """An executable that runs this server with llama-server's arguments."""
    wrapper = work / "mlxcel-server"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m mlxcel_compat \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def free_port_block(size: int = 10) -> int:
    """A loopback port whose next ``size`` ports are free too: the suite's servers listen on
    ``$PORT`` (llama.cpp's default 8080 is shared by anyone else running these tests here)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 60000 - size)
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SystemExit("no free block of loopback ports")


def run_suite(name: str, binary: Path, tests: Path, work: Path, llama_cache: Path,
              files: list[str], start_timeout: int = 0) -> dict[str, str]:
    """pytest over ``files`` (all ``unit/`` when empty) against ``binary``: test id -> outcome."""
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "lcpp_runner_plugin.py").write_text(PLUGIN)
    report = work / f"junit-{name}.xml"
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(binary),
        "LLAMA_CACHE": str(llama_cache),
        "LLAMA_ARG_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(tests), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PORT": os.environ.get("PORT") or str(free_port_block()),
        "LCPP_IMAGE_URL": IMAGE_URL,
        "LCPP_IMAGE_DIR": str(write_images(work / "images")),
        "LCPP_START_TIMEOUT": str(start_timeout),
    }
    targets = [f"unit/{f}" for f in files] or ["unit"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "lcpp_runner_plugin",
               "-m", "not slow", "-o", "addopts=", f"--junitxml={report}", *targets]
    log = work / f"pytest-{name}.log"
    print(f"[{name}] {' '.join(command)}  (log: {log})", flush=True)
    with open(log, "w") as out:
        subprocess.run(command, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    return read_junit(report)


def read_junit(report: Path) -> dict[str, str]:
    """``unit/test_x.py::test_y[param]`` -> passed / failed / error / skipped."""
    outcomes: dict[str, str] = {}
    if not report.is_file():
        return outcomes
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        outcomes[f"{module}::{case.get('name')}"] = outcome
    return outcomes


def merged(previous: dict[str, dict[str, str]], fresh: dict[str, dict[str, str]], files: list[str]) -> dict[str, dict[str, str]]:
    """``previous`` with the outcomes of the files run now (all of them when ``files`` is empty)
    replaced by ``fresh``'s, per server; servers not run now keep their previous outcomes."""
    rerun = {f"unit/{f}" for f in files}
    out = {}
    for name in dict.fromkeys([*previous, *fresh]):
        old = previous.get(name, {})
        if name in fresh:
            old = {t: v for t, v in old.items() if files and t.split("::")[0] not in rerun}
        out[name] = {**old, **fresh.get(name, {})}
    return out


def print_table(results: dict[str, dict[str, str]]) -> int:
    """Per file: tests, passes on each server, passes on both; then what passes only on llama-server."""
    names = list(results)
    ids = sorted({test for outcomes in results.values() for test in outcomes})
    files = sorted({test.split("::")[0] for test in ids})
    header = f"{'file':42} {'tests':>5}" + "".join(f" {n:>12}" for n in names)
    both = len(names) == 2
    print("\n" + header + (f" {'both':>6}" if both else ""))
    totals = [0] * (len(names) + 2)
    for file in files:
        tests = [t for t in ids if t.startswith(file + "::")]
        passes = [sum(results[n].get(t) == "passed" for t in tests) for n in names]
        row = f"{file:42} {len(tests):>5}" + "".join(f" {p:>12}" for p in passes)
        common = sum(all(results[n].get(t) == "passed" for n in names) for t in tests)
        print(row + (f" {common:>6}" if both else ""))
        for i, value in enumerate([len(tests), *passes, common]):
            totals[i] += value
    print(f"{'total':42} {totals[0]:>5}" + "".join(f" {p:>12}" for p in totals[1:1 + len(names)])
          + (f" {totals[-1]:>6}" if both else ""))
    if not both:
        return 0
    reference, ours = names
    missing = [t for t in ids if results[reference].get(t) == "passed" and results[ours].get(t) != "passed"]
    print(f"\n{len(missing)} tests pass on {reference} and not on {ours}:")
    for test in missing:
        print(f"  {test}  ({results[ours].get(test, 'not run')})")
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("both", "llama-server", "mlxcel"), default="both")
    parser.add_argument("--files", nargs="*", default=[], help="test files of unit/ (default: all)")
    parser.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP,
                        help="llama.cpp tree with tools/server/tests (default %(default)s)")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_CPP / "build" / "bin" / "llama-server")
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    parser.add_argument("--model-cache", type=Path, help="factory model cache (default: the factory's)")
    parser.add_argument("--json", type=Path, help="save every test's outcome per server here")
    parser.add_argument("--start-timeout", type=int, default=0, help="seconds each server may take to answer "
                        "/health (both servers alike; default: the suite's 60)")
    parser.add_argument("--reuse", type=Path, help="a previous --json file: its outcomes stand for the files "
                        "not run now (a rerun of a few files then prints the whole table)")
    args = parser.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="lcpp-server-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    from mlxcel_compat.testing.cache_dir import default_cache_dir

    model_cache = (args.model_cache or default_cache_dir()).resolve()
    llama_cache = work / "llama-cache"
    lay_out_cache(llama_cache, model_cache)
    tests = tests_tree(args.llama_cpp, work)
    servers = {"llama-server": args.llama_server.resolve(), "mlxcel": write_wrapper(work)}
    chosen = list(servers) if args.server == "both" else [args.server]
    results = {name: run_suite(name, servers[name], tests, work, llama_cache, args.files, args.start_timeout)
               for name in chosen}
    if args.reuse:
        results = merged(json.loads(args.reuse.read_text()), results, args.files)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    return print_table(results)


if __name__ == "__main__":
    raise SystemExit(main())
