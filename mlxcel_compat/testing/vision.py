"""Tiny random-weight vision-language directories for tests (Qwen2.5-VL, Qwen2-VL, Gemma 3,
LLaVA, SmolVLM): a real vision tower, a real image processor; and Gemma 3n (``--family gemma3n``): a real
audio tower, a real audio feature extractor.

Each model is mlx-vlm's own classes for its ``model_type`` at tiny sizes (2-block vision towers of
width 32 feeding 2-layer text models of width 64), so the server runs the same vision tower,
projector, merged embeddings and positions (Qwen's multimodal RoPE, plain RoPE for the others)
that a real checkpoint of the family runs, in milliseconds.

- Weights: a fixed NumPy seed, stored under mlx-vlm's parameter names and layouts (so loading
  needs no conversion), initialized like the text factory's (``weights.init_tensor``).
- Tokenizer: the factory's shared 8k vocabulary (``testing/tokenizer.py``) with the family's vision
  tokens added after it as special tokens (``FAMILY_TOKENS``: Qwen2-VL's ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``; Gemma 3's ``<start_of_image>``,
  ``<end_of_image>``, ``<image_soft_token>``; LLaVA's ``<image>``).
- Chat template: the factory's ChatML, whose content parts also render an image part
  (``image`` or ``image_url``) as the family's template does (``TEMPLATE_IMAGE``); the server
  expands it into the image's tokens.
- Image processor: the family's Hugging Face ``preprocessor_config.json``, written offline. Qwen:
  14-pixel patches, 2x2 merge, temporal patch 2, CLIP mean/std, and a small ``max_pixels``
  (28*28*16: at most 16 image tokens an image). Gemma 3: 56-pixel images (SigLIP, 4x4 patches
  pooled to 4 tokens), a sliding window of 24 tokens on its local layers (shorter than the tests'
  prompts). LLaVA: 56-pixel center crops (CLIP, 16 tokens, a Llama text model). SmolVLM: images
  resized to 112 pixels on the longest edge and cut into 56-pixel tiles (at most 2x2) plus the
  whole image, 4 tokens a tile (SigLIP-like tower, pixel shuffle by 2), a Llama text model; its
  vocabulary holds ``\n\n`` as one token, as SmolLM2's does (llama.cpp's mtmd looks it up as one).
- Gemma 3n: a 4-layer text model (sliding and full attention, the last 2 layers sharing KV, AltUp,
  per-layer inputs) with a 2-block conformer audio tower of width 32 over 16 mel bins; 8 tokens a
  clip (1.28 s at 16 kHz). Its vision tower is not written (see ``_gemma3n_config``).

Size ``small`` (Qwen2.5-VL only; ``SMALL``): an 8-block tower of width 384 feeding an 8-layer text
model of width 512 (~45M parameters), and the real processor's image sizes (a 448x448 image
becomes 256 image tokens): for benchmarks whose ratios need a first turn that costs what a real
one's vision tower and image prefill cost (``scripts/bench_vision_ttft.py``), not for tests.

- Qwen3-VL (``--family qwen3_vl``): 16-pixel patches merged 2x2, a 4x4 table of learned position
  embeddings (interpolated to each image's grid), deepstack mergers on 2 of its 3 tower blocks, a
  3-layer Qwen3 text model with interleaved M-RoPE (``testing/vision_configs.py``); at most 16 tokens an image.
- InternVL (``--family internvl_chat``): InternVL's own layout (``llm_config``), a 4-block InternViT over
  56-pixel tiles (1 to 4 and a thumbnail, as GotOcr2ImageProcessor cuts them), 4 tokens a tile, Qwen2 text.
- Mistral 3 (``--family mistral3``): Mistral Small 3.1's layout, a 2-block Pixtral tower (2-D RoPE) over
  14-pixel patches, the 2x2 patch merger, a Mistral text model; PixtralImageProcessor to whole 28-pixel
  merged patches within a 112-pixel longest edge (at most 16 ``[IMG]`` tokens, a ``[IMG_BREAK]`` a row).
- LFM2-VL (``--family lfm2_vl``): LFM2-VL-450M's layout, a 2-block SigLIP2 NaFlex tower over 16-pixel patches
  (2 to 8 tokens a view; 64-pixel tiles, 2 to 4 of them and a thumbnail, for images over 128x128), a 4-layer
  LFM2 text model (convolution and attention layers alternating).

Command line: ``python -m mlxcel_compat.testing.vision --out DIR [--family qwen2_vl|qwen3_vl|internvl_chat|gemma3|llava|smolvlm|mistral3|gemma3n|lfm2_vl] [--size small]``;
with ``--format gguf`` (Gemma 3, Qwen2.5-VL, Qwen2-VL, SmolVLM, Qwen3-VL, InternVL, LLaVA, Mistral 3, LFM2-VL) the directory's GGUF pair instead, the text
model and its ``mmproj-*.gguf`` projector as llama.cpp's converter writes them (``testing/vision_gguf.py``; LLaVA's projector as
its legacy tools write it, ``testing/vision_gguf_llava.py``; Mistral 3's ``pixtral`` projector ``testing/vision_gguf_pixtral.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from . import chatml
from . import tokenizer as tok
from .families import EOS_IDS
from .vision_configs import (LFM2VL_TOKENS, internvl_config, internvl_preprocessor, lfm2_vl_config, lfm2_vl_preprocessor,
                             mistral3_config, mistral3_preprocessor, qwen3_vl_config, qwen3_vl_preprocessor)

FORMAT_VERSION = 1
WEIGHT_SEED = 20261202
MANIFEST_NAME = "mlxcel_vision.json"
# Each family's vision tokens, added after the shared vocabulary as special tokens, in this order.
FAMILY_TOKENS: dict[str, tuple[str, ...]] = {
    "qwen2_5_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen2_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen3_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "internvl_chat": ("<img>", "</img>", "<IMG_CONTEXT>"),
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
    "llava": ("<image>",),
    "mistral3": ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    # SmolVLM (Idefics3's layout): "\n\n" is one token in SmolLM2's vocabulary (llama.cpp's mtmd looks it up
    # as one), the row/column tokens of a 2x2 grid, the most the tiny processor cuts an image into.
    "smolvlm": ("<fake_token_around_image>", "<image>", "<global-img>", "\n\n", "<row_1_col_1>", "<row_1_col_2>",
                "<row_2_col_1>", "<row_2_col_2>"),
    # Gemma 3n's layout at tiny size: two text-range markers, then the vision vocabulary (its first id
    # the vision offset, <end_of_image> at it), then the audio vocabulary (<end_of_audio> at its offset).
    "gemma3n": ("<start_of_image>", "<start_of_audio>", "<end_of_image>", "<image_soft_token>", "<vision_2>",
                "<vision_3>", "<end_of_audio>", "<audio_soft_token>", "<audio_2>", "<audio_3>"),
    "lfm2_vl": LFM2VL_TOKENS,
}
ALL_FAMILIES: tuple[str, ...] = tuple(FAMILY_TOKENS)
AUDIO_FAMILIES: tuple[str, ...] = ("gemma3n",)  # served for audio (Gemma 3n's images are not)
# Served for images with a hybrid text model whose prompt cache keeps whole states (session snapshots): the
# dense-KV rules tests/engine/test_vision.py checks for FAMILIES do not apply; tests/vision/test_lfm2vl.py checks theirs.
SNAPSHOT_FAMILIES: tuple[str, ...] = ("lfm2_vl",)
FAMILIES: tuple[str, ...] = tuple(f for f in ALL_FAMILIES if f not in AUDIO_FAMILIES + SNAPSHOT_FAMILIES)  # served for images
# What each family's chat template writes for one image part (the server expands it).
TEMPLATE_IMAGE = {"qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                  "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                  "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                  "internvl_chat": "<img><IMG_CONTEXT></img>",
                  "gemma3": "<start_of_image>", "llava": "<image>", "gemma3n": "<image_soft_token>",
                  "smolvlm": "<image>", "mistral3": "[IMG]", "lfm2_vl": "<image>"}
# What the template writes for one audio part (families with an audio tower): Gemma 3n's soft token.
TEMPLATE_AUDIO = {"gemma3n": "<audio_soft_token>"}
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 28 * 28 * 4  # at least 2x2 merged tokens
MAX_PIXELS = 28 * 28 * 16  # at most 16 merged tokens an image: tests stay fast
# Gemma 3 and LLaVA: fixed-size images of 4x4 patches (SigLIP / CLIP towers at 56 pixels).
IMAGE_SIZE = 56
GEMMA_TOKENS_PER_IMAGE = 4  # the 4x4 patches average-pooled 2x2
SMOLVLM_SCALE = 2  # SmolVLM's pixel shuffle: 4x4 patches a tile become 2x2 = 4 tokens
SMOLVLM_LONGEST_EDGE = 2 * IMAGE_SIZE  # at most a 2x2 grid of tiles, plus the whole image as one more
SLIDING_WINDOW = 24  # Gemma 3's local layers: shorter than the tests' prompts, so the window matters
# CLIP's normalisation, as Qwen2-VL's and LLaVA's processor configs have it; Gemma 3's is 0.5.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
SIZES = ("tiny", "small")
# The small Qwen2.5-VL: what differs from the tiny one (text model, tower, processor).
SMALL = {
    "text": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
                 num_key_value_heads=4, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),  # head_dim 64
    "vision": dict(depth=8, num_heads=6, hidden_size=384, intermediate_size=1024, out_hidden_size=512,
                   window_size=112, fullatt_block_indexes=[3, 7]),
    "max_pixels": 448 * 448,
}
# Gemma 3n: 8 audio tokens a clip (its audio tower reduces mel frames 16x: 1.28 s of 16 kHz audio),
# 16 mel bins; the real model takes 188 tokens (30 s) of 128 bins.
AUDIO_TOKENS_PER_CLIP = 8
AUDIO_MEL_BINS = 16
AUDIO_SAMPLING_RATE = 16000


def vision_token_id(content: str, family: str = "qwen2_5_vl") -> int:
    """The id of a vision token: they follow the shared vocabulary in ``FAMILY_TOKENS`` order."""
    return tok.VOCAB_SIZE + FAMILY_TOKENS[family].index(content)


def vocab_size(family: str) -> int:
    return tok.VOCAB_SIZE + len(FAMILY_TOKENS[family])


_ARCHITECTURES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
                  "gemma3": "Gemma3ForConditionalGeneration", "llava": "LlavaForConditionalGeneration",
                  "gemma3n": "Gemma3nForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration"}


def _vision_config(family: str) -> dict[str, Any]:
    if family == "gemma3":  # SigLIP (no class token), 4x4 patches
        return dict(model_type="siglip_vision_model", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, patch_size=PATCH_SIZE, image_size=IMAGE_SIZE, num_channels=3,
                    layer_norm_eps=1e-6)
    if family == "llava":  # CLIP (a class token, dropped by the "default" feature strategy)
        return dict(model_type="clip_vision_model", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, patch_size=PATCH_SIZE, image_size=IMAGE_SIZE, num_channels=3,
                    projection_dim=32, layer_norm_eps=1e-5)
    common = dict(model_type=family, depth=2, num_heads=2, in_chans=3, in_channels=3, patch_size=PATCH_SIZE,
                  spatial_patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    if family == "qwen2_vl":  # a plain ViT (LayerNorm, GELU MLP), its width "embed_dim"; hidden_size is the output
        return dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
    # Qwen2.5-VL: windowed attention with full-attention blocks, SwiGLU MLPs
    return dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
                fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu")


def _gemma3_config() -> dict[str, Any]:
    """Gemma 3's layout: ``text_config`` and ``vision_config`` nested, the image token ids at the top."""
    text = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                rms_norm_eps=1e-6, vocab_size=vocab_size("gemma3"), rope_global_base_freq=1000000.0,
                rope_local_base_freq=10000.0, sliding_window=SLIDING_WINDOW, sliding_window_pattern=2,
                max_position_embeddings=32768, mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE)
    return dict(
        model_type="gemma3", architectures=[_ARCHITECTURES["gemma3"]], text_config=text,
        vision_config=_vision_config("gemma3"), hidden_size=64, vocab_size=vocab_size("gemma3"),
        mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE,
        boi_token_index=vision_token_id("<start_of_image>", "gemma3"),
        eoi_token_index=vision_token_id("<end_of_image>", "gemma3"),
        image_token_index=vision_token_id("<image_soft_token>", "gemma3"),
        bos_token_id=None, eos_token_id=EOS_IDS, pad_token_id=tok.token_id(tok.ENDOFTEXT), torch_dtype="float32",
    )


