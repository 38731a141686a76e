"""A factory vision-language directory written as llama.cpp's GGUF pair: the text model and its
projector (``mmproj-*.gguf``), as ``convert_hf_to_gguf.py`` writes them (plain, then ``--mmproj``).

The weights are the directory's (``testing/vision.py``: mlx-vlm's names and layouts); the
converter's conventions are applied here, independently of the loader that undoes them
(``vision/gguf_projector.py``), so a test of one against the other means something:

- **text model**: the language model's tensors under the text architecture's names
  (``gguf_tensors.converted_tensors``: Gemma's norms stored as ``1 + w``); Qwen2.5-VL's text is
  the ``qwen2vl`` architecture with its M-RoPE sections as ``rope.dimension_sections``; the
  tokenizer and chat template are the directory's (``gguf_metadata.add_tokenizer``).
- **projector** (``general.type = mmproj``, architecture ``clip``): the vision tower and projector
  under gguf-py's ``MMPROJ`` names (``TensorNameMap``) in the checkpoint's (PyTorch) layouts:
  convolutions ``(out, in, kh, kw)``; the hyperparameters as ``clip.vision.*`` keys. Per type, what
  the converter does: Gemma 3 (``Gemma3VisionModel``) stores the projector's soft-embedding norm
  as ``1 + w`` and writes ``projector.scale_factor`` when it is not 4; Qwen2.5-VL
  (``Qwen2VLVisionModel``) splits the fused ``qkv`` into ``attn_q/k/v`` and the 3-D patch
  convolution into two 2-D ones (``v.patch_embd.weight`` and ``.weight.1``), and writes
  ``n_wa_pattern`` from ``fullatt_block_indexes``; Qwen2-VL the same splits, its ``embed_dim`` as
  the width and its ``hidden_size`` (the merger's output) as ``feed_forward_length``; SmolVLM
  (``SmolVLMModel``, type ``idefics3``) its checkpoint's ``model.vision_model.*`` and
  ``model.connector.*`` as they are, ``projector.scale_factor`` and the processor's longest edge as
  ``preproc_image_size``, its embeddings F32 in every file; its text is ``llama`` (the
  checkpoint's ``model.text_model.*``); Qwen3-VL (``Qwen3VLVisionModel``, type ``qwen3vl_merger``) keeps
  ``qkv`` fused, splits the patch convolution as Qwen2.5-VL's, names its mergers by hand
  (``v.post_ln``, ``mm.0``/``mm.2``, ``v.deepstack.N.*`` under the tower block's index) and flags
  those blocks in ``is_deepstack_layers``; its text is ``qwen3vl`` (sections, ``n_deepstack_layers``);
  InternVL (``InternVisionModel``, type ``internvl``) its tower as ``vision_tower.vision_model.*`` with
  ``qkv`` split into ``self_attn.{q,k,v}_proj``, ``.weight`` added to the layer scales and the position
  table (not to the class embedding: ``v.class_embd``), the pixel shuffle's factor and the tiles'
  bounds as keys; its text is ``qwen2`` (``llm_config``); LLaVA 1.5 (type ``mlp``) as llama.cpp's legacy
  tools write it (``testing/vision_gguf_llava.py``), its text ``llama``; LFM2-VL (``LFM2VLModel``, type
  ``lfm2``: ``testing/vision_gguf_lfm2.py``), its text ``lfm2``.
- One key the converter does not write: ``clip.vision.window_size`` for a Qwen2.5-VL whose
  window is not llama.cpp's fixed 112 pixels (the tiny model's is 56), so that this file computes
  what the directory computes (llama.cpp reads the key for other projectors; for Qwen2.5-VL it
  uses 112 whatever the file says).

File names follow the converter's: ``<Name>-<TYPE>.gguf`` and ``mmproj-<Name>-<TYPE>.gguf``,
side by side. Matrices of the text model take the requested type (``gguf_tensors.encode_tensor``);
the projector is F32, F16 or Q8_0 (``--outtype`` of the converter's ``--mmproj`` run), with the
converter's ``tensor_force_quant`` exceptions: Gemma 3's input projection is always F16, its
embeddings and any position embedding F32, a patch embedding F16 only in an F16 file, vectors F32.

Command line: ``python -m mlxcel_compat.testing.vision --format gguf --family gemma3 --out DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_metadata import add_hparams, add_tokenizer
from .gguf_tensors import converted_tensors, encode_tensor, file_type
from .mmproj_writer import clip_writer, tower_keys, write_tensors

# family -> (the text factory family whose conventions the text model takes, GGUF architecture,
# pre-tokenizer name, llama.cpp's projector type)
GGUF_VISION: dict[str, tuple[str, str, str, str]] = {
    "gemma3": ("gemma3_text", "gemma3", "gpt-2", "gemma3"),
    "qwen2_5_vl": ("qwen2", "qwen2vl", "qwen2", "qwen2.5vl"),
    "qwen2_vl": ("qwen2", "qwen2vl", "qwen2", "qwen2vl_merger"),
    "smolvlm": ("llama", "llama", "gpt-2", "idefics3"),
    "qwen3_vl": ("qwen3", "qwen3vl", "qwen2", "qwen3vl_merger"),
    "internvl_chat": ("qwen2", "qwen2", "qwen2", "internvl"),
    "llava": ("llama", "llama", "gpt-2", "mlp"),  # LLaVA 1.5: the legacy tools' projector (vision_gguf_llava.py)
    "mistral3": ("mistral", "mistral3", "gpt-2", "pixtral"),  # Mistral Small 3.1: vision_gguf_pixtral.py
    "lfm2_vl": ("lfm2", "lfm2", "qwen2", "lfm2"),  # LFM2VLModel's projector (vision_gguf_lfm2.py)
}
GGUF_VISION_FAMILIES: tuple[str, ...] = tuple(GGUF_VISION)
MMPROJ_TYPES = ("f32", "f16", "q8_0")
PAIR_VERSION = 1  # bumped when the pair's bytes change: cached pairs are rebuilt
LLAMA_CPP_QWEN_WINDOW = 112  # the window clip.cpp takes for Qwen2.5-VL


def gguf_names(family: str, size: str, gguf_type: str, mmproj_type: str = "f32") -> tuple[str, str]:
    """The converter's file names of the pair: ``(text, mmproj)``."""
    import gguf

    name = gguf.naming_convention(f"mlxcel-{family.replace('_', '-')}-{size}", None, None, None, None, gguf_type.upper())
    projector = gguf.naming_convention(f"mlxcel-{family.replace('_', '-')}-{size}", None, None, None, None,
                                       mmproj_type.upper())
    return f"{name}.gguf", f"mmproj-{projector}.gguf"


