"""BERT-family encoders in MLX: BERT, XLM-RoBERTa and NomicBERT (bge, e5, gte, bge-reranker,
nomic-embed-text).

mlx-lm is the model zoo for decoders but has no encoder. The MLX ecosystem's ``mlx-embeddings``
does, but its package requires mlx-vlm (and through it opencv, datasets, mlx-audio, fastapi, ...)
and importing it pulls them in: a server that only embeds text would carry all of that. The
architecture is small, so it is written here, following transformers' ``BertModel`` and
``XLMRobertaModel`` (which compute the same thing) and llama.cpp's ``bert`` graph:

- embeddings: token + absolute position + token type, then LayerNorm;
- each layer: bidirectional self-attention over the real tokens (a padding mask hides the rest),
  output projection, residual, LayerNorm ("post-norm"), then a GELU (exact, erf) MLP, residual,
  LayerNorm;
- no final norm: the last layer's output is the hidden state that is pooled.

XLM-R numbers its positions from ``pad_token_id + 1`` (its position table's first rows are never
used). As llama.cpp's converter does, those rows are dropped at load, so positions start at 0
for every model here and the table's length is the longest input the model takes.

NomicBERT (nomic-embed-text) keeps the post-norm layout but has rotary positions (NeoX style, no
position table), a SwiGLU MLP (``down(silu(gate(x)) * up(x))``) and no biases in its linear layers.

A cross-encoder (``*ForSequenceClassification``) scores the first token's final hidden state:
BERT through its pooler (dense + tanh) and a linear classifier, XLM-R through its classification
head (dense + tanh, then ``out_proj``): both are ``dense -> tanh -> out`` (:class:`ClassifierHead`).
llama.cpp's GGUF names the dense ``cls`` and the output ``cls.output``; when ``cls`` is absent
(llama.cpp's converter drops BERT's pooler) the head is the output projection alone, as in
llama.cpp's graph.

Weights are float32: encoders are small, and on the CPU float16 matmuls are ~40x slower.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ENCODER_TYPES = ("bert", "xlm-roberta", "nomic_bert")


@dataclass(frozen=True)
class EncoderConfig:
    """The numbers that shape an encoder, read from config.json or a GGUF header."""

    model_type: str  # bert | xlm-roberta (llama.cpp writes both as the "bert" architecture) | nomic_bert
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    n_positions: int  # usable positions: the table's rows once XLM-R's offset rows are dropped
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_offset: int = 0  # rows dropped from a Hugging Face position table (XLM-R: pad_token_id + 1)
    num_labels: int = 0  # > 0: a sequence-classification head (a cross-encoder)
    head_dense: bool = True  # the head has its dense + tanh layer (BERT's pooler, XLM-R's classifier.dense)
    rotary: bool = False  # NomicBERT: rotary positions (NeoX style) instead of a position table
    rope_theta: float = 1000.0
    gated: bool = False  # NomicBERT: a SwiGLU MLP (up, gate, down) instead of GELU (up, down)
    bias: bool = True  # the linear layers of the attention and the MLP have biases

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "EncoderConfig":
        """From a Hugging Face config.json (``model_type`` bert or xlm-roberta)."""
        model_type = str(config.get("model_type", ""))
        if model_type not in ENCODER_TYPES:
            raise ValueError(f"not a BERT-family encoder: model_type {model_type!r} (known: {', '.join(ENCODER_TYPES)})")
        if model_type == "nomic_bert":
            return cls._from_nomic(config)
        act = str(config.get("hidden_act", "gelu"))
        if act != "gelu":
            raise ValueError(f"{model_type}: hidden_act {act!r} is not supported (only gelu)")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{model_type}: position_embedding_type {config['position_embedding_type']!r} is not supported")
        offset = int(config.get("pad_token_id", 1)) + 1 if model_type == "xlm-roberta" else 0
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            n_positions=int(config["max_position_embeddings"]) - offset,
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            position_offset=offset,
            num_labels=_num_labels(config),
        )


    @classmethod
    def _from_nomic(cls, config: dict[str, Any]) -> "EncoderConfig":
        """nomic-ai's own config keys (n_embd, n_layer, ...) or transformers' NomicBertConfig's."""
        def key(*names: str, default: Any = None) -> Any:
            for name in names:
                if config.get(name) is not None:
                    return config[name]
            if default is None:
                raise ValueError(f"nomic_bert config.json lacks {' / '.join(names)}")
            return default

        act = str(key("hidden_act", "activation_function", default="swiglu"))
        if act not in ("swiglu", "silu"):
            raise ValueError(f"nomic_bert: activation {act!r} is not supported (only swiglu)")
        if key("rotary_emb_fraction", default=1.0) != 1.0 or key("rotary_emb_interleaved", default=False):
            raise ValueError("nomic_bert: only full, non-interleaved rotary embeddings are supported")
        if key("prenorm", default=False) or key("moe_every_n_layers", default=0):
            raise ValueError("nomic_bert: pre-norm and MoE variants are not supported")
        rope = config.get("rope_parameters") or {}
        n_positions = int(key("max_position_embeddings", "n_positions", default=2048))
        if n_positions == 8192 and int(config.get("max_trained_positions", 2048)) == 2048:
            n_positions = 2048  # what llama.cpp's converter says nomic-embed-text v1/v1.5 are trained for
        return cls(
            model_type="nomic_bert",
            vocab_size=int(key("vocab_size")),
            hidden_size=int(key("hidden_size", "n_embd")),
            num_hidden_layers=int(key("num_hidden_layers", "n_layer")),
            num_attention_heads=int(key("num_attention_heads", "n_head")),
            intermediate_size=int(key("intermediate_size", "n_inner")),
            n_positions=n_positions,
            type_vocab_size=int(key("type_vocab_size", default=2)),
            layer_norm_eps=float(key("layer_norm_eps", "layer_norm_epsilon", default=1e-12)),
            num_labels=0,
            rotary=True,
            rope_theta=float(rope.get("rope_theta") or key("rotary_emb_base", "rope_theta", default=1000.0)),
            gated=True,
            bias=bool(config.get("qkv_proj_bias", False)),
        )


def is_classifier(config: dict[str, Any]) -> bool:
    """A cross-encoder checkpoint: its architecture is ``*ForSequenceClassification``."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def is_encoder_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") in ENCODER_TYPES


def _num_labels(config: dict[str, Any]) -> int:
    if not is_classifier(config):
        return 0
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(config.get("num_labels", 2))


def _make_modules() -> tuple[Any, Any]:
    """The MLX module classes, built on first use: importing this file must not import MLX
    (the HTTP side reads :class:`EncoderConfig` and the tokenizer helpers)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxcel_compat.runtime import cpu_fusion

    class Embeddings(nn.Module):
        def __init__(self, c: EncoderConfig) -> None:
            super().__init__()
            self.tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            if not c.rotary:
                self.positions = nn.Embedding(c.n_positions, c.hidden_size)
            self.types = nn.Embedding(max(1, c.type_vocab_size), c.hidden_size)
            self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

        def __call__(self, ids: mx.array, types: mx.array) -> mx.array:
            x = self.tokens(ids) + self.types(types)
            if "positions" in self:
                x = x + self.positions(mx.arange(ids.shape[1])[None, :])
            return self.norm(x)

    class Layer(nn.Module):
        def __init__(self, c: EncoderConfig) -> None:
            super().__init__()
            h = c.hidden_size
            self.n_heads = c.num_attention_heads
            self.head_dim = h // c.num_attention_heads
            self.scale = 1.0 / math.sqrt(self.head_dim)
            self.rope_theta = c.rope_theta if c.rotary else None
            self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=c.bias) for _ in range(4))
            self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
            self.up = nn.Linear(h, c.intermediate_size, bias=c.bias)
            if c.gated:
                self.gate = nn.Linear(h, c.intermediate_size, bias=c.bias)
            self.down = nn.Linear(c.intermediate_size, h, bias=c.bias)
            self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

        def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
            b, n, h = x.shape

            def heads(t: mx.array) -> mx.array:
                return t.reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)

            q, k = heads(self.q(x)), heads(self.k(x))
            if self.rope_theta is not None:  # rotate-half (NeoX) rotary, positions 0..n-1
                q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=0)
                k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=0)
            att = mx.fast.scaled_dot_product_attention(q, k, heads(self.v(x)), scale=self.scale, mask=mask)
            x = self.attn_norm(x + self.o(att.transpose(0, 2, 1, 3).reshape(b, n, h)))
            if "gate" in self:
                return self.out_norm(x + self.down(nn.silu(self.gate(x)) * self.up(x)))
            return self.out_norm(x + self.down(cpu_fusion.gelu(self.up(x))))

    class ClassifierHead(nn.Module):
        """``out(tanh(dense(h_first)))``, or ``out(h_first)`` without the dense layer."""

        def __init__(self, c: EncoderConfig) -> None:
            super().__init__()
            if c.head_dense:
                self.dense = nn.Linear(c.hidden_size, c.hidden_size)
            self.out = nn.Linear(c.hidden_size, c.num_labels)

        def __call__(self, first: mx.array) -> mx.array:
            if "dense" in self:
                first = mx.tanh(self.dense(first))
            return self.out(first)

    class Encoder(nn.Module):
        """Token ids (B, L) -> final hidden states (B, L, hidden); :meth:`classify` scores them."""

        is_encoder = True  # engine/embedding.py's cue: bidirectional, one pass, no KV cache

        def __init__(self, c: EncoderConfig) -> None:
            super().__init__()
            self.config = c
            self.embed = Embeddings(c)
            self.layers = [Layer(c) for _ in range(c.num_hidden_layers)]
            if c.num_labels > 0:
                self.head = ClassifierHead(c)

        def __call__(self, ids: mx.array, types: mx.array | None = None, lengths: list[int] | None = None) -> mx.array:
            """Args:
                ids: (B, L) token ids, each row right-padded to L.
                types: (B, L) token type ids (segment A 0, B 1), or None for all 0.
                lengths: each row's real length (None: every row is full); padded keys are masked.
            """
            if types is None or self.config.type_vocab_size <= 1:  # one type row: segment B is type 0 too
                types = mx.zeros(ids.shape, dtype=mx.int32)
            mask = None
            if lengths is not None and any(n < ids.shape[1] for n in lengths):
                keep = mx.arange(ids.shape[1])[None, :] < mx.array(lengths)[:, None]
                mask = mx.where(keep, 0.0, -math.inf)[:, None, None, :].astype(mx.float32)
            x = self.embed(ids, types)
            for layer in self.layers:
                x = layer(x, mask)
            return x

        def classify(self, hidden: mx.array) -> mx.array:
            """(B, L, hidden) -> (B, num_labels): the head on each row's first token."""
            if "head" not in self:
                raise ValueError("this encoder has no sequence-classification head")
            return self.head(hidden[:, 0])

    return Encoder, ClassifierHead


_MODULES: tuple[Any, Any] | None = None


def build_encoder(config: EncoderConfig) -> Any:
    """A fresh, randomly initialised :class:`Encoder` (an ``mlx.nn.Module``)."""
    global _MODULES
    if _MODULES is None:
        _MODULES = _make_modules()
    return _MODULES[0](config)


# --- weight names -------------------------------------------------------------------------------

# Hugging Face names (model prefix "bert." / "roberta." stripped) -> this module's names.
_HF_NAMES = (
    (r"embeddings\.word_embeddings\.(\w+)", r"embed.tokens.\1"),
    (r"embeddings\.position_embeddings\.(\w+)", r"embed.positions.\1"),
    (r"embeddings\.token_type_embeddings\.(\w+)", r"embed.types.\1"),
    (r"embeddings\.LayerNorm\.(\w+)", r"embed.norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(\w+)", r"layers.\1.q.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(\w+)", r"layers.\1.k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(\w+)", r"layers.\1.v.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(\w+)", r"layers.\1.o.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(\w+)", r"layers.\1.attn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(\w+)", r"layers.\1.up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(\w+)", r"layers.\1.down.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(\w+)", r"layers.\1.out_norm.\2"),
)
_HF_HEADS = {
    # BertForSequenceClassification: the pooler's dense + tanh, then a linear classifier.
    "bert": ((r"pooler\.dense\.(\w+)", r"head.dense.\1"), (r"classifier\.(weight|bias)", r"head.out.\1")),
    # XLMRobertaForSequenceClassification: classifier.dense + tanh, then classifier.out_proj.
    "xlm-roberta": ((r"classifier\.dense\.(\w+)", r"head.dense.\1"), (r"classifier\.out_proj\.(\w+)", r"head.out.\1")),
}
# NomicBERT: nomic-ai's checkpoint names, then transformers' NomicBertModel's (its save format).
_NOMIC_NAMES = (
    (r"embeddings\.word_embeddings\.(\w+)", r"embed.tokens.\1"),
    (r"embeddings\.token_type_embeddings\.(\w+)", r"embed.types.\1"),
    (r"(?:emb_ln|embeddings\.LayerNorm)\.(\w+)", r"embed.norm.\1"),
    (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.(\w+)", r"layers.\1.qkv.\2"),  # split below
    (r"encoder\.layers\.(\d+)\.attn\.out_proj\.(\w+)", r"layers.\1.o.\2"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc11\.(\w+)", r"layers.\1.up.\2"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc12\.(\w+)", r"layers.\1.gate.\2"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.(\w+)", r"layers.\1.down.\2"),
    (r"encoder\.layers\.(\d+)\.norm1\.(\w+)", r"layers.\1.attn_norm.\2"),
    (r"encoder\.layers\.(\d+)\.norm2\.(\w+)", r"layers.\1.out_norm.\2"),
    (r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.(\w+)", r"layers.\1.\2.\3"),
    (r"layers\.(\d+)\.mlp\.(up|gate|down)_proj\.(\w+)", r"layers.\1.\2.\3"),
    (r"layers\.(\d+)\.post_attention_layernorm\.(\w+)", r"layers.\1.attn_norm.\2"),
    (r"layers\.(\d+)\.post_mlp_layernorm\.(\w+)", r"layers.\1.out_norm.\2"),
)
# llama.cpp's GGUF names (src/llama-arch.cpp) -> this module's names.
GGUF_NAMES = (
    (r"token_embd\.weight", "embed.tokens.weight"),
    (r"position_embd\.weight", "embed.positions.weight"),
    (r"token_types\.weight", "embed.types.weight"),
    (r"token_embd_norm\.(weight|bias)", r"embed.norm.\1"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"layers.\1.q.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"layers.\1.k.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"layers.\1.v.\2"),
    (r"blk\.(\d+)\.attn_qkv\.(weight|bias)", r"layers.\1.qkv.\2"),  # fused (nomic-bert): split below
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"layers.\1.o.\2"),
    (r"blk\.(\d+)\.attn_output_norm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"layers.\1.up.\2"),
    (r"blk\.(\d+)\.ffn_gate\.(weight|bias)", r"layers.\1.gate.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"layers.\1.down.\2"),
    (r"blk\.(\d+)\.layer_output_norm\.(weight|bias)", r"layers.\1.out_norm.\2"),
    (r"cls\.output\.(weight|bias)", r"head.out.\1"),
    (r"cls\.(weight|bias)", r"head.dense.\1"),
)


def _rename(name: str, table: Any) -> str | None:
    for pattern, target in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, target, name)
    return None


def hf_weights(config: EncoderConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Hugging Face checkpoint's tensors under this module's names, float32; unused ones
    (MLM heads, a plain model's pooler, ``position_ids`` buffers) are dropped."""
    if config.model_type == "nomic_bert":
        table: Any = _NOMIC_NAMES
    else:
        table = _HF_NAMES + (_HF_HEADS[config.model_type] if config.num_labels > 0 else ())
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        for prefix in ("bert.", "roberta."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        target = _rename(name, table)
        if target is None:
            continue
        value = np.asarray(value, dtype=np.float32)
        if target == "embed.positions.weight":
            value = value[config.position_offset:]
        out[target] = value
    return _split_qkv(out)


def _split_qkv(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A fused query/key/value projection (rows q, then k, then v) as three."""
    for name in [n for n in weights if ".qkv." in n]:
        for part, rows in zip("qkv", np.split(weights.pop(name), 3, axis=0)):
            weights[name.replace(".qkv.", f".{part}.")] = np.ascontiguousarray(rows)
    return weights


def gguf_target(name: str) -> str | None:
    """This module's name for a GGUF tensor (None: a tensor the encoder does not use)."""
    return _rename(name, GGUF_NAMES)


def gguf_weights(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A GGUF's tensors (already dequantized, NumPy row-major) under this module's names."""
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        target = _rename(name, GGUF_NAMES)
        if target is not None:
            out[target] = np.asarray(value, dtype=np.float32)
    return _split_qkv(out)


def load_weights(model: Any, weights: dict[str, np.ndarray]) -> None:
    """Install ``weights`` (this module's names; the dict is emptied of them as they are copied
    into MLX); every parameter must be given, in its shape."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"encoder weights missing: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    for name, value in weights.items():
        if name in expected and tuple(expected[name].shape) != value.shape:
            raise ValueError(f"encoder weight {name}: shape {value.shape}, expected {tuple(expected[name].shape)}")
    loaded = []
    for name in [n for n in weights if n in expected]:
        loaded.append((name, mx.array(weights.pop(name))))  # each NumPy copy goes once MLX holds it
        mx.eval(loaded[-1][1])
    model.load_weights(loaded)
    mx.eval(model.parameters())


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's ``*.safetensors`` files, as NumPy arrays (float32 for
    half-precision ones, which NumPy cannot hold as bfloat16)."""
    import mlx.core as mx

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    out: dict[str, np.ndarray] = {}
    for file in files:
        for name, value in mx.load(str(file)).items():
            if value.dtype in (mx.float16, mx.bfloat16):
                value = value.astype(mx.float32)
            out[name] = np.array(value)
    return out


def load_directory(directory: Path) -> tuple[Any, dict[str, Any]]:
    """The encoder of a Hugging Face directory, and its config.json."""
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config = EncoderConfig.from_hf(raw)
    weights = hf_weights(config, read_safetensors(directory))
    if config.num_labels > 0 and "head.dense.weight" not in weights:
        config = replace(config, head_dense=False)
    model = build_encoder(config)
    load_weights(model, weights)
    return model, raw


def pair_encoding(tokenizer: Any, first: str, second: str) -> tuple[list[int], list[int]]:
    """A (query, document) pair as the model's own tokenizer joins it: ids and token types
    (``[CLS] q [SEP] d [SEP]`` with types 0/1 for BERT, ``<s> q </s></s> d </s>`` for XLM-R).

    A cross-encoder was trained on exactly this layout, so this is what transformers and
    sentence-transformers' ``CrossEncoder`` feed it. (llama-server's own layout for a GGUF
    without a rerank template is ``BOS q EOS SEP d EOS`` by the vocabulary's flags, all of type 0.)
    """
    # The served tokenizer and an HF tokenizer are callable; mlx-lm's TokenizerWrapper wraps one.
    hf = tokenizer if callable(tokenizer) else tokenizer._tokenizer
    encoded = hf(first, second)
    types = encoded.get("token_type_ids") or [0] * len(encoded["input_ids"])
    return list(encoded["input_ids"]), list(types)
