"""The Anthropic Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

A Messages body is translated into the OpenAI chat body the shared pipeline takes (system and
text blocks become messages and text parts, ``image`` blocks ``image_url`` parts (read by a
vision model, refused by a text model as llama-server refuses them), ``tool_use`` becomes ``tool_calls``,
``tool_result`` becomes ``tool`` messages, ``thinking`` becomes ``reasoning_content``), and the engine's events
come back as an Anthropic message or its SSE events. ``cache_control`` markers travel with the
parts, messages and tools they sit on: the pipeline turns them into explicit cache breakpoints.

Errors on these paths have Anthropic's shape, ``{"type": "error", "error": {type, message}}``
(``ERROR_SHAPES``, rendered by the app's middleware), with the status codes of the other routes.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, TokenEvent
from mlxcel_compat.server import cache_explain
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import ApiError, InvalidRequest, ServerError, json_response
from mlxcel_compat.server.openapi import ANTHROPIC_ERROR_REF, JSON, SSE, Operation
from mlxcel_compat.server.pipeline import (
    ChatJob,
    collect,
    count_prompt_tokens,
    ctx_of,
    prepare_chat,
    read_json,
    reply_deltas,
    reply_splitter,
    sse_response,
    stream_deltas,
    warm_up,
)

DEFAULT_MAX_TOKENS = 4096  # max_tokens is required by Anthropic; llama-server defaults it to this
# Request fields that mean the same in both APIs, plus llama-server extras it passes through.
PASSTHROUGH = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs", "cache_prompt", "cache_explain")
STOP_REASONS = {"eos": "end_turn", "word": "stop_sequence", "limit": "max_tokens", "none": "end_turn"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_json(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error body; the type follows the status (``api_error`` for other 5xx)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status_code, "api_error"), "message": exc.message}}


def message_id() -> str:
    return fmt.random_id("msg_", 24)


def tool_use_id() -> str:
    return fmt.random_id("toolu_", 24)


# ---------------------------------------------------------------------- request translation


def _text_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text: must be a string")
    part: dict[str, Any] = {"type": "text", "text": text}
    if block.get("cache_control") is not None:
        part["cache_control"] = block["cache_control"]
    return part


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """Content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise InvalidRequest(f"{where}: must be a string or an array of content blocks")
    for i, block in enumerate(content):
        if block.get("type") == "document":
            raise InvalidRequest(f"{where}[{i}]: document content blocks are not supported: this server has no multimodal input")
    return content