def _text_config(family: str, config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config as the text family's writer reads it."""
    if family == "gemma3":
        text = dict(config["text_config"])
        n, period = text["num_hidden_layers"], text["sliding_window_pattern"]
        return dict(text, rope_theta=text["rope_global_base_freq"],
                    layer_types=["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)])
    if family in ("llava", "mistral3"):
        return dict(config["text_config"])
    if family in ("smolvlm", "qwen3_vl", "lfm2_vl"):  # Qwen3-VL's M-RoPE: its sections, written apart
        return {k: v for k, v in config["text_config"].items() if k != "rope_scaling"}
    if family == "internvl_chat":  # InternVL's own name for its text config
        return dict(config["llm_config"])
    return {k: v for k, v in config.items() if k != "rope_scaling"}  # M-RoPE: its sections, written apart


def write_text_gguf(family: str, directory: Path, weights: dict[str, Any], out: Path, gguf_type: str) -> Path:
    """The language model of ``directory`` (a factory vision directory) as the text GGUF."""
    import gguf

    text_family, arch, pre, _ = GGUF_VISION[family]
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    text_config = _text_config(family, config)
    text_weights = {name.removeprefix("language_model."): value for name, value in weights.items()
                    if name.startswith("language_model.")}
    if family == "smolvlm":  # mlx-vlm's Idefics3 language model names its layers without "model."
        text_weights = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in text_weights.items()}
    if family == "gemma3":
        # Gemma 3 ties its head to the embeddings (its checkpoints hold no lm_head, so the converter
        # writes no output.weight); mlx-vlm ties it whatever a directory holds, so the factory's
        # directory has an unused lm_head, which the pair leaves out.
        text_weights.pop("lm_head.weight", None)
    writer = gguf.GGUFWriter(None, arch)
    writer.add_name(out.stem)
    writer.add_file_type(file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hparams(writer, text_family, text_config, text_weights)
    if family in ("qwen2_5_vl", "qwen2_vl"):  # the TextModel base writes the M-RoPE sections, padded to four
        writer.add_rope_dimension_sections([*config["rope_scaling"]["mrope_section"], 0, 0, 0][:4])
    if family == "qwen3_vl":  # the converter's Qwen3VLTextModel: the sections, and how many deepstack mergers
        writer.add_rope_dimension_sections([*config["text_config"]["rope_scaling"]["mrope_section"], 0, 0, 0][:4])
        writer.add_num_deepstack_layers(len(config["vision_config"].get("deepstack_visual_indexes", [])))
    add_tokenizer(writer, directory, pre)
    for name, data in converted_tensors(text_family, text_config, text_weights).items():
        stored, raw_type = encode_tensor(name, data, gguf_type, text_config["num_hidden_layers"])
        writer.add_tensor(name, stored, raw_dtype=raw_type)
    _write(writer, out)
    return out


def _checkpoint_tensors(family: str, weights: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """The vision tower's and projector's tensors under the Hugging Face checkpoint's names and
    layouts (PyTorch's ``(out, in, ...)`` convolutions), as the converter reads them."""
    out = []
    for name, value in sorted(weights.items()):
        if name.startswith("language_model."):
            continue
        if family in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
            name = "visual." + name.removeprefix("vision_tower.")
            if name.endswith("patch_embed.proj.weight"):  # mlx (O, T, H, W, I) -> torch (O, I, T, H, W)
                value = value.transpose(0, 4, 1, 2, 3)
        elif name.endswith("patch_embedding.weight"):  # mlx (O, H, W, I) -> torch (O, I, H, W)
            value = value.transpose(0, 3, 1, 2)
        if family == "internvl_chat" and name.startswith("vision_model."):  # as the converter renames them
            name = "vision_tower." + name
            if name.endswith((".ls1", ".ls2", ".position_embedding")):  # v.class_embd: no .weight
                name += ".weight"
        if family == "smolvlm":  # SmolVLM's checkpoint: model.vision_model.*, model.connector.*
            name = "model." + name
        out.append((name, value))
    return out


def _qwen3vl_merger_name(name: str, deepstack: list[int]) -> str | None:
    """Qwen3-VL's mergers as the converter's ``Qwen3VLVisionModel`` names them by hand: the
    merger's norm ``v.post_ln``, its layers ``mm.0`` and ``mm.2``; each deepstack merger under its
    tower block's index (``v.deepstack.N.{norm,fc1,fc2}``); ``None`` for other tensors."""
    parts = name.split(".")
    if parts[1] == "merger":
        return {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[parts[2]] + "." + parts[3]
    if parts[1] == "deepstack_merger_list":
        layer = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}[parts[3]]
        return f"v.deepstack.{deepstack[int(parts[2])]}.{layer}.{parts[4]}"
    return None


def _converted_projector(family: str, weights: dict[str, np.ndarray], n_blocks: int,
                         deepstack: list[int] | None = None) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as the family's ``MmprojModel`` class writes them."""
    deepstack = deepstack or []
    import gguf

    # gguf-py maps the projector's layers (``mm.N``) through its block-indexed rows: a map of fewer
    # than 3 blocks lacks Qwen's ``mm.2`` (the converter, with the 2-block tower's depth, would stop).
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(n_blocks, 3))
    out: dict[str, np.ndarray] = {}
    for name, value in _checkpoint_tensors(family, weights):
        if family == "qwen3_vl" and (renamed := _qwen3vl_merger_name(name, deepstack)):
            out[renamed] = np.ascontiguousarray(value, dtype=np.float32)
            continue
        parts = [(name, value)]
        if family == "gemma3":
            name = name.replace("_weight", ".weight")  # mm_input_projection_weight
            if "soft_emb_norm.weight" in name:
                value = value + np.float32(1.0)
            parts = [(name, value)]
        elif ".qkv." in name and family == "internvl_chat":  # InternVisionModel: three projections
            third = value.shape[0] // 3
            parts = [(name.replace("attn.qkv", f"self_attn.{q}_proj"), value[i * third:(i + 1) * third])
                     for i, q in enumerate("qkv")]
        elif ".qkv." in name and family != "qwen3_vl":  # Qwen3-VL's converter keeps it fused
            third = value.shape[0] // 3
            parts = [(name.replace("qkv", q), value[i * third:(i + 1) * third]) for i, q in enumerate("qkv")]
        elif name.endswith("patch_embed.proj.weight"):
            out["v.patch_embd.weight"] = np.ascontiguousarray(value[:, :, 0])
            out["v.patch_embd.weight.1"] = np.ascontiguousarray(value[:, :, 1])
            continue
        for hf_name, data in parts:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"no GGUF projector name for {hf_name}")
            out[gguf_name] = np.ascontiguousarray(data, dtype=np.float32)
    return out


def write_mmproj_gguf(family: str, directory: Path, weights: dict[str, Any], out: Path, mmproj_type: str = "f32") -> Path:
    """The vision tower and projector of ``directory`` as llama.cpp's clip GGUF."""
    import gguf

    if mmproj_type not in MMPROJ_TYPES:
        raise ValueError(f"projector type {mmproj_type!r}: one of {', '.join(MMPROJ_TYPES)}")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    processor = json.loads((directory / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision = config["vision_config"]
    text = config.get("text_config") or config.get("llm_config") or config
    writer = clip_writer(out, mmproj_type, int(text["hidden_size"]), int(vision["patch_size"]), processor)
    if family == "gemma3":
        n_blocks = tower_keys(writer, vision)
        writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        writer.add_vision_attention_layernorm_eps(float(vision.get("layer_norm_eps", 1e-6)))
        writer.add_vision_use_gelu(True)
        per_side = int(int(processor.get("image_seq_length", 256)) ** 0.5)
        scale = (int(vision["image_size"]) // int(vision["patch_size"])) // per_side
        if scale > 0 and scale != 4:
            writer.add_vision_projector_scale_factor(scale)
    elif family == "smolvlm":  # the converter's SmolVLMModel
        n_blocks = tower_keys(writer, vision)
        writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
        writer.add_vision_attention_layernorm_eps(float(vision.get("layer_norm_eps", 1e-5)))
        writer.add_vision_projector_scale_factor(int(config.get("scale_factor", 2)))
        writer.add_vision_use_gelu(True)
        writer.add_vision_preproc_image_size(int(processor["size"]["longest_edge"]))
    elif family == "qwen3_vl":  # the converter's Qwen3VLVisionModel: image_size from the position table
        n_blocks = int(vision["depth"])
        writer.add_vision_image_size(int(int(vision["num_position_embeddings"]) ** 0.5 * int(vision["patch_size"])))
        writer.add_vision_embedding_length(int(vision["hidden_size"]))
        writer.add_vision_feed_forward_length(int(vision["intermediate_size"]))
        writer.add_vision_block_count(n_blocks)
        writer.add_vision_head_count(int(vision["num_heads"]))
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
        writer.add_vision_use_gelu(True)
        writer.add_vision_spatial_merge_size(int(vision["spatial_merge_size"]))
        writer.add_vision_attention_layernorm_eps(float(text.get("rms_norm_eps", 1e-6)))
        deepstack = list(vision.get("deepstack_visual_indexes", []))
        writer.add_vision_is_deepstack_layers([i in deepstack for i in range(n_blocks)])
    elif family == "internvl_chat":  # the converter's InternVisionModel
        n_blocks = tower_keys(writer, vision)
        writer.add_clip_projector_type(gguf.VisionProjectorType.INTERNVL)
        writer.add_vision_attention_layernorm_eps(float(vision["layer_norm_eps"]))
        writer.add_vision_use_gelu(True)
        writer.add_vision_projector_scale_factor(int(1.0 / float(config["downsample_ratio"])))
        writer.add_vision_preproc_min_tiles(int(config["min_dynamic_patch"]))
        writer.add_vision_preproc_max_tiles(int(config["max_dynamic_patch"]))
    elif family == "qwen2_vl":  # the converter's renames: embed_dim is the width, hidden_size the "FFN"
        n_blocks = int(vision["depth"])
        writer.add_vision_image_size(int(vision.get("image_size", 560)))
        writer.add_vision_embedding_length(int(vision["embed_dim"]))
        writer.add_vision_feed_forward_length(int(vision["hidden_size"]))
        writer.add_vision_block_count(n_blocks)
        writer.add_vision_head_count(int(vision["num_heads"]))
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
        writer.add_vision_attention_layernorm_eps(float(config.get("rms_norm_eps", 1e-6)))
    else:  # Qwen2.5-VL: depth / num_heads renamed as the converter does; image_size defaults to 560
        n_blocks = int(vision["depth"])
        writer.add_vision_image_size(int(vision.get("image_size", 560)))
        writer.add_vision_embedding_length(int(vision["hidden_size"]))
        writer.add_vision_feed_forward_length(int(vision["intermediate_size"]))
        writer.add_vision_block_count(n_blocks)
        writer.add_vision_head_count(int(vision["num_heads"]))
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        writer.add_vision_use_silu(True)
        full = list(vision["fullatt_block_indexes"])
        writer.add_vision_n_wa_pattern(full[0] + 1)
        writer.add_vision_attention_layernorm_eps(float(config.get("rms_norm_eps", 1e-6)))
        if int(vision.get("window_size", LLAMA_CPP_QWEN_WINDOW)) != LLAMA_CPP_QWEN_WINDOW:
            writer.add_uint32("clip.vision.window_size", int(vision["window_size"]))
    arrays = {name: np.array(value, dtype=np.float32) for name, value in weights.items()}
    tensors = _converted_projector(family, arrays, n_blocks, vision.get("deepstack_visual_indexes"))
    return write_tensors(writer, out, tensors, lambda name, data: _stored_type(family, name, data, mmproj_type))


def _stored_type(family: str, name: str, data: np.ndarray, mmproj_type: str) -> str:
    """How the converter stores this projector tensor (its ``tensor_force_quant``): Gemma 3's
    input projection F16 always (llama.cpp issue 13025), its embeddings and any position embedding
    F32, a patch embedding F16 in an F16 file and F32 otherwise, vectors F32; other matrices in the
    file's type (Q8_0 where rows are whole 32-value blocks, else F16)."""
    if family == "gemma3" and "input_projection" in name:
        return "f16"
    if (family in ("gemma3", "smolvlm") and name.startswith(("v.patch_embd", "v.position_embd"))) or ".position_embd." in name:
        return "f32"
    if data.ndim < 2 or mmproj_type == "f32":
        return "f32"
    if "patch_embd" in name:
        return "f16" if mmproj_type == "f16" else "f32"
    if mmproj_type == "q8_0" and data.shape[-1] % 32 == 0:
        return "q8_0"
    return "f16"


def _write(writer: Any, out: Path) -> None:
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_vision_gguf_pair(family: str, directory: Path, out_dir: Path, size: str = "tiny", gguf_type: str = "f32",
                           mmproj_type: str = "f32") -> tuple[Path, Path]:
    """The factory vision directory ``directory`` as ``(text GGUF, mmproj GGUF)`` in ``out_dir``."""
    import mlx.core as mx

    if family not in GGUF_VISION:
        raise ValueError(f"vision family {family!r} has no GGUF form; choose one of: {', '.join(GGUF_VISION_FAMILIES)}")
    weights = {name: np.array(value) for name, value in mx.load(str(directory / "model.safetensors")).items()}
    text_name, mmproj_name = gguf_names(family, size, gguf_type, mmproj_type)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = write_text_gguf(family, directory, weights, out_dir / text_name, gguf_type)
    if family == "llava":
        from .vision_gguf_llava import write_llava_mmproj

        mmproj = write_llava_mmproj(directory, weights, out_dir / mmproj_name, mmproj_type)
    elif family == "mistral3":
        from .vision_gguf_pixtral import write_pixtral_mmproj

        mmproj = write_pixtral_mmproj(directory, weights, out_dir / mmproj_name, mmproj_type)
    elif family == "lfm2_vl":
        from .vision_gguf_lfm2 import write_lfm2vl_mmproj

        mmproj = write_lfm2vl_mmproj(directory, weights, out_dir / mmproj_name, mmproj_type)
    else:
        mmproj = write_mmproj_gguf(family, directory, weights, out_dir / mmproj_name, mmproj_type)
    return text, mmproj
