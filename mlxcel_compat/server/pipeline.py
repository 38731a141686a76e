"""The request pipeline every generation API shares: body → options → prompt → cache facts → engine.

Each API module (``api_native``, ``api_openai``, ``api_anthropic``, ``api_responses``) translates
its own wire format into the internal :class:`GenerationRequest` list with these helpers (chat-like
APIs translate into an OpenAI chat body and call :func:`prepare_chat`), runs it through
:func:`collect` (a whole response) or ``ctx.run`` (a stream), and formats the events back in its
own shapes. Nothing here knows a wire format beyond llama-server's request fields and the OpenAI
chat body, and nothing here touches MLX. A fifth API is one more module of that kind.

The CPU work of a request (parsing a large body, rendering the chat template, tokenizing, building
a large response) runs in the server's bounded worker pool (``server/workers.py``), never on the
event loop: :func:`read_json`, :func:`prepare_completion`, :func:`prepare_chat` and
:func:`respond` are coroutines that hand that work over. A prompt whose length proves it cannot
fit the context is refused before it is tokenized (``server/prompts.py``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mlxcel_compat.chat.lenient_calls import collect_schemas
from mlxcel_compat.chat.render import render_chat
from mlxcel_compat.chat.reply_parser import collect_arg_types
from mlxcel_compat.chat.request import ChatRequest, ChatRequestError, parse_chat_request
from mlxcel_compat.chat.sandbox import TemplateError
from mlxcel_compat.chat.stream_splitter import ReplyStream
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply as parse_reply_text
from mlxcel_compat.engine.reasoning_budget import opens_block
from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent, next_task_id
from mlxcel_compat.vision.inputs import MediaInput
from mlxcel_compat.engine.sampling.dry import dry_sequence_breakers
from mlxcel_compat.engine.sampling.infill_pieces import piece_index
from mlxcel_compat.server import cache_explain
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.cache_hooks import find_breakpoints
from mlxcel_compat.server.errors import ContextExceeded, InvalidRequest, ServerError, event_error, json_response
from mlxcel_compat.server.params import CompletionOptions, parse_completion_options
from mlxcel_compat.server.prompts import tokenize_prompts
from mlxcel_compat.server.streams import CONVERSATION_HEADER
from mlxcel_compat.settings import default_template_kwargs

SSE_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}
INLINE_JSON_BYTES = 64 * 1024  # smaller bodies are parsed on the loop (a thread hop costs more)

# Session headers routers and agents send for affinity; the first non-empty one is the prompt
# cache's session. vllm-router's consistent_hash hashes x-session-id, then x-user-id (then
# x-tenant-id, x-correlation-id, x-request-id, x-trace-id: a tenant spans many conversations and
# the last three are often per request, so they name no session here); Codex sends session_id.
SESSION_HEADERS = ("x-session-id", "session-id", "session_id", "x-session-affinity", "x-user-id")


def ctx_of(request: Request) -> ServerContext:
    return request.app.state.ctx


def header_session(request: Request) -> str | None:
    """The session a router named in the request headers, if any."""
    for name in SESSION_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return value
    return None


def api_key_id(request: Request) -> str | None:
    """The digest of the API key that authenticated the request (set by the gate), if any."""
    return request.scope.get("state", {}).get("api_key_id")


def parse_json(raw: bytes, empty: Any = None) -> Any:
    """A body as JSON (``empty`` for a blank one); invalid JSON is a 400 (llama-server answers 500)."""
    try:
        return orjson.loads(raw) if raw.strip() else empty
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Invalid JSON in request body: {exc}") from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object; anything else is a 400 (llama-server answers 500)."""
    data = parse_json(raw, {})
    if not isinstance(data, dict):
        raise InvalidRequest("Request body must be a JSON object")
    return data


async def read_json(request: Request) -> dict[str, Any]:
    """The request body (at most ``--max-body-bytes``, enforced while it streams in) as a JSON
    object; a large body is parsed on a worker thread."""
    raw = await request.body()
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json_object(raw)
    return await ctx_of(request).workers.run(parse_json_object, raw)