def _llava_config() -> dict[str, Any]:
    """LLaVA's layout: a Llama ``text_config``, a CLIP ``vision_config``, a 2-layer GELU projector."""
    text = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=vocab_size("llava"), rope_theta=10000.0,
                max_position_embeddings=32768, tie_word_embeddings=False)
    return dict(
        model_type="llava", architectures=[_ARCHITECTURES["llava"]], text_config=text,
        vision_config=_vision_config("llava"), vocab_size=vocab_size("llava"),
        image_token_index=vision_token_id("<image>", "llava"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
        bos_token_id=None, eos_token_id=EOS_IDS, pad_token_id=tok.token_id(tok.ENDOFTEXT), torch_dtype="float32",
    )


def _smolvlm_config() -> dict[str, Any]:
    """SmolVLM's layout (Idefics3's): a Llama ``text_config``, a SigLIP-like ``vision_config`` of
    56-pixel tiles (4x4 patches), the connector's pixel shuffle by ``scale_factor`` 2 (4 tokens a
    tile). LayerNorm epsilon 1e-5 everywhere (mlx-vlm's post-layernorm takes MLX's default)."""
    text = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab_size("smolvlm"), rope_theta=100000.0,
                max_position_embeddings=32768, tie_word_embeddings=False,
                architectures=["VLlama3ForCausalLM"])  # as SmolVLM's: llama.cpp's converter takes its text by it
    vision_config = dict(model_type="smolvlm_vision", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                         num_attention_heads=2, patch_size=PATCH_SIZE, image_size=IMAGE_SIZE, num_channels=3,
                         layer_norm_eps=1e-5)
    return dict(
        model_type="smolvlm", architectures=[_ARCHITECTURES["smolvlm"]], text_config=text, vision_config=vision_config,
        vocab_size=vocab_size("smolvlm"), scale_factor=SMOLVLM_SCALE, image_token_id=vision_token_id("<image>", "smolvlm"),
        bos_token_id=None, eos_token_id=EOS_IDS, pad_token_id=tok.token_id(tok.ENDOFTEXT), torch_dtype="float32",
    )


