"""llama-server's embedding routes: ``/embedding``, ``/embeddings`` (native) and ``/v1/embeddings`` (OpenAI).

All need ``--embeddings`` (501 otherwise). The body's ``input`` (or ``content``, which forces the
native shape even on ``/v1/embeddings``) takes the prompt shapes of ``/completion``; an array of
prompts is embedded in one request, in as few forward passes as the lengths allow
(``engine/embedding.py``). The native answer is a list of ``{"index", "embedding"}`` whose
``embedding`` is 2-D: one pooled vector, or one vector per token with pooling ``none``
(unnormalised). The OpenAI answer carries one vector per input (``encoding_format: base64``:
little-endian float32 bytes) and ``usage.prompt_tokens``, the tokens actually embedded.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.embedding import EmbeddingJob
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.embedding_requests import NO_HEAD, UNSPLIT_POOLINGS, check_length, embeddings_enabled
from mlxcel_compat.server.errors import InvalidRequest, NotSupported
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of, read_json, respond
from mlxcel_compat.server.prompts import tokenize_one

NOT_ENABLED = "This server does not support embeddings. Start it with `--embeddings`"
NOT_OAI = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"


def normalize(vector: np.ndarray, mode: int) -> np.ndarray:
    """llama.cpp's ``common_embd_normalize``: -1 none, 0 max-abs scaled to int16, 2 euclidean,
    other values the p-norm; summed in double precision, a zero norm leaves zeros."""
    v = vector.astype(np.float64)
    if mode == -1:
        total = 1.0
    elif mode == 0:
        total = float(np.abs(v).max(initial=0.0)) / 32760.0
    elif mode == 2:
        total = float(np.sqrt(np.dot(v, v)))
    else:
        total = float(np.sum(np.abs(v) ** mode)) ** (1.0 / mode)
    scale = 1.0 / total if total > 0.0 else 0.0
    return (vector * np.float32(scale)).astype(np.float32)


@dataclass(frozen=True)
class EmbeddingRequest:
    """A parsed body: what to embed and how to answer."""

    job: EmbeddingJob
    oai: bool  # the OpenAI shape (False when the body used ``content``)
    base64: bool
    normalize: int
    model: str


def parse_request(ctx: ServerContext, data: dict[str, Any], oai: bool) -> EmbeddingRequest:
    """llama-server's checks, in its order; every failure is a 400 except a too long input (500)."""
    m = ctx.model
    assert m is not None
    if data.get("input") is not None:
        prompt = data["input"]
    elif data.get("content") is not None:
        oai = False  # "content" is not OAI-compatible: the native shape answers
        prompt = data["content"]
    else:
        raise InvalidRequest('"input" or "content" must be provided')
    encoding = data.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise InvalidRequest("The format to return the embeddings in. Can be either float or base64")
    prompts = _tokenize(ctx, prompt)
    mode = data.get("embd_normalize")
    if mode is None:
        mode = ctx.settings.embd_normalize
    elif not isinstance(mode, int) or isinstance(mode, bool):
        raise InvalidRequest("embd_normalize must be an integer")
    ubatch = ctx.settings.ubatch_size
    for tokens in prompts:
        check_length(ctx, tokens, m.pooling in UNSPLIT_POOLINGS)
    model = data.get("model")
    return EmbeddingRequest(
        job=EmbeddingJob(prompts=prompts, pooling=m.pooling, max_batch_tokens=ubatch, rank=m.rank_head),
        oai=oai,
        base64=encoding == "base64",
        normalize=mode,
        model=model if isinstance(model, str) else m.model_id,
    )


def _tokenize(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    """``/completion``'s prompt shapes; an array without token ids holds one prompt per item."""
    m = ctx.model
    assert m is not None
    if isinstance(prompt, list) and not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        limit = ctx.settings.max_prompts
        if len(prompt) > limit:
            raise InvalidRequest(f"Field 'input': at most {limit} inputs are allowed in one request (--max-prompts), but got {len(prompt)}")
        prompts = [_tokenize_entry(ctx, p) for p in prompt]
    else:
        prompts = [_tokenize_entry(ctx, prompt)]
    if not prompts:
        raise InvalidRequest('"input" must not be empty')
    if any(not tokens for tokens in prompts):
        raise InvalidRequest("Input content cannot be empty")
    return prompts


# llama-server's words for a media part on a model without a projector (oaicompat_content_load_media).
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}


