"""The factory's Qwen3-VL and InternVL configurations: their ``config.json`` (each family's own
layout, at tiny sizes) and ``preprocessor_config.json``. ``testing/vision.py`` builds, writes and
names them as it does its other families; they are kept here for that module's size.

- **Qwen3-VL**: ``text_config`` (a 3-layer Qwen3 text model with interleaved M-RoPE: head_dim 32,
  its 16 rotary frequencies split 6/5/5 over time, height and width, as 24/20/20 split 64) and
  ``vision_config`` (16-pixel patches merged 2x2, a 4x4 table of learned position embeddings
  interpolated to each image's grid, deepstack mergers on the first two of three blocks) nested;
  Qwen2-VL's processor at 16-pixel patches, at most 16 tokens an image.
- **InternVL**: InternVL's own layout (``InternVLChatModel``: ``llm_config``, a Qwen2 text model,
  and ``vision_config``, InternViT: a class token, learned positions, layer scales; 4 blocks, as
  gguf-py maps the projector's ``mlp1.3`` through a block-indexed row), the pixel shuffle's
  ``downsample_ratio`` and the dynamic tiles' bounds at the top; GotOcr2ImageProcessor's tiles
  (1 to 4 and a thumbnail) of 56 pixels, 4 tokens a tile, ImageNet's normalisation.
"""

from __future__ import annotations

from typing import Any, Callable

QWEN3_PATCH_SIZE = 16
QWEN3_MIN_PIXELS = 32 * 32 * 4  # 16-pixel patches merged 2x2: 32 pixels a token
QWEN3_MAX_PIXELS = 32 * 32 * 16  # at most 16 merged tokens an image, as the tiny Qwen2.5-VL
INTERNVL_MAX_TILES = 4
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def qwen3_vl_config(vocab: int, token_id: Callable[[str], int], common: dict[str, Any]) -> dict[str, Any]:
    """Deepstack mergers on 2 of 3 tower blocks feed the first 2 of 3 text layers: fewer than the
    text layers, as in real checkpoints (3 of 36), which llama.cpp's ``qwen3vl`` graph needs (it
    adds them after the last layer's rows are cut to the outputs otherwise)."""
    text = dict(model_type="qwen3_vl_text", hidden_size=64, num_hidden_layers=3, intermediate_size=192,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=5000000.0,
                rope_scaling={"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True},
                max_position_embeddings=32768, vocab_size=vocab, tie_word_embeddings=True,
                hidden_act="silu", attention_bias=False)
    vision = dict(model_type="qwen3_vl", depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, in_channels=3, patch_size=QWEN3_PATCH_SIZE, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                  hidden_act="gelu_pytorch_tanh")
    return dict(model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"], text_config=text,
                vision_config=vision, tie_word_embeddings=True, vocab_size=vocab,
                image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
                vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"),
                **common)


def qwen3_vl_preprocessor() -> dict[str, Any]:
    """Qwen3-VL's checkpoints name Qwen2-VL's processor, at 16-pixel patches and 0.5 mean and std."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": QWEN3_PATCH_SIZE, "merge_size": 2, "temporal_patch_size": 2,
        "size": {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS},
    }


def internvl_config(vocab: int, token_id: Callable[[str], int], common: dict[str, Any], image_size: int,
                    patch_size: int) -> dict[str, Any]:
    text = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=2,
                intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=32768, vocab_size=vocab, tie_word_embeddings=False,
                hidden_act="silu")
    vision = dict(model_type="intern_vit_6b", architectures=["InternVisionModel"], hidden_size=32,
                  num_attention_heads=2, intermediate_size=64, num_hidden_layers=4, image_size=image_size,
                  patch_size=patch_size, num_channels=3, layer_norm_eps=1e-6, qkv_bias=True,
                  qk_normalization=False, norm_type="layer_norm", hidden_act="gelu", drop_path_rate=0.0)
    return dict(model_type="internvl_chat", architectures=["InternVLChatModel"], llm_config=text, vision_config=vision,
                downsample_ratio=0.5, select_layer=-1, ps_version="v2", template="internvl2_5",
                force_image_size=image_size, dynamic_image_size=True, use_thumbnail=True, min_dynamic_patch=1,
                max_dynamic_patch=INTERNVL_MAX_TILES, vocab_size=vocab, image_token_index=token_id("<IMG_CONTEXT>"),
                **common)


def internvl_preprocessor(image_size: int) -> dict[str, Any]:
    """InternVL's dynamic tiles and thumbnail, as GotOcr2ImageProcessor cuts them."""
    return {
        "image_processor_type": "GotOcr2ImageProcessor", "processor_class": "InternVLProcessor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "crop_to_patches": True, "min_patches": 1, "max_patches": INTERNVL_MAX_TILES, "resample": 3,
        "rescale_factor": 1 / 255, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
        "size": {"height": image_size, "width": image_size},
    }


MISTRAL3_LONGEST_EDGE = 112  # PixtralImageProcessor's size: at most 4x4 merged patches (16 tokens and 4 breaks)


def mistral3_config(vocab: int, token_id: Callable[[str], int], common: dict[str, Any], patch_size: int) -> dict[str, Any]:
    """Mistral Small 3.1's layout at tiny size: a Mistral ``text_config`` (plain RoPE, no biases,
    untied head), a Pixtral ``vision_config`` (2-D RoPE over ``image_size / patch_size`` patches a
    side, RMS norms, SwiGLU), the 2x2 patch merger and a GELU projector without biases."""
    text = dict(model_type="mistral", hidden_size=64, num_hidden_layers=2, intermediate_size=192,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1000000000.0,
                max_position_embeddings=32768, vocab_size=vocab, tie_word_embeddings=False, sliding_window=None,
                hidden_act="silu")
    vision = dict(model_type="pixtral", hidden_size=32, head_dim=16, num_attention_heads=2, intermediate_size=64,
                  num_hidden_layers=2, image_size=MISTRAL3_LONGEST_EDGE, patch_size=patch_size, num_channels=3,
                  rope_theta=10000.0, hidden_act="silu")
    return dict(model_type="mistral3", architectures=["Mistral3ForConditionalGeneration"], text_config=text,
                vision_config=vision, image_token_index=token_id("[IMG]"), spatial_merge_size=2,
                vision_feature_layer=-1, multimodal_projector_bias=False, projector_hidden_act="gelu",
                vocab_size=vocab, **common)


def mistral3_preprocessor(patch_size: int, mean: list[float], std: list[float]) -> dict[str, Any]:
    """PixtralImageProcessor as Mistral Small 3.1 ships it (its ``patch_size`` the tower's; the
    processor resizes to whole merged patches), the longest edge at the tiny tower's size."""
    return {
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 3,
        "rescale_factor": 1 / 255, "image_mean": mean, "image_std": std, "patch_size": patch_size,
        "size": {"longest_edge": MISTRAL3_LONGEST_EDGE},
    }


# LFM2-VL: 16-pixel patches (the only size llama.cpp's converter takes) unshuffled 2x2 (a token per 32x32
# pixels), 64-pixel tiles (4 tokens each); a single view holds 2 to 8 tokens, an image over twice that
# (16384 pixels, 128x128) is cut into 2 to 4 tiles and a thumbnail.
LFM2VL_PATCH_SIZE = 16
LFM2VL_TILE_SIZE = 64
LFM2VL_MAX_TILES = 4
LFM2VL_MAX_IMAGE_TOKENS = 8
LFM2VL_MARKER_GRID = 10  # LFM2-VL's vocabulary holds a marker for every row and column up to 10 (mtmd's most tiles)
# The tokens LFM2-VL's processor writes around an image's: start, end, thumbnail, then each tile's row/column marker.
LFM2VL_TOKENS: tuple[str, ...] = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
                                  *(f"<|img_row_{r}_col_{c}|>" for r in range(1, LFM2VL_MARKER_GRID + 1)
                                    for c in range(1, LFM2VL_MARKER_GRID + 1)))