def _image_part(block: Mapping[str, Any]) -> dict[str, Any] | None:
    """An ``image`` block as the OpenAI ``image_url`` part llama-server turns it into.

    The chat pipeline then reads it on a vision model (``server/media.py``) or refuses it as
    llama-server does on a model without a projector (500, "image input is not supported - hint:
    ..."), in a message and in a ``tool_result`` alike. A source other than base64 or a URL is dropped, as llama-server drops it.
    """
    source = block.get("source")
    source = source if isinstance(source, Mapping) else {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type') or 'image/jpeg'};base64,{source.get('data') or ''}"
    elif source.get("type") == "url":
        url = str(source.get("url") or "")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _system_message(system: Any) -> dict[str, Any] | None:
    if system is None:
        return None
    blocks = _blocks(system, "system")
    for i, block in enumerate(blocks):
        if block.get("type") != "text":
            raise InvalidRequest(f"system[{i}]: only text blocks are allowed in system")
    return {"role": "system", "content": system if isinstance(system, str) else [_text_part(b, f"system[{i}]") for i, b in enumerate(blocks)]}


def _tool_result_content(block: Mapping[str, Any], where: str) -> str | list[dict[str, Any]]:
    """A ``tool_result``'s content as the tool message's: its text, or parts when it holds images."""
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    else:
        parts = _blocks(content, f"{where}.content")
        for i, part in enumerate(parts):
            if part.get("type") not in ("text", "image"):
                raise InvalidRequest(f"{where}.content[{i}]: only text and image blocks are supported in tool_result")
        if any(p.get("type") == "image" for p in parts):  # llama-server keeps parts, which a text-only model refuses
            kept = [_image_part(p) if p.get("type") == "image" else {"type": "text", "text": str(p.get("text", ""))} for p in parts]
            return [p for p in kept if p is not None]
        text = "\n".join(str(p.get("text", "")) for p in parts)
    return "Error: " + text if block.get("is_error") is True else text


def _translate_message(m: int, message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages (tool results become ``tool`` messages first)."""
    where = f"messages[{m}]"
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where}: must be an object")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant'")
    if "content" not in message:
        raise InvalidRequest(f"{where}.content: field required")
    content = message["content"]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning = ""
    marked = None  # cache_control of a tool_use block: marks the whole assistant message
    for i, block in enumerate(_blocks(content, f"{where}.content")):
        kind, here = block.get("type"), f"{where}.content[{i}]"
        if kind == "text":
            parts.append(_text_part(block, here))
        elif kind == "image":
            image = _image_part(block)
            if image is not None:
                parts.append(image)
        elif kind == "thinking" and role == "assistant":
            reasoning += str(block.get("thinking", ""))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque to any other model
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise InvalidRequest(f"{here}.name: must be a string")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": {"name": block["name"], "arguments": arguments}})
            marked = block.get("cache_control") or marked
        elif kind == "tool_result" and role == "user":
            result: dict[str, Any] = {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": _tool_result_content(block, here)}
            if block.get("cache_control") is not None:
                result["cache_control"] = block["cache_control"]
            tools.append(result)
        else:
            raise InvalidRequest(f"{here}: content block type '{kind}' is not supported in a {role} message")
    out = list(tools)
    if parts or calls or reasoning or not tools:
        msg: dict[str, Any] = {"role": role, "content": parts}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        if marked is not None:
            msg["cache_control"] = marked
        out.append(msg)
    return out


def _translate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools[{i}]: a tool needs a 'name'")
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequest(f"tools[{i}]: tool type '{tool['type']}' is not supported: only client tools (name, description, input_schema)")
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": tool["name"], "description": tool.get("description") or "", "parameters": tool.get("input_schema") or {}},
        }
        if tool.get("cache_control") is not None:
            entry["cache_control"] = tool["cache_control"]
        out.append(entry)
    return out


def _translate_tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if not isinstance(choice, Mapping):
        raise InvalidRequest("tool_choice: must be an object")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise InvalidRequest("tool_choice: type must be 'auto', 'any', 'none' or 'tool' with a name")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _thinking_switch(thinking: Any) -> bool:
    """``thinking`` → the template's ``enable_thinking`` (its budget is checked here, applied by the caller)."""
    if not isinstance(thinking, Mapping) or thinking.get("type") not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise InvalidRequest("thinking: type must be 'enabled', 'adaptive', 'between_tools' or 'disabled'")
    budget = thinking.get("budget_tokens")
    if thinking["type"] == "enabled" and budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise InvalidRequest("thinking.budget_tokens: must be a positive integer")
    return thinking["type"] != "disabled"


def to_chat_body(body: Mapping[str, Any], for_generation: bool = True) -> dict[str, Any]:
    """The OpenAI chat body a Messages request means (400 with a clear message on bad input)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("messages: field required (an array of messages)")
    chat: dict[str, Any] = {k: body[k] for k in PASSTHROUGH if body.get(k) is not None}
    system = _system_message(body.get("system"))
    chat["messages"] = ([system] if system else []) + [msg for m, message in enumerate(messages) for msg in _translate_message(m, message)]
    if body.get("tools") is not None:
        chat["tools"] = _translate_tools(body["tools"])
    if body.get("tool_choice") is not None:
        _translate_tool_choice(body["tool_choice"], chat)
    if body.get("thinking") is not None:
        kwargs = dict(chat.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", _thinking_switch(body["thinking"]))
        chat["chat_template_kwargs"] = kwargs
        if body["thinking"].get("budget_tokens") is not None:
            chat["thinking_budget_tokens"] = body["thinking"]["budget_tokens"]  # the reasoning budget, as llama-server
    if body.get("cache_control") is not None and chat["messages"]:
        # Automatic caching: the marker goes on the last block, i.e. the end of the last message.
        chat["messages"][-1]["cache_control"] = body["cache_control"]
    output_format = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), Mapping) else None
    if isinstance(output_format, Mapping) and output_format.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format.get("schema") or {}}}
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]  # the prompt cache's session, as OpenAI's user is
    if for_generation:
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InvalidRequest("stop_sequences: must be an array of strings")
            chat["stop"] = stops
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequest("max_tokens: must be a positive integer")
        chat["max_tokens"] = max_tokens
    return chat


# ---------------------------------------------------------------------- response shapes


def usage_json(n_prompt: int, n_cached: int, n_written: int, n_output: int) -> dict[str, Any]:
    """Anthropic usage: input_tokens excludes what was read from and written to the cache."""
    return {
        "input_tokens": n_prompt - n_cached - n_written,
        "cache_creation_input_tokens": n_written,
        "cache_read_input_tokens": n_cached,
        "output_tokens": n_output,
    }


def stop_reason(fin: FinishEvent, tool_calls: bool) -> tuple[str, str | None]:
    if tool_calls and fin.stop_type in ("eos", "word"):
        return "tool_use", None
    reason = STOP_REASONS.get(fin.stop_type, "end_turn")
    return reason, fin.stopping_word if reason == "stop_sequence" else None


def assistant_message(content: str, reasoning: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the client will send it back, in OpenAI form (for the session warm-up)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def message_body(mid: str, model: str, content: list[dict[str, Any]], reason: str | None, stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def sse_event(data: dict[str, Any]) -> bytes:
    """Anthropic SSE framing: the event name is the payload's type."""
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# ---------------------------------------------------------------------- /v1/messages


async def messages(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_json(request)
    job = await prepare_chat(ctx, request, to_chat_body(body))
    if job.opts.stream:
        return sse_response(_stream(ctx, job), job.opts, request)
    res = (await collect(ctx, request, job.requests))[0]
    fin = res.finish
    assert fin is not None
    blocks = ContentBlocks()  # the blocks a stream of the reply would send, in the order they were written
    for field, value in reply_deltas(ctx, job, res.content):
        blocks.feed(field, value)
    blocks.close()
    warm_up(ctx, job, blocks.assistant_message())
    reason, stop_sequence = stop_reason(fin, bool(blocks.calls()))
    usage = usage_json(fin.n_prompt, fin.n_cached, fin.n_cache_written, fin.n_decoded)
    body = message_body(message_id(), ctx.model.model_id, blocks.content, reason, stop_sequence, usage)
    explained = cache_explain.render(fin.cache_explain, ctx.model.tokenizer)
    if explained is not None:  # "cache_explain": true (or X-Cache-Explain: 1)
        body["cache_explain"] = explained
    return json_response(body)


class ContentBlocks:
    """The content blocks of a message, numbered and opened/closed in the order they are read.

    Text and thinking arrive as ``(field, text)`` deltas, tool calls as the splitter's OpenAI
    ``tool_calls`` deltas (:meth:`feed` takes either); each becomes the events Anthropic streams
    for its block as soon as it is read: ``content_block_start`` (a ``tool_use`` block with its
    ``toolu_`` id, its name and an empty ``input``), then ``text_delta`` / ``thinking_delta`` /
    ``input_json_delta`` increments (a thinking block ends with its ``signature_delta``), then
    ``content_block_stop``. ``content`` holds the blocks themselves: a whole response is the same
    writer fed the whole reply, so both list the same blocks.
    """

    KINDS = {"reasoning_content": ("thinking", "thinking_delta", "thinking"), "content": ("text", "text_delta", "text")}

    def __init__(self) -> None:
        self.open: str | None = None  # the splitter field of the open block, or "tool_calls"
        self.content: list[dict[str, Any]] = []
        self.arguments: dict[int, str] = {}  # block index -> a tool_use block's arguments read so far
        self.texts = {"content": "", "reasoning_content": ""}

    @property
    def index(self) -> int:
        return len(self.content) - 1

    def feed(self, field: str, value: Any) -> list[bytes]:
        """The events of one splitter delta."""
        return self.tool_calls(value) if field == "tool_calls" else self.delta(field, value)

    def delta(self, field: str, text: str) -> list[bytes]:
        out = []
        kind, delta_type, key = self.KINDS[field]
        if self.open != field:
            out += self.close()
            self.open = field
            block: dict[str, Any] = {"type": kind, key: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.content.append(block)
            out.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": dict(block)}))
        self.content[-1][key] += text
        self.texts[field] += text
        out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": {"type": delta_type, key: text}}))
        return out

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """The events of OpenAI ``tool_calls`` deltas: a delta with a name starts a ``tool_use``
        block, the arguments pieces become its ``input_json_delta`` increments."""
        out = []
        for delta in deltas:
            function = delta.get("function") or {}
            if "name" in function:
                out += self.close()
                self.open = "tool_calls"
                block = {"type": "tool_use", "id": tool_use_id(), "name": function["name"], "input": {}}
                self.content.append(block)
                self.arguments[self.index] = ""
                out.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": dict(block)}))
            piece = function.get("arguments") or ""
            if piece and self.open == "tool_calls":
                self.arguments[self.index] += piece
                delta_json = {"type": "input_json_delta", "partial_json": piece}
                out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": delta_json}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "reasoning_content":  # Anthropic closes a thinking block with its signature
            out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": {"type": "signature_delta", "signature": ""}}))
        elif self.open == "tool_calls":
            self.content[-1]["input"] = _tool_input(self.arguments[self.index])
        self.open = None
        out.append(sse_event({"type": "content_block_stop", "index": self.index}))
        return out

    def calls(self) -> list[dict[str, Any]]:
        """The tool calls read, in OpenAI form under their ``toolu_`` ids (the client sends them back so)."""
        return [{"type": "function", "id": b["id"], "function": {"name": b["name"], "arguments": self.arguments[i]}}
                for i, b in enumerate(self.content) if b["type"] == "tool_use"]

    def assistant_message(self) -> dict[str, Any]:
        """The reply as the client will send it back, in OpenAI form (for the session warm-up)."""
        return assistant_message(self.texts["content"], self.texts["reasoning_content"] or None, self.calls())


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a ``tool_use`` block's ``input`` (``{}`` where they are no JSON object)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def _stream(ctx: ServerContext, job: ChatJob) -> AsyncIterator[bytes]:
    """message_start, ping, the content blocks in the order they are read, message_delta (stop,
    usage), message_stop."""
    m = ctx.model
    splitter = reply_splitter(ctx, job)
    blocks = ContentBlocks()
    res = fmt.Result(index=0, request=job.requests[0])
    mid = message_id()
    started = False
    async for _, event in ctx.run(job.requests):
        if isinstance(event, ErrorEvent):
            yield sse_event(error_json(ServerError(event.message)))
            return
        if not isinstance(event, (TokenEvent, FinishEvent)):
            continue
        if not started:
            started = True
            usage = usage_json(event.n_prompt, event.n_cached, event.n_cache_written, 0)
            yield sse_event({"type": "message_start", "message": message_body(mid, m.model_id, [], None, None, usage)})
            yield sse_event({"type": "ping"})
        for field, value in stream_deltas(ctx, splitter, res, event):
            for chunk in blocks.feed(field, value):
                yield chunk
        if isinstance(event, FinishEvent):
            for chunk in blocks.close():
                yield chunk
            warm_up(ctx, job, blocks.assistant_message())
            reason, stop_sequence = stop_reason(event, bool(blocks.calls()))
            usage = usage_json(event.n_prompt, event.n_cached, event.n_cache_written, event.n_decoded)
            delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence}, "usage": usage}
            explained = cache_explain.render(event.cache_explain, m.tokenizer)
            if explained is not None:
                delta["cache_explain"] = explained
            yield sse_event(delta)
            yield sse_event({"type": "message_stop"})


# ---------------------------------------------------------------------- /v1/messages/count_tokens


async def count_tokens(request: Request) -> Response:
    """``{"input_tokens": N}`` for the prompt the request renders to; no max_tokens needed."""
    ctx = ctx_of(request)
    body = await read_json(request)
    return json_response({"input_tokens": await count_prompt_tokens(ctx, to_chat_body(body, for_generation=False))})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
ERROR_SHAPES = {route.path: error_json for route in ROUTES}

MESSAGE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "model": {"type": "string"},
        "content": {"type": "array", "items": {"type": "object", "properties": {"type": {"enum": ["text", "thinking", "tool_use"]}}, "required": ["type"]}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object", "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}, "required": ["input_tokens", "output_tokens"]},
    },
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
}
OPERATIONS = {
    ("POST", "/v1/messages"): Operation(
        "Anthropic Messages (errors in Anthropic's shape)", body=("messages",), ok=MESSAGE, media=(JSON, SSE), errors=(500,), error=ANTHROPIC_ERROR_REF
    ),
    ("POST", "/v1/messages/count_tokens"): Operation(
        "Prompt tokens of an Anthropic Messages body",
        body=("messages",),
        ok={"type": "object", "properties": {"input_tokens": {"type": "integer"}}, "required": ["input_tokens"]},
        error=ANTHROPIC_ERROR_REF,
    ),
}