def _tokenize_entry(ctx: ServerContext, entry: Any) -> list[int]:
    """One input: ``/completion``'s prompt shapes, or an OpenAI content array
    ``{"content": [{"type": "text", "text": ...}, ...]}`` whose text parts are joined into one
    string, as llama-server's ``tokenize_oai_content_array`` joins them."""
    m = ctx.model
    assert m is not None
    if isinstance(entry, dict) and "content" in entry:
        entry = content_parts_text(entry["content"])
    return tokenize_one(m.tokenizer, entry, m.vocab_size, ctx.prompt_bound)


def content_parts_text(parts: Any) -> str:
    """The text of an OpenAI content array; a media part is refused (no model here embeds one),
    as is any other part type."""
    if not isinstance(parts, list):
        raise InvalidRequest('"content" must be an array')
    text = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise InvalidRequest(f"{MEDIA_PARTS[kind]} input is not supported - hint: if this is unexpected, "
                                 "you may need to provide the mmproj")
        if kind != "text":
            raise InvalidRequest("unsupported content[].type")
        value = part.get("text", "")
        if not isinstance(value, str):
            raise InvalidRequest("content[].text must be a string")
        text.append(value)
    return "".join(text)


def format_response(ctx: ServerContext, req: EmbeddingRequest, vectors: list[np.ndarray]) -> Any:
    """The native list, or the OpenAI object (``usage`` counts every embedded token)."""
    pooled = ctx.model is not None and ctx.model.pooling != "none"
    rows = [np.stack([normalize(v, req.normalize) for v in vec]) if pooled else vec for vec in vectors]
    if not req.oai:
        return [{"index": i, "embedding": vec} for i, vec in enumerate(rows)]
    data = []
    for i, vec in enumerate(rows):
        if req.base64:
            text = base64.b64encode(vec[0].astype("<f4").tobytes()).decode("ascii")
            data.append({"embedding": text, "index": i, "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vec[0], "index": i, "object": "embedding"})
    n_tokens = sum(len(p) for p in req.job.prompts)
    return {"model": req.model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data}


async def _embeddings(request: Request, oai: bool) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)  # first: an answer that leaves the body unread breaks keep-alive
    if not embeddings_enabled(ctx):
        raise NotSupported(NOT_ENABLED)
    if oai and ctx.model.pooling == "none":
        raise InvalidRequest(NOT_OAI)
    if ctx.model.pooling == "rank" and ctx.model.rank_head is None:
        raise NotSupported(NO_HEAD)
    req = await ctx.workers.run(parse_request, ctx, data, oai)
    vectors = await ctx.client.embed(req.job)
    return await respond(ctx, lambda: format_response(ctx, req, vectors))


async def embeddings_native(request: Request) -> Response:
    return await _embeddings(request, oai=False)


async def embeddings_oai(request: Request) -> Response:
    return await _embeddings(request, oai=True)


ROUTES = [
    Route("/embedding", embeddings_native, methods=["POST"]),
    Route("/embeddings", embeddings_native, methods=["POST"]),
    Route("/v1/embeddings", embeddings_oai, methods=["POST"]),
]

_VECTOR = {"type": "array", "items": {"type": "number"}}
NATIVE = Operation(
    "llama-server's native embeddings: per input a 2-D embedding (one pooled vector, or one per token with pooling none); needs --embeddings",
    body=("embeddings",),
    ok={"type": "array", "items": {"type": "object", "properties": {"index": {"type": "integer"}, "embedding": {"type": "array", "items": _VECTOR}},
                                   "required": ["index", "embedding"]}},
    errors=(500, 501),
)
OAI = Operation(
    "OpenAI embeddings (float or base64 vectors, usage); needs --embeddings and a pooling other than none",
    body=("embeddings",),
    ok={
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "model": {"type": "string"},
                    "object": {"const": "list"},
                    "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
                    "data": {"type": "array", "items": {"type": "object", "properties": {
                        "embedding": {"anyOf": [_VECTOR, {"type": "string"}]}, "index": {"type": "integer"},
                        "object": {"const": "embedding"}, "encoding_format": {"const": "base64"}}}},
                },
                "required": ["model", "object", "usage", "data"],
            },
            NATIVE.ok,  # a body with "content" gets the native shape
        ]
    },
    errors=(500, 501),
)
OPERATIONS = {
    ("POST", "/embedding"): NATIVE,
    ("POST", "/embeddings"): NATIVE,
    ("POST", "/v1/embeddings"): OAI,
}
