"""Idefics3 / SmolVLM's two parts that are not family rules: how an image cut into tiles is
written in the prompt (:class:`TileLayout`, plain data for the HTTP side) and the text model
those families run (mlx-lm's Llama holding mlx-vlm's weights, :func:`llama_language_model`).
``vision/families.py`` holds the family (``Idefics3``) that uses them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TileLayout:
    """How an image cut into tiles is written in the prompt (Idefics3 / SmolVLM; plain data):
    each tile of the grid as ``tile_prefix[row][col] + tokens_per_tile x <image>``, ``row_end``
    between rows, then the whole image as ``gap + global_start + tokens_per_tile x <image> +
    global_end`` (``gap`` only after a grid), as Idefics3Processor and llama.cpp's mtmd write it."""

    tokens_per_tile: int
    tile_prefix: tuple[tuple[tuple[int, ...], ...], ...]  # [row][col]: <fake_token_around_image><row_r_col_c>
    row_end: tuple[int, ...]  # "\n"
    gap: tuple[int, ...]  # "\n\n"
    global_start: tuple[int, ...]  # <fake_token_around_image><global-img>
    global_end: tuple[int, ...]  # <fake_token_around_image>

    def tokens(self, image_token: int, rows: int, cols: int) -> list[int]:
        tile = [image_token] * self.tokens_per_tile
        out: list[int] = []
        for r in range(rows):
            if r:
                out += self.row_end
            for c in range(cols):
                if r >= len(self.tile_prefix) or c >= len(self.tile_prefix[r]):
                    raise ValueError(f"an image of {rows}x{cols} tiles is over the {len(self.tile_prefix)}x{len(self.tile_prefix)} "
                                     "grid whose row and column markers the prompt side knows")
                out += list(self.tile_prefix[r][c]) + tile
        return out + list(self.gap if rows else ()) + list(self.global_start) + tile + list(self.global_end)


def llama_language_model(text_config: dict[str, Any], mlx_vlm_language: Any) -> Any:
    """mlx-lm's Llama with the weights of mlx-vlm's Idefics3 ``LanguageModel`` (which names its
    layers without the ``model.`` prefix and always has a head; a tied text model uses its embeddings)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(dict(text_config, model_type="llama")))
    tied = not hasattr(model, "lm_head")  # tie_word_embeddings: mlx-vlm's head is a copy of the embeddings
    weights = [(name if name.startswith("lm_head.") else f"model.{name}", value)
               for name, value in tree_flatten(mlx_vlm_language.parameters())
               if not (tied and name.startswith("lm_head."))]
    model.load_weights(weights, strict=True)
    model.eval()
    return model
