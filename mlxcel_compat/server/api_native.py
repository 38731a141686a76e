"""llama-server's native API: ``/completion``, ``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``.

``/completion`` (alias ``/completions``) takes llama-server's prompt shapes and answers with its
native result JSON, or native SSE chunks when streaming. ``/infill`` builds a fill-in-the-middle
prompt (``server/infill.py``) and then answers exactly as ``/completion`` does.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, GenerationRequest, ProgressEvent, TokenEvent
from mlxcel_compat.engine.textstream import token_bytes
from mlxcel_compat.server import cache_explain
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import ApiError, InvalidRequest, NotSupported, event_error, json_response
from mlxcel_compat.server.infill import InfillBudget, infill_prompt, parse_infill, plain_tokenizer
from mlxcel_compat.server.openapi import JSON, SSE, Operation
from mlxcel_compat.server.params import CompletionOptions
from mlxcel_compat.server.pipeline import (
    CompletionJob,
    api_key_id,
    build_completion_job,
    collect,
    ctx_of,
    header_session,
    prepare_completion,
    prompt_text,
    read_json,
    render_prompt,
    respond,
    sse_response,
)
from mlxcel_compat.server.progress import PromptProgress

# ---------------------------------------------------------------------- /completion


async def completion(request: Request) -> Response:
    ctx = ctx_of(request)
    return await _answer(ctx, request, await prepare_completion(ctx, request, await read_json(request)))


async def _answer(ctx: ServerContext, request: Request, job: CompletionJob) -> Response:
    opts = job.opts
    if opts.stream:
        return sse_response(_stream(ctx, job.requests, opts), opts, request)
    results = await collect(ctx, request, job.requests)
    m = ctx.model

    def build() -> Any:
        bodies = []
        for res in results:
            body = fmt.native_final(
                res, m.model_id, prompt_text(ctx, res.request.prompt_tokens), False, opts.return_tokens, opts.n_keep, True, m.eog_ids, timings_per_token=opts.timings_per_token
            )
            _add_explain(body, res, m.tokenizer)
            bodies.append(fmt.filter_fields(body, opts.response_fields) if opts.response_fields else body)
        return bodies if (job.multi or len(bodies) > 1) else bodies[0]

    return await respond(ctx, build)


def _add_explain(body: dict[str, Any], res: fmt.Result, tokenizer: Any) -> None:
    explained = cache_explain.render(res.finish.cache_explain if res.finish else None, tokenizer)
    if explained is not None:
        body["cache_explain"] = explained


async def _stream(ctx: ServerContext, requests: list[GenerationRequest], opts: CompletionOptions) -> AsyncIterator[bytes]:
    m = ctx.model
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    progress = PromptProgress.for_request(ctx, opts.timings_per_token)
    try:
        async for i, event in ctx.run(requests):
            res = results[i]
            if isinstance(event, TokenEvent):
                res.add(event, m.tokenizer)
                chunk = fmt.native_partial(res, event, m.tokenizer, event.id_slot, opts.timings_per_token)
                yield fmt.sse(chunk)
            elif isinstance(event, ProgressEvent):
                for report in progress.feed(i, event):
                    yield fmt.sse(report.attach(fmt.native_progress(res, event.id_slot)))
            elif isinstance(event, FinishEvent):
                res.close(event)
                body = fmt.native_final(
                    res, m.model_id, prompt_text(ctx, res.request.prompt_tokens), True, False, opts.n_keep, False, m.eog_ids, timings_per_token=opts.timings_per_token
                )
                _add_explain(body, res, m.tokenizer)
                # As in llama-server, text still held back at the end (a partial stop string, an
                # unfinished character) is not streamed; non-streamed responses include it.
                yield fmt.sse(fmt.filter_fields(body, opts.response_fields) if opts.response_fields else body)
            elif isinstance(event, ErrorEvent):
                yield fmt.sse(event_error(event).to_json())
                return
    except ApiError as exc:
        yield fmt.sse(exc.to_json())


# ---------------------------------------------------------------------- /infill


async def infill(request: Request) -> Response:
    ctx = ctx_of(request)
    missing = ctx.model.fim.missing()
    if missing:  # checked before the body is read, as llama-server does
        raise NotSupported(f"Infill is not supported by this model: {missing}")
    data = await read_json(request)
    job = await ctx.workers.run(_prepare_infill, ctx, data, header_session(request), api_key_id(request))
    return await _answer(ctx, request, job)


def _prepare_infill(ctx: ServerContext, data: dict[str, Any], session: str | None, key_id: str | None) -> CompletionJob:
    m = ctx.model
    s = ctx.settings
    budget = InfillBudget(n_batch=s.batch_size, n_predict=s.n_predict, n_ctx=m.n_ctx, spm=bool(s.spm_infill), bos_id=m.bos_id)
    tokens = infill_prompt(m.fim, parse_infill(data), budget, plain_tokenizer(m.tokenizer), ctx.tokenize)
    # From here on an infill request is a completion of these tokens (cache, samplers, stream).
    return build_completion_job(ctx, {**data, "prompt": tokens}, session, key_id)


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
    return await ctx.workers.run(_tokenize, ctx, data)


def _tokenize(ctx: ServerContext, data: dict[str, Any]) -> Response:
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
    return await ctx.workers.run(_detokenize, ctx, data)


def _detokenize(ctx: ServerContext, data: dict[str, Any]) -> Response:
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
    prompt, _ = await ctx.workers.run(render_prompt, ctx, data)
    return json_response({"prompt": prompt})


ROUTES = [
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/infill", infill, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
]

# Typed but not required: response_fields may keep any subset (flattened "a/b" keys included).
NATIVE_RESULT = {
    "type": "object",
    "properties": {
        "index": {"type": "integer"},
        "content": {"type": "string"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "id_slot": {"type": "integer"},
        "stop": {"type": "boolean"},
        "model": {"type": "string"},
        "tokens_predicted": {"type": "integer"},
        "tokens_evaluated": {"type": "integer"},
        "generation_settings": {"type": "object"},
        "prompt": {"type": "string"},
        "has_new_line": {"type": "boolean"},
        "truncated": {"type": "boolean"},
        "stop_type": {"enum": ["eos", "word", "limit", "none"]},
        "stopping_word": {"type": "string"},
        "tokens_cached": {"type": "integer"},
        "timings": fmt.TIMINGS_SCHEMA,
        "completion_probabilities": {"type": "array", "items": fmt.PROB_SCHEMA},
    },
}
COMPLETION = Operation(
    "llama-server's native completion (one result, or an array for several prompts / n_cmpl)",
    body=("all", "completion"),
    ok={"anyOf": [NATIVE_RESULT, {"type": "array", "items": NATIVE_RESULT}]},
    media=(JSON, SSE),
    errors=(500, 501),
)
OPERATIONS = {
    ("POST", "/completion"): COMPLETION,
    ("POST", "/completions"): COMPLETION,
    ("POST", "/infill"): Operation(
        "Fill in the middle: llama-server's FIM prompt from input_prefix, input_suffix and input_extra, then a native completion",
        body=("all", "infill"),
        ok=COMPLETION.ok,  # an array with n_cmpl > 1, as /completion
        media=(JSON, SSE),
        errors=(500, 501),
    ),
    ("POST", "/tokenize"): Operation(
        "Tokenize text (special tokens parsed), optionally with each token's piece",
        body=("tokenize",),
        ok={
            "type": "object",
            "properties": {
                "tokens": {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {"type": "integer"},
                            {
                                "type": "object",
                                "properties": {"id": {"type": "integer"}, "piece": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}},
                                "required": ["id", "piece"],
                            },
                        ]
                    },
                }
            },
            "required": ["tokens"],
        },
    ),
    ("POST", "/detokenize"): Operation(
        "Turn token ids back into text",
        body=("detokenize",),
        ok={"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]},
    ),
    ("POST", "/apply-template"): Operation(
        "Render a chat through the model's template, without generating",
        body=("chat",),
        ok={"type": "object", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        errors=(500,),
    ),
}
