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
  llama-quantize runs; the i-quants llama-quantize needs an importance matrix for get a uniform
  one, the others none), types of 256-value blocks of rows that do not fill whole blocks fall
  back as llama-quantize's do (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, Q2_K and Q3_K to
  Q4_0, the i-quants to IQ4_NL), and ``q4_k_m`` / ``q5_k_m``
  follow llama-quantize's mix: Q6_K for the output and for ``attn_v`` and ``ffn_down`` of the
  layers its ``use_more_bits`` picks;
- the tokenizer as ``gpt2`` BPE; the pre-tokenizer is named after how transformers splits text
  for the family (``gpt-2``, the regex of our tokenizer.json, except ``qwen2``: transformers
  applies Qwen2's regex to that model type), as the converter's tokenizer hash would find;
  token types CONTROL for special added tokens and USER_DEFINED for the others.

``split_max_tensors`` writes ``name-00001-of-0000N.gguf`` parts like ``gguf-split``.

The conventions live in ``gguf_tensors.py`` (tensor names, layout and types) and
``gguf_metadata.py`` (the keys); this module writes the files. Random-block files of any size
are ``gguf_random.py``'s; this module's ``main`` is their command line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .cache_dir import default_cache_dir
from .gguf_metadata import add_hparams, add_tokenizer
from .gguf_random import LLAMA2_7B_DIMS, RANDOM_SEED, write_random_gguf
from .gguf_tensors import GGUF_FAMILIES, GGUF_TARGETS, GGUF_TYPES, converted_tensors, encode_tensor, file_type
from .model_directory import FORMAT_VERSION, ensure_model
from .weights import random_weights


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


def write_bpe_tokenizer_gguf(out: str | Path, tokenizer_dir: str | Path, pre: str = "gpt-2", arch: str = "llama") -> Path:
    """A GGUF holding only the byte-level BPE vocabulary of ``tokenizer_dir`` (``tokenizer.ggml.model = gpt2``).

    The keys are the ones a factory GGUF gets (``gguf_metadata.add_tokenizer``: added tokens stored
    as their text, CONTROL when special, USER_DEFINED otherwise). No tensors: it is for tokenizer tests.
    """
    import gguf

    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    add_tokenizer(writer, Path(tokenizer_dir), pre)
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

    if family not in GGUF_TARGETS:
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
    writer = gguf.GGUFWriter(None, GGUF_TARGETS[family].arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"mlxcel-{family}-{size}")
    writer.add_file_type(file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hparams(writer, family, config, weights)
    if pooling is not None or reranker:
        writer.add_pooling_type(gguf.PoolingType[(pooling or "rank").upper()])
    add_tokenizer(writer, source, GGUF_TARGETS[family].pre)
    tensors = converted_tensors(family, config, weights)
    if reranker:
        from mlxcel_compat.encoders.rerank import LABELS, QWEN3_RERANK_TEMPLATE

        if family != "qwen3":
            raise ValueError("only the qwen3 factory model has a reranker form")
        writer.add_classifier_output_labels(list(LABELS))
        writer.add_string("tokenizer.chat_template.rerank", QWEN3_RERANK_TEMPLATE)
        head = tensors.get("output.weight", tensors["token_embd.weight"])
        tensors["cls.output.weight"] = np.ascontiguousarray(head[list(rerank_label_ids(source))])
    for name, data in tensors.items():
        stored, raw_type = encode_tensor(name, data, gguf_type, config["num_hidden_layers"])
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
