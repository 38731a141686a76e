"""Tiny random-weight BERT-family encoders for tests: embedders and a cross-encoder.

Three kinds, each a Hugging Face directory that transformers loads as it is (``AutoModel``,
``AutoModelForSequenceClassification``) and that this server loads through ``encoders/bert.py``:

- ``bert``: a ``BertModel`` embedder with a WordPiece tokenizer and sentence-transformers files
  saying mean pooling (bge/e5/gte shape);
- ``xlm-roberta``: an ``XLMRobertaModel`` embedder with a Unigram tokenizer and CLS pooling
  (bge-m3 shape; positions numbered from ``pad_token_id + 1``);
- ``bert-reranker``: a ``BertForSequenceClassification`` cross-encoder with one label (the
  ms-marco cross-encoder / bge-reranker shape);
- ``xlm-roberta-reranker``: an ``XLMRobertaForSequenceClassification`` cross-encoder (bge-reranker's
  shape: ``classifier.dense`` + tanh, then ``classifier.out_proj``);
- ``nomic-bert``: a ``NomicBertModel`` embedder (nomic-embed-text shape: rotary positions, SwiGLU,
  no linear biases) with the WordPiece tokenizer and mean pooling, its weights under nomic-ai's
  checkpoint names (``emb_ln``, ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` ...).

Weights come from a fixed NumPy seed; the tokenizers are trained offline with ``tokenizers`` on
the factory's generated corpus (``testing/corpus.py``), so a build takes well under a second.
:func:`write_encoder_gguf` writes the same weights and vocabulary as llama.cpp's converter writes
a BERT-family model (architecture ``bert``: XLM-R's offset position rows dropped, the WordPiece
vocabulary in "phantom space" form, pooling as ``bert.pooling_type``), except that a BERT
cross-encoder's pooler is kept as ``cls`` (the converter drops it, which changes the scores).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cache_dir import build_directory, default_cache_dir

FORMAT_VERSION = 2
WEIGHT_SEED = 20261202
VOCAB_SIZE = 1000
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


@dataclass(frozen=True)
class EncoderSpec:
    kind: str
    model_type: str  # bert | xlm-roberta
    architecture: str
    pooling: str  # what sentence-transformers' files (and the GGUF) declare: mean | cls | rank
    num_labels: int = 0
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    n_positions: int = 64  # usable positions (XLM-R's table has pad_token_id + 1 more rows)


SPECS: dict[str, EncoderSpec] = {
    s.kind: s
    for s in (
        EncoderSpec("bert", "bert", "BertModel", "mean"),
        EncoderSpec("xlm-roberta", "xlm-roberta", "XLMRobertaModel", "cls"),
        EncoderSpec("bert-reranker", "bert", "BertForSequenceClassification", "rank", num_labels=1),
        EncoderSpec("nomic-bert", "nomic_bert", "NomicBertModel", "mean"),
        EncoderSpec("xlm-roberta-reranker", "xlm-roberta", "XLMRobertaForSequenceClassification", "rank", num_labels=1),
        # bge-small-en's shape (33M parameters with its vocabulary): for benchmarks, not tests
        EncoderSpec("bert-small", "bert", "BertModel", "mean", hidden_size=384, num_hidden_layers=12,
                    num_attention_heads=12, intermediate_size=1536, n_positions=512),
    )
}
KINDS = tuple(SPECS)


def _spec(kind: str) -> EncoderSpec:
    if kind not in SPECS:
        raise ValueError(f"unknown encoder kind {kind!r}; choose one of: {', '.join(KINDS)}")
    return SPECS[kind]


def _xlmr(spec: EncoderSpec) -> bool:
    return spec.model_type == "xlm-roberta"


def _nomic(spec: EncoderSpec) -> bool:
    return spec.model_type == "nomic_bert"


NOMIC_ROPE_THETA = 1000.0


def config_for(kind: str) -> dict[str, Any]:
    """The directory's config.json."""
    s = _spec(kind)
    pad = 1 if _xlmr(s) else 0
    config: dict[str, Any] = {
        "architectures": [s.architecture],
        "model_type": s.model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "intermediate_size": s.intermediate_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": s.n_positions + (pad + 1 if _xlmr(s) else 0),
        "type_vocab_size": 1 if _xlmr(s) else 2,
        "layer_norm_eps": 1e-5 if _xlmr(s) else 1e-12,
        "pad_token_id": pad,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
    }
    if _xlmr(s):
        config.update(bos_token_id=0, eos_token_id=2)
    if _nomic(s):
        del config["position_embedding_type"]
        config.update(hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": NOMIC_ROPE_THETA},
                      layer_norm_eps=1e-12, qkv_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False,
                      rotary_emb_fraction=1.0, rotary_emb_interleaved=False, prenorm=False)
    if s.num_labels:
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(s.num_labels)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(s.num_labels)}
    return config


