"""llama-server's mtmd and this server on the same GGUF pair, for the same image.

For each factory family with a served projector type:

1. the factory writes the tiny vision-language directory (mlx-vlm's names and layouts); a copy in
   the Hugging Face checkpoint's layouts (PyTorch's ``(out, in, kh, kw)`` convolutions, Qwen's
   ``visual.`` names, SmolVLM's ``model.vision_model.`` / ``model.connector.`` /
   ``model.text_model.``, Qwen3-VL's ``model.visual.`` / ``model.language_model.``) is what
   llama.cpp's converter reads;
2. llama.cpp's own converter (``convert_hf_to_gguf.py`` of the peer tree, in a child process
   whose ``get_vocab_base_pre`` answers the factory's pre-tokenizer, as
   ``scripts/check_gguf_architectures.py`` runs it) writes the text GGUF and, with ``--mmproj``,
   the projector (F32 both); gguf-py's projector map is built for at least 3 blocks there (the
   2-block tiny tower's map lacks Qwen's ``mm.2``: the converter would stop on it); LLaVA 1.5's
   projector, which the converter does not write, by llama.cpp's legacy tools instead
   (:func:`convert_llava_legacy`), and our server for it reproduces mtmd's class-token order
   (``MTMD_CLS_LAST``: llama.cpp issue 25814);
3. the converter's projector is compared with the factory writer's (``testing/vision_gguf.py``):
   tensor names, shapes and values, and the ``clip.*`` keys;
4. llama-server (``-m text --mmproj mmproj``, F32 KV, no flash attention) and this server serve the
   converter's pair; one ``/completion`` with the image in ``multimodal_data`` (an image of the
   tower's input size, so neither side resizes it; InternVL's: two tiles, and the thumbnail
   each side shrinks itself), greedy, ``n_probs`` 2: the greedy tokens
   must agree where our top-2 gap exceeds ``--margin``, and the top log-probabilities within
   ``--tolerance`` (ggml's CPU GELU rounds through float16, ``GGML_GELU_FP16``; both the SigLIP
   tower and Gemma's MLP use GELU). Each server's resident memory after the request is shown
   (informational: a tiny model's is the runtime's, not its weights').

llama.cpp wraps a Gemma 3 image as ``<start_of_image>`` ... ``<end_of_image>``; Gemma3Processor
(and this server) as ``\\n\\n<start_of_image>`` ... ``<end_of_image>\\n\\n``: llama-server's prompt
carries the two ``\\n\\n`` as text, so both sides see the same tokens. The tiny Gemma 3's layers
alternate sliding and global; the converter writes no pattern, so the check adds
``gemma3.attention.sliding_window_pattern`` to the converter's text file, which both servers read.
llama.cpp's InternVL graph gives each patch its predecessor's position embedding (the class token
appended last, the table added in the checkpoint's order): llama-server gets a copy of the
converter's projector with the class token's row moved last (:func:`class_position_last`), this
server the converter's file itself.

Prints one Markdown row per family (docs/vision.md's table); exits non-zero if any fails.

    .venv/bin/python scripts/check_mmproj.py [--families gemma3,qwen2_5_vl,qwen2_vl,smolvlm,qwen3_vl,internvl_chat,llava,mistral3,lfm2_vl]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

PEER = Path(os.environ.get("LLAMA_PEER", Path.home() / ".cache/llama-peer/llama.cpp"))
CONVERTER_CHILD = """
import sys
peer, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, peer + "/gguf-py")
sys.path.insert(0, peer)
import convert_hf_to_gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import gguf
name_map = gguf.get_tensor_name_map
# gguf-py maps the projector's layers (mm.N) through block-indexed rows: a 2-block tower's map
# lacks Qwen's mm.2. Real towers have dozens of blocks; the tiny one gets a map of 3.
gguf.get_tensor_name_map = lambda arch, n: name_map(arch, max(n, 3) if arch == gguf.MODEL_ARCH.MMPROJ else n)
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert_hf_to_gguf.main()
"""
PRE = {"gemma3": "gpt-2", "qwen2_5_vl": "qwen2", "qwen2_vl": "qwen2", "smolvlm": "gpt-2", "qwen3_vl": "qwen2",
       "internvl_chat": "qwen2", "llava": "gpt-2", "mistral3": "gpt-2", "lfm2_vl": "qwen2"}
# What each side's prompt holds around the media marker (see the module docstring).
WRAP = {"gemma3": ("\n\n", "\n\n"), "qwen2_5_vl": ("", ""), "qwen2_vl": ("", ""), "smolvlm": ("", ""),
        "qwen3_vl": ("", ""), "internvl_chat": ("", ""), "llava": ("", ""), "mistral3": ("", ""), "lfm2_vl": ("", "")}
# SmolVLM's checkpoint names, which the converter reads (mlx-vlm's sanitize strips them).
SMOLVLM_NAMES = (("language_model.lm_head.", "lm_head."), ("language_model.", "model.text_model."),
                 ("vision_model.", "model.vision_model."), ("connector.", "model.connector."))
# Qwen3-VL's checkpoint names (mlx-vlm's sanitize maps them to its own).
QWEN3VL_NAMES = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."),
                 ("vision_tower.", "model.visual."))
# LFM2-VL's checkpoint names (Lfm2VlForConditionalGeneration; mlx-vlm's sanitize maps them to its own).
LFM2VL_NAMES = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower.vision_model."),
                ("multi_modal_projector.", "model.multi_modal_projector."))


def checkpoint_copy(family: str, directory: Path, work: Path) -> Path:
    """The factory directory in the checkpoint's layouts, which the converter reads."""
    import mlx.core as mx

    copy = work / f"{family}-checkpoint"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(directory, copy)
    out = {}
    for name, value in mx.load(str(directory / "model.safetensors")).items():
        array = np.array(value)
        if name.endswith(("patch_embedding.weight", "patch_embed.proj.weight", "patch_conv.weight")) and array.ndim > 2:
            array = np.moveaxis(array, -1, 1)  # MLX channels-last -> PyTorch (out, in, ...) (SigLIP2's is a linear layer)
        if family == "mistral3":  # Mistral Small 3.1's checkpoint: vision_tower.transformer.*, mlx-vlm's vision_model inserted
            name = name.replace("vision_tower.vision_model.", "vision_tower.")
            # b11312's MmprojModel drops every "language_model." tensor before LlavaVisionModel could copy
            # the [IMG_BREAK] row out of the embeddings: the text named as a plain Mistral's, which the
            # converter's text path reads the same (it strips "language_model." itself)
            name = name.replace("language_model.model.", "model.").replace("language_model.lm_head.", "lm_head.")
        if family == "lfm2_vl" and name.endswith("conv.conv.weight"):
            array = array.transpose(0, 2, 1)  # LFM2's depthwise convolution: MLX (C, K, 1) -> PyTorch (C, 1, K)
        if family in ("qwen2_5_vl", "qwen2_vl") and name.startswith("vision_tower."):
            name = "visual." + name.removeprefix("vision_tower.")
        if family in ("smolvlm", "qwen3_vl", "lfm2_vl"):
            prefixes = {"smolvlm": SMOLVLM_NAMES, "qwen3_vl": QWEN3VL_NAMES, "lfm2_vl": LFM2VL_NAMES}[family]
            mlx_prefix, checkpoint_prefix = next(p for p in prefixes if name.startswith(p[0]))
            name = checkpoint_prefix + name.removeprefix(mlx_prefix)
        out[name] = mx.array(np.ascontiguousarray(array))
    mx.save_safetensors(str(copy / "model.safetensors"), out, metadata={"format": "pt"})
    return copy


