"""LFM2-VL's image input on the HTTP side (plain NumPy and Pillow, no MLX, no torch): how an image
becomes the SigLIP2 NaFlex tower's packed patches, and how the prompt writes it.

Hugging Face's ``Lfm2VlImageProcessor`` has only a torchvision backend, and torch is not a
dependency of this server, so :class:`Lfm2VlImageProcessorPil` does the same arithmetic with Pillow
(``tests/vision/test_lfm2vl.py`` checks it against Hugging Face's where torch is installed):

- **one view**: an image whose size, rounded to ``encoder_patch_size * downsample_factor``, holds at
  most ``max_pixels_tolerance`` times ``max_image_tokens`` tokens is resized ("smart resize": each
  side a multiple of patch x downsample, the area between ``min_image_tokens`` and
  ``max_image_tokens`` tokens, the aspect ratio kept);
- **tiles**: a larger one (``do_image_splitting``) is resized to a grid of ``tile_size`` tiles,
  ``min_tiles`` to ``max_tiles`` of them, the grid whose aspect ratio is nearest the image's (on a
  tie the larger grid, when the image covers more than half of it), cut row by row, then the
  smart-resized whole image follows as a thumbnail (``use_thumbnail``);
- **patches**: each view rescaled and normalized, cut into ``encoder_patch_size`` patches (each a
  row of ``patch * patch * 3`` values, row, column, channel), padded with zero rows to
  ``max_num_patches`` (``pixel_attention_mask`` marks the real ones) with its patch grid in
  ``spatial_shapes``;
- **tokens**: a view of ``h x w`` patches takes ``ceil(h / d) * ceil(w / d)`` tokens after the
  projector's pixel unshuffle by ``d = downsample_factor``.

:class:`Lfm2VlLayout` writes the tokens as ``Lfm2VlProcessor`` does: ``<|image_start|>``, then for
tiles ``<|img_row_R_col_C|>`` + the tile's tokens each and ``<|img_thumbnail|>`` + the thumbnail's,
or the single view's tokens, then ``<|image_end|>`` (the markers only with
``use_image_special_tokens``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# Lfm2VlImageProcessor's defaults (its class attributes), which a preprocessor_config.json overrides.
DEFAULTS: dict[str, Any] = {
    "downsample_factor": 2, "do_image_splitting": True, "min_tiles": 2, "max_tiles": 10, "use_thumbnail": True,
    "min_image_tokens": 64, "max_image_tokens": 256, "encoder_patch_size": 16, "tile_size": 512,
    "max_pixels_tolerance": 2.0, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_pad": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def _round_to(value: float, factor: int) -> int:
    return round(value / factor) * factor


def smart_size(height: int, width: int, patch: int, factor: int, min_tokens: int, max_tokens: int) -> tuple[int, int]:
    """``(height, width)`` of a single view (or a thumbnail): multiples of ``patch * factor``
    whose area holds ``min_tokens`` to ``max_tokens`` tokens, the aspect ratio kept."""
    step = patch * factor
    low, high = min_tokens * step * step, max_tokens * step * step
    h, w = max(step, _round_to(height, step)), max(step, _round_to(width, step))
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h, w = max(step, math.floor(height / beta / step) * step), max(step, math.floor(width / beta / step) * step)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = math.ceil(height * beta / step) * step, math.ceil(width * beta / step) * step
    return h, w


def too_large(height: int, width: int, patch: int, factor: int, max_tokens: int, tolerance: float) -> bool:
    """Whether the image is cut into tiles (when splitting is on)."""
    step = patch * factor
    h, w = max(patch, _round_to(height, step)), max(patch, _round_to(width, step))
    return h * w > max_tokens * step * step * tolerance


def tile_grid(height: int, width: int, min_tiles: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """``(rows, columns)`` of tiles: the grid whose aspect ratio is nearest the image's; between
    grids as near, the later (larger) one when the image covers more than half of it."""
    grids = sorted({(c, r) for n in range(min_tiles, max_tiles + 1) for c in range(1, n + 1) for r in range(1, n + 1)
                    if min_tiles <= c * r <= max_tiles}, key=lambda g: g[0] * g[1])
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best[1], best[0]


def view_tokens(rows: int, cols: int, factor: int) -> int:
    """Tokens of a view of ``rows x cols`` patches after the pixel unshuffle by ``factor``."""
    return math.ceil(rows / factor) * math.ceil(cols / factor)


class Lfm2VlImageProcessorPil:
    """Hugging Face's ``Lfm2VlImageProcessor`` in Pillow and NumPy (module docstring); configured by
    a ``preprocessor_config.json`` (:meth:`from_pretrained`) or keyword arguments."""

    def __init__(self, **config: Any) -> None:
        known = {k: config.get(k, v) for k, v in DEFAULTS.items()}
        for name, value in known.items():
            setattr(self, name, value)
        self.resample = Image.Resampling(int(known["resample"]))
        tile_patches = (self.tile_size // self.encoder_patch_size) ** 2 if self.do_image_splitting else 0
        self.max_num_patches = max(self.max_image_tokens * self.downsample_factor ** 2, tile_patches)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "Lfm2VlImageProcessorPil":
        return cls(**json.loads((Path(directory) / "preprocessor_config.json").read_text(encoding="utf-8")))

    def views(self, image: Image.Image) -> tuple[list[Image.Image], int, int, tuple[int, int]]:
        """The tower's views of one RGB image (tiles row by row, then the thumbnail; or the one
        resized image), its tile grid's ``(rows, columns)`` (1, 1 for one view) and the smart-resized
        ``(height, width)`` (the single view's or the thumbnail's)."""
        width, height = image.size
        patch, factor = self.encoder_patch_size, self.downsample_factor
        small_h, small_w = smart_size(height, width, patch, factor, self.min_image_tokens, self.max_image_tokens)
        splitting = self.do_image_splitting and not self.min_tiles == self.max_tiles == 1
        if splitting and too_large(height, width, patch, factor, self.max_image_tokens, self.max_pixels_tolerance):
            rows, cols = tile_grid(height, width, self.min_tiles, self.max_tiles, self.tile_size)
            tile = self.tile_size
            whole = image.resize((cols * tile, rows * tile), self.resample)
            views = [whole.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
            if self.use_thumbnail and rows * cols > 1:
                views.append(image.resize((small_w, small_h), self.resample))
            return views, rows, cols, (small_h, small_w)
        return [image.resize((small_w, small_h), self.resample)], 1, 1, (small_h, small_w)

    def patches(self, view: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """One view's patch rows (unpadded) and its patch grid ``(rows, columns)``."""
        pixels = np.asarray(view, dtype=np.float32)
        if self.do_rescale:
            pixels = pixels * np.float32(self.rescale_factor)
        if self.do_normalize:
            pixels = (pixels - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        p = self.encoder_patch_size
        rows, cols = pixels.shape[0] // p, pixels.shape[1] // p
        cut = pixels[: rows * p, : cols * p].reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        return cut.reshape(rows * cols, p * p * 3), (rows, cols)

    def __call__(self, images: Any, return_tensors: str | None = "np", **_: Any) -> dict[str, np.ndarray]:
        """``pixel_values`` (views, max_num_patches, patch * patch * 3), ``pixel_attention_mask``,
        ``spatial_shapes`` (views, 2), and per image ``image_rows``, ``image_cols``, ``image_sizes``."""
        images = images if isinstance(images, (list, tuple)) else [images]
        rows_out, masks, shapes, grid_rows, grid_cols, sizes = [], [], [], [], [], []
        for image in images:
            image = image.convert("RGB") if image.mode != "RGB" else image
            views, rows, cols, size = self.views(image)
            for view in views:
                patches, shape = self.patches(view)
                # padded to one length (do_pad; views never hold more than max_num_patches)
                padded = np.zeros((self.max_num_patches, patches.shape[1]), np.float32)
                padded[: len(patches)] = patches
                mask = np.zeros(self.max_num_patches, np.int32)
                mask[: len(patches)] = 1
                rows_out.append(padded)
                masks.append(mask)
                shapes.append(shape)
            grid_rows.append(rows)
            grid_cols.append(cols)
            sizes.append(size)
        return {"pixel_values": np.stack(rows_out), "pixel_attention_mask": np.stack(masks),
                "spatial_shapes": np.asarray(shapes, np.int64), "image_rows": np.asarray(grid_rows),
                "image_cols": np.asarray(grid_cols), "image_sizes": np.asarray(sizes)}


@dataclass(frozen=True)
class Lfm2VlLayout:
    """How one image is written in the prompt (plain data; module docstring): ``count`` reads the
    processor's output, ``tokens`` writes the image's whole expansion, markers included."""

    downsample_factor: int
    tokens_per_tile: int
    image_start: tuple[int, ...]  # <|image_start|>; empty without use_image_special_tokens
    image_end: tuple[int, ...]
    thumbnail: tuple[int, ...]  # <|img_thumbnail|>
    tile_markers: tuple[tuple[tuple[int, ...], ...], ...]  # [row][col]: <|img_row_R_col_C|>

    def count(self, processed: Any) -> tuple[int, tuple[int, int, int]]:
        """``(image tokens, (1, rows, columns))`` of one image's processor output."""
        shapes = np.asarray(processed["spatial_shapes"]).reshape(-1, 2)
        count = sum(view_tokens(int(h), int(w), self.downsample_factor) for h, w in shapes)
        rows, cols = (int(np.asarray(processed[k]).reshape(-1)[0]) if k in processed else 1 for k in ("image_rows", "image_cols"))
        return count, (1, rows, cols)

    def tokens(self, image_token: int, count: int, grid: tuple[int, int, int]) -> list[int]:
        rows, cols = grid[1], grid[2]
        out = list(self.image_start)
        if rows * cols <= 1:
            return out + [image_token] * count + list(self.image_end)
        if rows > len(self.tile_markers) or cols > len(self.tile_markers[0]):
            raise ValueError(f"an image of {rows}x{cols} tiles is over the {len(self.tile_markers)}x"
                             f"{len(self.tile_markers[0])} grid whose markers the prompt side knows")
        for r in range(rows):
            for c in range(cols):
                out += list(self.tile_markers[r][c]) + [image_token] * self.tokens_per_tile
        thumbnail = count - rows * cols * self.tokens_per_tile
        if thumbnail > 0:
            out += list(self.thumbnail) + [image_token] * thumbnail
        return out + list(self.image_end)