def _prefix(spec: EncoderSpec) -> str:
    # transformers saves a task model's encoder under its base model's prefix.
    return ("roberta." if _xlmr(spec) else "bert.") if spec.num_labels else ""


def random_weights(kind: str) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 tensors, from a seed fixed per kind."""
    s = _spec(kind)
    c = config_for(kind)
    rng = np.random.Generator(np.random.PCG64(WEIGHT_SEED + KINDS.index(kind)))
    h, f = s.hidden_size, s.intermediate_size

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(n)).astype(np.float32)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32), f"{prefix}.bias": bias(h)}

    if _nomic(s):
        return _nomic_weights(s, c, rng, matrix, norm)
    p = _prefix(s)
    w: dict[str, np.ndarray] = {
        f"{p}embeddings.word_embeddings.weight": (0.5 * rng.standard_normal((VOCAB_SIZE, h))).astype(np.float32),
        f"{p}embeddings.position_embeddings.weight": (0.5 * rng.standard_normal((c["max_position_embeddings"], h))).astype(np.float32),
        f"{p}embeddings.token_type_embeddings.weight": (0.5 * rng.standard_normal((c["type_vocab_size"], h))).astype(np.float32),
        **norm(f"{p}embeddings.LayerNorm"),
    }
    for i in range(s.num_hidden_layers):
        layer = f"{p}encoder.layer.{i}"
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            w[f"{layer}.{name}.weight"], w[f"{layer}.{name}.bias"] = matrix(h, h), bias(h)
        w.update(norm(f"{layer}.attention.output.LayerNorm"))
        w[f"{layer}.intermediate.dense.weight"], w[f"{layer}.intermediate.dense.bias"] = matrix(f, h), bias(f)
        w[f"{layer}.output.dense.weight"], w[f"{layer}.output.dense.bias"] = matrix(h, f), bias(h)
        w.update(norm(f"{layer}.output.LayerNorm"))
    if s.num_labels and not _xlmr(s):
        w["bert.pooler.dense.weight"], w["bert.pooler.dense.bias"] = matrix(h, h), bias(h)
        w["classifier.weight"], w["classifier.bias"] = matrix(s.num_labels, h), bias(s.num_labels)
    elif s.num_labels:
        w["classifier.dense.weight"], w["classifier.dense.bias"] = matrix(h, h), bias(h)
        w["classifier.out_proj.weight"], w["classifier.out_proj.bias"] = matrix(s.num_labels, h), bias(s.num_labels)
    else:
        w["pooler.dense.weight"], w["pooler.dense.bias"] = matrix(h, h), bias(h)  # a base model has one, unused
    return w


def _nomic_weights(s: EncoderSpec, c: dict[str, Any], rng: np.random.Generator, matrix: Any, norm: Any) -> dict[str, np.ndarray]:
    """nomic-ai's checkpoint names: fused Wqkv, fc11 (up), fc12 (gate), fc2 (down), no biases."""
    h, f = s.hidden_size, s.intermediate_size
    w: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": (0.5 * rng.standard_normal((VOCAB_SIZE, h))).astype(np.float32),
        "embeddings.token_type_embeddings.weight": (0.5 * rng.standard_normal((c["type_vocab_size"], h))).astype(np.float32),
        **norm("emb_ln"),
    }
    for i in range(s.num_hidden_layers):
        layer = f"encoder.layers.{i}"
        w[f"{layer}.attn.Wqkv.weight"] = matrix(3 * h, h)
        w[f"{layer}.attn.out_proj.weight"] = matrix(h, h)
        w[f"{layer}.mlp.fc11.weight"], w[f"{layer}.mlp.fc12.weight"] = matrix(f, h), matrix(f, h)
        w[f"{layer}.mlp.fc2.weight"] = matrix(h, f)
        w.update(norm(f"{layer}.norm1"))
        w.update(norm(f"{layer}.norm2"))
    return w


def _corpus() -> list[str]:
    from .corpus import generate_corpus

    return [line for line in generate_corpus(target_chars=60_000).splitlines() if line.strip()]


