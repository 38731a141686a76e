"""``/v1/chat/completions`` and ``/chat/completions`` (OpenAI chat shape, llama-server semantics)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from mlxcel_compat.chat.messages import (
    ChatRequest,
    ChatRequestError,
    StreamSplitter,
    parse_chat_request,
    parse_tool_calls,
    prompt_opens_thinking,
    render_chat,
    split_reasoning,
)
from mlxcel_compat.chat.template import TemplateError
from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, GenerationRequest, ProgressEvent, TokenEvent
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import InvalidRequest, NotSupported, ServerError, json_response
from mlxcel_compat.server.routes_completion import SSE_HEADERS, add_verbose, check_context, collect, expand, parse_options, with_keepalive
from mlxcel_compat.server.routes_misc import ctx_of, read_json
from mlxcel_compat.settings import default_template_kwargs


def render_prompt(ctx: ServerContext, data: dict[str, Any]) -> tuple[str, ChatRequest]:
    """Validate the chat body and render it through the model's template (400 on any problem)."""
    template = ctx.model.chat_template
    if template is None:
        raise InvalidRequest("this model has no chat template; pass --chat-template")
    try:
        defaults = default_template_kwargs(ctx.settings)
        if ctx.cache_hooks is not None:
            defaults = ctx.cache_hooks.template_defaults(data, defaults)
        chat = parse_chat_request(data, default_template_kwargs=defaults)
        return render_chat(template, chat), chat
    except (ChatRequestError, TemplateError) as exc:
        if getattr(exc, "status_code", 400) >= 500:
            raise ServerError(exc.message) from None
        raise InvalidRequest(exc.message) from None


