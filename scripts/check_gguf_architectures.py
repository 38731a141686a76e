"""Three runs agree on every GGUF architecture: llama-server, this server and mlx-lm.

For each factory family of a served GGUF architecture (docs/gguf.md's table):

1. the factory writes the tiny model (``CHECK_SIZE``: the small one) as a Hugging Face directory
   (random weights, fixed seed);
2. llama.cpp's own converter (``convert_hf_to_gguf.py`` in the tree that
   ``../shared/peers/build-llama-server.sh`` unpacks) turns the directory into an F32 GGUF. It
   refuses a tokenizer whose pre-tokenizer hash it does not know, which includes the factory's:
   the converter runs in a child process of this script in which ``get_vocab_base_pre`` answers
   the pre-tokenizer the factory's own GGUF writer names for the family. The other questions a
   factory directory asks and a real checkpoint does not are answered per family below
   (``GPT2_VOCAB``, ``CONFIG_READ``, ``CONVERTER_FLAGS``, ``CONVERTER_INPUT``), each with its
   reason; the tensor conversion is the converter's own;
3. the converter's file is compared with the factory writer's (tensor names, shapes, metadata
   keys and the ``{arch}.*`` values), which is what the test suite loads instead (CI has neither
   torch nor llama-server);
4. logits of one prompt: mlx-lm on the directory against this server's loader on the converter's
   file (and on the factory's), over every position;
5. llama-server on the converter's file, one position at a time along mlx-lm's greedy path:
   its greedy token must equal ours wherever both sides' top-2 gap exceeds ``--margin``, and its
   top-2 log-probabilities must agree with ours within ``--tolerance`` at every position
   (``--gelu-tolerance`` for families with a GELU activation: ggml's CPU GELU rounds its input
   and output to float16 through a lookup table, ``GGML_GELU_FP16`` in ``ggml-cpu/vec.h``).
   llama-server runs with an F32 KV cache and without flash attention (``-ctk f32 -ctv f32
   -fa off``), whose float16 accumulations would otherwise dominate the difference.

Prints one Markdown row per family (the table in docs/gguf.md) and exits non-zero if any fails.

    .venv/bin/python scripts/check_gguf_architectures.py                # every family
    .venv/bin/python scripts/check_gguf_architectures.py --families llama,qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxcel_compat.runtime.backend import load_optimized_blas  # noqa: E402

load_optimized_blas()

import numpy as np  # noqa: E402

PEER = Path(os.environ.get("LLAMA_PEER", Path.home() / ".cache/llama-peer/llama.cpp"))
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
N_PREDICT = 16
# Families whose tiny model departs from the real one's structure in a way the converter cannot
# carry: the check takes their small size, which has the real structure. Gemma 3's converter
# writes no sliding-window pattern (every real Gemma 3 has a global layer every 6th, which
# llama.cpp assumes); the tiny one alternates so that four layers hold both kinds.
CHECK_SIZE = {"gemma3_text": "small"}
# Families whose factory directory holds mlx-lm's sanitized layout (stacked experts as
# ``switch_mlp`` / ``switch_glu``, Qwen3.5's ``language_model.`` prefix, MLX's convolution layout,
# norms after mlx-lm's ``1 + w``) or, for gpt-oss, a form the converter does not read: the converter
# gets a copy of the directory in the checkpoint's form (``testing/hf_layouts.py``, the inverse of
# mlx-lm's ``sanitize``). Without it: "Can not map tensor 'model.layers.0.mlp.switch_mlp...'".
CONVERTER_INPUT = {"gpt_oss": "gpt_oss_bf16", "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5",
                   "gemma4_text_moe": "gemma4_moe", "granitemoehybrid": "granitemoehybrid"}

# The converter's vocabulary step, answered per family. Each class below reads the vocabulary in a
# form the factory's byte-level BPE (a ``tokenizer.json`` with GPT-2's byte alphabet) is not, though
# the real models of the family ship one; the child then takes the converter's own GPT-2 path
# (``TextModel._set_vocab_gpt2``, which Phi-4 and EXAONE take for real) for the token list and
# touches nothing else. Phi-3: ``tokenizer.model`` (SentencePiece) unless ``tokenizer_config.json``
# names ``GPT2Tokenizer``; Gemma 2, ERNIE 4.5 (dense and MoE): ``tokenizer.model`` always; Gemma 4:
# ``LlamaHfVocab`` ("Cannot find Llama BPE tokenizer": a SentencePiece-style ``tokenizer.json``);
# GLM-4 and GLM-4.5: ``_set_vocab_glm`` looks up GLM's own special tokens (``[gMASK]``,
# ``<|user|>``, ...) by name; Nemotron-H: ``AutoTokenizer`` with ``trust_remote_code``.
GPT2_VOCAB = {"phi3", "gemma2", "ernie4_5", "ernie4_5_moe", "gemma4_text", "gemma4_text_moe", "glm4", "glm4_moe",
              "nemotron_h"}
# How the converter reads a family's config, where transformers' ``AutoConfig`` (5.25 here) changes
# it. "as written": ``config.json`` alone, the converter's own fallback when ``AutoConfig`` fails;
# ``AutoConfig`` adds MoE defaults to a dense Nemotron-H config (``n_routed_experts`` and others),
# after which the converter classifies it as ``nemotron_h_moe`` with zero MLP widths and
# llama-server refuses the file ("tensor 'blk.1.ssm_in.weight' not found"). "merged": ``AutoConfig``'s
# dictionary with ``config.json``'s keys it dropped put back; its ``ExaoneConfig`` (EXAONE 3.5)
# renames ``activation_function`` to ``hidden_act``, after which the converter's ``assert
# hparams["activation_function"] == "silu"`` raises ``KeyError``, and read as written the converter
# writes ``attention.layer_norm_epsilon``, which llama-server refuses ("key not found in model:
# exaone.attention.layer_norm_rms_epsilon"): it needs ``AutoConfig``'s ``rms_norm_eps``.
CONFIG_READ = {"nemotron_h": "as written", "exaone": "merged", "qwen3_5": "as written", "qwen3_5_moe": "as written"}

# Converter options per family. Qwen3.5 and Qwen3-Next checkpoints carry multi-token-prediction
# layers (``mtp.*``) and the converter exports them unless told not to; on a checkpoint without
# them (the factory's: mlx-lm has no MTP layers) its ``__init__`` stops at ``assert
# self.opt_num_mtp_layers != 0`` (``conversion/qwen.py``) unless ``--no-mtp`` says so.
# llama.cpp's vocabulary loader keys on ``general.name``: one containing "phi3" or "phi-3" sets
# attributes of ``</s>``, ``<unk>``, ``<s>`` and ``<|endoftext|>``, which Phi-3's vocabulary has and
# the factory's does not, so llama-server stops with "error loading model vocabulary:
# unordered_map::at"; the converter names the file after the directory (``phi3-tiny-v4``) unless
# ``--model-name`` names it otherwise.
CONVERTER_FLAGS = {"qwen3_5": ("--no-mtp",), "qwen3_5_moe": ("--no-mtp",), "qwen3_next": ("--no-mtp",),
                   "phi3": ("--model-name", "factory tiny model")}

# llama-server's context per family (default 512). Phi-3's LongRoPE: llama.cpp takes the short
# factors while the context per sequence is at most the original one (``get_rope_factors``), mlx-lm
# always the long ones (docs/gguf.md), so llama-server runs with more than the factory's 4096.
PEER_CONTEXT = {"phi3": 8192}

# The child process: llama.cpp's converter with the questions above answered (see the module
# docstring); the tensor conversion is the converter's own.
CONVERTER_CHILD = """
import json, sys
from pathlib import Path
peer, options = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, peer + "/gguf-py")
sys.path.insert(0, peer)
import convert_hf_to_gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: options["pre"]
if options["gpt2_vocab"]:
    model_class = convert_hf_to_gguf.get_model_class
    def gpt2_vocab_class(*args, **kwargs):
        found = model_class(*args, **kwargs)
        found.set_vocab = base.TextModel._set_vocab_gpt2
        return found
    convert_hf_to_gguf.get_model_class = gpt2_vocab_class
