"""A ``pixtral`` GGUF pair's image processor: Hugging Face's PixtralImageProcessor (PIL backend)
with llama.cpp's mtmd sizing in place of the longest edge.

mtmd (``mtmd_image_preprocessor_dyn_size``, ``calc_size_preserved_ratio``) rounds each side to the
nearest whole merged patch (``patch_size * spatial_merge_size`` pixels, at least one), then, when
the image holds more than ``max_tokens`` merged patches, scales it down by ``sqrt(area / max)``
rounding each side *down*, or when it holds fewer than ``min_tokens``, scales it up rounding *up*
(clip.cpp's bounds for ``pixtral``: 8 and 1024; ``--image-min-tokens`` / ``--image-max-tokens``
replace them). The rescale, normalisation and bicubic resampling stay Hugging Face's (mtmd's own
bicubic differs in the last digits). This module imports transformers: the prompt side loads it by
name, only for a ``pixtral`` pair."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.image_utils import SizeDict

MTMD_MIN_TOKENS, MTMD_MAX_TOKENS = 8, 1024  # clip.cpp's bounds for pixtral


def mtmd_size(height: int, width: int, unit: int, min_tokens: int, max_tokens: int) -> tuple[int, int]:
    """``(height, width)`` as mtmd sizes a ``pixtral`` image: whole ``unit``-pixel merged patches,
    between ``min_tokens`` and ``max_tokens`` of them."""
    def rounded(x: float) -> int:
        return int(math.floor(x / unit + 0.5)) * unit  # C's round: halves away from zero

    h_bar, w_bar = max(unit, rounded(height)), max(unit, rounded(width))
    if h_bar * w_bar > max_tokens * unit * unit:
        beta = math.sqrt(height * width / (max_tokens * unit * unit))
        h_bar = max(unit, int(math.floor(height / beta / unit)) * unit)
        w_bar = max(unit, int(math.floor(width / beta / unit)) * unit)
    elif h_bar * w_bar < min_tokens * unit * unit:
        beta = math.sqrt(min_tokens * unit * unit / (height * width))
        h_bar = int(math.ceil(height * beta / unit)) * unit
        w_bar = int(math.ceil(width * beta / unit)) * unit
    return h_bar, w_bar


class MtmdPixtralImageProcessor(PixtralImageProcessorPil):
    """PixtralImageProcessor sized as mtmd sizes a ``pixtral`` pair's images (module docstring)."""

    def __init__(self, min_tokens: int = MTMD_MIN_TOKENS, max_tokens: int = MTMD_MAX_TOKENS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_tokens, self.max_tokens = int(min_tokens), int(max_tokens)

    def resize(self, image: np.ndarray, size: Any, patch_size: Any, resample: Any = None, **kwargs: Any) -> np.ndarray:
        height, width = image.shape[-2:]  # channels first, as the PIL backend hands it
        target = mtmd_size(int(height), int(width), int(patch_size.height), self.min_tokens, self.max_tokens)
        return super(PixtralImageProcessorPil, self).resize(
            image, size=SizeDict(height=target[0], width=target[1]), resample=resample, **kwargs)