async def respond(ctx: ServerContext, build: Callable[[], Any]) -> Response:
    """A JSON response whose body is built and serialised on a worker thread (a response with
    per-token probabilities can be large)."""
    return await ctx.workers.run(lambda: json_response(build()))


# ---------------------------------------------------------------------- options and prompts


def parse_options(ctx: ServerContext, data: Mapping[str, Any], *, response_format: bool = False) -> CompletionOptions:
    """A completion route's options and output constraint (a ``grammar`` wins over a
    ``json_schema``; ``response_format`` is read on ``/v1/completions``)."""
    constraint = ctx.structured.for_completion(data, response_format=response_format)
    opts = _parse_options(ctx, data)
    opts.request.constraint = constraint
    return opts


def _parse_options(ctx: ServerContext, data: Mapping[str, Any]) -> CompletionOptions:
    m = ctx.model
    return parse_completion_options(data, ctx.settings, len(ctx.engine.slots), m.vocab_size, ctx.tokenize, m.eog_ids,
                                    ctx.adapters)


def prepare_samplers(ctx: ServerContext, opts: CompletionOptions) -> None:
    """Work the engine would otherwise do when the sequence starts, done here on a worker thread:
    mapping DRY sequence breakers to token sequences scans the whole vocabulary (cached per list),
    and the infill sampler's piece index sorts it (once per model)."""
    s = opts.request.sampling
    if s.dry_multiplier > 0 and "dry" in s.samplers:
        dry_sequence_breakers(ctx.model.tokenizer, s.dry_sequence_breakers)
    if "infill" in s.samplers:
        piece_index(ctx.model.tokenizer)


def check_context(ctx: ServerContext, tokens: list[int]) -> None:
    if len(tokens) >= ctx.model.n_ctx:
        raise ContextExceeded(len(tokens), ctx.model.n_ctx)


def expand(ctx: ServerContext, opts: CompletionOptions, prompts: list[list[int]]) -> list[GenerationRequest]:
    """One request per prompt and per completion (``n_cmpl``); children get seed+1, seed+2, ...

    An encoder cannot generate: llama-server answers its 500 once a prompt reaches a slot (an
    empty prompt still gets its empty answer). Raised here, before any stream starts, it is the
    plain JSON error llama-server sends for a stream whose first result is an error."""
    if ctx.model.kind == "encoder" and any(prompts):
        from mlxcel_compat.engine.core import NO_LOGITS

        raise ServerError(NO_LOGITS)
    requests = []
    for p_index, tokens in enumerate(prompts):
        for child in range(opts.n_cmpl):
            req = copy.deepcopy(opts.request)
            req.task_id = next_task_id()  # each sequence is its own task (events, cancellation)
            req.prompt_tokens = tokens
            req.index = p_index * opts.n_cmpl + child
            budget = req.reasoning_budget
            if budget is not None:  # a template that opens <think> for the model starts the count
                req.reasoning_budget = dataclasses.replace(budget, open_at_start=opens_block(tokens, budget.start, budget.end))
            if child and req.sampling.seed != 0xFFFFFFFF:
                req.sampling.seed = (req.sampling.seed + child) & 0xFFFFFFFF
            req.slot_params = fmt.metrics_params(req, opts.stream)
            if opts.n_cmpl > 1:
                # The engine prefills the prompt once and the siblings copy its KV.
                req.share_group = requests[-child].task_id if child else req.task_id
            requests.append(req)
    # Children of one prompt share the token list object (usage counts the prompt once).
    return requests


def prompt_text(ctx: ServerContext, tokens: list[int]) -> str:
    return ctx.model.tokenizer.decode(tokens, skip_special_tokens=False)


@dataclass
class CompletionJob:
    """A raw-prompt request ready for the engine: one request per prompt and per completion."""

    opts: CompletionOptions
    requests: list[GenerationRequest]
    multi: bool  # the body held several prompts (the response is then an array)


async def prepare_completion(
    ctx: ServerContext, request: Request, data: Mapping[str, Any], *, response_format: bool = False
) -> CompletionJob:
    """``prompt`` (llama-server's shapes) and the options, tokenized on a worker thread;
    ``response_format`` is read on ``/v1/completions`` only."""
    job = await ctx.workers.run(build_completion_job, ctx, data, header_session(request), api_key_id(request), response_format)
    explain_on_header(request, job.requests)
    return job


