"""``/completion`` (llama-server native) and ``/v1/completions`` (OpenAI legacy)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, GenerationRequest, ProgressEvent, TokenEvent, next_task_id
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import ApiError, ContextExceeded, ServerError, json_response
from mlxcel_compat.server.params import CompletionOptions, parse_completion_options
from mlxcel_compat.server.prompts import tokenize_prompts
from mlxcel_compat.server.routes_misc import ctx_of, read_json

SSE_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}


def parse_options(ctx: ServerContext, data: dict[str, Any]) -> CompletionOptions:
    m = ctx.model
    return parse_completion_options(data, ctx.settings, len(ctx.engine.slots), m.vocab_size, ctx.tokenize, m.eog_ids)


def check_context(ctx: ServerContext, tokens: list[int]) -> None:
    if len(tokens) >= ctx.model.n_ctx:
        raise ContextExceeded(len(tokens), ctx.model.n_ctx)


def expand(ctx: ServerContext, opts: CompletionOptions, prompts: list[list[int]]) -> list[GenerationRequest]:
    """One request per prompt and per completion (``n_cmpl``); children get seed+1, seed+2, ..."""
    requests = []
    for p_index, tokens in enumerate(prompts):
        for child in range(opts.n_cmpl):
            req = copy.deepcopy(opts.request)
            req.task_id = next_task_id()  # each sequence is its own task (events, cancellation)
            req.prompt_tokens = tokens
            req.index = p_index * opts.n_cmpl + child
            if child and req.sampling.seed != 0xFFFFFFFF:
                req.sampling.seed = (req.sampling.seed + child) & 0xFFFFFFFF
            req.slot_params = fmt.metrics_params(req, opts.stream)
            if opts.n_cmpl > 1:
                # The engine prefills the prompt once and the siblings copy its KV.
                req.share_group = requests[-child].task_id if child else req.task_id
            requests.append(req)
    # Children of one prompt share the token list object (usage counts the prompt once).
    return requests


def empty_finish(req: GenerationRequest) -> FinishEvent:
    return FinishEvent("limit", "", "", 0, 0, 0, 0, 0.0, 0.0, False, -1, req.sampling.seed)


async def collect(ctx: ServerContext, request: Request, requests: list[GenerationRequest]) -> list[fmt.Result]:
    """Run the sequences to completion; a client that disconnects cancels them."""
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    live = [r for r in requests if r.prompt_tokens]
    for res in results:
        if not res.request.prompt_tokens:
            res.close(empty_finish(res.request))
    if not live:
        return results
    by_task = {r.task_id: results[i] for i, r in enumerate(requests)}
    tokenizer = ctx.model.tokenizer

    async def consume() -> None:
        async for i, event in ctx.run(live):
            res = by_task[live[i].task_id]
            if isinstance(event, TokenEvent):
                res.add(event, tokenizer)
            elif isinstance(event, FinishEvent):
                res.close(event)
            elif isinstance(event, ErrorEvent):
                raise ServerError(event.message)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    work = asyncio.create_task(consume())
    watch = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # closes ctx.run, which cancels the sequences on the engine
            await asyncio.gather(work, return_exceptions=True)
            raise asyncio.CancelledError()
    work.result()
    return results


async def with_keepalive(chunks: AsyncIterator[bytes], interval: int) -> AsyncIterator[bytes]:
    """Pass ``chunks`` through, sending an SSE comment after ``interval`` seconds of silence.

    ``sse_ping_interval``: a request waiting for a slot or a long prefill stays visibly alive.
    """
    if interval <= 0:
        async for chunk in chunks:
            yield chunk
        return
    source = chunks.__aiter__()
    pending: asyncio.Future[bytes] = asyncio.ensure_future(source.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield fmt.SSE_PING
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(source.__anext__())
    finally:
        if not pending.done():
            pending.cancel()  # cancels the sequences through the inner generator's cleanup
            await asyncio.gather(pending, return_exceptions=True)
        await source.aclose()


def add_verbose(ctx: ServerContext, data: dict[str, Any], body: dict[str, Any], result: fmt.Result) -> dict[str, Any]:
    """``verbose: true`` (or a ``-v`` server): OpenAI bodies also carry the native result."""
    if data.get("verbose") is True or (data.get("verbose") is None and ctx.settings.verbose):
        m = ctx.model
        body["__verbose"] = fmt.native_final(result, m.model_id, prompt_text(ctx, result.request.prompt_tokens), False, False, 0, True, m.eog_ids)
    return body


def prompt_text(ctx: ServerContext, tokens: list[int]) -> str:
    return ctx.model.tokenizer.decode(tokens, skip_special_tokens=False)


async def completion(request: Request) -> Response:
    return await _handle(request, oai=False)


async def v1_completions(request: Request) -> Response:
    return await _handle(request, oai=True)


async def _handle(request: Request, oai: bool) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    opts = parse_options(ctx, data)
    prompts, multi = tokenize_prompts(ctx.model.tokenizer, data.get("prompt"), ctx.model.vocab_size)
    for tokens in prompts:
        check_context(ctx, tokens)
    requests = expand(ctx, opts, prompts)
    if ctx.cache_hooks is not None:
        ctx.cache_hooks.prepare_raw(data, requests)
    if opts.stream:
        stream = _stream_oai(ctx, requests, opts) if oai else _stream_native(ctx, requests, opts)
        return StreamingResponse(with_keepalive(stream, opts.sse_ping_interval), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await collect(ctx, request, requests)
    m = ctx.model
    if oai:
        body = fmt.oai_completion(results, m.model_id, fmt.completion_id(), fmt.now())
        return json_response(add_verbose(ctx, data, body, results[0]))
    bodies = []
    for res in results:
        body = fmt.native_final(res, m.model_id, prompt_text(ctx, res.request.prompt_tokens), False, opts.return_tokens, opts.n_keep, True, m.eog_ids, timings_per_token=opts.timings_per_token)
        bodies.append(fmt.filter_fields(body, opts.response_fields) if opts.response_fields else body)
    return json_response(bodies if (multi or len(bodies) > 1) else bodies[0])


async def _stream_native(ctx: ServerContext, requests: list[GenerationRequest], opts: CompletionOptions) -> AsyncIterator[bytes]:
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
                body = fmt.native_final(res, m.model_id, prompt_text(ctx, res.request.prompt_tokens), True, False, opts.n_keep, False, m.eog_ids, timings_per_token=opts.timings_per_token)
                # As in llama-server, text still held back at the end (a partial stop string, an
                # unfinished character) is not streamed; non-streamed responses include it.
                yield fmt.sse(fmt.filter_fields(body, opts.response_fields) if opts.response_fields else body)
            elif isinstance(event, ErrorEvent):
                yield fmt.sse(ServerError(event.message).to_json())
                return
    except ApiError as exc:
        yield fmt.sse(exc.to_json())


async def _stream_oai(ctx: ServerContext, requests: list[GenerationRequest], opts: CompletionOptions) -> AsyncIterator[bytes]:
    m = ctx.model
    cid, created = fmt.completion_id(), fmt.now()
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    remaining = len(requests)
    async for i, event in ctx.run(requests):
        res = results[i]
        if isinstance(event, TokenEvent):
            res.add(event, m.tokenizer)
            if event.text or event.top is not None:
                logprobs = {"content": [res.probs[-1]]} if event.top is not None else None
                yield fmt.sse(fmt.oai_completion_chunk(event.text, i, m.model_id, cid, created, None, logprobs))
        elif isinstance(event, FinishEvent):
            res.close(event)
            remaining -= 1
            if event.text:
                yield fmt.sse(fmt.oai_completion_chunk(event.text, i, m.model_id, cid, created, None))
            final = fmt.oai_completion_chunk("", i, m.model_id, cid, created, fmt.finish_reason(event))
            if remaining == 0:
                final["usage"] = fmt.usage_json(results)
                final["timings"] = fmt.timings_json(event)
            yield fmt.sse(final)
        elif isinstance(event, ErrorEvent):
            yield fmt.sse(ServerError(event.message).to_json())
            return
    yield fmt.SSE_DONE


ROUTES = [
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/v1/completions", v1_completions, methods=["POST"]),
]