def _check_response_format(data: dict[str, Any]) -> None:
    """``response_format``: "text" is the only type served; the JSON types need constrained sampling."""
    fmt_spec = data.get("response_format")
    if fmt_spec is None:
        return
    kind = fmt_spec.get("type") if isinstance(fmt_spec, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise NotSupported(f"response_format type '{kind}' needs constrained sampling, which this server does not support")
    raise InvalidRequest("response_format type must be one of 'text', 'json_object' or 'json_schema'")


def _check_logprobs(data: dict[str, Any]) -> dict[str, Any]:
    """OpenAI ``logprobs: true`` + ``top_logprobs`` map to ``n_probs`` (default 20, llama-server)."""
    logprobs = data.get("logprobs")
    top = data.get("top_logprobs")
    if top is not None and logprobs is not True:
        raise InvalidRequest("top_logprobs requires logprobs to be set to true")
    if logprobs is True:
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
            raise InvalidRequest("Field 'top_logprobs': must be a non-negative integer")
        data = dict(data)
        data["n_probs"] = 20 if top is None else top
    data = {k: v for k, v in data.items() if k != "logprobs"}
    return data


async def chat_completions(request: Request) -> Response:
    ctx = ctx_of(request)
    data = await read_json(request)
    _check_response_format(data)
    prompt, chat = render_prompt(ctx, data)
    opts = parse_options(ctx, _check_logprobs(data))
    tokens = ctx.tokenize_rendered(prompt)
    check_context(ctx, tokens)
    requests = expand(ctx, opts, [tokens])
    if ctx.cache_hooks is not None:
        ctx.cache_hooks.prepare_chat(data, chat, requests, prompt)
    with_tools = bool(chat.tools) and chat.tool_choice != "none"
    if opts.stream:
        splitters = [
            StreamSplitter(reasoning=_reasoning_on(ctx, data), in_reasoning=prompt_opens_thinking(prompt), tools=with_tools) for _ in requests
        ]
        on_reply = lambda msg: _warm_up(ctx, data, chat, requests[0], msg)  # noqa: E731
        stream = _stream(ctx, data, requests, opts.include_usage, with_tools, splitters, on_reply)
        return StreamingResponse(with_keepalive(stream, opts.sse_ping_interval), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await collect(ctx, request, requests)
    choices = []
    for i, res in enumerate(results):
        reasoning, content = _split(ctx, res.content, data)
        tool_calls: list[dict[str, Any]] = []
        if with_tools:
            content, tool_calls = _tool_calls(content, data)
        choice: dict[str, Any] = {
            "finish_reason": fmt.finish_reason(res.finish, bool(tool_calls)),
            "index": i,
            "message": fmt.chat_message(content, reasoning, tool_calls),
        }
        if res.request.n_probs > 0:
            choice["logprobs"] = {"content": res.probs}
        choices.append(choice)
    _warm_up(ctx, data, chat, requests[0], choices[0]["message"])
    body = fmt.oai_chat(choices, results, ctx.model.model_id, fmt.completion_id(), fmt.now())
    return json_response(add_verbose(ctx, data, body, results[0]))


def _warm_up(ctx: ServerContext, data: dict[str, Any], chat: ChatRequest, request: GenerationRequest, message: dict[str, Any]) -> None:
    """Ask the engine to prepare the session's next turn while it is idle (snapshot families)."""
    if ctx.cache_hooks is None:
        return
    job = ctx.cache_hooks.warmup_job(data, chat, request, message)
    if job is not None:
        ctx.engine.warmup(job)


def _reasoning_on(ctx: ServerContext, data: dict[str, Any]) -> bool:
    """``reasoning_format`` (request, else ``--reasoning-format``): "none" keeps thinking in content."""
    requested = data.get("reasoning_format")
    return (requested if isinstance(requested, str) else ctx.settings.reasoning_format) != "none"


def _split(ctx: ServerContext, text: str, data: dict[str, Any]) -> tuple[str | None, str]:
    if not _reasoning_on(ctx, data):
        return None, text
    return split_reasoning(text)


def _tool_calls(content: str, data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Parsed tool calls; ``parallel_tool_calls: false`` keeps only the first."""
    content, calls = parse_tool_calls(content)
    if data.get("parallel_tool_calls") is False:
        calls = calls[:1]
    return content, calls


async def _stream(
    ctx: ServerContext,
    data: dict[str, Any],
    requests: list[GenerationRequest],
    include_usage: bool,
    with_tools: bool,
    splitters: list[StreamSplitter],
    on_reply: Callable[[dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    """OpenAI chat chunks: reasoning and content deltas split as they stream, tool calls at the end."""
    m = ctx.model
    rebuilt = [{"content": "", "reasoning_content": ""} for _ in requests]  # what the client will hold
    cid, created = fmt.completion_id(), fmt.now()
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    started: set[int] = set()
    last_finish: FinishEvent | None = None
    remaining = len(requests)
    async for i, event in ctx.run(requests):
        res = results[i]
        if i not in started and isinstance(event, (TokenEvent, FinishEvent)):
            started.add(i)
            yield fmt.sse(fmt.oai_chat_chunk({"role": "assistant", "content": None}, i, m.model_id, cid, created))
        if isinstance(event, TokenEvent):
            res.add(event, m.tokenizer)
            deltas = splitters[i].push(event.text) if event.text else []
            logprobs = {"content": [res.probs[-1]]} if event.top is not None else None
            if not deltas and logprobs is not None:
                deltas = [("content", "")]  # the token's text is held back; its logprobs are not
            for k, (field, text) in enumerate(deltas):
                rebuilt[i][field] += text
                last = logprobs if k == len(deltas) - 1 else None
                yield fmt.sse(fmt.oai_chat_chunk({field: text}, i, m.model_id, cid, created, None, last))
        elif isinstance(event, ProgressEvent):
            chunk = fmt.oai_chat_chunk({"role": "assistant", "content": None}, i, m.model_id, cid, created)
            chunk["prompt_progress"] = {"total": event.total, "cache": event.cache, "processed": event.processed, "time_ms": event.time_ms}
            yield fmt.sse(chunk)
        elif isinstance(event, FinishEvent):
            res.close(event)
            remaining -= 1
            last_finish = event
            for field, text in splitters[i].push(event.text) + splitters[i].flush():
                rebuilt[i][field] += text
                yield fmt.sse(fmt.oai_chat_chunk({field: text}, i, m.model_id, cid, created))
            tool_calls: list[dict[str, Any]] = []
            if with_tools:
                _, tool_calls = _tool_calls(_split(ctx, res.content, data)[1], data)
            if i == 0:
                # The message as the client rebuilds it from the deltas it received.
                reasoning = rebuilt[0]["reasoning_content"] or None
                on_reply(fmt.chat_message(rebuilt[0]["content"], reasoning, tool_calls))
            if tool_calls:
                deltas = [dict(tc, index=k) for k, tc in enumerate(tool_calls)]
                yield fmt.sse(fmt.oai_chat_chunk({"tool_calls": deltas}, i, m.model_id, cid, created))
            final = fmt.oai_chat_chunk({}, i, m.model_id, cid, created, fmt.finish_reason(event, bool(tool_calls)))
            if remaining == 0 and not include_usage:
                final["timings"] = fmt.timings_json(event)
            yield fmt.sse(final)
        elif isinstance(event, ErrorEvent):
            yield fmt.sse(ServerError(event.message).to_json())
            return
    if include_usage:
        usage_chunk: dict[str, Any] = {
            "choices": [],
            "created": created,
            "id": cid,
            "model": m.model_id,
            "system_fingerprint": fmt.SYSTEM_FINGERPRINT,
            "object": "chat.completion.chunk",
            "usage": fmt.usage_json(results),
        }
        if last_finish is not None:
            usage_chunk["timings"] = fmt.timings_json(last_finish)
        yield fmt.sse(usage_chunk)
    yield fmt.SSE_DONE


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions", chat_completions, methods=["POST"]),
]