def build_completion_job(
    ctx: ServerContext, data: Mapping[str, Any], session: str | None, key_id: str | None, response_format: bool = False
) -> CompletionJob:
    """The work of :func:`prepare_completion`, on the calling thread: ``session`` and ``key_id``
    are what the request's headers gave. ``/infill`` and the tests call it with their own prompts."""
    opts = parse_options(ctx, data, response_format=response_format)
    m = ctx.model
    media = _raw_media(ctx, data.get("prompt"))
    if media is not None:
        prompts, multi = [media[0]], False
    else:
        prompts, multi = tokenize_prompts(m.tokenizer, data.get("prompt"), m.vocab_size, ctx.prompt_bound, ctx.settings.max_prompts)
    for tokens in prompts:
        check_context(ctx, tokens)
    prepare_samplers(ctx, opts)
    requests = expand(ctx, opts, prompts)
    if ctx.cache_hooks is not None:
        ctx.cache_hooks.prepare_raw(data, requests, session, key_id)
    if media is not None:
        attach_media(requests, media[1], media[2])
    return CompletionJob(opts=opts, requests=requests, multi=multi)


def _raw_media(ctx: ServerContext, prompt: Any) -> tuple[list[int], MediaInput, bytes] | None:
    """A raw prompt ``{"prompt_string", "multimodal_data": [base64, ...]}`` on a vision model:
    its tokens with the images in place of the media markers (None for any other prompt; a text
    model refuses ``multimodal_data`` in ``tokenize_prompts`` with llama-server's message)."""
    if ctx.media is None:
        return None
    if isinstance(prompt, list) and any(isinstance(p, Mapping) and "multimodal_data" in p for p in prompt):
        raise InvalidRequest("multimodal_data is served for a single prompt per request")
    if not isinstance(prompt, Mapping) or "multimodal_data" not in prompt:
        return None
    return media_prompt(ctx, prompt)


def media_prompt(ctx: ServerContext, prompt: Mapping[str, Any]) -> tuple[list[int], MediaInput, bytes]:
    """``(tokens, media, mm_digest)`` of one raw prompt ``{"prompt_string", "multimodal_data"}``
    on a vision model: each media marker becomes its item's tokens (the prepared-image memo
    spares the same bytes a second decode). ``/completion`` and ``/embeddings`` share it."""
    from mlxcel_compat.server.media import marked_prompt_tokens, raw_media_sources

    text, items = prompt.get("prompt_string"), prompt.get("multimodal_data")
    if not isinstance(text, str):
        raise InvalidRequest("prompt_string must be a string")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise InvalidRequest("multimodal_data must be an array of base64 strings")
    ctx.prompt_bound.check(len(text))
    sources, kinds = raw_media_sources(ctx.media.facts, items)
    tokens = marked_prompt_tokens(ctx.model.tokenizer, ctx.media.facts, text, len(items), kinds)
    return ctx.media.prepare(sources, tokens)


# ---------------------------------------------------------------------- chat requests


def render_prompt(ctx: ServerContext, data: Mapping[str, Any]) -> tuple[str, ChatRequest]:
    """Validate an OpenAI-shaped chat body and render it through the model's template (400 on any problem)."""
    template = ctx.model.chat_template
    if template is None:
        raise InvalidRequest("this model has no chat template; pass --chat-template")
    try:
        defaults = default_template_kwargs(ctx.settings)
        facts = ctx.media.facts if ctx.media is not None else None
        chat = parse_chat_request(data, default_template_kwargs=defaults, images=facts is not None and facts.images,
                                  audio=facts is not None and facts.audio is not None)
        return render_chat(template, chat), chat
    except (ChatRequestError, TemplateError) as exc:
        if getattr(exc, "status_code", 400) >= 500:
            raise ServerError(exc.message) from None
        raise InvalidRequest(exc.message) from None