if options["config"]:
    read = base.ModelBase.load_hparams
    def load_hparams(directory, is_mistral_format):
        written = json.loads((Path(directory) / "config.json").read_text())
        return written if options["config"] == "as written" else {**written, **read(directory, is_mistral_format)}
    base.ModelBase.load_hparams = staticmethod(load_hparams)
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert_hf_to_gguf.main()
"""


@dataclass
class Row:
    family: str
    arch: str = ""
    layout: str = ""  # the converter's file against the factory writer's
    logits: str = ""  # mlx-lm (directory) against this server (converter's file)
    peer: str = ""  # llama-server against this server
    ok: bool = True
    notes: list[str] = field(default_factory=list)

    def fail(self, note: str) -> None:
        self.ok = False
        self.notes.append(note)

    def markdown(self) -> str:
        verdict = "pass" if self.ok else "FAIL"
        notes = "; ".join(self.notes)
        return f"| `{self.arch}` | `{self.family}` | {self.layout} | {self.logits} | {self.peer} | {verdict}{': ' + notes if notes else ''} |"


def convert(family: str, directory: Path, out: Path, pre: str) -> None:
    """llama.cpp's converter on ``directory``, as an F32 GGUF at ``out``."""
    options = json.dumps({"pre": pre, "gpt2_vocab": family in GPT2_VOCAB, "config": CONFIG_READ.get(family)})
    done = subprocess.run([sys.executable, "-c", CONVERTER_CHILD, str(PEER), options, str(directory), "--outfile", str(out),
                           "--outtype", "f32", *CONVERTER_FLAGS.get(family, ())], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 or not out.is_file():
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"the converter failed: {tail}")


