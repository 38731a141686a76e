"""The OpenAI API: ``/v1/chat/completions`` and ``/v1/completions`` (llama-server semantics).

Translates the OpenAI request shapes into the shared pipeline's requests and formats the engine's
events back as OpenAI bodies and SSE chunks.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.chat.stream_splitter import ReplyStream
from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, GenerationRequest, ProgressEvent, TokenEvent
from mlxcel_compat.server import cache_explain
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import InvalidRequest, event_error, json_response
from mlxcel_compat.server.openapi import JSON, SSE, Operation
from mlxcel_compat.server.params import CompletionOptions
from mlxcel_compat.server.pipeline import (
    ChatJob,
    collect,
    count_prompt_tokens,
    ctx_of,
    parse_reply,
    prepare_chat,
    prepare_completion,
    prompt_text,
    read_json,
    reply_splitter,
    respond,
    sse_response,
    warm_up,
)
from mlxcel_compat.server.progress import PromptProgress

SYSTEM_FINGERPRINT = fmt.BUILD_INFO


def completion_id() -> str:
    return fmt.random_id("chatcmpl-")


# ---------------------------------------------------------------------- request checks


TOP_LOGPROBS_MAX = 20  # OpenAI's limit


def check_logprobs(data: dict[str, Any]) -> dict[str, Any]:
    """OpenAI ``logprobs: true`` + ``top_logprobs`` map to ``n_probs`` (default 20, llama-server);
    ``top_logprobs`` is capped at OpenAI's 20."""
    logprobs = data.get("logprobs")
    top = data.get("top_logprobs")
    if top is not None and logprobs is not True:
        raise InvalidRequest("top_logprobs requires logprobs to be set to true")
    if logprobs is True:
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= TOP_LOGPROBS_MAX):
            raise InvalidRequest(f"Field 'top_logprobs': must be an integer between 0 and {TOP_LOGPROBS_MAX}, but got {top!r}")
        data = dict(data)
        data["n_probs"] = 20 if top is None else top
    data = {k: v for k, v in data.items() if k != "logprobs"}
    return data


def add_verbose(ctx: ServerContext, data: dict[str, Any], body: dict[str, Any], result: fmt.Result) -> dict[str, Any]:
    """``verbose: true`` (or a ``-v`` server): OpenAI bodies also carry the native result."""
    if data.get("verbose") is True or (data.get("verbose") is None and ctx.settings.verbose):
        m = ctx.model
        body["__verbose"] = fmt.native_final(result, m.model_id, prompt_text(ctx, result.request.prompt_tokens), False, False, 0, True, m.eog_ids)
    return body


def with_explain(ctx: ServerContext, body: dict[str, Any], results: list[fmt.Result]) -> dict[str, Any]:
    """``cache_explain`` asked for: why the prompt cache reused what it did, in the body."""
    explained = cache_explain.of_results(results, ctx.model.tokenizer)
    if explained is not None:
        body["cache_explain"] = explained
    return body


# ---------------------------------------------------------------------- response shapes


def finish_reason(fin: FinishEvent, has_tool_calls: bool = False) -> str:
    if fin.stop_type in ("eos", "word"):
        return "tool_calls" if has_tool_calls else "stop"
    return "length"


def usage_json(results: list[fmt.Result]) -> dict[str, Any]:
    counts = fmt.token_counts(results)
    return {
        "completion_tokens": counts.completion,
        "prompt_tokens": counts.prompt,
        "total_tokens": counts.prompt + counts.completion,
        "prompt_tokens_details": {"cached_tokens": counts.cached},
    }


def _logprobs(result: fmt.Result) -> dict[str, Any] | None:
    if result.request.n_probs <= 0:
        return None
    return {"content": result.probs}


def _timings(results: list[fmt.Result]) -> dict[str, Any]:
    return fmt.timings_json(results[0].finish) if results and results[0].finish else {}