def _check(family: str, size: str) -> None:
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; choose one of: {', '.join(ALL_FAMILIES)}")
    if size not in SIZES or (size == "small" and family != "qwen2_5_vl"):
        raise ValueError(f"vision size {size!r} is not made for {family}: tiny for every family, small for qwen2_5_vl")


def _gemma3n_config() -> dict[str, Any]:
    """Gemma 3n's layout: text, vision and audio configs nested; the vision and audio vocabularies
    follow the text one (``vocab_offset``). The vision tower (MobileNetV5, its blocks fixed at
    ~300M parameters in mlx-vlm) has no weights here: mlx-vlm drops a module a checkpoint omits, and
    the server serves Gemma 3n's audio, not its images."""
    vision_offset = vision_token_id("<end_of_image>", "gemma3n")
    audio_offset = vision_token_id("<end_of_audio>", "gemma3n")
    total = vocab_size("gemma3n")
    text = dict(model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4, intermediate_size=[128] * 4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=total,
                vocab_size_per_layer_input=vision_offset, laurel_rank=8, hidden_size_per_layer_input=16,
                altup_num_inputs=4, altup_active_idx=0, altup_correct_scale=True, num_kv_shared_layers=2,
                layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=SLIDING_WINDOW,
                rope_theta=1000000.0, rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
                activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], max_position_embeddings=32768)
    vision = dict(model_type="gemma3n_vision", hidden_size=32, vocab_size=4, vocab_offset=vision_offset,
                  rms_norm_eps=1e-6)
    audio = dict(model_type="gemma3n_audio", input_feat_size=AUDIO_MEL_BINS, hidden_size=32,
                 conf_num_attention_heads=2, conf_num_hidden_layers=2, conf_attention_chunk_size=4,
                 conf_attention_context_left=5, conf_attention_context_right=0, conf_conv_kernel_size=3,
                 conf_positional_bias_size=64, conf_reduction_factor=4, sscp_conv_channel_size=[8, 4],
                 vocab_size=4, vocab_offset=audio_offset, rms_norm_eps=1e-6)
    return dict(
        model_type="gemma3n", architectures=[_ARCHITECTURES["gemma3n"]], text_config=text, vision_config=vision,
        audio_config=audio, hidden_size=64, vocab_size=total,
        vision_soft_tokens_per_image=GEMMA_TOKENS_PER_IMAGE, audio_soft_tokens_per_image=AUDIO_TOKENS_PER_CLIP,
        boi_token_id=vision_token_id("<start_of_image>", "gemma3n"), eoi_token_id=vision_offset,
        image_token_id=vision_token_id("<image_soft_token>", "gemma3n"),
        boa_token_id=vision_token_id("<start_of_audio>", "gemma3n"), eoa_token_id=audio_offset,
        audio_token_id=vision_token_id("<audio_soft_token>", "gemma3n"),
        bos_token_id=None, eos_token_id=EOS_IDS, pad_token_id=tok.token_id(tok.ENDOFTEXT), torch_dtype="float32",
    )