def converter_input(family: str, directory: Path, work: Path) -> Path:
    """The directory the converter reads: the factory's, or a copy in ``CONVERTER_INPUT``'s form."""
    if family not in CONVERTER_INPUT:
        return directory
    import shutil

    import mlx.core as mx

    from mlxcel_compat.testing import hf_layouts

    copy = work / f"{family}-checkpoint"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(directory, copy)
    config = json.loads((directory / "config.json").read_text())
    weights = {name: np.array(value) for name, value in mx.load(str(directory / "model.safetensors")).items()}
    form = getattr(hf_layouts, CONVERTER_INPUT[family])(weights, config)
    mx.save_safetensors(str(copy / "model.safetensors"), {name: mx.array(value) for name, value in form.items()})
    return copy


def compare_layout(theirs: Path, ours: Path) -> list[str]:
    """Where the factory writer's file differs from the converter's (empty: none)."""
    from mlxcel_compat.gguf.reader import open_gguf

    a, b = open_gguf(theirs), open_gguf(ours)
    problems = []
    if a.architecture != b.architecture:
        problems.append(f"architecture {a.architecture} vs ours {b.architecture}")
    only_theirs, only_ours = sorted(set(a.tensors) - set(b.tensors)), sorted(set(b.tensors) - set(a.tensors))
    # A NextN (multi-token prediction) layer's tensors: the converter exports them, the loader leaves
    # them out (logged) and the factory's writer does not write them (the suite adds them where it
    # tests that: test_glm4moe_nextn_layers_are_left_out).
    prefix = f"{a.architecture}."
    blocks, nextn = int(a.metadata.get(prefix + "block_count", 0)), int(a.metadata.get(prefix + "nextn_predict_layers", 0))
    unserved = tuple(f"blk.{i}." for i in range(blocks - nextn, blocks)) if nextn else ()
    only_theirs = [name for name in only_theirs if not name.startswith(unserved)] if unserved else only_theirs
    if only_theirs:
        problems.append(f"tensors only the converter writes: {', '.join(only_theirs[:6])}")
    if only_ours:
        problems.append(f"tensors only ours writes: {', '.join(only_ours[:6])}")
    for name in sorted(set(a.tensors) & set(b.tensors)):
        if tuple(a.tensors[name].shape) != tuple(b.tensors[name].shape):
            problems.append(f"{name} shape {a.tensors[name].shape} vs ours {b.tensors[name].shape}")
    keys_a = {k for k in a.metadata if k.startswith(prefix)}
    keys_b = {k for k in b.metadata if k.startswith(prefix)}
    if keys_a - keys_b:
        problems.append(f"keys only the converter writes: {', '.join(sorted(keys_a - keys_b))}")
    if keys_b - keys_a:
        problems.append(f"keys only ours writes: {', '.join(sorted(keys_b - keys_a))}")
    for key in sorted(keys_a & keys_b):
        va, vb = a.metadata[key], b.metadata[key]
        same = np.allclose(np.asarray(va, dtype=float), np.asarray(vb, dtype=float), rtol=1e-6) \
            if isinstance(va, (int, float, list)) and not isinstance(va, bool) and np.asarray(va).dtype.kind in "iuf" \
            else va == vb
        if not same:
            problems.append(f"{key} = {va!r} vs ours {vb!r}")
    return problems


