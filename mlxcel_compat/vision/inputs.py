"""What a request's images and audio are when they reach the model: decoded, preprocessed, placed.

``server/media.py`` builds these records on the worker pool (decode, limits, the family's
processor); the engine carries them in ``GenerationRequest.media``; the vision model
(``vision/model.py``) turns them into features when a prompt chunk first reaches them. They hold
NumPy arrays and plain values, never MLX arrays, so they may cross the engine thread's boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MediaImage:
    """One decoded, preprocessed image of a request (server/media.py), in prompt order."""

    pixel_values: Any  # numpy float32, the image processor's output (Qwen: patches x features; else 1, 3, H, W)
    grid_thw: tuple[int, int, int]  # Qwen's patch grid (time, rows, columns) before the merge; else (1, 1, 1)
    span: tuple[int, int]  # [start, end) of its image tokens in the prompt
    # NaFlex towers (LFM2-VL): each view's patch grid (rows, columns); pixel_values' rows past a
    # view's rows * columns are padding. Empty for the other families.
    spatial_shapes: tuple[tuple[int, int], ...] = ()


@dataclass
class MediaAudio:
    """One decoded audio clip of a request, as its family's feature extractor gives it (server/media.py)."""

    features: Any  # numpy float32 (1, frames, mel bins): the log-mel features
    mask: Any  # numpy bool (1, frames): True for the clip's frames, False for padding
    span: tuple[int, int]  # [start, end) of its audio tokens in the prompt


@dataclass
class MediaInput:
    """The images and audio clips of a request; the engine's model (vision/model.py) turns them
    into features. ``spans`` is what the prompt cache needs: it never splits a prompt inside one."""

    images: list[MediaImage] = field(default_factory=list)
    audio: list[MediaAudio] = field(default_factory=list)

    @property
    def spans(self) -> list[tuple[int, int]]:
        return sorted([img.span for img in self.images] + [clip.span for clip in self.audio])