def model_config(family: str = "qwen2_5_vl", size: str = "tiny") -> dict[str, Any]:
    """``config.json``: Qwen2-VL's layout (text fields at the top level, ``vision_config`` nested),
    or Gemma 3's and LLaVA's (``text_config`` nested too)."""
    _check(family, size)
    if size == "small":
        tiny = model_config(family)
        return dict(tiny, **SMALL["text"], vision_config=dict(tiny["vision_config"], **SMALL["vision"]))
    if family == "gemma3":
        return _gemma3_config()
    if family == "gemma3n":
        return _gemma3n_config()
    if family == "llava":
        return _llava_config()
    if family == "smolvlm":
        return _smolvlm_config()
    if family in ("qwen3_vl", "internvl_chat", "mistral3", "lfm2_vl"):  # testing/vision_configs.py
        common = dict(bos_token_id=None, eos_token_id=EOS_IDS, pad_token_id=tok.token_id(tok.ENDOFTEXT),
                      torch_dtype="float32")
        vocab, token = vocab_size(family), lambda content: vision_token_id(content, family)
        if family == "qwen3_vl":
            return qwen3_vl_config(vocab, token, common)
        if family == "mistral3":
            return mistral3_config(vocab, token, common, PATCH_SIZE)
        if family == "lfm2_vl":
            return lfm2_vl_config(vocab, token, common)
        return internvl_config(vocab, token, common, IMAGE_SIZE, PATCH_SIZE)
    vision = _vision_config(family)
    return dict(
        model_type=family, architectures=[_ARCHITECTURES[family]],
        hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
        # head_dim 16: 8 rotary frequencies split over (time, height, width)
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        max_position_embeddings=32768, vocab_size=vocab_size(family),
        vision_start_token_id=vision_token_id("<|vision_start|>"),
        vision_end_token_id=vision_token_id("<|vision_end|>"),
        image_token_id=vision_token_id("<|image_pad|>"),
        video_token_id=vision_token_id("<|video_pad|>"),
        vision_token_id=vision_token_id("<|vision_start|>"),
        bos_token_id=None, eos_token_id=EOS_IDS, pad_token_id=tok.token_id(tok.ENDOFTEXT),
        torch_dtype="float32", vision_config=vision,
    )