def lfm2_vl_config(vocab: int, token_id: Callable[[str], int], common: dict[str, Any]) -> dict[str, Any]:
    """LFM2-VL-450M's layout at tiny sizes: an LFM2 ``text_config`` (convolution and attention
    layers alternating, as LFM2 starts with convolutions), a SigLIP2 NaFlex ``vision_config`` (a 4x4
    table of learned positions resized to each view), the projector's settings at the top."""
    text = dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], vocab_size=vocab, hidden_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128000,
                norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128, intermediate_size=128,
                block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, rope_theta=1000000.0,
                layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
                eos_token_id=common["eos_token_id"])
    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_channels=3, patch_size=LFM2VL_PATCH_SIZE, num_patches=16,
                  layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", vision_use_head=False)
    return dict(model_type="lfm2_vl", architectures=["Lfm2VlForConditionalGeneration"], text_config=text,
                vision_config=vision, vocab_size=vocab, image_token_id=token_id("<image>"), downsample_factor=2,
                encoder_patch_size=LFM2VL_PATCH_SIZE, projector_hidden_size=64, projector_hidden_act="gelu",
                projector_bias=True, projector_use_layernorm=True, vision_feature_layer=-1,
                use_image_special_tokens=True, use_thumbnail=True, do_image_splitting=True,
                min_tiles=2, max_tiles=LFM2VL_MAX_TILES, tile_size=LFM2VL_TILE_SIZE, min_image_tokens=2,
                max_image_tokens=LFM2VL_MAX_IMAGE_TOKENS, max_num_patches=LFM2VL_MAX_IMAGE_TOKENS * 4,
                max_pixels_tolerance=2.0, tie_word_embeddings=True, **common)


def lfm2_vl_preprocessor() -> dict[str, Any]:
    """Lfm2VlImageProcessor's settings at the tiny sizes (bicubic, as LFM2-VL-450M's)."""
    return {
        "image_processor_type": "Lfm2VlImageProcessorFast", "processor_class": "Lfm2VlProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_pad": True, "do_image_splitting": True,
        "downsample_factor": 2, "encoder_patch_size": LFM2VL_PATCH_SIZE, "tile_size": LFM2VL_TILE_SIZE,
        "min_tiles": 2, "max_tiles": LFM2VL_MAX_TILES, "use_thumbnail": True, "min_image_tokens": 2,
        "max_image_tokens": LFM2VL_MAX_IMAGE_TOKENS, "max_pixels_tolerance": 2.0, "resample": 3,
        "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }
