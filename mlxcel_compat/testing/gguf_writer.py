"""Write a factory model as a GGUF file, the way llama.cpp's ``convert_hf_to_gguf.py`` would.

The weights, tokenizer and chat template are the ones of the Hugging Face directory built by
``model_directory.py`` for the same (family, size), so a test can load both and compare. The converter's
conventions are applied here, independently of the loader that undoes them:

- tensor names from gguf-py's ``TensorNameMap`` (``model.layers.0.self_attn.q_proj.weight`` ->
  ``blk.0.attn_q.weight``);
- llama-family Q/K rows permuted for ggml's interleaved RoPE (``LlamaModel.permute``);
- Gemma norm weights stored as ``1 + w`` (ggml multiplies by the weight itself);
- LFM2's depthwise convolution squeezed to 2-D;
- RoPE scaling from the directory's ``config.json`` (a test may add ``rope_scaling`` to a copy of
  a factory directory): ``linear`` and ``yarn`` as ``rope.scaling.*`` keys, Llama 3's as the
  ``rope_freqs`` tensor of per-frequency divisors;
- named chat templates (a ``tokenizer_config.json`` whose ``chat_template`` is a list of
  ``{name, template}``) as ``tokenizer.chat_template.NAME`` keys, ``default`` as the plain key;
- 1-D tensors (norms, biases) and the convolution stay F32; matrices take the requested type,
  falling back to F16 when a row does not fill whole 32-value blocks (as the converter does);
  the types past F16/Q8_0/Q4_0 are quantized by ggml's own quantizer (``ggml_cpu``, what
  llama-quantize runs, without an importance matrix), K-quants of rows that do not fill whole
  256-value blocks fall back as llama-quantize's do (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
  Q8_0; Q2_K and Q3_K to Q4_0, where llama-quantize takes IQ4_NL), and ``q4_k_m`` / ``q5_k_m``
  follow llama-quantize's mix: Q6_K for the output and for ``attn_v`` and ``ffn_down`` of the
  layers its ``use_more_bits`` picks;
- the tokenizer as ``gpt2`` BPE; the pre-tokenizer is named after how transformers splits text
  for the family (``gpt-2``, the regex of our tokenizer.json, except ``qwen2``: transformers
  applies Qwen2's regex to that model type), as the converter's tokenizer hash would find;
  token types CONTROL for special added tokens and USER_DEFINED for the others.

``split_max_tensors`` writes ``name-00001-of-0000N.gguf`` parts like ``gguf-split``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                               "q5_k", "q6_k", "q4_k_m", "q5_k_m")
# llama-quantize's fallbacks for K-quants of rows that are not whole 256-value blocks (Q2_K and
# Q3_K fall back to IQ4_NL there, which this server does not load: Q4_0 here).
_K_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


@dataclass(frozen=True)
class _Target:
    arch: str  # general.architecture
    permute_qk: bool  # llama-family Q/K row permutation
    norm_shift: float  # added to every *norm.weight
    pre: str = "gpt-2"  # tokenizer.ggml.pre: the split regex transformers applies to this family


_TARGETS: dict[str, _Target] = {
    "llama": _Target("llama", permute_qk=True, norm_shift=0.0),
    "mistral": _Target("llama", permute_qk=True, norm_shift=0.0),
    # transformers tokenizes model_type qwen2 with Qwen2's own regex, whatever tokenizer.json says,
    # and llama.cpp's converter names the pre-tokenizer after that behaviour.
    "qwen2": _Target("qwen2", permute_qk=False, norm_shift=0.0, pre="qwen2"),
    "qwen3": _Target("qwen3", permute_qk=False, norm_shift=0.0),
    "gemma3_text": _Target("gemma3", permute_qk=False, norm_shift=1.0),
    "lfm2": _Target("lfm2", permute_qk=False, norm_shift=0.0),
    "qwen2_coder": _Target("qwen2", permute_qk=False, norm_shift=0.0, pre="qwen2"),
}
# The families the family-wide GGUF tests run on (the FIM family has its own tests).
GGUF_FAMILIES: tuple[str, ...] = tuple(f for f in _TARGETS if f != "qwen2_coder")
# llama.cpp's metadata keys for the FIM tokens (what convert_hf_to_gguf writes for Qwen2.5-Coder).
FIM_KEYS = {"<|fim_prefix|>": "fim_pre", "<|fim_suffix|>": "fim_suf", "<|fim_middle|>": "fim_mid",
            "<|fim_pad|>": "fim_pad", "<|repo_name|>": "fim_rep", "<|file_sep|>": "fim_sep"}


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: within each head, interleave the two rotary halves."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _file_type(gguf_type: str) -> int:
    from gguf import LlamaFileType as F

    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0,
            "q4_1": F.MOSTLY_Q4_1, "q5_0": F.MOSTLY_Q5_0, "q5_1": F.MOSTLY_Q5_1, "q2_k": F.MOSTLY_Q2_K,
            "q3_k": F.MOSTLY_Q3_K_M, "q4_k": F.MOSTLY_Q4_K_S, "q5_k": F.MOSTLY_Q5_K_S, "q6_k": F.MOSTLY_Q6_K,
            "q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_m": F.MOSTLY_Q5_K_M}[gguf_type]


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v / ffn_down get more bits in *_M mixes."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, gguf_type: str, n_layers: int) -> str:
    """The type one matrix gets in a file of ``gguf_type`` (before the row-length fallbacks)."""
    if gguf_type not in ("q4_k_m", "q5_k_m"):
        return gguf_type
    base = gguf_type[:4]
    if name == "output.weight":
        return "q6_k"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "q6_k" if use_more_bits(layer, n_layers) else base
    return base


def stored_type(name: str, shape: tuple[int, ...], gguf_type: str, n_layers: int = 1) -> str:
    """The type one tensor of ``shape`` is stored as in a file of ``gguf_type``, the row-length
    fallbacks included: ``f32`` for 1-D tensors and the convolution, ``f16`` for rows that are not
    whole 32-value blocks, the K-quants' fallbacks for rows that are not whole 256-value blocks."""
    if len(shape) < 2 or gguf_type == "f32" or name.endswith("shortconv.conv.weight"):
        return "f32"
    if gguf_type == "f16" or shape[-1] % 32:
        return "f16"
    kind = tensor_type(name, gguf_type, n_layers)
    if kind in _K_FALLBACK and shape[-1] % 256:
        kind = _K_FALLBACK[kind]
    return kind