def preprocessor_config(family: str = "qwen2_5_vl", size: str = "tiny") -> dict[str, Any]:
    """Hugging Face's image processor configuration (``preprocessor_config.json``) of the family
    (Gemma 3n: its audio feature extractor's, the fields of ``Gemma3nAudioFeatureExtractor``)."""
    if size == "small":
        tiny = preprocessor_config(family)
        most = SMALL["max_pixels"]
        return dict(tiny, max_pixels=most, size={"shortest_edge": MIN_PIXELS, "longest_edge": most})
    if family == "gemma3n":
        return {
            "feature_extractor_type": "Gemma3nAudioFeatureExtractor", "processor_class": "Gemma3nProcessor",
            "feature_size": AUDIO_MEL_BINS, "sampling_rate": AUDIO_SAMPLING_RATE, "padding_value": 0.0,
            "return_attention_mask": True, "frame_length_ms": 32.0, "hop_length_ms": 10.0,
            "min_frequency": 125.0, "max_frequency": 7600.0, "preemphasis": 0.97, "preemphasis_htk_flavor": True,
            "fft_overdrive": True, "dither": 0.0, "input_scale_factor": 1.0, "mel_floor": 1e-5,
            "per_bin_mean": None, "per_bin_stddev": None, "padding_side": "right",
        }
    if family == "gemma3":
        return {
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": None, "do_resize": True, "do_rescale": True, "do_normalize": True,
            "do_pan_and_scan": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
            "rescale_factor": 1 / 255, "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "image_seq_length": GEMMA_TOKENS_PER_IMAGE,
        }
    if family == "smolvlm":  # images resized to 112 on the longest edge, cut into 56-pixel tiles plus the whole
        return {
            "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
            "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
            "do_image_splitting": True, "do_pad": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "resample": 1, "rescale_factor": 1 / 255, "size": {"longest_edge": SMOLVLM_LONGEST_EDGE},
            "max_image_size": {"longest_edge": IMAGE_SIZE},
        }
    if family == "qwen3_vl":
        return qwen3_vl_preprocessor()
    if family == "internvl_chat":
        return internvl_preprocessor(IMAGE_SIZE)
    if family == "mistral3":
        return mistral3_preprocessor(PATCH_SIZE, IMAGE_MEAN, IMAGE_STD)
    if family == "lfm2_vl":
        return lfm2_vl_preprocessor()
    if family == "llava":  # llava-hf's checkpoints name CLIP's processor
        return {
            "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
            "do_convert_rgb": True, "do_resize": True, "do_center_crop": True, "do_rescale": True,
            "do_normalize": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "resample": 3,
            "rescale_factor": 1 / 255, "size": {"shortest_edge": IMAGE_SIZE},
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        }
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "rescale_factor": 1 / 255, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
        "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": 2,
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def chat_template(family: str = "qwen2_5_vl") -> str:
    """The factory's ChatML template with image parts rendered as the family's template renders
    them (``TEMPLATE_IMAGE``)."""
    base = chatml.chat_template(thinking=False)
    unsupported = "{%- else -%}\n                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}"
    if unsupported not in base:
        raise RuntimeError("the factory chat template changed: update testing/vision.py")
    image = ("{%- elif part.type == 'image' or part.type == 'image_url' -%}\n"
             f"                {{{{- '{TEMPLATE_IMAGE[family]}' -}}}}\n            ")
    if family in TEMPLATE_AUDIO:
        image += ("{%- elif part.type == 'audio' or part.type == 'input_audio' -%}\n"
                  f"                {{{{- '{TEMPLATE_AUDIO[family]}' -}}}}\n            ")
    return base.replace(unsupported, image + unsupported)


