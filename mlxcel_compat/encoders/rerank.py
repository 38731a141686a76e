"""A decoder reranker's head and prompt (Qwen3-Reranker kind), found as llama.cpp finds them.

Such a model scores a (query, document) pair by the next-token logits of "yes" and "no" at the
last token of a fixed prompt: the score is ``softmax([yes, no])[0]``. llama.cpp's converter keeps
only those two rows of the output head, as ``cls.output.weight``, writes the pooling type
``rank`` and the prompt as the GGUF's ``tokenizer.chat_template.rerank``; its graph applies the
softmax for the ``qwen3`` architecture. A directory is recognised by the converter's own hints (a
README titled Qwen3-Reranker, the name, a ``*ForSequenceClassification`` architecture) and its head
rows are the vocabulary's "yes" and "no" tokens.

A cross-encoder (a BERT-family ``*ForSequenceClassification``, ``encoders/bert.py``) scores a pair
with its own classification head on the first token; its head here only says how a pair becomes
tokens: the model's tokenizer joins the two texts with their segment ids (``pair``).

Everything here is NumPy and plain Python: the HTTP side reads it at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The prompt Qwen3-Reranker's model card gives (the default instruction), as llama.cpp's converter
# stores it: {query} and {document} are replaced by the request's texts.
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
CLS_OUT = "cls.output.weight"
LABELS = ("yes", "no")


@dataclass(frozen=True)
class RankHead:
    """How to score one pair from the final hidden state of its prompt's last token."""

    template: str  # the prompt, with {query} and {document}
    matrix: np.ndarray | None = None  # (n_labels, n_embd): a GGUF's cls.output rows
    token_ids: tuple[int, ...] = ()  # or these rows of the model's own output head
    softmax: bool = True  # llama.cpp applies it for qwen3 rerankers
    pair: bool = False  # a cross-encoder: the tokenizer's pair encoding, the model's own head scores it
    # A decoder without any reranking head (llama-server pools ``rank`` on any model): the pair is
    # BOS, query, EOS, document, EOS (each special token where the vocabulary adds it) and the
    # score is the first component of the last token's final hidden state, llama-server's embd[0].
    plain: bool = False

    def prompt(self, tokenizer: Any, query: str, document: str) -> list[int]:
        """The pair's tokens: the template filled in, special tokens parsed, none added."""
        return self.encode(tokenizer, query, document)[0]

    def encode(self, tokenizer: Any, query: str, document: str) -> tuple[list[int], list[int] | None]:
        """The pair's tokens and, for a cross-encoder, their token types (None: all 0)."""
        if self.pair:
            from mlxcel_compat.encoders.bert import pair_encoding

            return pair_encoding(tokenizer, query, document)
        if self.plain:
            return plain_pair(tokenizer, query, document), None
        text = self.template.replace("{query}", query).replace("{document}", document)
        return list(tokenizer.encode(text, add_special_tokens=False)), None


CROSS_ENCODER = RankHead(template="", softmax=False, pair=True)
PLAIN_DECODER = RankHead(template="", softmax=False, plain=True)


def plain_pair(tokenizer: Any, query: str, document: str) -> list[int]:
    """llama-server's rerank prompt for a model without a rerank template (``format_prompt_rerank``):
    ``[BOS] query [EOS] document [EOS]``, with BOS and EOS where the tokenizer adds them itself."""
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    start, end = (full[:at], full[at + len(bare):]) if bare and at is not None else ([], [])
    ids = list(start)
    for text in (query, document):
        ids += list(tokenizer.encode(text, add_special_tokens=False)) + list(end)
    return ids


def rank_head(path: str | Path, tokenizer: Any) -> RankHead | None:
    """The model's reranking head: a reranker's own, else (a plain decoder) llama-server's
    fallback, :data:`PLAIN_DECODER`; None for an encoder without a classification head."""
    path = Path(path)
    from mlxcel_compat.encoders import load as encoder_load

    if encoder_load.is_encoder_path(path):
        return CROSS_ENCODER if encoder_load.has_classifier(path) else None
    if path.is_file():
        return _gguf_head(path) or PLAIN_DECODER
    config = _read_json(path / "config.json") or {}
    if not _is_qwen3_reranker(path, config):
        return PLAIN_DECODER
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = tuple(vocab.get(label) for label in LABELS)
    if any(i is None for i in ids):
        return None
    return RankHead(template=QWEN3_RERANK_TEMPLATE, token_ids=tuple(int(i) for i in ids))


def is_reranker_directory(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and _is_qwen3_reranker(path, _read_json(path / "config.json") or {})


def _gguf_head(path: Path) -> RankHead | None:
    from mlxcel_compat.gguf.reader import open_gguf, read_tensor

    file = open_gguf(path)
    template = file.metadata.get("tokenizer.chat_template.rerank")
    info = file.tensors.get(CLS_OUT)
    if info is None or not isinstance(template, str):
        return None
    from mlxcel_compat.gguf.quants import dequantize

    matrix = dequantize(read_tensor(info), info.ggml_type, info.n_values).reshape(info.shape)
    return RankHead(template=template, matrix=matrix, softmax=file.architecture in ("qwen3", "qwen3vl"))


def _is_qwen3_reranker(directory: Path, config: dict[str, Any]) -> bool:
    """The converter's test: the README's title, the names, or a classification architecture."""
    try:
        readme = (directory / "README.md").read_text(encoding="utf-8").lower()
    except OSError:
        readme = ""
    if "# qwen3-reranker" in readme:
        return True
    architecture = str((config.get("architectures") or [""])[0])
    hints = [directory.name, str(config.get("_name_or_path", "")), str(config.get("model_type", "")), architecture]
    if any("qwen3-reranker" in hint.lower() for hint in hints):
        return True
    return config.get("model_type") == "qwen3" and "sequenceclassification" in architecture.lower()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