def tokenizer_json(kind: str) -> str:
    """A trained tokenizer.json: WordPiece (BERT, lowercased) or Unigram (XLM-R, Metaspace)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    s = _spec(kind)
    if _xlmr(s):
        tk = Tokenizer(models.Unigram())
        tk.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
        tk.pre_tokenizer = pre_tokenizers.Metaspace()
        tk.decoder = decoders.Metaspace()
        tk.train_from_iterator(_corpus(), trainers.UnigramTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(XLMR_SPECIALS),
                                                                   unk_token="<unk>", show_progress=False))
        ids = {t: tk.token_to_id(t) for t in ("<s>", "</s>")}
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=list(ids.items()))
    else:
        tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tk.normalizer = normalizers.BertNormalizer(lowercase=True)
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tk.decoder = decoders.WordPiece()
        tk.train_from_iterator(_corpus(), trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(BERT_SPECIALS),
                                                                     show_progress=False))
        ids = {t: tk.token_to_id(t) for t in ("[CLS]", "[SEP]")}
        tk.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=list(ids.items()))
    assert tk.get_vocab_size() == VOCAB_SIZE, f"{tk.get_vocab_size()=}"
    return tk.to_str(pretty=True)


def _tokenizer_config(spec: EncoderSpec) -> dict[str, Any]:
    if _xlmr(spec):
        names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                     pad_token="<pad>", mask_token="<mask>")
        inputs = ["input_ids", "attention_mask"]
    else:
        names = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
        inputs = ["input_ids", "token_type_ids", "attention_mask"]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec.n_positions,
            "model_input_names": inputs, "clean_up_tokenization_spaces": False, **names}


def _sentence_transformers_files(spec: EncoderSpec) -> dict[str, str]:
    if spec.num_labels:
        return {}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    pooling = {"word_embedding_dimension": spec.hidden_size, "pooling_mode_cls_token": spec.pooling == "cls",
               "pooling_mode_mean_tokens": spec.pooling == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_lasttoken": False}
    return {"modules.json": json.dumps(modules, indent=2), "1_Pooling/config.json": json.dumps(pooling, indent=2)}


def _write_files(kind: str, directory: Path) -> None:
    from safetensors.numpy import save_file

    s = _spec(kind)
    save_file(random_weights(kind), str(directory / "model.safetensors"), metadata={"format": "pt"})
    texts = {
        "config.json": json.dumps(config_for(kind), indent=2),
        "tokenizer.json": tokenizer_json(kind),
        "tokenizer_config.json": json.dumps(_tokenizer_config(s), indent=2),
        **_sentence_transformers_files(s),
    }
    for name, text in texts.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    (directory / "mlxcel_encoder.json").write_text(json.dumps({"kind": kind, "format_version": FORMAT_VERSION}),
                                                    encoding="utf-8")  # last: the directory is complete


def ensure_encoder(kind: str, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/encoder-<kind>-v<N>``, built on first use (into a temporary directory renamed
    into place, so concurrent callers never see half a model)."""
    _spec(kind)
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()
    return build_directory(root / f"encoder-{kind}-v{FORMAT_VERSION}", "mlxcel_encoder.json",
                           lambda tmp: _write_files(kind, tmp))


# --- GGUF ---------------------------------------------------------------------------------------

