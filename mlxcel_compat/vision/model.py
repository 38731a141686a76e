"""Vision-language models through mlx-vlm: loading, and a text-model face for the engine.

The engine drives every model as mlx-lm drives one: ``model(tokens, cache=cache)`` for a prefill
chunk or a decode step, with mlx-lm's KV cache objects. A vision-language model needs more: the
image features merged into the input embeddings where the prompt holds the image's tokens, and,
for Qwen2-VL / Qwen2.5-VL, multimodal RoPE positions (``mrope``: an image's tokens take (time,
row, column) positions, and the text after it continues from the image's largest position rather
than from its token count). What differs between families (which tokens, which tower call,
which positions, which cache) is in ``vision/families.py``; this module is the same for all.
mlx-vlm's language models keep mrope positions in attributes of the shared model object
(``_position_ids``, ``_rope_deltas``), which several slots with different images would overwrite. So:

- :class:`VisionLM` wraps the loaded mlx-vlm model and, for an mrope family, always passes the
  positions explicitly: a sequence without media gets plain positions (offset + index on all
  three axes, which is ordinary RoPE, so text-only requests behave as on the text model);
- :meth:`VisionLM.bind` gives one sequence its own :class:`BoundVisionLM`, built from the
  request's :class:`~mlxcel_compat.vision.inputs.MediaInput`: the vision tower runs once, on the
  engine thread, the first time a chunk reaches an image (never when the prompt cache already
  holds every image), and each chunk takes its slice of the merged embeddings and positions,
  found from the cache's offset (so an adopted prefix needs nothing more).

Batched decode and batched prefill are off for these models (``Engine.probe_batching``): one
forward pass of several rows would need per-row position deltas through mlx-lm's batch caches.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.vision.families import VisionFacts, VisionFamily
from mlxcel_compat.vision.served import SUPPORTED_MODEL_TYPES, family_of

__all__ = ["SUPPORTED_MODEL_TYPES", "VisionFacts", "VisionLM", "BoundVisionLM", "is_vision_directory",
           "load_vision_directory", "vision_facts"]

log = logging.getLogger(__name__)


def is_vision_directory(path: Path) -> bool:
    """A model directory whose config declares a vision tower (``vision_config``)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def vision_facts(path: Path, config: dict[str, Any], tokenizer: Any = None) -> VisionFacts:
    """The prompt-side facts of the directory's family (its tokenizer read when not given)."""
    if tokenizer is None:
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(path)
    return family_of(config).facts(path, config, tokenizer)


def load_vision_directory(path: Path) -> tuple["VisionLM", Any, dict[str, Any], VisionFacts]:
    """``(model, tokenizer, config, facts)`` of an mlx-vlm model directory (engine thread)."""
    from mlx_lm.utils import load_tokenizer

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    family = family_of(config)
    if not (path / "preprocessor_config.json").is_file():
        raise ValueError(f"{path} has no preprocessor_config.json: the image processor's settings are missing")
    family.processor_name(path)  # an image processor the family does not take is refused before the weights load
    vlm = family.load(path)
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(path, eos_token_ids=eos if isinstance(eos, list) else None)
    facts = family.facts(path, config, tokenizer)
    return VisionLM(vlm, family, facts), tokenizer, config, facts


def _offset(cache: Any) -> int:
    # The first layer that counts tokens: a hybrid's convolution layers (LFM2's ArraysCache) do not.
    counted = [layer for layer in cache or () if hasattr(layer, "offset")]
    if not counted:
        return 0
    offset = counted[0].offset
    if not isinstance(offset, int):
        # A batch cache (per-row offsets): the engine never batches these models.
        raise TypeError("vision-language models decode one sequence per forward pass")
    return offset


