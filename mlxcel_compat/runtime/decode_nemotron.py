"""Nemotron-H's blocks as the CPU decode runtime's layers: each Mamba-2 or attention block paired
with the MLP block after it.

Why: mlx-lm's Nemotron-H is a stack of one-branch blocks (``x + mixer(norm(x))``): Mamba-2 (``M``),
attention (``*``), a squared-ReLU MLP (``-``) or experts (``E``), and its ``make_cache`` gives a
cache only to the Mamba-2 and attention blocks. The decoder's layer is a mixer and an MLP with a
norm before each (``x += mixer(n1(x)); x += mlp(n2(x))``), one cache each: a Mamba-2 or attention
block followed by an MLP block is exactly that layer, and one followed by another mixer is that
layer without an MLP (the pass skips an MLP it has none of). Paired so, the decoder's layers and
the model's caches correspond one to one, and nothing else in the runtime needs to know the family
(:func:`decoder_view` presents the model as the decoder reads one: ``model.layers``,
``embed_tokens``, ``norm``, ``lm_head``).

Which models: blocks ``M``, ``*`` and ``-``, each ``-`` right after an ``M`` or ``*``; the
Mamba-2 mixers ``decode_mamba.py`` takes, attention without RoPE (Nemotron-H has none), the MLP
``down(relu(up(x))^2)``, float32 or ggml's blocks. Experts (``E``) keep MLX's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel_compat.runtime import decode_mamba
from mlxcel_compat.runtime.block_layers import BlockEmbedding, BlockLinear, block_weight_of
from mlxcel_compat.runtime.decode_layers import LayerWeights, linear_weights, norm_weights

PAIRED_TYPES = ("nemotron_h",)  # mlx-lm model types whose blocks are paired here


@dataclass
class PairedLayer:
    """A mixer block and the MLP block after it (if any), under the decoder's layer names."""

    input_layernorm: Any  # the mixer block's norm
    self_attn: Any = None  # an attention block's mixer
    mamba: Any = None  # a Mamba-2 block's mixer
    post_attention_layernorm: Any = None  # the MLP block's norm
    mlp: Any = None  # the MLP block's mixer


class DecoderView:
    """A Nemotron-H model as the decoder reads a model: ``model.layers`` (the paired layers),
    ``model.embed_tokens``, ``model.norm``; everything else is the model's own."""

    def __init__(self, model: Any, layers: list[PairedLayer]) -> None:
        backbone = model.backbone
        self.wrapped = model
        self.model = SimpleNamespace(layers=layers, embed_tokens=backbone.embeddings, norm=backbone.norm_f)

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def pair_blocks(blocks: list[Any]) -> list[PairedLayer] | str:
    """The blocks paired into layers, or why they cannot be."""
    layers: list[PairedLayer] = []
    for block in blocks:
        kind = block.block_type
        if kind in ("M", "*"):
            layers.append(PairedLayer(block.norm, **{"mamba" if kind == "M" else "self_attn": block.mixer}))
        elif kind == "-":
            if not layers or layers[-1].mlp is not None:
                return "an MLP block after no Mamba-2 or attention block"
            layers[-1].post_attention_layernorm, layers[-1].mlp = block.norm, block.mixer
        else:
            return f"blocks of kind {kind!r} (experts) run in MLX's step"
    return layers


def decoder_view(model: Any) -> Any:
    """``model`` as the decoder reads it: a :class:`DecoderView` of a Nemotron-H whose blocks pair
    up, else the model itself (:func:`unsupported` says why a Nemotron-H's do not)."""
    if getattr(getattr(model, "args", None), "model_type", None) not in PAIRED_TYPES or isinstance(model, DecoderView):
        return model
    layers = pair_blocks(model.backbone.layers)
    return model if isinstance(layers, str) else DecoderView(model, layers)


def is_paired(layer: Any) -> bool:
    return isinstance(layer, PairedLayer)


def unsupported(model: Any) -> str | None:
    """Why a Nemotron-H (``decoder_view``'s result) keeps MLX's step, or None if the runtime takes it."""
    if not isinstance(model, DecoderView):
        reason = pair_blocks(model.backbone.layers)
        return f"Nemotron-H: {reason}" if isinstance(reason, str) else "Nemotron-H: unexpected module layout"
    layers = model.model.layers
    if not isinstance(model.model.embed_tokens, (nn.Embedding, BlockEmbedding)):
        return "unexpected module layout"
    if not any(layer.self_attn is not None for layer in layers):
        return "no attention layer (a recurrent model's position is its attention layers')"
    linears = [model.model.embed_tokens, model.lm_head]
    norms = [model.model.norm]
    for layer in layers:
        if layer.mamba is not None:
            reason = decode_mamba.unsupported(layer.mamba)
            if reason is not None:
                return f"Mamba-2 layers (nemotron_h): {reason}"
            linears += decode_mamba.linear_modules(layer.mamba)
        else:
            attn = layer.self_attn
            if type(attn).__name__ != "NemotronHAttention":
                return "unexpected attention layout"
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if layer.mlp is not None:
            if type(layer.mlp).__name__ != "NemotronHMLP":
                return "unexpected layer layout"
            linears += [layer.mlp.up_proj, layer.mlp.down_proj]
            norms.append(layer.post_attention_layernorm)
        norms.append(layer.input_layernorm)
    if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in linears[2:]):
        return "unexpected attention layout"
    if not all(isinstance(n, nn.RMSNorm) for n in norms):
        return "norms other than RMSNorm"
    if any(m.weight.dtype != mx.float32 for m in linears if block_weight_of(m) is None):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def paired_layer(layer: PairedLayer) -> LayerWeights:
    """A paired layer as ``decode_layers.layer_weights`` gives one: its mixer (attention without
    RoPE, or Mamba-2), and its squared-ReLU MLP (no gate: up, relu^2, down) or none."""
    lin = linear_weights
    mlp = (dict(gate=None, up=lin(layer.mlp.up_proj), down=lin(layer.mlp.down_proj)) if layer.mlp is not None
           else dict(gate=None, up=None, down=None))
    norms = dict(n1=norm_weights(layer.input_layernorm), n2=norm_weights(layer.post_attention_layernorm))
    if layer.mamba is not None:
        return LayerWeights(**norms, q=None, k=None, v=None, o=None, q_norm=None, k_norm=None,
                            mamba=decode_mamba.mamba_weights(layer.mamba), **mlp)
    a = layer.self_attn
    return LayerWeights(**norms, q=lin(a.q_proj), k=lin(a.k_proj), v=lin(a.v_proj), o=lin(a.o_proj), q_norm=None,
                        k_norm=None, **mlp)


__all__ = ["DecoderView", "PAIRED_TYPES", "PairedLayer", "decoder_view", "is_paired", "pair_blocks", "paired_layer",
           "unsupported"]
