"""What the embedding and rerank routes share: whether they are served, and llama-server's
length limits for an input (``api_embeddings.py``, ``api_rerank.py``)."""

from __future__ import annotations

from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import ContextExceeded, ServerError
from mlxcel_compat.server.pipeline import check_context

# Poolings whose input must fit one physical batch in llama.cpp (it cannot split them).
UNSPLIT_POOLINGS = ("none", "mean", "cls")
NO_HEAD = ("This model has no reranking head this server can use: a cross-encoder (a BERT or XLM-R "
           "*ForSequenceClassification directory, or a bert GGUF with cls.output) or a Qwen3-Reranker-style decoder "
           "(a GGUF with cls.output and a rerank template, or a Qwen3-Reranker directory) is needed")


def embeddings_enabled(ctx: ServerContext) -> bool:
    return bool(ctx.settings.embeddings or ctx.settings.rerank)


def check_length(ctx: ServerContext, tokens: list[int], unsplit: bool) -> None:
    """llama-server's limits, in its order: an input it cannot split must fit one physical batch
    (its 500) and the slot's context (its own 400 wording); others get the usual context check.
    An encoder never splits an input (it has no KV cache), and its context is its position table."""
    assert ctx.model is not None
    unsplit = unsplit or ctx.model.kind == "encoder"
    n, ubatch, n_ctx = len(tokens), ctx.settings.ubatch_size, ctx.model.n_ctx
    if not unsplit:
        check_context(ctx, tokens)
    elif n > ubatch:
        raise ServerError(f"input ({n} tokens) is too large to process. increase the physical batch size (current batch size: {ubatch})")
    elif n > n_ctx:
        exc = ContextExceeded(n, n_ctx)
        exc.message = f"input ({n} tokens) is larger than the max context size ({n_ctx} tokens). skipping"
        raise exc