def tokenizer_json(family: str = "qwen2_5_vl") -> str:
    """The shared vocabulary with the family's vision tokens added after it."""
    from tokenizers import AddedToken, Tokenizer

    tokens = FAMILY_TOKENS[family]
    tokenizer = Tokenizer.from_str(tok.tokenizer_json_for(add_bos=False))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    assert [tokenizer.token_to_id(t) for t in tokens] == [vision_token_id(t, family) for t in tokens]
    return tokenizer.to_str(pretty=True) + "\n"


def _tokenizer_config(family: str) -> dict[str, Any]:
    tokens = FAMILY_TOKENS[family]
    added = {str(tok.token_id(t.content)): {"content": t.content, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": t.special}
             for t in tok.ADDED_TOKENS}
    added.update({str(vision_token_id(t, family)): {"content": t, "lstrip": False, "normalized": False,
                                                     "rstrip": False, "single_word": False, "special": True}
                  for t in tokens})
    return {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": added,
        "additional_special_tokens": [tok.IM_START, tok.IM_END, *tokens], "bos_token": None,
        "chat_template": chat_template(family), "clean_up_tokenization_spaces": False, "eos_token": tok.IM_END,
        "errors": "replace", "model_max_length": 32768, "pad_token": tok.ENDOFTEXT,
        "split_special_tokens": False, "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], family: str) -> np.ndarray:
    """Biases zero, other vectors (norm gains) one, matrices the text factory's 1/sqrt(fan_in).
    Gemma 3's RMSNorms scale by ``1 + w`` (its text model and projector): stored as zero."""
    from .families import FAMILY_SPECS
    from .weights import init_tensor

    if len(shape) == 1:
        leaf = name.rsplit(".", 1)[-1]
        gemma_norm = family == "gemma3" and name.startswith(("language_model.", "multi_modal_projector."))
        return np.zeros(shape, np.float32) if leaf == "bias" or gemma_norm else np.ones(shape, np.float32)
    return init_tensor(rng, name, shape, FAMILY_SPECS["qwen2"])


def random_weights(config: dict[str, Any]) -> dict[str, Any]:
    """mlx-vlm's model for ``config`` with seeded weights, in sorted name order."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(config)
    # InternVL names its text config llm_config (mlx-vlm's loader renames it); a copy: mlx-vlm's
    # TextConfig rewrites its rope_scaling in place (Qwen3-VL's rope_type)
    text = json.loads(json.dumps(config.get("text_config") or config.get("llm_config") or config))
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(dict(config, text_config=text) if "llm_config" in config
                                                                      else config)))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = module.TextConfig.from_dict(text)
    if "audio_config" in config:
        model_config.audio_config = module.AudioConfig.from_dict(config["audio_config"])
    model = module.Model(model_config)
    if config["model_type"] == "gemma3n":
        model.vision_tower = None  # not written: mlx-vlm drops a module a checkpoint omits (see _gemma3n_config)
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    rng = np.random.default_rng(WEIGHT_SEED)
    return {name: mx.array(_init(rng, name, shapes[name], config["model_type"])) for name in sorted(shapes)}


def _write_files(directory: Path, family: str, size: str = "tiny") -> None:
    import mlx.core as mx

    config = model_config(family, size)
    weights = random_weights(config)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokens = FAMILY_TOKENS[family]
    texts = {
        "config.json": config,
        "preprocessor_config.json": preprocessor_config(family, size),
        "tokenizer_config.json": _tokenizer_config(family),
        "special_tokens_map.json": {"additional_special_tokens": [tok.IM_START, tok.IM_END, *tokens],
                                    "eos_token": tok.IM_END, "pad_token": tok.ENDOFTEXT},
        "generation_config.json": {"bos_token_id": None, "eos_token_id": EOS_IDS,
                                   "pad_token_id": config["pad_token_id"]},
    }
    for name, data in texts.items():
        (directory / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (directory / "tokenizer.json").write_text(tokenizer_json(family), encoding="utf-8")
    manifest = {"family": family, "size": size, "format_version": FORMAT_VERSION,
                "num_parameters": int(sum(v.size for v in weights.values()))}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")  # last


def ensure_vision_model(cache_dir: str | Path | None = None, family: str = "qwen2_5_vl", size: str = "tiny") -> Path:
    """``<cache>/<family>-<size>-v<N>``, built on first use (into a temporary directory renamed
    into place, so concurrent callers never see half a model)."""
    from .cache_dir import build_directory, default_cache_dir

    _check(family, size)  # fails here, before anything is written
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()
    return build_directory(root / f"{family}-{size}-v{FORMAT_VERSION}", MANIFEST_NAME,
                           lambda tmp: _write_files(tmp, family, size))


def ensure_vision_gguf(cache_dir: str | Path | None = None, family: str = "qwen2_5_vl", size: str = "tiny",
                       gguf_type: str = "f32", mmproj_type: str = "f32") -> tuple[Path, Path]:
    """``(text GGUF, mmproj GGUF)`` of the (family, size) directory, as llama.cpp's converter
    names them (``testing/vision_gguf.py``), in ``<cache>/<family>-<size>-v<N>-gguf<M>-<types>/``,
    written on first use (whole, like the directory)."""
    from .cache_dir import build_directory
    from .vision_gguf import GGUF_VISION_FAMILIES, PAIR_VERSION, gguf_names, write_vision_gguf_pair

    if family not in GGUF_VISION_FAMILIES:
        raise ValueError(f"vision family {family!r} has no GGUF form; choose one of: {', '.join(GGUF_VISION_FAMILIES)}")
    source = ensure_vision_model(cache_dir, family, size)
    target = source.parent / f"{source.name}-gguf{PAIR_VERSION}-{gguf_type}-{mmproj_type}"
    text, mmproj = gguf_names(family, size, gguf_type, mmproj_type)

    def write(tmp: Path) -> None:
        write_vision_gguf_pair(family, source, tmp, size, gguf_type, mmproj_type)
        (tmp / MANIFEST_NAME).write_text(json.dumps({"family": family, "text": text, "mmproj": mmproj}) + "\n",
                                         encoding="utf-8")  # last

    directory = build_directory(target, MANIFEST_NAME, write)
    return directory / text, directory / mmproj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxcel_compat.testing.vision",
                                     description="Write a random-weight vision-language directory (tiny: for tests), "
                                                 "or with --format gguf its GGUF pair (text model + mmproj projector).")
    parser.add_argument("--out", required=True, help="the cache directory to build it in")
    parser.add_argument("--family", default="qwen2_5_vl", choices=ALL_FAMILIES)
    parser.add_argument("--size", default="tiny", choices=SIZES, help="small: Qwen2.5-VL only, for benchmarks")
    parser.add_argument("--format", default="hf", choices=("hf", "gguf"),
                        help="hf: the mlx-vlm directory; gguf: the text GGUF and its mmproj-*.gguf beside it")
    parser.add_argument("--gguf-type", default="f32", help="the text GGUF's type (f32, f16, q8_0, q4_k_m, ...)")
    parser.add_argument("--mmproj-type", default="f32", choices=("f32", "f16", "q8_0"))
    args = parser.parse_args(argv)
    if args.format == "gguf":
        text, mmproj = ensure_vision_gguf(args.out, args.family, args.size, args.gguf_type, args.mmproj_type)
        print(text)
        print(mmproj)
        return 0
    print(ensure_vision_model(args.out, args.family, args.size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
