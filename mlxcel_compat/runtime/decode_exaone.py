"""EXAONE 3.5 (mlx-lm's ``exaone``) on the CPU decode runtime: its modules seen under llama's names.

Why a view: EXAONE 3.5's layer is llama's (RMS norms before attention and MLP, grouped-query
attention with RoPE, a SwiGLU MLP, tied embeddings), only named otherwise: ``transformer.wte``,
``transformer.h[i]`` with ``ln_1``, ``attn.attention`` (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj``), ``ln_2`` and ``mlp`` (``c_fc_0`` the gate, ``c_fc_1`` the up projection, ``c_proj``
the down one: ``c_proj(swiglu(c_fc_0(x), c_fc_1(x)))``), ``transformer.ln_f``. :func:`runtime_view`
wraps those very modules (no weight is copied: the view's parameters are the model's arrays, its
adapters the model's) in containers named as mlx-lm's llama names them, so the decoder reads the
llama layer it already runs. MLX's step, the KV cache (``make_prompt_cache`` of the model: a
``KVCache`` a layer) and the engine keep the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

MODEL_TYPE = "exaone"


@dataclass(frozen=True)
class ViewArgs:
    """What the decoder reads of a model's ``args``: its family, and the config it was built from
    (every other attribute is the model's own ``args``'s)."""

    model_type: str
    source: Any

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not set yet (a copy being made): no attribute, rather than a loop
            raise AttributeError(name)
        return getattr(self.source, name)


class ExaoneAttention(nn.Module):
    """EXAONE 3.5's ``AttentionModule`` under llama's names (``out_proj`` as ``o_proj``)."""

    def __init__(self, attention: Any) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = attention.q_proj, attention.k_proj, attention.v_proj
        self.o_proj = attention.out_proj
        self.rope = attention.rope
        self.n_heads, self.n_kv_heads, self.scale = attention.n_heads, attention.n_kv_heads, attention.scale


class ExaoneMLP(nn.Module):
    """EXAONE 3.5's MLP under llama's names: ``c_fc_0`` the gate, ``c_fc_1`` up, ``c_proj`` down."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.c_fc_0, mlp.c_fc_1, mlp.c_proj


class ExaoneLayer(nn.Module):
    def __init__(self, block: Any) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = block.ln_1, block.ln_2
        self.self_attn = ExaoneAttention(block.attn.attention)
        self.mlp = ExaoneMLP(block.mlp)


class ExaoneInner(nn.Module):
    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.embed_tokens, self.norm = transformer.wte, transformer.ln_f
        self.layers = [ExaoneLayer(block) for block in transformer.h]


class ExaoneView(nn.Module):
    """The model as the decoder reads it: ``model.layers``, ``embed_tokens``, ``norm``, the head
    (the embedding where tied), ``args``, and the KV types ``kv_precision.install`` gave the model."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.args = ViewArgs(MODEL_TYPE, model.args)
        self.model = ExaoneInner(model.transformer)
        self.tie_word_embeddings = bool(model.args.tie_word_embeddings)
        if not self.tie_word_embeddings:
            self.lm_head = model.lm_head
        self.kv_types = getattr(model, "kv_types", None)


def runtime_view(model: Any) -> Any:
    """``model`` as the CPU decode runtime reads it: an EXAONE 3.5 model's :class:`ExaoneView`, any
    other model itself."""
    if getattr(getattr(model, "args", None), "model_type", None) != MODEL_TYPE or not hasattr(model, "transformer"):
        return model
    return ExaoneView(model)


__all__ = ["MODEL_TYPE", "ExaoneView", "runtime_view"]
