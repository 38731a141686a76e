"""llama-server's rerank routes: ``/rerank``, ``/reranking``, ``/v1/rerank``, ``/v1/reranking``.

They need ``--rerank`` (embeddings with pooling ``rank``; 501 otherwise). Each document is paired
with the query in the model's rerank prompt (``encoders/rerank.py``) and all pairs are scored in one
request, in as few forward passes as their lengths allow. Two answer shapes, as llama-server:

- Jina (``documents``): ``{"model", "object": "list", "usage", "results": [{"index", "relevance_score"}]}``;
- TEI (the body has ``texts``): a bare ``[{"index", "score"[, "text"]}]`` (``return_text``).

Both are sorted by score, highest first, and cut to ``top_n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.embedding import EmbeddingJob
from mlxcel_compat.server.embedding_requests import NO_HEAD, check_length, embeddings_enabled
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import InvalidRequest, NotSupported
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of, read_json, respond

NOT_ENABLED = "This server does not support reranking. Start it with `--reranking`"


@dataclass(frozen=True)
class RerankRequest:
    job: EmbeddingJob
    documents: list[str]
    top_n: int
    tei: bool
    return_text: bool
    model: str


def parse_request(ctx: ServerContext, data: dict[str, Any]) -> RerankRequest:
    m = ctx.model
    assert m is not None
    tei = "texts" in data
    if "query" not in data:
        raise InvalidRequest('"query" must be provided')
    query = data["query"]
    if not isinstance(query, str):
        raise InvalidRequest('"query" must be a string')
    documents = data.get("documents", data.get("texts"))
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise InvalidRequest('"documents" must be a non-empty string array')
    top_n = data.get("top_n", len(documents))
    if not isinstance(top_n, int) or isinstance(top_n, bool):
        raise InvalidRequest("top_n must be an integer")
    pairs = [m.rank_head.encode(m.tokenizer, query, doc) for doc in documents]
    prompts = [tokens for tokens, _ in pairs]
    types = [t if t is not None else [0] * len(tokens) for tokens, t in pairs] if m.rank_head.pair else None
    for tokens in prompts:
        check_length(ctx, tokens, unsplit=False)  # a causal reranker reads its last token: splittable
    model = data.get("model")
    return RerankRequest(
        job=EmbeddingJob(prompts=prompts, pooling="rank", max_batch_tokens=ctx.settings.ubatch_size, rank=m.rank_head,
                         token_types=types),
        documents=documents,
        top_n=max(0, top_n),
        tei=tei,
        return_text=tei and data.get("return_text") is True,
        model=model if isinstance(model, str) else m.model_id,
    )


def format_response(req: RerankRequest, scores: list[np.ndarray]) -> Any:
    label = "score" if req.tei else "relevance_score"
    items = []
    for i, score in enumerate(scores):
        item: dict[str, Any] = {"index": i, label: float(score.ravel()[0])}
        if req.return_text:
            item["text"] = req.documents[i]
        items.append(item)
    items.sort(key=lambda item: item[label], reverse=True)  # stable: ties keep the input order
    results = items[: req.top_n]
    if req.tei:
        return results
    n_tokens = sum(len(p) for p in req.job.prompts)
    return {"model": req.model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results}


async def rerank(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)  # first: an answer that leaves the body unread breaks keep-alive
    if not embeddings_enabled(ctx) or ctx.model.pooling != "rank":
        raise NotSupported(NOT_ENABLED)
    if ctx.model.rank_head is None:
        raise NotSupported(NO_HEAD)
    req = await ctx.workers.run(parse_request, ctx, data)
    scores = await ctx.client.embed(req.job)
    return await respond(ctx, lambda: format_response(req, scores))


PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
ROUTES = [Route(path, rerank, methods=["POST"]) for path in PATHS]

_RESULT = {"type": "object", "properties": {"index": {"type": "integer"}, "relevance_score": {"type": "number"},
                                            "score": {"type": "number"}, "text": {"type": "string"}},
           "required": ["index"]}
RERANK = Operation(
    "Score documents against a query (Jina shape; TEI's bare array when the body has texts); needs --rerank",
    body=("rerank",),
    ok={"anyOf": [
        {"type": "object", "properties": {"model": {"type": "string"}, "object": {"const": "list"},
                                          "usage": {"type": "object"}, "results": {"type": "array", "items": _RESULT}},
         "required": ["model", "object", "usage", "results"]},
        {"type": "array", "items": _RESULT},
    ]},
    errors=(501,),
)
OPERATIONS = {("POST", path): RERANK for path in PATHS}
