"""llama-server's embedding routes: ``/embedding``, ``/embeddings`` (native) and ``/v1/embeddings`` (OpenAI).

All need ``--embeddings`` (501 otherwise). The body's ``input`` (or ``content``, which forces the
native shape even on ``/v1/embeddings``) takes the prompt shapes of ``/completion``; an array of
prompts is embedded in one request, in as few forward passes as the lengths allow
(``engine/embedding.py``). The native answer is a list of ``{"index", "embedding"}`` whose
``embedding`` is 2-D: one pooled vector, or one vector per token with pooling ``none``
(unnormalised). The OpenAI answer carries one vector per input (``encoding_format: base64``:
little-endian float32 bytes) and ``usage.prompt_tokens``, the tokens actually embedded.

On a vision model an input may hold images (and audio, where the model has an audio tower): a
``{"prompt_string", "multimodal_data"}`` prompt, or an OpenAI content array with ``image_url``
parts. They go the way a completion's do (``pipeline.media_prompt``: the media markers, the
prepared-image memo, the image's tokens), and the engine pools what llama-server pools: the
tokens after the prompt's last image (``engine/embedding.py``). Bad media are 400s with the
completion path's messages (llama-server answers some of them with a 500).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.chat.request import AudioSource
from mlxcel_compat.engine.embedding import EmbeddingJob, pooled_from
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.embedding_requests import NO_HEAD, UNSPLIT_POOLINGS, check_length, embeddings_enabled
from mlxcel_compat.server.errors import InvalidRequest, NotSupported
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.media import MEDIA_MARKER, marked_prompt_tokens
from mlxcel_compat.server.pipeline import ctx_of, media_prompt, read_json, respond
from mlxcel_compat.server.prompts import tokenize_one
from mlxcel_compat.vision.inputs import MediaInput

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
    prompts, media = _tokenize(ctx, prompt)
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
        job=EmbeddingJob(prompts=prompts, pooling=m.pooling, max_batch_tokens=ubatch, rank=m.rank_head, media=media),
        oai=oai,
        base64=encoding == "base64",
        normalize=mode,
        model=model if isinstance(model, str) else m.model_id,
    )


def _tokenize(ctx: ServerContext, prompt: Any) -> tuple[list[list[int]], list[MediaInput | None] | None]:
    """``/completion``'s prompt shapes; an array without token ids holds one prompt per item.
    Returns the prompts' tokens and, when any holds media, each prompt's media (None where none)."""
    if isinstance(prompt, list) and not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        limit = ctx.settings.max_prompts
        if len(prompt) > limit:
            raise InvalidRequest(f"Field 'input': at most {limit} inputs are allowed in one request (--max-prompts), but got {len(prompt)}")
        entries = [_tokenize_entry(ctx, p) for p in prompt]
    else:
        entries = [_tokenize_entry(ctx, prompt)]
    if not entries:
        raise InvalidRequest('"input" must not be empty')
    if any(not tokens for tokens, _ in entries):
        raise InvalidRequest("Input content cannot be empty")
    media = [m for _, m in entries]
    return [tokens for tokens, _ in entries], (media if any(m is not None for m in media) else None)


# llama-server's words for a media part on a model without a projector (oaicompat_content_load_media).
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}


def _tokenize_entry(ctx: ServerContext, entry: Any) -> tuple[list[int], MediaInput | None]:
    """One input: ``/completion``'s prompt shapes (with ``multimodal_data`` on a vision model),
    or an OpenAI content array ``{"content": [{"type": "text", "text": ...}, {"type":
    "image_url", ...}, ...]}`` whose parts are joined into one string, each media part as the
    media marker, as llama-server's ``tokenize_oai_content_array`` joins them."""
    m = ctx.model
    assert m is not None
    if isinstance(entry, dict) and "content" in entry:
        text, sources = content_parts(entry["content"], ctx.media.facts if ctx.media is not None else None)
        if not sources:
            return tokenize_one(m.tokenizer, text, m.vocab_size, ctx.prompt_bound), None
        ctx.prompt_bound.check(len(text))
        kinds = [isinstance(source, AudioSource) for source in sources]
        marked = marked_prompt_tokens(m.tokenizer, ctx.media.facts, text, len(sources), kinds)
        tokens, media, _ = ctx.media.prepare(sources, marked)
    elif ctx.media is not None and isinstance(entry, dict) and "multimodal_data" in entry:
        tokens, media, _ = media_prompt(ctx, entry)
    else:
        return tokenize_one(m.tokenizer, entry, m.vocab_size, ctx.prompt_bound), None
    if pooled_from(media) >= len(tokens):
        raise InvalidRequest("nothing to embed after the last image: llama-server embeds the tokens that follow "
                             "a prompt's last image, so the prompt must end with text")
    return tokens, media


def content_parts(parts: Any, facts: Any) -> tuple[str, list[Any]]:
    """The text of an OpenAI content array, a media marker where each media part was, and the
    media parts' sources (base64 or data URIs; ``AudioSource``s) in order. ``facts`` is a
    vision model's ``VisionFacts`` (None on a text model, which refuses every media part with
    llama-server's hint), which says whether it takes images and audio."""
    if not isinstance(parts, list):
        raise InvalidRequest('"content" must be an array')
    text: list[str] = []
    sources: list[Any] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            source = _media_source(part, kind, facts)
            if source is None:
                raise InvalidRequest(f"{MEDIA_PARTS[kind]} input is not supported - hint: if this is unexpected, "
                                     "you may need to provide the mmproj")
            sources.append(source)
            text.append(MEDIA_MARKER)
            continue
        if kind != "text":
            raise InvalidRequest("unsupported content[].type")
        value = part.get("text", "")
        if not isinstance(value, str):
            raise InvalidRequest("content[].text must be a string")
        text.append(value)
    return "".join(text), sources


def _media_source(part: dict[str, Any], kind: str, facts: Any) -> Any:
    """A media part's source as ``media_prompt`` takes it, or None where the model takes no such media."""
    if facts is None:
        return None
    if kind == "image_url" and facts.images:
        value = part.get("image_url")
        return value.get("url") if isinstance(value, dict) else value  # a bare string, as some clients send
    if kind == "input_audio" and facts.audio is not None:
        value = part.get("input_audio")
        value = value if isinstance(value, dict) else {}
        return AudioSource(value.get("data", value.get("url")), value.get("format"))
    return None


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