class VisionLM(nn.Module):
    """The mlx-vlm model, called like an mlx-lm language model (tokens, cache) -> logits."""

    def __init__(self, vlm: Any, family: VisionFamily, facts: VisionFacts) -> None:
        super().__init__()
        self.vlm = vlm
        self.family = family
        self.facts = facts

    @property
    def layers(self) -> list[Any]:
        return self.vlm.language_model.model.layers

    @property
    def config(self) -> Any:
        return self.vlm.config

    def make_cache(self) -> list[Any]:
        """The family's KV cache layers (mlx-lm's ``make_prompt_cache`` asks for them)."""
        return self.family.make_cache(self.vlm)

    def bind(self, media: Any, prompt: list[int]) -> "VisionLM | BoundVisionLM":
        """This model for one sequence (``prompt``): with its images when ``media`` has any."""
        return self if media is None or not media.spans else BoundVisionLM(self, media, prompt)

    def warm_up(self) -> None:
        """Run the vision tower once on a blank image: MLX's first call of a graph pays a one-off
        set-up cost (seconds), which the first request with an image would otherwise pay. The
        tower's rows are checked against the image tokens the prompt side gives the same image
        (a mismatch would put features at the wrong tokens). A family with audio runs its audio tower
        on the longest clip it takes, which must fit the clip's tokens."""
        if self.facts.audio is not None:
            self._warm_up_audio(self.facts.audio)
        if not self.facts.images:
            return
        blank = self.family.blank_image(self.vlm)
        rows = self.family.features(self.vlm, [blank])
        mx.eval(rows)
        mx.clear_cache()  # the tower's temporaries (see BoundVisionLM._cached)
        processed = {"pixel_values": blank.pixel_values}
        if self.family.mrope:
            processed["image_grid_thw"] = np.asarray([blank.grid_thw])
        if blank.spatial_shapes:
            processed["spatial_shapes"] = np.asarray(blank.spatial_shapes)
        tokens, _ = self.facts.image_token_count(processed)
        if rows.shape[0] != tokens:
            raise ValueError(f"the vision tower gives {rows.shape[0]} feature rows for an image of {tokens} image tokens")

    def _warm_up_audio(self, audio: Any) -> None:
        import importlib

        from mlxcel_compat.vision.inputs import MediaAudio

        module, _, name = audio.extractor.partition(":")
        extractor = getattr(importlib.import_module(module), name).from_pretrained(str(audio.extractor_dir))
        out = extractor([np.zeros(audio.max_samples, np.float32)], return_tensors="np", max_length=audio.max_samples)
        clip = MediaAudio(out["input_features"], out["input_features_mask"], (0, audio.tokens_per_clip))
        mx.eval(self.family.audio_features(self.vlm, [clip]))

    def forward_hidden(self, inputs: mx.array, cache: Any, embeds: mx.array | None, positions: mx.array | None) -> mx.array:
        """The text model's final (normed) hidden states of ``inputs`` (1, L) at ``positions``
        (mrope: (3, 1, L); else ``None``, the cache's offset + index), with ``embeds`` replacing
        the token embeddings where given: what the head turns into logits, and what an embedding
        pools (llama.cpp's ``t_embd``)."""
        return self.family.hidden(self.vlm.language_model, inputs, cache, embeds, positions)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.family.logits(self.vlm.language_model, self.hidden(inputs, cache))

    def hidden(self, inputs: mx.array, cache: Any = None) -> mx.array:
        """Hidden states of a text-only chunk (the embeddings' path; ``__call__`` adds the head)."""
        batch, length = inputs.shape
        embeds = self.family.text_embeddings(self.vlm, inputs)
        return self.forward_hidden(inputs, cache, embeds, self.family.text_positions(_offset(cache), length, batch))


class BoundVisionLM:
    """One sequence's view of a :class:`VisionLM`: its images' features (and mrope positions)."""

    def __init__(self, base: VisionLM, media: Any, prompt_tokens: list[int]) -> None:
        self.base = base
        self.media = media
        self.layers = base.layers
        self.make_cache = base.make_cache
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        rope = base.family.prompt_positions(base.vlm, prompt, media.images) if media.images else None
        self.positions, self.delta = rope if rope is not None else (None, 0)  # (3, 1, n_prompt) for mrope
        # Per kind (images, audio clips): the row of its features each of its tokens takes, or -1.
        self.kinds: list[tuple[np.ndarray, Any]] = []
        if media.images:
            self.kinds.append((self._rows(prompt, base.facts.image_token_id), self._image_features))
        audio = getattr(media, "audio", None)
        if audio:
            self.kinds.append((self._rows(prompt, base.facts.audio.audio_token_id), self._audio_features))
        self._features: dict[str, mx.array] = {}

    @staticmethod
    def _rows(prompt: np.ndarray, token: int) -> np.ndarray:
        hit = prompt == token
        return np.where(hit, np.cumsum(hit) - 1, -1)

    def _cached(self, kind: str, make: Any) -> mx.array:
        if kind not in self._features:
            self._features[kind] = make()
            mx.eval(self._features[kind])
            # The tower's temporaries go back to MLX's buffer cache, which keeps them: a 896-pixel
            # SigLIP image's attention alone is 16 x 4096^2 floats (1 GiB) that would stay resident.
            mx.clear_cache()
        return self._features[kind]

    def _image_features(self) -> mx.array:
        return self._cached("image", lambda: self.base.family.features(self.base.vlm, self.media.images))

    def _audio_features(self) -> mx.array:
        return self._cached("audio", lambda: self.base.family.audio_features(self.base.vlm, self.media.audio))

    def _positions(self, start: int, length: int) -> mx.array | None:
        if self.positions is None:
            return None
        n_prompt = self.positions.shape[-1]
        if start + length <= n_prompt:
            return self.positions[:, :, start : start + length]
        inside = self.positions[:, :, start:n_prompt] if start < n_prompt else None
        first = max(start, n_prompt)
        after = mx.arange(first, start + length) + self.delta
        after = mx.broadcast_to(after[None, None], (3, 1, start + length - first))
        return after if inside is None else mx.concatenate([inside, after], axis=-1)

    def _embeds(self, inputs: mx.array, start: int, length: int) -> mx.array | None:
        embeds = None
        for feature_row, features_of in self.kinds:
            rows = np.full(length, -1, dtype=np.int64)
            inside = feature_row[start : start + length]
            rows[: inside.size] = inside
            if rows.max() < 0:
                continue
            if embeds is None:
                embeds = self.base.family.token_embeddings(self.base.vlm, inputs)
            features = features_of()[mx.array(np.maximum(rows, 0))]
            mask = mx.array(rows >= 0)[None, :, None]
            embeds = mx.where(mask, features[None].astype(embeds.dtype), embeds)
        return embeds if embeds is not None else self.base.family.text_embeddings(self.base.vlm, inputs)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.base.family.logits(self.base.vlm.language_model, self.hidden(inputs, cache))

    def hidden(self, inputs: mx.array, cache: Any = None) -> mx.array:
        """Hidden states of one chunk of this sequence, its media rows in place (the embeddings' path)."""
        length = inputs.shape[1]
        start = _offset(cache)
        return self.base.forward_hidden(inputs, cache, self._embeds(inputs, start, length), self._positions(start, length))
