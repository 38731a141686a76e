"""Embeddings of token sequences: the model's final hidden states, pooled (engine thread only).

A decoder's embedding is what llama.cpp reads as ``t_embd``: the hidden state after the final
norm, before the output head. Several inputs go through one forward pass: sorted by length and
right-padded, at most ``max_batch_tokens`` padded tokens a pass. Padding after a sequence's last
token changes nothing before it under a causal mask, and pooling reads only the real positions,
so a batched input's vector is its vector alone (to float rounding). An input longer than one
pass is run in chunks through a KV cache (a causal model reads the past from it). Nothing here
touches the prompt cache: an embedding is one pass that nothing continues.

An encoder (``encoders/bert.py``) attends both ways, so its padding is masked instead, and an input
is never split (the HTTP side refuses one longer than a pass, as llama-server does). Its pooling
``rank`` is its classification head on the first token.

A vision-language model embeds one prompt a pass, bound to its images (``vision/model.py``: the
features replace the image tokens' embeddings, as in a completion's prefill). What is pooled is
what llama-server pools: its server decodes each image in a batch of its own whose positions
are not outputs, and pools (or, with pooling ``none``, returns) the outputs of the prompt's last
batch only: the tokens after the last image. So an image's positions reach the embedding only
through attention; a prompt without images pools all its tokens.

Results leave the engine thread as NumPy float32 arrays, never as ``mx.array``s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PAD_TOKEN = 0  # any id works: padding sits after the real tokens and is never pooled


@dataclass(frozen=True)
class EmbeddingJob:
    """One request's inputs, already tokenized and checked by the HTTP side."""

    prompts: list[list[int]]
    pooling: str  # none | mean | cls | last | rank
    max_batch_tokens: int  # padded tokens per forward pass (--ubatch-size)
    rank: Any = None  # model.rerank.RankHead for pooling rank: the last token's scores
    token_types: list[list[int]] | None = None  # an encoder's segment ids per prompt (a rerank pair); None: all 0
    media: list[Any] | None = None  # a vision model's MediaInput (or None) per prompt; None: no images at all


def pooled_from(media: Any) -> int:
    """The first token an embedding pools: the one after the prompt's last image or audio clip
    (llama-server pools its last batch, which follows the media), 0 without media."""
    spans = media.spans if media is not None else []
    return max(end for _, end in spans) if spans else 0


def hidden_module(model: Any) -> Any:
    """The part of an mlx-lm model that maps token ids to final (normed) hidden states."""
    for inner in (getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None)):
        if inner is not None and callable(inner):
            return inner
    raise TypeError(f"{type(model).__name__} exposes no hidden states (no .model module)")


def embed(model: Any, job: EmbeddingJob) -> list[np.ndarray]:
    """Each prompt's embedding in input order: shape (n_tokens, n_embd) for pooling ``none``,
    else (1, n_embd), unnormalised (the caller normalises pooled vectors)."""
    if getattr(model, "is_encoder", False):
        return _embed_encoder(model, job)
    if callable(getattr(model, "bind", None)):  # a vision-language model (vision/model.py: VisionLM)
        vectors = _embed_vision(model, job)
    else:
        vectors = _embed_decoder(model, job)
    if job.pooling == "rank":
        scores = rank_scores(model, np.concatenate(vectors, axis=0), job.rank)
        vectors = [scores[i : i + 1] for i in range(len(vectors))]
    return vectors


def _embed_decoder(model: Any, job: EmbeddingJob) -> list[np.ndarray]:
    """Padded batches of similar lengths; a prompt longer than a pass in chunks through a KV cache."""
    inner = hidden_module(model)
    out: list[np.ndarray | None] = [None] * len(job.prompts)
    for group in length_groups([len(p) for p in job.prompts], job.max_batch_tokens):
        if len(group) == 1 and len(job.prompts[group[0]]) > job.max_batch_tokens:
            i = group[0]
            out[i] = _pool(_hidden_chunked(model, inner, job.prompts[i], job.max_batch_tokens), job.pooling)
            continue
        hidden = _hidden_batch(inner, [job.prompts[i] for i in group])
        for row, i in enumerate(group):
            out[i] = _pool(hidden[row, : len(job.prompts[i])], job.pooling)
    return [v for v in out if v is not None]