async def count_prompt_tokens(ctx: ServerContext, data: Mapping[str, Any]) -> int:
    """Tokens of the prompt an OpenAI chat body renders to (the ``input_tokens`` routes), counted
    on a worker thread."""
    return await ctx.workers.run(_count_prompt_tokens, ctx, data)


def _count_prompt_tokens(ctx: ServerContext, data: Mapping[str, Any]) -> int:
    prompt, chat = render_prompt(ctx, data)
    tokens = ctx.tokenize_rendered(prompt)
    if chat.images:
        tokens, _, _ = ctx.media.prepare(chat.images, tokens)
    return len(tokens)


@dataclass
class ChatJob:
    """A chat request ready for the engine: the rendered prompt and one request per choice."""

    data: Mapping[str, Any]  # the OpenAI-shaped chat body the job was built from
    chat: ChatRequest
    prompt: str
    opts: CompletionOptions
    requests: list[GenerationRequest]
    syntax: ChatSyntax  # how the reply is written: the rendering template's (learned on a worker)

    @property
    def with_tools(self) -> bool:
        return bool(self.chat.tools) and self.chat.tool_choice != "none"

    @property
    def calls_forced(self) -> bool:
        """``tool_choice`` "required" or a named function: the grammar lets the reply hold calls
        only (``server/structured.py``), so any content is a call cut short (``max_tokens``)."""
        return bool(self.chat.callable_tools) and self.chat.tool_choice != "auto"


async def prepare_chat(ctx: ServerContext, request: Request, data: Mapping[str, Any]) -> ChatJob:
    """Render, tokenize, check the context and attach the prompt-cache facts, on a worker thread.

    ``data`` is an OpenAI chat-completions body (``messages``, ``tools``, sampling fields); other
    chat-like APIs translate into that shape first. ``cache_control`` markers on its content
    parts, messages or tools are explicit cache breakpoints. ``request`` gives the session a router
    named in its headers (:func:`header_session`) and the API key's digest (the tenant namespace).
    Its structured-output fields (``grammar``, ``json_schema``,
    ``response_format``, ``tool_choice`` with ``tools``, ``parallel_tool_calls``) become the
    requests' constraint (``server/structured.py``).
    """
    job = await ctx.workers.run(build_chat_job, ctx, data, header_session(request), api_key_id(request))
    explain_on_header(request, job.requests)
    return job


def explain_on_header(request: Request, requests: list[GenerationRequest]) -> None:
    """``X-Cache-Explain: 1`` asks for ``cache_explain`` as the body field does."""
    if cache_explain.wanted(request):
        for req in requests:
            req.cache.explain = True


def build_chat_job(ctx: ServerContext, data: Mapping[str, Any], session: str | None, key_id: str | None) -> ChatJob:
    """The work of :func:`prepare_chat`, on the calling thread: ``session`` and ``key_id`` are
    what the request's headers gave."""
    breakpoints = find_breakpoints(data)
    prompt, chat = render_prompt(ctx, data)
    ctx.prompt_bound.check(len(prompt))  # the rendered prompt cannot fit: no need to tokenize it
    constraint = ctx.structured.for_chat(data, chat, prompt, ctx.model.chat_template.for_tools(chat.render_tools))
    opts = _parse_options(ctx, data)
    opts.request.constraint = constraint
    _budget_in_template_syntax(ctx, data, chat, opts)
    tokens = ctx.tokenize_rendered(prompt)
    media = digest = None
    if chat.images:
        tokens, media, digest = ctx.media.prepare(chat.images, tokens)
    check_context(ctx, tokens)
    prepare_samplers(ctx, opts)
    requests = expand(ctx, opts, [tokens])
    if ctx.cache_hooks is not None:
        ctx.cache_hooks.prepare_chat(data, chat, requests, prompt, session, breakpoints, key_id)
    if media is not None:
        attach_media(requests, media, digest)
    syntax = ctx.model.chat_template.for_tools(chat.render_tools).syntax()  # learned once per template
    return ChatJob(data=data, chat=chat, prompt=prompt, opts=opts, requests=requests, syntax=syntax)


def _budget_in_template_syntax(ctx: ServerContext, data: Mapping[str, Any], chat: ChatRequest, opts: CompletionOptions) -> None:
    """A reasoning budget counts the block of the template's own syntax (``[THINK]``,
    ``<seed:think>``, ...) unless the request names its tags (``reasoning_budget_*_tag``)."""
    budget = opts.request.reasoning_budget
    if budget is None or "reasoning_budget_start_tag" in data or "reasoning_budget_end_tag" in data:
        return
    reasoning = ctx.model.chat_template.for_tools(chat.render_tools).syntax().reasoning
    if reasoning is None or (reasoning.start, reasoning.end) == ("<think>", "</think>"):
        return
    message = data.get("reasoning_budget_message", ctx.settings.reasoning_budget_message or "")
    tokenize = ctx.tokenize
    start = reasoning.start or reasoning.opener
    opts.request.reasoning_budget = dataclasses.replace(
        budget, start=tuple(tokenize(start)) if start else (), end=tuple(tokenize(reasoning.end)),
        forced=tuple(tokenize(str(message) + reasoning.end)))


def attach_media(requests: list[GenerationRequest], media: MediaInput, digest: bytes) -> None:
    """Images ride with each request; their digest keys the prompt cache (``mm_digest``). The
    history-boundary split is computed on the rendered text, whose offsets the image tokens
    moved, so it is dropped (dense-KV families do not use it), and breakpoints inside an image
    are moved back to its start (the cache never splits a prompt inside one)."""
    from mlxcel_compat.cache.media import clip_to_media

    for req in requests:
        req.media = media
        req.cache.mm_digest = digest
        req.cache.history_boundary = None
        req.cache.breakpoints = [(clip_to_media(at, media.spans), ttl) for at, ttl in req.cache.breakpoints]


def reasoning_on(ctx: ServerContext, data: Mapping[str, Any]) -> bool:
    """``reasoning_format`` (request, else ``--reasoning-format``): "none" keeps thinking in content.

    SGLang's ``separate_reasoning: false`` means the same as ``reasoning_format: "none"`` when the
    request names no format. Routers (vllm-router, sglang-router) add ``separate_reasoning: true``
    to every chat body, so only ``false`` can carry a client's intent; ``true`` changes nothing.
    """
    requested = data.get("reasoning_format")
    if not isinstance(requested, str) and data.get("separate_reasoning") is False:
        return False
    return (requested if isinstance(requested, str) else ctx.settings.reasoning_format) != "none"


def reply_options(ctx: ServerContext, job: ChatJob, syntax: ChatSyntax) -> ReplyOptions:
    """How the request's reply is taken apart: ``reasoning_format``, whether the prompt opened the
    reasoning block, the offered tools and ``parallel_tool_calls``, and whether a call written
    loosely is recovered (``--lenient-tool-calls``, with tools offered and ``tool_choice`` not ``none``)."""
    separate = reasoning_on(ctx, job.data)
    return ReplyOptions(
        reasoning=separate,
        in_reasoning=separate and syntax.reply_starts_in_reasoning(job.prompt),
        tools=job.with_tools,
        parallel=job.data.get("parallel_tool_calls") is not False,
        arg_types=collect_arg_types(job.chat.tools) if job.with_tools else {},
        lenient_schemas=lenient_schemas(ctx, job),
    )


def lenient_schemas(ctx: ServerContext, job: ChatJob) -> dict[str, Any]:
    """The tools a loosely written call may name, with their schemas: the offered ones (only the
    named one under a named ``tool_choice``); none with ``--no-lenient-tool-calls`` or without tools."""
    if not job.with_tools or not ctx.settings.lenient_tool_calls:
        return {}
    schemas = collect_schemas(job.chat.tools)
    choice = job.chat.tool_choice
    return schemas if choice in ("auto", "required") else {k: v for k, v in schemas.items() if k == choice}


@dataclass
class Reply:
    """A finished chat reply taken apart: reasoning, the text, the tool calls (OpenAI shape)."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]]


def parse_reply(ctx: ServerContext, job: ChatJob, text: str) -> Reply:
    """A finished reply in its template's syntax; ``parallel_tool_calls: false`` keeps the first call."""
    parsed = parse_reply_text(job.syntax, text, reply_options(ctx, job, job.syntax))
    content = "" if _calls_only(ctx, job) else parsed.content
    return Reply(parsed.reasoning, content, parsed.tool_calls)


def _calls_only(ctx: ServerContext, job: ChatJob) -> bool:
    """A reply whose content is dropped: forced calls with the reasoning taken out (with
    ``reasoning_format: none`` the content holds the reasoning the client asked to keep)."""
    return job.calls_forced and reasoning_on(ctx, job.data)


class CallsOnlyStream(ReplyStream):
    """A stream of forced calls: a call cut short is never sent as content."""

    def push(self, text: str) -> list[tuple[str, Any]]:
        return [d for d in super().push(text) if d[0] != "content"]

    def finish(self) -> list[tuple[str, Any]]:
        return [d for d in super().finish() if d[0] != "content"]


def reply_splitter(ctx: ServerContext, job: ChatJob) -> ReplyStream:
    """Takes a streamed reply apart: reasoning and content deltas, and tool-call deltas."""
    stream = CallsOnlyStream if _calls_only(ctx, job) else ReplyStream
    return stream(job.syntax, reply_options(ctx, job, job.syntax))


def reply_deltas(ctx: ServerContext, job: ChatJob, text: str) -> list[tuple[str, Any]]:
    """A finished reply as the deltas its stream sends, in one piece: the Anthropic and Responses
    routes build a whole response with their stream's writer, so it lists the blocks or items in
    the order they were written, as the stream does."""
    splitter = reply_splitter(ctx, job)
    return splitter.push(text) + splitter.finish()


def stream_deltas(ctx: ServerContext, splitter: ReplyStream, result: fmt.Result, event: TokenEvent | FinishEvent) -> list[tuple[str, Any]]:
    """Add a token or finish event to ``result``; return the ``(field, value)`` deltas to send."""
    if isinstance(event, TokenEvent):
        result.add(event, ctx.model.tokenizer)
        return splitter.push(event.text)
    result.close(event)
    return splitter.push(event.text) + splitter.finish()


def warm_up(ctx: ServerContext, job: ChatJob, message: Mapping[str, Any]) -> None:
    """Ask the engine to prepare the session's next turn while it is idle (snapshot families).

    ``message`` is the assistant reply as the client will send it back (OpenAI message shape).
    Rendering and tokenizing the next turn's history happens on a worker thread; nothing waits.
    """
    hooks = ctx.cache_hooks
    if hooks is None or not hooks.warmup:
        return

    def prepare() -> None:
        warmup = hooks.warmup_job(job.data, job.chat, job.requests[0], message)
        if warmup is not None:
            ctx.engine.warmup(warmup)

    ctx.workers.submit(prepare)


# ---------------------------------------------------------------------- running


async def collect(ctx: ServerContext, request: Request, requests: list[GenerationRequest]) -> list[fmt.Result]:
    """Run the sequences to completion; a client that disconnects cancels them."""
    results = [fmt.Result(index=r.index, request=r) for r in requests]
    tokenizer = ctx.model.tokenizer

    async def consume() -> None:
        async for i, event in ctx.run(requests, incremental=False):  # nothing is sent before the end
            res = results[i]
            if isinstance(event, TokenEvent):
                res.add(event, tokenizer)
            elif isinstance(event, FinishEvent):
                res.close(event)
            elif isinstance(event, ErrorEvent):
                raise event_error(event)

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


def sse_response(chunks: AsyncIterator[bytes], opts: CompletionOptions, request: Request | None = None) -> StreamingResponse:
    """An SSE stream with llama-server's headers and the request's keep-alive interval.

    A request with an ``X-Conversation-Id`` header gets a resumable stream (``server/streams.py``):
    its bytes are produced into the conversation's buffer whether or not the client stays, and
    the client reads them from there as a later ``GET /v1/stream`` would."""
    chunks = with_keepalive(chunks, opts.sse_ping_interval)
    conversation = request.headers.get(CONVERSATION_HEADER, "").strip() if request is not None else ""
    if conversation:
        session = ctx_of(request).streams.create_or_replace(conversation)
        session.produce(chunks)
        chunks = session.read_from(0)
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