def completion_body(results: list[fmt.Result], model_id: str, cid: str, created: int) -> dict[str, Any]:
    choices = [
        {
            "text": r.content,
            "index": i,
            "logprobs": _logprobs(r),
            "finish_reason": finish_reason(r.finish) if r.finish else "stop",
        }
        for i, r in enumerate(results)
    ]
    return {
        "choices": choices,
        "created": created,
        "model": model_id,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "object": "text_completion",
        "usage": usage_json(results),
        "id": cid,
        "timings": _timings(results),
    }


def completion_chunk(text: str, index: int, model_id: str, cid: str, created: int, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
    return {
        "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}],
        "created": created,
        "model": model_id,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "object": "text_completion",
        "id": cid,
    }


def chat_message(content: str, reasoning: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def chat_body(choices: list[dict[str, Any]], results: list[fmt.Result], model_id: str, cid: str, created: int) -> dict[str, Any]:
    return {
        "choices": choices,
        "created": created,
        "model": model_id,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "object": "chat.completion",
        "usage": usage_json(results),
        "id": cid,
        "timings": _timings(results),
    }


def chat_chunk(delta: dict[str, Any], index: int, model_id: str, cid: str, created: int, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"finish_reason": finish, "index": index, "delta": delta}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {
        "choices": [choice],
        "created": created,
        "id": cid,
        "model": model_id,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "object": "chat.completion.chunk",
    }


# ---------------------------------------------------------------------- /v1/completions


async def completions(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    job = await prepare_completion(ctx, request, data, response_format=True)
    if job.opts.stream:
        return sse_response(_stream_completion(ctx, job.requests, job.opts), job.opts, request)
    results = await collect(ctx, request, job.requests)
    cid, created = completion_id(), fmt.now()
    return await respond(ctx, lambda: add_verbose(ctx, data, with_explain(ctx, completion_body(results, ctx.model.model_id, cid, created), results), results[0]))


async def _stream_completion(ctx: ServerContext, requests: list[GenerationRequest], opts: CompletionOptions) -> AsyncIterator[bytes]:
    m = ctx.model
    cid, created = completion_id(), fmt.now()
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    remaining = len(requests)
    progress = PromptProgress.for_request(ctx, opts.timings_per_token)
    async for i, event in ctx.run(requests):
        res = results[i]
        if isinstance(event, TokenEvent):
            res.add(event, m.tokenizer)
            if event.text or event.top is not None:
                logprobs = {"content": [fmt.prob_entry(m.tokenizer, event, res.request.post_sampling_probs)]} if event.top is not None else None
                chunk = completion_chunk(event.text, i, m.model_id, cid, created, None, logprobs)
                if opts.timings_per_token:
                    chunk["timings"] = fmt.timings_json(event)
                yield fmt.sse(chunk)
        elif isinstance(event, ProgressEvent):
            for report in progress.feed(i, event):  # an empty token's chunk, as llama-server sends it
                yield fmt.sse(report.attach(completion_chunk("", i, m.model_id, cid, created, None)))
        elif isinstance(event, FinishEvent):
            res.close(event)
            remaining -= 1
            if event.text:  # text held back until the end (a stop string's prefix, a split character)
                chunk = completion_chunk(event.text, i, m.model_id, cid, created, None)
                if opts.timings_per_token:
                    chunk["timings"] = fmt.timings_json(event)
                yield fmt.sse(chunk)
            final = completion_chunk("", i, m.model_id, cid, created, finish_reason(event))
            if remaining == 0:
                final["usage"] = usage_json(results)
                final["timings"] = fmt.timings_json(event)
                with_explain(ctx, final, results)
            yield fmt.sse(final)
        elif isinstance(event, ErrorEvent):
            yield fmt.sse(event_error(event).to_json())
            return
    yield fmt.SSE_DONE


# ---------------------------------------------------------------------- /v1/chat/completions


async def chat_completions(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    job = await prepare_chat(ctx, request, check_logprobs(data))
    if job.opts.stream:
        splitters = [reply_splitter(ctx, job) for _ in job.requests]
        on_reply = lambda msg: warm_up(ctx, job, msg)  # noqa: E731
        return sse_response(_stream_chat(ctx, job, splitters, on_reply), job.opts, request)
    results = await collect(ctx, request, job.requests)
    cid, created = completion_id(), fmt.now()

    def build() -> dict[str, Any]:
        choices = []
        for i, res in enumerate(results):
            reply = parse_reply(ctx, job, res.content)
            choice: dict[str, Any] = {
                "finish_reason": finish_reason(res.finish, bool(reply.tool_calls)),
                "index": i,
                "message": chat_message(reply.content, reply.reasoning, reply.tool_calls),
            }
            if res.request.n_probs > 0:
                choice["logprobs"] = {"content": res.probs}
            choices.append(choice)
        warm_up(ctx, job, choices[0]["message"])
        return add_verbose(ctx, data, with_explain(ctx, chat_body(choices, results, ctx.model.model_id, cid, created), results), results[0])

    return await respond(ctx, build)


async def _stream_chat(
    ctx: ServerContext,
    job: ChatJob,
    splitters: list[ReplyStream],
    on_reply: Callable[[dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    """OpenAI chat chunks: reasoning, content and tool-call deltas as the reply streams (a call's name
    first, then its arguments in pieces). While it runs, ``POST /v1/chat/completions/control``
    finds its sequences by the id its chunks carry."""
    cid, created = completion_id(), fmt.now()
    with ctx.completions.register(cid, job.requests):
        async for chunk in _chat_chunks(ctx, job, splitters, on_reply, cid, created):
            yield chunk


async def _chat_chunks(
    ctx: ServerContext,
    job: ChatJob,
    splitters: list[ReplyStream],
    on_reply: Callable[[dict[str, Any]], None],
    cid: str,
    created: int,
) -> AsyncIterator[bytes]:
    m = ctx.model
    requests = job.requests
    rebuilt = [{"content": "", "reasoning_content": ""} for _ in requests]  # what the client will hold
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    started: set[int] = set()
    last_finish: FinishEvent | None = None
    remaining = len(requests)
    progress = PromptProgress.for_request(ctx, job.opts.timings_per_token)
    async for i, event in ctx.run(requests):
        res = results[i]
        if i not in started and isinstance(event, (TokenEvent, FinishEvent)):
            started.add(i)
            yield fmt.sse(chat_chunk({"role": "assistant", "content": None}, i, m.model_id, cid, created))
        if isinstance(event, TokenEvent):
            res.add(event, m.tokenizer)
            deltas = splitters[i].push(event.text) if event.text else []
            logprobs = {"content": [fmt.prob_entry(m.tokenizer, event, res.request.post_sampling_probs)]} if event.top is not None else None
            if not deltas and logprobs is not None:
                deltas = [("content", "")]  # the token's text is held back; its logprobs are not
            for k, (field, text) in enumerate(deltas):
                if field != "tool_calls":
                    rebuilt[i][field] += text
                is_last = k == len(deltas) - 1
                chunk = chat_chunk({field: text}, i, m.model_id, cid, created, None, logprobs if is_last else None)
                if is_last and job.opts.timings_per_token:  # on the token's last chunk, as llama-server
                    chunk["timings"] = fmt.timings_json(event)
                yield fmt.sse(chunk)
        elif isinstance(event, ProgressEvent):
            for report in progress.feed(i, event):
                yield fmt.sse(report.attach(chat_chunk({"role": "assistant", "content": None}, i, m.model_id, cid, created)))
        elif isinstance(event, FinishEvent):
            res.close(event)
            remaining -= 1
            last_finish = event
            for field, text in splitters[i].push(event.text) + splitters[i].finish():
                if field != "tool_calls":
                    rebuilt[i][field] += text
                chunk = chat_chunk({field: text}, i, m.model_id, cid, created)
                if job.opts.timings_per_token:  # held-back text is a token's too
                    chunk["timings"] = fmt.timings_json(event)
                yield fmt.sse(chunk)
            tool_calls = splitters[i].tool_calls
            if i == 0:
                # The message as the client rebuilds it from the deltas it received.
                reasoning = rebuilt[0]["reasoning_content"] or None
                on_reply(chat_message(rebuilt[0]["content"], reasoning, tool_calls))
            final = chat_chunk({}, i, m.model_id, cid, created, finish_reason(event, bool(tool_calls)))
            if remaining == 0 and not job.opts.include_usage:
                final["timings"] = fmt.timings_json(event)
                with_explain(ctx, final, results)
            yield fmt.sse(final)
        elif isinstance(event, ErrorEvent):
            yield fmt.sse(event_error(event).to_json())
            return
    if job.opts.include_usage:
        usage_chunk: dict[str, Any] = {
            "choices": [],
            "created": created,
            "id": cid,
            "model": m.model_id,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": "chat.completion.chunk",
            "usage": usage_json(results),
        }
        if last_finish is not None:
            usage_chunk["timings"] = fmt.timings_json(last_finish)
        yield fmt.sse(with_explain(ctx, usage_chunk, results))  # cache_explain beside the usage it explains
    yield fmt.SSE_DONE


# ---------------------------------------------------------------------- /v1/chat/completions/input_tokens


async def chat_input_tokens(request: Request) -> Response:
    """Tokens of the prompt a chat body renders to, without generating (llama-server's route)."""
    ctx = ctx_of(request)
    data = await read_json(request)
    return json_response({"input_tokens": await count_prompt_tokens(ctx, data)})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
    Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
]

USAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}, "required": ["cached_tokens"]},
    },
    "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
}
FINISH_REASON = {"enum": ["stop", "length", "tool_calls"]}
LOGPROBS_SCHEMA = {"type": "object", "properties": {"content": {"type": "array", "items": fmt.PROB_SCHEMA}}, "required": ["content"]}
COMMON = {
    "id": {"type": "string"},
    "created": {"type": "integer"},
    "model": {"type": "string"},
    "system_fingerprint": {"type": "string"},
    "usage": USAGE_SCHEMA,
    "timings": fmt.TIMINGS_SCHEMA,
}
CHAT_COMPLETION = {
    "type": "object",
    "properties": {
        **COMMON,
        "object": {"const": "chat.completion"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "finish_reason": FINISH_REASON,
                    "message": {
                        "type": "object",
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "reasoning_content": {"type": "string"},
                            "tool_calls": {"type": "array", "items": {"type": "object"}},
                        },
                        "required": ["role", "content"],
                    },
                    "logprobs": LOGPROBS_SCHEMA,
                },
                "required": ["index", "finish_reason", "message"],
            },
        },
    },
    "required": ["id", "object", "created", "model", "choices", "usage"],
}
TEXT_COMPLETION = {
    "type": "object",
    "properties": {
        **COMMON,
        "object": {"const": "text_completion"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "index": {"type": "integer"},
                    "logprobs": {"anyOf": [LOGPROBS_SCHEMA, {"type": "null"}]},
                    "finish_reason": FINISH_REASON,
                },
                "required": ["text", "index", "finish_reason"],
            },
        },
    },
    "required": ["id", "object", "created", "model", "choices", "usage"],
}
CHAT = Operation("OpenAI chat completions", body=("all", "chat"), ok=CHAT_COMPLETION, media=(JSON, SSE), errors=(500, 501))
INPUT_TOKENS = Operation(
    "Prompt tokens of a chat body (rendered, not run)",
    body=("all", "chat"),
    ok={"type": "object", "properties": {"input_tokens": {"type": "integer"}}, "required": ["input_tokens"]},
)
OPERATIONS = {
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/chat/completions"): CHAT,
    ("POST", "/v1/chat/completions/input_tokens"): INPUT_TOKENS,
    ("POST", "/chat/completions/input_tokens"): INPUT_TOKENS,
    ("POST", "/v1/completions"): Operation(
        "OpenAI text completions", body=("all", "completion"), ok=TEXT_COMPLETION, media=(JSON, SSE), errors=(500, 501)
    ),
}