_GGUF_NAMES = (
    ("embeddings.word_embeddings.weight", "token_embd.weight"),
    ("embeddings.position_embeddings.weight", "position_embd.weight"),
    ("embeddings.token_type_embeddings.weight", "token_types.weight"),
    ("embeddings.LayerNorm.weight", "token_embd_norm.weight"),
    ("embeddings.LayerNorm.bias", "token_embd_norm.bias"),
)
_GGUF_LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
_GGUF_NOMIC = (
    (r"embeddings\.word_embeddings\.weight", "token_embd.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "token_types.weight"),
    (r"emb_ln\.(weight|bias)", r"token_embd_norm.\1"),
    (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.weight", r"blk.\1.attn_qkv.weight"),
    (r"encoder\.layers\.(\d+)\.attn\.out_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc11\.weight", r"blk.\1.ffn_up.weight"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc12\.weight", r"blk.\1.ffn_gate.weight"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.weight", r"blk.\1.ffn_down.weight"),
    (r"encoder\.layers\.(\d+)\.norm1\.(weight|bias)", r"blk.\1.attn_output_norm.\2"),
    (r"encoder\.layers\.(\d+)\.norm2\.(weight|bias)", r"blk.\1.layer_output_norm.\2"),
)
_GGUF_HEAD = {
    "pooler.dense": "cls", "classifier.dense": "cls", "classifier.out_proj": "cls.output", "classifier": "cls.output",
}


def gguf_tensors(kind: str) -> dict[str, np.ndarray]:
    """The weights under llama.cpp's names, as its converter writes them."""
    s = _spec(kind)
    c = config_for(kind)
    out: dict[str, np.ndarray] = {}
    if _nomic(s):
        import re

        for name, value in random_weights(kind).items():
            for pattern, target in _GGUF_NOMIC:
                if re.fullmatch(pattern, name):
                    out[re.sub(pattern, target, name)] = np.ascontiguousarray(value, dtype=np.float32)
        return out
    for name, value in random_weights(kind).items():
        for prefix in ("bert.", "roberta."):
            name = name[len(prefix):] if name.startswith(prefix) else name
        if name.startswith("pooler.") and not s.num_labels:
            continue  # the converter drops an embedder's pooler
        target = dict(_GGUF_NAMES).get(name)
        if target is None and name.startswith("encoder.layer."):
            index, rest = name[len("encoder.layer."):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            target = f"blk.{index}.{_GGUF_LAYER[module]}.{leaf}"
        if target is None:
            module, leaf = name.rsplit(".", 1)
            target = f"{_GGUF_HEAD[module]}.{leaf}"
        if target == "position_embd.weight" and _xlmr(s):
            value = value[c["pad_token_id"] + 1:]  # positions start at pad_token_id + 1: chop the table
        out[target] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def _add_vocab(writer: Any, kind: str, directory: Path) -> None:
    from gguf import TokenType

    s = _spec(kind)
    tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    if _xlmr(s):
        pieces = tokenizer["model"]["vocab"]  # [[piece, score], ...] in id order
        tokens = [p for p, _ in pieces]
        scores = [float(score) for _, score in pieces]
        unk = tokenizer["model"]["unk_id"]
        types = [int(TokenType.UNKNOWN if i == unk else TokenType.CONTROL if t in specials else TokenType.NORMAL)
                 for i, t in enumerate(tokens)]
        writer.add_tokenizer_model("t5")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(True)
        writer.add_remove_extra_whitespaces(True)
        writer.add_bos_token_id(specials["<s>"])
        writer.add_eos_token_id(specials["</s>"])
        writer.add_unk_token_id(specials["<unk>"])
        writer.add_sep_token_id(specials["</s>"])
        writer.add_pad_token_id(specials["<pad>"])
        writer.add_mask_token_id(specials["<mask>"])
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(True)
        return
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    words = sorted(vocab, key=vocab.__getitem__)
    types = [int(TokenType.CONTROL if w in specials else TokenType.NORMAL) for w in words]

    def phantom(word: str, kind_: int) -> str:  # llama.cpp's converter: word starts get "▁", "##" goes
        if kind_ == TokenType.CONTROL:
            return word
        return word[2:] if word.startswith("##") else "\u2581" + word

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(w, k) for w, k in zip(words, types)])
    writer.add_token_types(types)
    writer.add_unk_token_id(specials["[UNK]"])
    writer.add_sep_token_id(specials["[SEP]"])
    writer.add_pad_token_id(specials["[PAD]"])
    writer.add_mask_token_id(specials["[MASK]"])
    writer.add_bos_token_id(specials["[CLS]"])  # llama.cpp's WPM default: CLS is the BOS


def write_encoder_gguf(kind: str, out: str | Path, model_dir: str | Path | None = None) -> Path:
    """The ``kind`` encoder as an F32 GGUF (architecture ``bert``, or ``nomic-bert``), from its
    directory's tokenizer."""
    import gguf

    s = _spec(kind)
    c = config_for(kind)
    directory = Path(model_dir) if model_dir is not None else ensure_encoder(kind)
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "nomic-bert" if _nomic(s) else "bert")
    writer.add_name(f"mlxcel-encoder-{kind}")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(s.n_positions)
    writer.add_embedding_length(s.hidden_size)
    writer.add_block_count(s.num_hidden_layers)
    writer.add_feed_forward_length(s.intermediate_size)
    writer.add_head_count(s.num_attention_heads)
    writer.add_layer_norm_eps(c["layer_norm_eps"])
    writer.add_causal_attention(False)
    if _nomic(s):
        writer.add_rope_freq_base(NOMIC_ROPE_THETA)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_pooling_type(gguf.PoolingType[s.pooling.upper()])
    writer.add_token_type_count(c["type_vocab_size"])
    if s.num_labels:
        writer.add_classifier_output_labels([f"LABEL_{i}" for i in range(s.num_labels)])
    _add_vocab(writer, kind, directory)
    for name, data in gguf_tensors(kind).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def ensure_encoder_gguf(kind: str, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/encoder-<kind>-v<N>.gguf``, written on first use (atomically)."""
    directory = ensure_encoder(kind, cache_dir)
    target = directory.parent / f"{directory.name}.gguf"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", suffix=".gguf", dir=directory.parent)
    os.close(fd)
    try:
        write_encoder_gguf(kind, tmp, directory)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