def _embed_vision(model: Any, job: EmbeddingJob) -> list[np.ndarray]:
    """One prompt a pass, bound to its media (vision models run one sequence a pass), through a
    KV cache in chunks of ``max_batch_tokens``; pooled from the token after its last medium."""
    out = []
    for i, prompt in enumerate(job.prompts):
        media = job.media[i] if job.media is not None else None
        start = pooled_from(media)
        if start >= len(prompt):
            raise ValueError("nothing to embed after the prompt's last image")
        sequence = model.bind(media, prompt)
        out.append(_pool(_hidden_chunked(model, sequence.hidden, prompt, job.max_batch_tokens)[start:], job.pooling))
    return out


def rank_scores(model: Any, last_hidden: np.ndarray, head: Any) -> np.ndarray:
    """(n, n_embd) last-token hidden states -> (n, n_labels) scores: the head's rows (a GGUF's
    ``cls.output``, or the output head's rows of the label tokens), softmax-ed for Qwen3 kinds."""
    if head is None:
        raise ValueError("pooling rank needs a reranking head")
    if head.plain:  # no head at all: llama-server scores with the hidden state's first component
        return np.ascontiguousarray(last_hidden[:, :1], dtype=np.float32)
    if head.matrix is not None:
        logits = last_hidden.astype(np.float64) @ head.matrix.astype(np.float64).T
    else:
        import mlx.core as mx

        h = mx.array(last_hidden)
        out = model.lm_head(h) if hasattr(model, "lm_head") else hidden_module(model).embed_tokens.as_linear(h)
        logits = np.array(out.astype(mx.float32))[:, list(head.token_ids)].astype(np.float64)
    if head.softmax:
        logits = np.exp(logits - logits.max(axis=1, keepdims=True))
        logits /= logits.sum(axis=1, keepdims=True)
    return logits.astype(np.float32)


def _embed_encoder(model: Any, job: EmbeddingJob) -> list[np.ndarray]:
    """Padded batches with a padding mask; pooling ``rank``: (1, n_labels) head scores."""
    import mlx.core as mx

    out: list[np.ndarray | None] = [None] * len(job.prompts)
    for group in length_groups([len(p) for p in job.prompts], job.max_batch_tokens):
        lengths = [len(job.prompts[i]) for i in group]
        width = max(lengths)
        ids = [job.prompts[i] + [PAD_TOKEN] * (width - n) for i, n in zip(group, lengths)]
        types = [(job.token_types[i] if job.token_types is not None else [0] * n) + [0] * (width - n)
                 for i, n in zip(group, lengths)]
        hidden = model(mx.array(ids), mx.array(types), lengths)
        if job.pooling == "rank":
            scores = np.array(model.classify(hidden).astype(mx.float32))
            for row, i in enumerate(group):
                out[i] = scores[row : row + 1]
            continue
        values = np.array(hidden.astype(mx.float32))
        for row, (i, n) in enumerate(zip(group, lengths)):
            out[i] = _pool(values[row, :n], job.pooling)
    return [v for v in out if v is not None]


def length_groups(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices in groups of similar length whose padded size fits one pass (one input at least).

    Sorting by length first keeps the padding of each batched pass small; a prompt longer than
    ``max_batch_tokens`` gets a group of its own (``embed`` runs a decoder's in chunks)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so the newest member is the longest: it sets the padded width.
        if current and (len(current) + 1) * lengths[i] > max_batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _hidden_batch(inner: Any, prompts: list[list[int]]) -> np.ndarray:
    import mlx.core as mx

    width = max(len(p) for p in prompts)
    rows = [p + [PAD_TOKEN] * (width - len(p)) for p in prompts]
    hidden = inner(mx.array(rows))
    return np.array(hidden.astype(mx.float32))


def _hidden_chunked(model: Any, inner: Any, prompt: list[int], chunk: int) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    parts = []
    for start in range(0, len(prompt), chunk):
        hidden = inner(mx.array([prompt[start : start + chunk]]), cache=cache)
        parts.append(np.array(hidden.astype(mx.float32))[0])
    return np.concatenate(parts, axis=0)


def _pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """(n_tokens, n_embd) hidden states of one input -> its embedding rows."""
    if pooling == "none":
        return np.ascontiguousarray(hidden)
    if pooling == "mean":
        return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)[None, :]
    if pooling == "cls":
        return hidden[:1].copy()
    if pooling in ("last", "rank"):  # a causal reranker reads its last token
        return hidden[-1:].copy()
    raise ValueError(f"unknown pooling {pooling!r}")
