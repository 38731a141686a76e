"""Vision-language models through mlx-vlm: loading, and a text-model face for the engine.

The engine drives every model as mlx-lm drives one: ``model(tokens, cache=cache)`` for a prefill
chunk or a decode step, with mlx-lm's ``KVCache`` objects. A Qwen2-VL / Qwen2.5-VL model from
mlx-vlm needs two more things: the image features merged into the input embeddings where the
prompt holds ``<|image_pad|>`` tokens, and multimodal RoPE positions (``mrope``: an image's tokens
take (time, row, column) positions, and the text after it continues from the image's largest
position rather than from its token count). mlx-vlm's language model keeps those positions in
attributes of the shared model object (``_position_ids``, ``_rope_deltas``), which several slots
with different images would overwrite. So:

- :class:`VisionLM` wraps the loaded mlx-vlm model and always passes the positions explicitly:
  a sequence without media gets plain positions (offset + index on all three axes, which is
  ordinary RoPE, so text-only requests behave as on the text model);
- :meth:`VisionLM.bind` gives one sequence its own :class:`BoundVisionLM`, built from the
  request's :class:`~mlxcel_compat.engine.request.MediaInput`: the vision tower runs once, on the
  engine thread, the first time a chunk reaches an image (never when the prompt cache already
  holds every image), and each chunk takes its slice of the merged embeddings and positions,
  found from the cache's offset (so an adopted prefix needs nothing more).

Batched decode and batched prefill are off for these models (``Engine.probe_batching``): one
forward pass of several rows would need per-row position deltas through mlx-lm's batch caches.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger(__name__)

# mlx-vlm model types served here (multimodal RoPE positions computed by the model's own
# get_rope_index); other vision families are refused at load with the list.
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_vision_directory(path: Path) -> bool:
    """A model directory whose config declares a vision tower (``vision_config``)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


@dataclass
class VisionFacts:
    """What the HTTP layer needs to know about the served model's image input (no MLX)."""

    model_type: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    merge_size: int
    processor_dir: Path  # holds preprocessor_config.json (the Hugging Face image processor)