def reference_logits(directory: Path, tokens: list[int]) -> np.ndarray:
    """mlx-lm's logits on the directory, every position."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(directory)
    logits = model(mx.array([tokens]))
    return np.array(logits[0].astype(mx.float32))


def served_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """This server's loader on a GGUF file (float weights: no blocks), every position."""
    import mlx.core as mx

    from mlxcel_compat.gguf.load import load_gguf

    model, _, _, _ = load_gguf(str(path), on_cpu=True)
    logits = model(mx.array([tokens]))
    return np.array(logits[0].astype(mx.float32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_next_logprobs(path: Path, prefixes: list[list[int]], context: int = 512) -> list[dict]:
    """llama-server's greedy next token after each prefix, with its top-2 log-probabilities.

    One request a position (teacher forcing on our greedy path): llama-server groups the
    probabilities of a generation by complete UTF-8 text, so a token that ends mid-character
    shares its entry with the next; one token a request keeps every entry at a known position.
    Its KV cache is F32 (``-ctk f32 -ctv f32``), as ours is.
    """
    port = free_port()
    server = PEER / "build/bin/llama-server"
    proc = subprocess.Popen([str(server), "-m", str(path), "--port", str(port), "-c", str(context), "-np", "1", "--no-warmup",
                             "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-400:]}")
                time.sleep(0.1)
        out = []
        for prefix in prefixes:
            body = {"prompt": prefix, "n_predict": 1, "temperature": 0, "n_probs": 2, "cache_prompt": False,
                    "samplers": ["top_k"], "top_k": 1, "return_tokens": True}
            request = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as r:
                reply = json.loads(r.read())
            # A token that ends mid-character is reported without its probabilities (they wait for
            # the character's end); an end-of-generation token ends the reply with no token at all.
            tokens = reply.get("tokens") or []
            probabilities = reply.get("completion_probabilities") or [
                {"id": tokens[0] if tokens else None, "top_logprobs": []}]
            out.append(probabilities[0])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def greedy_with_logits(directory: Path, tokens: list[int], steps: int) -> list[np.ndarray]:
    """mlx-lm's last-position logits at each greedy step, from the prompt on."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(directory)
    cache = make_prompt_cache(model)
    out = []
    logits = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
    for _ in range(steps):
        row = np.array(logits)
        out.append(row)
        logits = model(mx.array([[int(row.argmax())]]), cache=cache)[0, -1].astype(mx.float32)
    return out


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row.astype(np.float64) - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def check(family: str, work: Path, margin: float, tolerance: float, gelu_tolerance: float, with_peer: bool) -> Row:
    from mlxcel_compat.testing.families import EOS_IDS
    from mlxcel_compat.testing.gguf_tensors import GGUF_TARGETS
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from mlxcel_compat.testing.model_directory import ensure_model
    from mlxcel_compat.tokenizer.cache import load_directory

    target = GGUF_TARGETS[family]
    row = Row(family, target.arch)
    size = CHECK_SIZE.get(family, "tiny")
    directory = ensure_model(family, size, cache_dir=work / "models")
    converted = work / f"{family}-converted.gguf"
    try:
        convert(family, converter_input(family, directory, work), converted, target.pre)
    except Exception as exc:  # noqa: BLE001 - the row says why
        row.fail(str(exc)[:300])
        row.layout = row.logits = row.peer = "-"
        return row
    ours = ensure_gguf(family, size, "f32", cache_dir=work / "models")
    problems = compare_layout(converted, ours)
    row.layout = "same" if not problems else "differs"
    for problem in problems:
        row.fail(problem)

    tokens = load_directory(directory).encode(PROMPT)
    config = json.loads((directory / "config.json").read_text())
    if "gelu" in str(config.get("hidden_activation") or config.get("hidden_act") or ""):
        tolerance = gelu_tolerance
    reference = reference_logits(directory, tokens)
    try:
        served = served_logits(converted, tokens)
    except Exception as exc:  # noqa: BLE001
        row.fail(f"this server does not load the converter's file: {exc}"[:300])
        row.logits = "-"
        served = None
    if served is not None:
        scale = float(np.abs(reference).max())
        error = float(np.abs(served - reference).max()) / scale
        row.logits = f"max rel. error {error:.1e}"
        if error > 1e-4:
            row.fail(f"logits differ by {error:.1e} of the largest")
    if not with_peer:
        row.peer = "not run"
        return row
    ours_steps = greedy_with_logits(directory, tokens, N_PREDICT)
    path = [*tokens]
    prefixes = []
    for logits in ours_steps:
        prefixes.append(list(path))
        path.append(int(logits.argmax()))
    try:
        steps = peer_next_logprobs(converted, prefixes, PEER_CONTEXT.get(family, 512))
    except Exception as exc:  # noqa: BLE001
        row.fail(f"llama-server: {exc}"[:300])
        row.peer = "-"
        return row
    decided = agreed = 0
    worst = 0.0
    from mlxcel_compat.gguf.reader import open_gguf

    metadata = open_gguf(converted).metadata
    end_ids = {metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.ggml.eot_token_id"), *EOS_IDS}
    for step, logits in zip(steps, ours_steps):
        top2 = np.sort(logits)[-2:]
        if step["id"] is None:  # llama-server ended the generation: our greedy token must end it too
            decided += 1
            agreed += int(int(logits.argmax()) in end_ids)
            continue
        theirs_top2 = step["top_logprobs"]
        theirs_gap = theirs_top2[0]["logprob"] - theirs_top2[1]["logprob"] if len(theirs_top2) > 1 else float("inf")
        lsm = log_softmax(logits)
        for entry in theirs_top2:
            worst = max(worst, abs(entry["logprob"] - float(lsm[entry["id"]])))
        if top2[1] - top2[0] < margin or theirs_gap < margin:
            continue  # a near-tie on either side: either token is a right answer
        decided += 1
        agreed += int(step["id"] == int(logits.argmax()))
    row.peer = f"{agreed}/{decided} decided tokens, log-prob error {worst:.1e}"
    if agreed != decided:
        row.fail("llama-server's greedy token differs at a decided position")
    if worst > tolerance:
        row.fail(f"log-probabilities differ by {worst:.1e}")
    return row


def main() -> int:
    from mlxcel_compat.testing.families import ARCHITECTURE_FAMILIES
    from mlxcel_compat.testing.gguf_tensors import GGUF_FAMILIES, GGUF_TARGETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="", help="comma-separated factory families (default: every GGUF one)")
    parser.add_argument("--margin", type=float, default=0.05, help="top-2 logit gap below which a position is a near-tie")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest log-probability difference allowed")
    parser.add_argument("--gelu-tolerance", type=float, default=2e-2,
                        help="the same for GELU families (ggml's GELU goes through float16)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-server (steps 1-4 only)")
    parser.add_argument("--work", default="", help="directory for models and files (default: a temporary one)")
    args = parser.parse_args()
    # Every family with a GGUF target (ARCHITECTURE_FAMILIES lists no qwen3_next, which the
    # factory has from before); qwen2_coder is qwen2 with FIM tokens.
    families = [f for f in args.families.split(",") if f] or [
        *GGUF_FAMILIES, *(f for f in ARCHITECTURE_FAMILIES if f in GGUF_TARGETS),
        *(f for f in GGUF_TARGETS if f not in (*GGUF_FAMILIES, *ARCHITECTURE_FAMILIES, "qwen2_coder"))]
    if not (PEER / "convert_hf_to_gguf.py").is_file():
        print(f"llama.cpp's tree is not at {PEER}: run ../shared/peers/build-llama-server.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("| `general.architecture` | factory family | converter's file vs the factory's | logits: mlx-lm vs this server (converter's file) | llama-server vs this server | result |")
        print("|---|---|---|---|---|---|")
        rows = []
        for family in families:
            row = check(family, work, args.margin, args.tolerance, args.gelu_tolerance, not args.no_peer)
            rows.append(row)
            print(row.markdown(), flush=True)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
