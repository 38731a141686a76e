"""llama-server's native API: ``/completion``, ``/tokenize``, ``/detokenize``, ``/apply-template``.

``/completion`` (alias ``/completions``) takes llama-server's prompt shapes and answers with its
native result JSON, or native SSE chunks when streaming.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, GenerationRequest, ProgressEvent, TokenEvent
from mlxcel_compat.engine.textstream import token_bytes
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import ApiError, InvalidRequest, ServerError, json_response
from mlxcel_compat.server.params import CompletionOptions
from mlxcel_compat.server.pipeline import check_context, collect, ctx_of, expand, header_session, parse_options, prompt_text, read_json, render_prompt, sse_response
from mlxcel_compat.server.prompts import tokenize_prompts

# ---------------------------------------------------------------------- /completion


async def completion(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    opts = parse_options(ctx, data)
    prompts, multi = tokenize_prompts(ctx.model.tokenizer, data.get("prompt"), ctx.model.vocab_size)
    for tokens in prompts:
        check_context(ctx, tokens)
    requests = expand(ctx, opts, prompts)
    if ctx.cache_hooks is not None:
        ctx.cache_hooks.prepare_raw(data, requests, header_session(request))
    if opts.stream:
        return sse_response(_stream(ctx, requests, opts), opts)
    results = await collect(ctx, request, requests)
    m = ctx.model
    bodies = []
    for res in results:
        body = fmt.native_final(
            res, m.model_id, prompt_text(ctx, res.request.prompt_tokens), False, opts.return_tokens, opts.n_keep, True, m.eog_ids, timings_per_token=opts.timings_per_token
        )
        bodies.append(fmt.filter_fields(body, opts.response_fields) if opts.response_fields else body)
    return json_response(bodies if (multi or len(bodies) > 1) else bodies[0])


async def _stream(ctx: ServerContext, requests: list[GenerationRequest], opts: CompletionOptions) -> AsyncIterator[bytes]:
    m = ctx.model
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    try:
        async for i, event in ctx.run(requests):
            res = results[i]
            if isinstance(event, TokenEvent):
                res.add(event, m.tokenizer)
                chunk = fmt.native_partial(res, event, m.tokenizer, event.id_slot, opts.timings_per_token)
                yield fmt.sse(chunk)
            elif isinstance(event, ProgressEvent):
                yield fmt.sse(
                    {
                        "index": res.index,
                        "content": "",
                        "tokens": [0],
                        "stop": False,
                        "id_slot": event.id_slot,
                        "prompt_progress": {"total": event.total, "cache": event.cache, "processed": event.processed, "time_ms": event.time_ms},
                    }
                )
            elif isinstance(event, FinishEvent):
                res.close(event)
                body = fmt.native_final(
                    res, m.model_id, prompt_text(ctx, res.request.prompt_tokens), True, False, opts.n_keep, False, m.eog_ids, timings_per_token=opts.timings_per_token
                )
                # As in llama-server, text still held back at the end (a partial stop string, an
                # unfinished character) is not streamed; non-streamed responses include it.
                yield fmt.sse(fmt.filter_fields(body, opts.response_fields) if opts.response_fields else body)
            elif isinstance(event, ErrorEvent):
                yield fmt.sse(ServerError(event.message).to_json())
                return
    except ApiError as exc:
        yield fmt.sse(exc.to_json())


# ---------------------------------------------------------------------- tokens and templates


def _piece(tokenizer: Any, token: int) -> str | list[int]:
    raw = token_bytes(tokenizer, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def tokenize(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    content = data.get("content")
    if content is None:
        return json_response({"tokens": []})
    add_special = data.get("add_special") is True
    with_pieces = data.get("with_pieces") is True
    tok = ctx.model.tokenizer
    if isinstance(content, str):
        tokens = list(tok.encode(content, add_special_tokens=add_special))
    elif isinstance(content, list):
        tokens = []
        for i, piece in enumerate(content):
            if isinstance(piece, int) and not isinstance(piece, bool):
                tokens.append(piece)
            elif isinstance(piece, str):
                tokens.extend(tok.encode(piece, add_special_tokens=add_special and i == 0))
            else:
                raise InvalidRequest("content must be a string or an array of strings and token ids")
    else:
        raise InvalidRequest("content must be a string or an array of strings and token ids")
    if with_pieces:
        return json_response({"tokens": [{"id": t, "piece": _piece(tok, t)} for t in tokens]})
    return json_response({"tokens": tokens})


async def detokenize(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    tokens = data.get("tokens") or []
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("tokens must be an array of token ids")
    valid = [t for t in tokens if 0 <= t < ctx.model.vocab_size]
    if len(valid) != len(tokens):
        raise InvalidRequest("tokens contains invalid token ids")
    return json_response({"content": ctx.model.tokenizer.decode(valid, skip_special_tokens=False)})


async def apply_template(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    prompt, _ = render_prompt(ctx, data)
    return json_response({"prompt": prompt})


ROUTES = [
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
]