def _encode(name: str, data: np.ndarray, gguf_type: str, n_layers: int = 1) -> tuple[np.ndarray, Any]:
    """The stored array and its raw GGML type (None for plain float arrays)."""
    from gguf import GGMLQuantizationType, quants

    kind = stored_type(name, data.shape, gguf_type, n_layers)
    if kind == "f32":
        return data.astype(np.float32), None
    if kind == "f16":
        return data.astype(np.float16), None
    if kind in ("q8_0", "q4_0"):
        qtype = GGMLQuantizationType.Q8_0 if kind == "q8_0" else GGMLQuantizationType.Q4_0
        return quants.quantize(data.astype(np.float32), qtype), qtype
    from mlxcel_compat.runtime import ggml_cpu

    kernels = ggml_cpu.kernels()
    if isinstance(kernels, str):
        raise RuntimeError(f"writing {kind.upper()} tensors needs ggml's quantizer: {kernels}")
    qtype = GGMLQuantizationType[kind.upper()]
    rows = data.astype(np.float32).reshape(-1, data.shape[-1])
    return kernels.quantize(qtype, rows).reshape(*data.shape[:-1], -1), qtype


def _tensors(family: str, config: dict[str, Any], weights: dict[str, Any]) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in the converter's layout."""
    import gguf

    target = _TARGETS[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == target.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    for hf_name in sorted(weights):
        data = np.array(weights[hf_name], dtype=np.float32)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {target.arch}")
        if target.permute_qk and ".self_attn.q_proj." in hf_name:
            data = permute_rows(data, config["num_attention_heads"])
        elif target.permute_qk and ".self_attn.k_proj." in hf_name:
            data = permute_rows(data, config["num_key_value_heads"])
        if hf_name.endswith("norm.weight"):
            data = data + np.float32(target.norm_shift)
        if gguf_name.endswith("shortconv.conv.weight"):
            data = data.reshape(data.shape[0], data.shape[1])  # (C, K, 1) -> (C, K)
        out[gguf_name] = data
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(config)
    return out


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """The ``rope_freqs`` tensor the converter writes for ``rope_type: llama3``: per rotary
    frequency, the factor ggml divides the rotation speed by (1 for short wavelengths, ``factor``
    for long ones, a smooth blend between)."""
    scaling = config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    context = float(scaling.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (float(config["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in inv_freq:
        wavelength = 2 * math.pi / float(freq)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_rope_scaling(writer: Any, config: dict[str, Any]) -> None:
    import gguf

    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        if "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if "beta_slow" in scaling:
            writer.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))
    elif kind not in (None, "default", "llama3"):  # llama3 is a tensor (_tensors)
        raise ValueError(f"the GGUF writer does not write rope_scaling type {kind!r}")


def _add_hparams(writer: Any, family: str, config: dict[str, Any]) -> None:
    c = config
    _add_rope_scaling(writer, c)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_vocab_size(c["vocab_size"])
    if family == "lfm2":
        writer.add_feed_forward_length(c["block_ff_dim"])
        writer.add_head_count_kv([c["num_key_value_heads"] if t == "full_attention" else 0
                                  for t in c["layer_types"]])
        writer.add_layer_norm_rms_eps(c["norm_eps"])
        writer.add_shortconv_l_cache(c["conv_L_cache"])
        return
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family in ("llama", "mistral"):
        writer.add_rope_dimension_count(head_dim)
    if family == "gemma3_text":
        writer.add_sliding_window(c["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
        writer.add_rope_freq_base_swa(c["rope_local_base_freq"])


def _add_tokenizer(writer: Any, model_dir: Path, pre: str) -> None:
    from gguf import TokenType

    from . import tokenizer as tok

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    n_vocab = 1 + max(max(vocab.values()), *(a["id"] for a in tokenizer["added_tokens"]))
    tokens = [""] * n_vocab
    types = [int(TokenType.NORMAL)] * n_vocab
    for text, index in vocab.items():
        tokens[index] = text
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED)
        if added["content"] in FIM_KEYS:
            writer.add_uint32(f"tokenizer.ggml.{FIM_KEYS[added['content']]}_token_id", added["id"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.get("bos_token"):
        writer.add_bos_token_id(tok.token_id(config["bos_token"]))
    writer.add_eos_token_id(tok.token_id(config["eos_token"]))
    writer.add_pad_token_id(tok.token_id(config["pad_token"]))
    writer.add_add_bos_token(bool(config["add_bos_token"]))
    writer.add_add_eos_token(bool(config["add_eos_token"]))
    writer.add_chat_template(config["chat_template"])


def write_spm_tokenizer_gguf(out: str | Path, tokenizer_dir: str | Path, arch: str = "llama",
                             add_space_prefix: bool = True) -> Path:
    """A GGUF holding only the SentencePiece vocabulary of ``tokenizer_dir`` (``tokenizer.ggml.model = llama``).

    Written as the converter's SentencePiece path writes one: tokens in id order, a score per
    token that ranks the pieces in merge order (SentencePiece BPE scores a piece by minus its merge
    rank), token types UNKNOWN / CONTROL / BYTE / NORMAL, the special ids, ``add_space_prefix``,
    the BOS/EOS flags and the chat template. No tensors: it is for tokenizer tests.
    """
    import gguf
    from gguf import TokenType

    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}

    def kind(text: str) -> int:
        if text == tokenizer["model"].get("unk_token"):
            return int(TokenType.UNKNOWN)
        if text in specials:
            return int(TokenType.CONTROL)
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return int(TokenType.BYTE)
        return int(TokenType.NORMAL)

    types = [kind(t) for t in tokens]
    scores = [0.0 if k != TokenType.NORMAL else -float(vocab[t]) for t, k in zip(tokens, types)]
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_unk_token_id(vocab[config["unk_token"]])
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_add_bos_token(bool(config["add_bos_token"]))
    writer.add_add_eos_token(bool(config["add_eos_token"]))
    writer.add_chat_template(config["chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_gguf(family: str, size: str, out: str | Path, gguf_type: str = "f32",
               split_max_tensors: int = 0, model_dir: str | Path | None = None, pooling: str | None = None,
               reranker: bool = False, weights: dict[str, Any] | None = None,
               config: dict[str, Any] | None = None) -> list[Path]:
    """Write (family, size) as GGUF at ``out``; returns the written files (several when split).

    ``model_dir`` is the HF directory to take the tokenizer from (built on demand otherwise);
    ``pooling`` (none, mean, cls, last, rank) is written as ``<arch>.pooling_type``, as llama.cpp's
    converter writes it for an embedding model. ``reranker`` (qwen3): a Qwen3-Reranker-style file as
    the converter writes one: pooling rank, the rerank prompt as ``tokenizer.chat_template.rerank``
    and ``cls.output.weight``, the output head's rows of :func:`rerank_label_ids`. ``weights``
    and ``config``: other weights of the family's shape (a derived model, ``draft_pair.py``)
    instead of the (family, size) ones.
    """
    import gguf

    from .model_directory import ensure_model
    from .weights import random_weights

    if family not in _TARGETS:
        raise ValueError(f"family {family!r} has no GGUF writer; choose one of: {', '.join(GGUF_FAMILIES)}")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
    if weights is None or config is None:
        weights, config = random_weights(family, size)
    source = Path(model_dir) if model_dir is not None else ensure_model(family, size)
    directory_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if directory_config.get("rope_scaling"):
        config = {**config, "rope_scaling": directory_config["rope_scaling"]}
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(None, _TARGETS[family].arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"mlxcel-{family}-{size}")
    writer.add_file_type(_file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, family, config)
    if pooling is not None or reranker:
        writer.add_pooling_type(gguf.PoolingType[(pooling or "rank").upper()])
    _add_tokenizer(writer, source, _TARGETS[family].pre)
    tensors = _tensors(family, config, weights)
    if reranker:
        from mlxcel_compat.encoders.rerank import LABELS, QWEN3_RERANK_TEMPLATE

        if family != "qwen3":
            raise ValueError("only the qwen3 factory model has a reranker form")
        writer.add_classifier_output_labels(list(LABELS))
        writer.add_string("tokenizer.chat_template.rerank", QWEN3_RERANK_TEMPLATE)
        head = tensors.get("output.weight", tensors["token_embd.weight"])
        tensors["cls.output.weight"] = np.ascontiguousarray(head[list(rerank_label_ids(source))])
    for name, data in tensors.items():
        stored, raw_type = _encode(name, data, gguf_type, config["num_hidden_layers"])
        writer.add_tensor(name, stored, raw_dtype=raw_type)
    paths = writer.format_shard_names(out)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return paths


def rerank_label_ids(model_dir: str | Path) -> tuple[int, int]:
    """The factory reranker's "yes" and "no" rows: the first token of each word (the factory's
    vocabulary has no single "yes" token; a real Qwen3 vocabulary has both)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    yes, no = (tokenizer.encode(word, add_special_tokens=False).ids[0] for word in ("yes", "no"))
    return yes, no


def ensure_gguf(family: str = "llama", size: str = "tiny", gguf_type: str = "f32",
                cache_dir: str | Path | None = None) -> Path:
    """``<cache>/<family>-<size>-v<N>-<type>.gguf``, written on first use (atomically, like ``ensure_model``)."""
    import os
    import tempfile

    from .cache_dir import default_cache_dir
    from .model_directory import FORMAT_VERSION, ensure_model

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root.absolute() / f"{family}-{size}-v{FORMAT_VERSION}-{gguf_type}.gguf"
    if target.is_file():
        return target
    source = ensure_model(family, size, cache_dir)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", suffix=".gguf", dir=root)
    os.close(fd)
    try:
        write_gguf(family, size, tmp, gguf_type, model_dir=source)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# --------------------------------------------------------------------------- random-block files

# Llama-2-7B's dimensions (the vocabulary stays the factory tokenizer's).
LLAMA2_7B_DIMS: dict[str, int] = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=32, head_dim=128, intermediate_size=11008)
RANDOM_SEED = 20251201

# Byte offsets of the float16 scale fields in one block: (d, the min/dmin field or None). The
# values are y = d * A + m * B with A and B set by the block's other bytes (Q4_1/Q5_1 add m,
# the K-quants subtract dmin times a sub-block min), so a block is linear in these two fields.
_SCALE_FIELDS: dict[str, tuple[int, int | None]] = {
    "q4_0": (0, None), "q4_1": (0, 2), "q5_0": (0, None), "q5_1": (0, 2), "q8_0": (0, None),
    "q2_k": (80, 82), "q3_k": (108, None), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208, None),
}


def _set_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _random_blocks(rng: np.random.Generator, kind: str, n_blocks: int, d: float, min_ratio: float) -> np.ndarray:
    """``n_blocks`` blocks of ``kind``: random bytes, then d = ``d`` times a factor in [0.5, 1.5)
    per block and the min field ``min_ratio`` times that d (both finite float16)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]][1]
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), dtype=np.uint8).reshape(n_blocks, size)
    d_at, m_at = _SCALE_FIELDS[kind]
    scale = (np.float32(d) * (np.float32(0.5) + rng.random(n_blocks, dtype=np.float32))).astype(np.float16)
    _set_f16(blocks, d_at, scale)
    if m_at is not None:
        _set_f16(blocks, m_at, scale.astype(np.float32) * np.float32(min_ratio))
    return blocks


def _block_calibration(kind: str) -> tuple[float, float]:
    """``(min_ratio, unit_std)`` for random blocks of ``kind``: the min field as a multiple of d
    that centres the values on 0, and the values' standard deviation when d's factor is 1.

    Measured with gguf-py's dequantizer on a fixed sample, using the linearity in the two fields
    (a sample with the min field 0, and one with d 0, give A and B). Every value of a block whose
    two fields are 0 must be 0: that checks the field offsets.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind.upper()]
    d_at, m_at = _SCALE_FIELDS[kind]
    rng = np.random.default_rng(RANDOM_SEED)
    base = _random_blocks(rng, kind, 512, 1.0, 0.0)
    factors = base[:, d_at:d_at + 2].copy().view("<f2").astype(np.float32).reshape(-1, 1)
    block_values = GGML_QUANT_SIZES[qtype][0]

    def values(d_on: bool, m_on: bool) -> np.ndarray:
        blocks = base.copy()
        _set_f16(blocks, d_at, factors[:, 0] if d_on else np.zeros(len(blocks), np.float32))
        if m_at is not None:
            _set_f16(blocks, m_at, factors[:, 0] if m_on else np.zeros(len(blocks), np.float32))
        return quants.dequantize(blocks, qtype).reshape(len(blocks), block_values).astype(np.float64)

    if np.any(values(False, False)):
        raise AssertionError(f"{kind}: the scale fields are not at {_SCALE_FIELDS[kind]}")
    a = values(True, False)
    ratio = 0.0
    if m_at is not None:
        b = values(False, True)
        ratio = float(-a.mean() / b.mean())
        a = a + ratio * b
    return ratio, float(a.std())


def random_tensor_shapes(family: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF name -> NumPy shape of every tensor a converted ``family`` model of ``config`` holds,
    in the order ``write_gguf`` writes them (HF names sorted)."""
    import gguf

    from .weights import instantiate, stored_shapes

    target = _TARGETS[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == target.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    shapes = stored_shapes(instantiate(config), config)  # lazy arrays: no memory
    out: dict[str, tuple[int, ...]] = {}
    for hf_name in sorted(shapes):
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {target.arch}")
        shape = shapes[hf_name]
        out[gguf_name] = shape[:2] if gguf_name.endswith("shortconv.conv.weight") else shape
    return out


def random_config(family: str, dims: dict[str, Any] | None) -> dict[str, Any]:
    """The factory's ``small`` config of ``family`` with ``dims`` in place of its dimensions
    (``head_dim`` follows ``hidden_size / num_attention_heads`` unless given)."""
    from .families import model_config

    config = model_config(family, "small")
    dims = dict(dims or {})
    if "layer_types" in config and "num_hidden_layers" in dims and "layer_types" not in dims:
        raise ValueError(f"{family} has per-layer types: give layer_types with num_hidden_layers")
    if "head_dim" in config and "head_dim" not in dims and ({"hidden_size", "num_attention_heads"} & set(dims)):
        dims["head_dim"] = dims.get("hidden_size", config["hidden_size"]) // dims.get(
            "num_attention_heads", config["num_attention_heads"])
    config.update(dims)
    return config


def write_random_gguf(out: str | Path, family: str = "llama", dims: dict[str, Any] | None = None,
                      gguf_type: str = "q4_k_m", seed: int = RANDOM_SEED,
                      model_dir: str | Path | None = None) -> Path:
    """Write a random-weight GGUF of any size, one tensor at a time, without a float32 source.

    The file is what ``write_gguf`` would write for the factory's ``family`` with its dimensions
    replaced by ``dims`` (``LLAMA2_7B_DIMS`` for a 7B-shaped file): the same metadata, tokenizer
    and chat template, the tensor types of ``gguf_type`` (``stored_type``: llama-quantize's
    Q4_K_M/Q5_K_M mixes and row-length fallbacks). Quantized tensors are valid random blocks:
    random bytes, with finite float16 scale fields chosen so that the values have mean about 0
    and standard deviation 1/sqrt(fan_in), as the factory's weights (``_block_calibration``).
    Float tensors are normal with that deviation; norm weights are 1. The bytes depend only on
    the arguments. The memory used is one tensor's blocks. ``model_dir`` is a factory directory
    of ``family`` to take the tokenizer from (the tiny one is built on demand otherwise).
    """
    import gguf

    from .families import FAMILY_SPECS
    from .model_directory import ensure_model

    if family not in _TARGETS:
        raise ValueError(f"family {family!r} has no GGUF writer; choose one of: {', '.join(GGUF_FAMILIES)}")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
    config = random_config(family, dims)
    n_layers = config["num_hidden_layers"]
    shapes = random_tensor_shapes(family, config)
    kinds = {name: stored_type(name, shape, gguf_type, n_layers) for name, shape in shapes.items()}
    calibration = {k: _block_calibration(k) for k in sorted(set(kinds.values())) if k in _SCALE_FIELDS}
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), _TARGETS[family].arch)
    writer.add_name(f"mlxcel-{family}-random")
    writer.add_file_type(_file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, family, config)
    source = Path(model_dir) if model_dir is not None else ensure_model(family, "tiny")  # one per family
    _add_tokenizer(writer, source, _TARGETS[family].pre)
    for name, shape in shapes.items():
        kind = kinds[name]
        if kind in ("f32", "f16"):
            dtype = np.float32 if kind == "f32" else np.float16
            writer.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = shape[-1] // block_values * block_bytes
            writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                                   math.prod(shape[:-1]) * row_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    norm_one = np.float32(FAMILY_SPECS[family].norm_one + _TARGETS[family].norm_shift)
    for name, shape in shapes.items():
        kind = kinds[name]
        std = 1.0 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.0
        if len(shape) == 1:
            data: np.ndarray = (np.full(shape, norm_one, np.float32) if "norm" in name
                                else np.zeros(shape, np.float32))
        elif kind in ("f32", "f16"):
            data = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(
                np.float32 if kind == "f32" else np.float16)
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            ratio, unit_std = calibration[kind]
            n_blocks = math.prod(shape) // gguf.GGML_QUANT_SIZES[qtype][0]
            data = _random_blocks(rng, kind, n_blocks, std / unit_std, ratio)
        writer.write_tensor_data(data)
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mlxcel_compat.testing.gguf_writer --random --out FILE`` (a 7B-shaped Q4_K_M
    by default; ``--dims hidden_size=256,num_hidden_layers=4`` for other shapes)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mlxcel_compat.testing.gguf_writer",
                                     description="Write a random-block GGUF of any size (write_random_gguf).")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--family", default="llama", help=f"one of: {', '.join(GGUF_FAMILIES)}")
    parser.add_argument("--gguf-type", default="q4_k_m", help=f"one of: {', '.join(GGUF_TYPES)}")
    parser.add_argument("--dims", default="",
                        help="KEY=INT,... replacing the family's dimensions (default: Llama-2-7B's)")
    parser.add_argument("--seed", type=int, default=RANDOM_SEED)
    args = parser.parse_args(argv)
    dims: dict[str, Any] = dict(LLAMA2_7B_DIMS)
    if args.dims:
        dims = {k.strip(): int(v) for k, v in (item.split("=", 1) for item in args.dims.split(","))}
    try:
        path = write_random_gguf(args.out, args.family, dims, args.gguf_type, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