def vision_facts(path: Path, config: dict[str, Any]) -> VisionFacts:
    vision = config.get("vision_config") or {}
    return VisionFacts(
        model_type=str(config.get("model_type")),
        image_token_id=int(config["image_token_id"]),
        vision_start_token_id=int(config.get("vision_start_token_id", -1)),
        vision_end_token_id=int(config.get("vision_end_token_id", -1)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        processor_dir=path,
    )


def load_vision_directory(path: Path) -> tuple["VisionLM", Any, dict[str, Any], VisionFacts]:
    """``(model, tokenizer, config, facts)`` of an mlx-vlm model directory (engine thread)."""
    from mlx_lm.utils import load_tokenizer

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"vision model type '{model_type}' is not served yet; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if not (path / "preprocessor_config.json").is_file():
        raise ValueError(f"{path} has no preprocessor_config.json: the image processor's settings are missing")
    from mlx_vlm.utils import load_model as load_vlm

    vlm = load_vlm(path)
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(path, eos_token_ids=eos if isinstance(eos, list) else None)
    return VisionLM(vlm), tokenizer, config, vision_facts(path, config)


def _offset(cache: Any) -> int:
    if not cache:
        return 0
    offset = cache[0].offset
    if not isinstance(offset, int):
        # A batch cache (per-row offsets): the engine never batches these models.
        raise TypeError("vision-language models decode one sequence per forward pass")
    return offset


class VisionLM(nn.Module):
    """The mlx-vlm model, called like an mlx-lm language model (tokens, cache) -> logits."""

    def __init__(self, vlm: Any) -> None:
        super().__init__()
        self.vlm = vlm

    @property
    def layers(self) -> list[Any]:
        return self.vlm.language_model.model.layers

    @property
    def config(self) -> Any:
        return self.vlm.config

    def bind(self, media: Any, prompt: list[int]) -> "VisionLM | BoundVisionLM":
        """This model for one sequence (``prompt``): with its images when ``media`` has any."""
        return self if media is None or not media.images else BoundVisionLM(self, media, prompt)

    def warm_up(self) -> None:
        """Run the vision tower once on a blank 2x2-patch image: MLX's first call of a graph pays a
        one-off set-up cost (seconds), which the first request with an image would otherwise pay."""
        tower = self.vlm.vision_tower
        merge = int(getattr(tower, "spatial_merge_size", 2))
        width = int(tower.patch_embed.proj.weight.size // tower.patch_embed.proj.weight.shape[0])
        grid = mx.array([[1, merge, merge]])
        pixels = mx.zeros((merge * merge, width), dtype=tower.patch_embed.proj.weight.dtype)
        mx.eval(tower(pixels, grid, output_hidden_states=False))

    def forward(self, inputs: mx.array, cache: Any, embeds: mx.array | None, positions: mx.array) -> mx.array:
        """Logits of ``inputs`` (1, L) at ``positions`` (3, 1, L), with ``embeds`` replacing the
        token embeddings where given."""
        language = self.vlm.language_model
        hidden = language.model(inputs, cache=cache, inputs_embeds=embeds, position_ids=positions)
        if language.args.tie_word_embeddings:
            return language.model.embed_tokens.as_linear(hidden)
        return language.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        batch, length = inputs.shape
        start = _offset(cache)
        positions = mx.broadcast_to(mx.arange(start, start + length)[None, None], (3, batch, length))
        return self.forward(inputs, cache, None, positions)


class BoundVisionLM:
    """One sequence's view of a :class:`VisionLM`: its images' features and mrope positions."""

    def __init__(self, base: VisionLM, media: Any, prompt_tokens: list[int]) -> None:
        self.base = base
        self.media = media
        self.layers = base.layers
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        grid = mx.array(np.asarray([img.grid_thw for img in media.images], dtype=np.int64))
        language = base.vlm.language_model
        positions, deltas = language.get_rope_index(mx.array(prompt)[None], grid, None, None)
        self.positions = positions  # (3, 1, n_prompt)
        self.delta = int(deltas.reshape(-1)[0].item())
        is_image = prompt == base.vlm.config.image_token_id
        # The row of the vision features each image token takes, or -1.
        self.feature_row = np.where(is_image, np.cumsum(is_image) - 1, -1)
        self._features: mx.array | None = None

    def _image_features(self) -> mx.array:
        if self._features is None:
            tower = self.base.vlm.vision_tower
            pixels = mx.array(np.concatenate([img.pixel_values for img in self.media.images]))
            grid = mx.array(np.asarray([img.grid_thw for img in self.media.images], dtype=np.int64))
            dtype = tower.patch_embed.proj.weight.dtype
            self._features = tower(pixels.astype(dtype), grid, output_hidden_states=False)
            mx.eval(self._features)
        return self._features

    def _positions(self, start: int, length: int) -> mx.array:
        n_prompt = self.positions.shape[-1]
        if start + length <= n_prompt:
            return self.positions[:, :, start : start + length]
        inside = self.positions[:, :, start:n_prompt] if start < n_prompt else None
        first = max(start, n_prompt)
        after = mx.arange(first, start + length) + self.delta
        after = mx.broadcast_to(after[None, None], (3, 1, start + length - first))
        return after if inside is None else mx.concatenate([inside, after], axis=-1)

    def _embeds(self, inputs: mx.array, start: int, length: int) -> mx.array | None:
        rows = np.full(length, -1, dtype=np.int64)
        inside = self.feature_row[start : start + length]
        rows[: inside.size] = inside
        if rows.max() < 0:
            return None
        language = self.base.vlm.language_model
        embeds = language.model.embed_tokens(inputs)
        features = self._image_features()[mx.array(np.maximum(rows, 0))]
        mask = mx.array(rows >= 0)[None, :, None]
        return mx.where(mask, features[None].astype(embeds.dtype), embeds)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        length = inputs.shape[1]
        start = _offset(cache)
        return self.base.forward(inputs, cache, self._embeds(inputs, start, length), self._positions(start, length))
