"""LFM2-VL: its family rules (a directory through mlx-vlm's ``lfm2_vl``).

- **images** (``vision/lfm2vl_images.py``, the HTTP side): one view at the image's own aspect
  ratio, or ``tile_size`` tiles and a thumbnail, each view packed into patches for the SigLIP2
  NaFlex tower with its patch grid (``spatial_shapes``, carried in ``MediaImage.spatial_shapes``);
  the prompt's ``<image>`` becomes ``<|image_start|>``, the tiles' ``<|img_row_R_col_C|>`` markers
  and tokens, ``<|img_thumbnail|>`` and the thumbnail's tokens, ``<|image_end|>``;
- **the tower**: SigLIP2 NaFlex (learned position embeddings resized to each view's grid, attention
  over the view's real patches only), then per view the pixel unshuffle by ``downsample_factor``
  and the projector (LayerNorm, linear, GELU, linear): mlx-vlm's ``encode_images``;
- **the text model**: LFM2, a hybrid of short-convolution layers (a state of the last
  ``conv_L_cache - 1`` inputs) and attention layers; mlx-lm's ``lfm2`` holding the checkpoint's
  text weights, in place of mlx-vlm's copy (the same layers), so its cache is mlx-lm's:
  ``ArraysCache`` for the convolutions, ``KVCache`` for attention. Plain positions, causal.

**The prompt cache**: a convolution state cannot be cut back to a prefix, so the cache keeps whole
states for this model, as for every hybrid text model (session snapshots, ``cache/snapshot.py``;
``docs/prompt-cache.md``): a finished turn's state is kept under its session with the request's
``mm_digest`` in the key, and the next turn about the same image, whose prompt starts with those
tokens, restores it whole and prefills only what follows (images included in the restored part:
their tower does not run again).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.vision.families import VisionFacts, VisionFamily
from mlxcel_compat.vision.lfm2vl_images import DEFAULTS, Lfm2VlLayout

LFM2VL_PROCESSOR = "mlxcel_compat.vision.lfm2vl_images:Lfm2VlImageProcessorPil"


def processor_settings(processor_dir: Path, processor_config: dict[str, Any] | None) -> dict[str, Any]:
    """Lfm2VlImageProcessor's settings: its defaults, overridden by the given config or the
    directory's ``preprocessor_config.json``."""
    if processor_config is None:
        processor_config = json.loads((processor_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    return {**DEFAULTS, **processor_config}


def lfm2_language_model(text_config: dict[str, Any], mlx_vlm_language: Any) -> Any:
    """mlx-lm's LFM2 with the weights of mlx-vlm's LFM2-VL ``LanguageModel`` (tied embeddings)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import lfm2

    model = lfm2.Model(lfm2.ModelArgs.from_dict(dict(text_config, model_type="lfm2")))
    weights = [(name, value) for name, value in tree_flatten(mlx_vlm_language.parameters()) if not name.startswith("lm_head.")]
    model.load_weights(weights, strict=True)
    model.eval()
    return model


class Lfm2Vl(VisionFamily):
    """LFM2-VL (``lfm2_vl``): NaFlex views of each image, pixel unshuffle and projector, the LFM2
    hybrid text model (module docstring)."""

    model_types = ("lfm2_vl", "lfm2-vl")
    processors = {"Lfm2VlImageProcessor": LFM2VL_PROCESSOR}

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        settings = processor_settings(processor_dir, processor_config)
        vocab = tokenizer.get_vocab()
        image = int(config.get("image_token_id", config.get("image_token_index", vocab.get("<image>", 396))))
        special = bool(config.get("use_image_special_tokens", True))

        def one(text: str) -> tuple[int, ...]:
            if not special:
                return ()
            if text not in vocab:
                raise ValueError(f"the LFM2-VL tokenizer lacks {text}")
            return (int(vocab[text]),)

        grid = int(settings["max_tiles"])  # a grid has at most max_tiles rows or columns
        markers = tuple(tuple(one(f"<|img_row_{r}_col_{c}|>") for c in range(1, grid + 1)) for r in range(1, grid + 1))
        factor = int(settings["downsample_factor"])
        side = -(-(int(settings["tile_size"]) // int(settings["encoder_patch_size"])) // factor)
        layout = Lfm2VlLayout(downsample_factor=factor, tokens_per_tile=side * side, image_start=one("<|image_start|>"),
                              image_end=one("<|image_end|>"), thumbnail=one("<|img_thumbnail|>"), tile_markers=markers)
        return VisionFacts(model_type="lfm2_vl", image_token_id=image, marker=(image,), expand_token=image, layout=layout,
                           processor=processor, processor_dir=processor_dir, processor_config=processor_config)

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        pixels = np.concatenate([np.asarray(img.pixel_values) for img in images])
        shapes = np.asarray([shape for img in images for shape in img.spatial_shapes], np.int64).reshape(-1, 2)
        if len(shapes) != len(pixels):
            raise ValueError(f"{len(pixels)} views with {len(shapes)} patch grids")
        mask = (np.arange(pixels.shape[1])[None, :] < (shapes[:, 0] * shapes[:, 1])[:, None]).astype(np.int32)
        dtype = vlm.vision_tower.embeddings.patch_embedding.weight.dtype
        views = vlm.encode_images(mx.array(pixels).astype(dtype), spatial_shapes=mx.array(shapes),
                                  pixel_attention_mask=mx.array(mask))
        return mx.concatenate(list(views), axis=0)

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.vision.inputs import MediaImage

        factor = int(vlm.config.downsample_factor)
        width = int(vlm.vision_tower.embeddings.patch_embedding.weight.shape[1])
        return MediaImage(np.zeros((1, factor * factor, width), np.float32), (1, 1, 1), (0, 1), ((factor, factor),))

    def load(self, path: Path) -> Any:
        vlm = super().load(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        vlm.language_model = lfm2_language_model(config["text_config"], vlm.language_model)
        return vlm

    def make_cache(self, vlm: Any) -> list[Any]:
        return vlm.language_model.make_cache()

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        return language.model(inputs, cache=cache, input_embeddings=embeds)