def convert(directory: Path, out: Path, pre: str, mmproj: bool) -> Path:
    args = [sys.executable, "-c", CONVERTER_CHILD, str(PEER), pre, str(directory), "--outfile", str(out),
            "--outtype", "f32", *(["--mmproj"] if mmproj else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.is_file():
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"the converter{' (--mmproj)' if mmproj else ''} failed: {tail}")
    return out


LEGACY_CHILD = """
import runpy, sys
import torch, transformers
peer = sys.argv[1]
sys.path.insert(0, peer + "/gguf-py")
# The legacy script was written for transformers 4, whose CLIPVisionModel held the tower as .vision_model;
# transformers 5's is the tower itself. Loaded, it is put under that attribute, which gives the names it expects.
class Holder(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.vision_model = inner
load = transformers.CLIPVisionModel.from_pretrained
transformers.CLIPVisionModel.from_pretrained = staticmethod(lambda path, *a, **k: Holder(load(path, *a, **k)))
sys.argv = ["convert_image_encoder_to_gguf.py", *sys.argv[2:]]
runpy.run_path(peer + "/tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py", run_name="__main__")
"""


def convert_llava_legacy(checkpoint: Path, work: Path) -> Path:
    """LLaVA 1.5's projector as llama.cpp's docs (``docs/multimodal/llava.md``) make it: the
    checkpoint split into a CLIP vision model (``vit/``: its config, with the checkpoint's
    ``vision_feature_layer``, and the tower's tensors) and the projector's tensors
    (``llava.projector``, a PyTorch file), then ``convert_image_encoder_to_gguf.py
    --clip-model-is-vision --llava-projector ... --use-f32`` (the legacy script)."""
    import mlx.core as mx
    import torch

    config = json.loads((checkpoint / "config.json").read_text())
    vit = work / "llava-vit"
    shutil.rmtree(vit, ignore_errors=True)
    vit.mkdir(parents=True)
    vision = dict(config["vision_config"], model_type="clip_vision_model", hidden_act="quick_gelu",
                  vision_feature_layer=config["vision_feature_layer"], architectures=["CLIPVisionModel"])
    (vit / "config.json").write_text(json.dumps(vision))
    tensors = {name: np.array(value) for name, value in mx.load(str(checkpoint / "model.safetensors")).items()}
    tower = {name.removeprefix("vision_tower.vision_model."): torch.from_numpy(value) for name, value in tensors.items()
             if name.startswith("vision_tower.")}
    from safetensors.torch import save_file

    save_file(tower, str(vit / "model.safetensors"), metadata={"format": "pt"})
    torch.save({name: torch.from_numpy(value) for name, value in tensors.items()
                if name.startswith("multi_modal_projector.")}, str(vit / "llava.projector"))
    out = work / "llava-mmproj"
    args = [sys.executable, "-c", LEGACY_CHILD, str(PEER), "-m", str(vit), "--llava-projector", str(vit / "llava.projector"),
            "--output-dir", str(out), "--clip-model-is-vision", "--use-f32"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    made = out / "mmproj-model-f32.gguf"
    if done.returncode != 0 or not made.is_file():
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"the legacy LLaVA converter failed: {tail}")
    return made


# llama.cpp b11312's LLaVA graph (tools/mtmd/models/llava.cpp) concatenates CLIP's class embedding after
# the patches while its inputs still assume it first (llama.cpp issue 25814, PR 25844 not merged): each
# patch takes its neighbour's position embedding, the first patch's row is dropped and the class token's
# row is fed as an image token. This server computes CLIP as transformers does; to compare everything
# else with mtmd, the check's own server for the llava row runs with that order reproduced in
# mlx-vlm's CLIP embeddings (class last, positions in order; the family then drops the first row).
MTMD_CLS_LAST = """
import runpy, sys
import mlx.core as mx
from mlx_vlm.models.llava import vision

def embeddings_cls_last(self, x):
    patches = self.patch_embedding(x)
    patches = mx.flatten(patches, start_axis=1, end_axis=2)
    cls = mx.broadcast_to(self.class_embedding, (patches.shape[0], 1, patches.shape[-1]))
    joined = mx.concatenate((patches, cls), axis=1)
    return joined + self.position_embedding(mx.arange(joined.shape[1])[None])

vision.VisionEmbeddings.__call__ = embeddings_cls_last
sys.argv = ["mlxcel_compat", *sys.argv[1:]]
runpy.run_module("mlxcel_compat", run_name="__main__", alter_sys=True)
"""


def add_swa_pattern(path: Path, config: dict) -> None:
    """The tiny Gemma 3's per-layer sliding flags as ``gemma3.attention.sliding_window_pattern``
    (llama.cpp reads it; the converter writes none, leaving llama.cpp's every-6th-layer-global,
    which a 2-layer model has no global layer of, and mlx-lm's Gemma 3 cannot build)."""
    import gguf

    text = config["text_config"]
    period = int(text["sliding_window_pattern"])
    flags = [(i + 1) % period != 0 for i in range(int(text["num_hidden_layers"]))]
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path) + ".tmp", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    writer.add_sliding_window_pattern(flags)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".tmp", path)


def class_position_last(path: Path) -> Path:
    """A copy of an InternVL projector whose position table has the class token's row last.
    llama.cpp's InternVL graph appends the class token after the patches but adds the table in the
    checkpoint's order (the class token's row first), so each patch takes its predecessor's
    position; with the row moved, llama-server computes what the checkpoint (and mlx-vlm, and this
    server, on the converter's own file) computes, and the rest of the pair is compared."""
    import gguf

    out = path.with_name(path.name.replace("mmproj-", "mmproj-class-last-"))
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "v.position_embd.weight":  # (1, 1 + patches, width): the class token's row first
            data = np.concatenate([data[:, 1:], data[:, :1]], axis=1)
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def compare_projectors(theirs: Path, ours: Path) -> list[str]:
    """Where the factory's projector differs from the converter's (empty: none)."""
    import gguf

    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    problems = []
    if set(ta) != set(tb):
        problems.append(f"tensors only the converter writes: {sorted(set(ta) - set(tb))[:4]}; "
                        f"only ours: {sorted(set(tb) - set(ta))[:4]}")
    for name in sorted(set(ta) & set(tb)):
        x, y = np.array(ta[name].data, dtype=np.float32), np.array(tb[name].data, dtype=np.float32)
        if x.shape != y.shape or not np.array_equal(x, y):
            problems.append(f"{name} differs")
    ka = {k: f.contents() for k, f in a.fields.items() if k.startswith("clip.")}
    kb = {k: f.contents() for k, f in b.fields.items() if k.startswith("clip.")}
    # The factory writes the tiny Qwen2.5-VL's 56-pixel window, which the converter does not
    # (testing/vision_gguf.py; clip.cpp takes 112 for Qwen2.5-VL whatever the file says).
    only = (set(ka) ^ set(kb)) - {"clip.vision.window_size"}
    if only:
        problems.append(f"clip keys in one file only: {sorted(only)}")
    problems += [f"{k}: {ka[k]} vs ours {kb[k]}" for k in sorted(set(ka) & set(kb)) if not same_value(ka[k], kb[k])]
    return problems


def same_value(a: object, b: object) -> bool:
    """Equal metadata values (floats to float32 rounding: the files store them as float32)."""
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=1e-6, atol=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(proc.stderr.read() if proc.stderr else '')[-400:]}")
            time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def complete(base: str, prompt: str, image: bytes, n_predict: int) -> list[dict]:
    body = {"prompt": {"prompt_string": prompt, "multimodal_data": [base64.b64encode(image).decode()]},
            "n_predict": n_predict, "temperature": 0, "n_probs": 2, "samplers": ["top_k"], "top_k": 1,
            "cache_prompt": False}
    request = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["completion_probabilities"]


def serve(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc)
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def rss_mib(pid: int) -> float:
    """A process's resident memory (``VmRSS``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def image_for(family: str) -> bytes:
    from PIL import Image

    # SmolVLM: the processor's longest edge, so neither side resizes it before cutting its 2x2 tiles (the
    # whole image, shrunk to one tile, is each side's own Lanczos).
    size = {"gemma3": (56, 56), "qwen2_5_vl": (112, 112), "qwen2_vl": (112, 112), "smolvlm": (112, 112),
            "qwen3_vl": (128, 128), "internvl_chat": (112, 56), "llava": (56, 56), "mistral3": (112, 84),
            "lfm2_vl": (256, 256)}[family]  # LFM2-VL: mtmd's 64-token minimum at 32 pixels a token, one view
    pixels = np.random.default_rng(7).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def check(family: str, work: Path, margin: float, tolerance: float, n_predict: int) -> tuple[bool, str]:
    from mlxcel_compat.testing import vision

    directory = vision.ensure_vision_model(work / "models", family)
    copy = checkpoint_copy(family, directory, work)
    text = convert(copy, work / f"{family}-text-F32.gguf", PRE[family], mmproj=False)
    if family == "llava":  # the converter writes no CLIP LLaVA projector: llama.cpp's legacy tools do
        mmproj = convert_llava_legacy(copy, work)
    else:
        mmproj = convert(copy, work / f"mmproj-{family}-F32.gguf", PRE[family], mmproj=True)
    if family == "gemma3":
        add_swa_pattern(text, json.loads((directory / "config.json").read_text()))
    _, ours = vision.ensure_vision_gguf(work / "models", family)
    layout = compare_projectors(mmproj, ours)
    image = image_for(family)
    before, after = WRAP[family]
    marker = "<__media__>"
    peer_mmproj = class_position_last(mmproj) if family == "internvl_chat" else mmproj
    peer, peer_base = serve([str(PEER / "build/bin/llama-server"), "-m", str(text), "--mmproj", str(peer_mmproj), "-c", "1024",
                             "-np", "1", "--no-warmup", "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
                            env={**os.environ, "LLAMA_MEDIA_MARKER": marker})
    try:
        theirs = complete(peer_base, f"Picture:{before}{marker}{after}Caption:", image, n_predict)
        peer_rss = rss_mib(peer.pid)
    finally:
        stop(peer)
    ours_cmd = [sys.executable, "-c", MTMD_CLS_LAST] if family == "llava" else [sys.executable, "-m", "mlxcel_compat"]
    mine, my_base = serve([*ours_cmd, "-m", str(text), "--mmproj", str(mmproj), "-c", "1024", "-np", "1"])
    try:
        marker_ours = json.loads(urllib.request.urlopen(my_base + "/props").read())["media_marker"]
        ours_steps = complete(my_base, f"Picture:{marker_ours}Caption:", image, n_predict)
        my_rss = rss_mib(mine.pid)
    finally:
        stop(mine)
    worst, agree, compared, problems = 0.0, 0, 0, list(layout)
    for step, (a, b) in enumerate(zip(theirs, held_back_dropped(theirs, ours_steps))):
        top_a, top_b = a.get("top_logprobs") or [], b.get("top_logprobs") or []
        if len(top_a) < 2 or len(top_b) < 2:
            continue
        compared += 1
        gap = top_b[0]["logprob"] - top_b[1]["logprob"]
        if a["id"] == b["id"]:
            agree += 1
        elif gap > margin:
            problems.append(f"step {step}: llama-server {a['id']} vs ours {b['id']} (gap {gap:.3f})")
            break
        if a["id"] != b["id"]:
            break  # the paths part: later steps condition on other tokens
        worst = max(worst, abs(a["logprob"] - b["logprob"]))
    if worst > tolerance:
        problems.append(f"top log-probability differs by {worst:.4f} > {tolerance}")
    summary = (f"| {family} | {'same tensors and keys' if not layout else '; '.join(layout)[:120]} | "
               f"{agree}/{compared} greedy tokens agree | {worst:.4f} | {my_rss:.0f} / {peer_rss:.0f} MiB | "
               f"{'pass' if not problems else 'FAIL: ' + '; '.join(problems)[:200]} |")
    return not problems, summary


def partial(step: dict) -> bool:
    """A step whose token's bytes are not whole UTF-8 characters."""
    try:
        bytes(step.get("bytes") or []).decode("utf-8")
        return not step.get("bytes")
    except UnicodeDecodeError:
        return True


def held_back_dropped(theirs: list[dict], ours: list[dict]) -> list[dict]:
    """Our steps without those llama-server leaves out: it sends no probabilities for a token that
    ends inside a UTF-8 character (a byte of one), where this server sends every token's. Such a
    step is dropped where ours runs one ahead of llama-server's and then agrees again."""
    out, j = [], 0
    for a in theirs:
        if j + 1 < len(ours) and ours[j]["id"] != a["id"] and ours[j + 1]["id"] == a["id"] and partial(ours[j]):
            j += 1
        if j < len(ours):
            out.append(ours[j])
            j += 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="gemma3")
    parser.add_argument("--margin", type=float, default=0.1, help="top-2 log-probability gap past which tokens must agree")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest top log-probability difference")
    parser.add_argument("--n-predict", type=int, default=8)
    parser.add_argument("--work", default="", help="keep the files here (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="check-mmproj-"))
    work.mkdir(parents=True, exist_ok=True)
    print("| family | the converter's projector against the factory's | greedy path | largest top log-prob difference "
          "| RSS, ours / llama-server's | verdict |")
    print("|---|---|---|---|---|---|")
    ok = True
    for family in args.families.split(","):
        try:
            passed, row = check(family, work, args.margin, args.tolerance, args.n_predict)
        except Exception as exc:  # one family's failure is its row, not the end of the check
            passed, row = False, f"| {family} | | | | | FAIL: {str(exc)[:300]} |"
        ok &= passed
        print(row, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
