"""The OpenAI Responses API: ``/v1/responses`` (and ``/responses``) and its ``input_tokens`` route.

Stateless, as llama-server's: a request carries its whole conversation in ``input``, and
``previous_response_id`` is refused with a 400 that says so; nothing is stored. The request is
translated into the OpenAI chat body the shared pipeline takes (``instructions`` and role items
become messages, ``function_call`` / ``function_call_output`` items become tool calls and tool
messages, ``reasoning`` items become ``reasoning_content``); the reply comes back as output
items (``reasoning``, ``message``, ``function_call``) or as the Responses SSE events, each with
its ``sequence_number``.

Tools other than ``function`` (web search, file search, computer use, ...) cannot run here:
they are left out of the prompt and logged at WARNING, so an agent that offers them still works.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, ProgressEvent, TokenEvent
from mlxcel_compat.server import formats as fmt
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import InvalidRequest, ServerError, json_response
from mlxcel_compat.server.openapi import JSON, SSE, Operation
from mlxcel_compat.server.pipeline import (
    ChatJob,
    collect,
    count_prompt_tokens,
    Reply,
    ctx_of,
    prepare_chat,
    read_json,
    reply_deltas,
    reply_splitter,
    sse_response,
    stream_deltas,
    warm_up,
)
from mlxcel_compat.server.progress import PromptProgress

log = logging.getLogger(__name__)

# Fields that mean the same in the chat body, plus llama-server extras passed through.
PASSTHROUGH = (
    "temperature", "top_p", "stream", "parallel_tool_calls", "prompt_cache_key", "user",
    "chat_template_kwargs", "cache_prompt", "top_k", "min_p", "seed", "timings_per_token", "return_progress",
)


def response_id() -> str:
    return fmt.random_id("resp_", 48)


def item_id(prefix: str) -> str:
    return fmt.random_id(prefix, 48)


# ---------------------------------------------------------------------- request translation


def _input_text(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """Content parts as chat parts (a string is one text part).

    Where ``kinds`` allows ``input_image``, an image becomes the chat body's ``image_url`` part,
    as llama-server converts it; the chat pipeline then refuses it on this text-only server with
    llama-server's 500. ``input_file`` and other media kinds are llama-server's 400s.
    """
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or an array of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "input_image" and "input_image" in kinds:
            if "image_url" not in part:
                raise InvalidRequest("'image_url' is required")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if kind == "input_file" and "input_image" in kinds:
            raise InvalidRequest("'input_file' is not supported by llamacpp at this moment")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.content[{i}]: type must be one of {', '.join(repr(k) for k in kinds)}, with a 'text'")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _has_media(parts: list[dict[str, Any]]) -> bool:
    return any(p["type"] != "text" for p in parts)


def _translate_input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidRequest("input: must be a string or an array of input items")
    messages: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        """The assistant message later assistant items merge into (a new one after any other role)."""
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"{where}: must be an object")
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "message" and role in ("user", "system", "developer"):
            messages.append({"role": "system" if role == "developer" else role, "content": _input_text(item.get("content"), where, ("input_text", "input_image"))})
        elif kind == "message" and role == "assistant":
            msg = assistant()
            text = "".join(p["text"] for p in _input_text(item.get("content"), where, ("output_text", "input_text")))
            msg["content"] = (msg["content"] + text) if isinstance(msg["content"], str) else text
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}: a function_call needs 'call_id' and 'name'")
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = orjson.dumps(arguments).decode()
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}: a function_call_output needs 'call_id'")
            output = item.get("output", "")
            parts = [] if isinstance(output, str) else _input_text(output, where, ("input_text", "output_text", "input_image"))
            text: Any = output if isinstance(output, str) else parts if _has_media(parts) else "".join(p["text"] for p in parts)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            pieces = [p.get("text", "") for p in (item.get("content") or item.get("summary") or []) if isinstance(p, Mapping)]
            if pieces:
                msg = {"role": "assistant", "content": "", "reasoning_content": "\n".join(pieces)}
                messages.append(msg)  # the assistant items that follow merge into it
        else:
            raise InvalidRequest(f"{where}: input item type '{kind}' is not supported")
    return messages


def _translate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidRequest(f"tools[{i}]: must be an object")
        if tool.get("type") != "function":
            log.warning("Responses tool type '%s' cannot run on this server; the model is not offered it", tool.get("type"))
            continue
        if not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools[{i}]: a function tool needs a 'name'")
        function = {"name": tool["name"], "description": tool.get("description") or "", "parameters": tool.get("parameters") or {}}
        out.append({"type": "function", "function": function})
    return out


def _translate_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # auto, none, required (validated with the chat body)
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("tool_choice: must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` → the chat body's ``response_format``."""
    if text is None:
        return None
    spec = text.get("format") if isinstance(text, Mapping) else None
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if kind == "json_schema":
        schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidRequest("text.format: type must be 'text', 'json_schema' or 'json_object'")


def to_chat_body(body: Mapping[str, Any], for_generation: bool = True) -> dict[str, Any]:
    """The OpenAI chat body a Responses request means (400 with a clear message on bad input)."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise InvalidRequest("previous_response_id and conversation are not supported: this server stores no responses; send the whole conversation in 'input'")
    if "input" not in body:
        raise InvalidRequest("input: field required")
    chat: dict[str, Any] = {k: body[k] for k in PASSTHROUGH if body.get(k) is not None}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions: must be a string")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + _translate_input(body["input"])
    if body.get("tools") is not None:
        chat["tools"] = _translate_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _translate_tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if for_generation and body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


# ---------------------------------------------------------------------- response shapes


def reasoning_item(rid: str, text: str) -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(call: Mapping[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "id": item_id("fc_"),
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if status == "completed" else "",
        "status": status,
    }


def usage_json(ctx: ServerContext, fin: FinishEvent, reasoning: str | None) -> dict[str, Any]:
    """Responses usage: input_tokens includes the cached ones (``input_tokens_details``).

    ``reasoning_tokens`` re-tokenizes the reasoning text (the engine does not label tokens).
    """
    reasoning_tokens = len(ctx.tokenize(reasoning)) if reasoning else 0
    return {
        "input_tokens": fin.n_prompt,
        "input_tokens_details": {"cached_tokens": fin.n_cached},
        "output_tokens": fin.n_decoded,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, fin.n_decoded)},
        "total_tokens": fin.n_prompt + fin.n_decoded,
    }


def response_body(
    rid: str, created: int, ctx: ServerContext, body: Mapping[str, Any], status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """The response object; request settings are echoed as OpenAI does."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": ctx.model.model_id,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "store": False,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


# ---------------------------------------------------------------------- /v1/responses


async def responses(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_json(request)
    job = await prepare_chat(ctx, request, to_chat_body(body))
    if job.opts.stream:
        return sse_response(_stream(ctx, job, body), job.opts, request)
    res = (await collect(ctx, request, job.requests))[0]
    fin = res.finish
    assert fin is not None
    events = ResponseEvents()  # the items a stream of the reply would send, in the order they were written
    for field, value in reply_deltas(ctx, job, res.content):
        events.feed(field, value)
    events.close()
    if not events.output:
        events.open_item("content")  # an empty reply is an empty message
        events.close()
    reply = events.reply()
    warm_up(ctx, job, _reply_message(reply))
    # "completed" even when max_output_tokens cut the reply: llama-server's status, which its
    # clients (and llama.cpp's own tests) expect; OpenAI would say "incomplete".
    out = response_body(response_id(), fmt.now(), ctx, body, "completed", events.output, usage_json(ctx, fin, reply.reasoning))
    return json_response(out)


def _reply_message(reply: Reply) -> dict[str, Any]:
    """The reply as the client will send it back, in OpenAI form (for the session warm-up)."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        msg["tool_calls"] = reply.tool_calls
    return msg


class ResponseEvents:
    """Responses SSE events, numbered, and the output items they build.

    Each item is streamed as soon as it is read, as OpenAI streams it: ``response.output_item.added``,
    then its increments (``response.reasoning_text.delta`` in a ``reasoning_text`` part,
    ``response.output_text.delta`` in an ``output_text`` part, ``response.function_call_arguments.delta``
    for a ``function_call`` item, which the splitter's OpenAI ``tool_calls`` deltas open with its
    name and ``call_id``), then the matching ``.done`` events and ``response.output_item.done``.
    """

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # splitter field of the open item ("tool_calls": a function call)
        self.text = ""  # the open item's text or arguments so far

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def reply(self) -> Reply:
        """The items written so far as one reply: its reasoning, its text, its calls (OpenAI form)."""
        texts = {"reasoning": "", "message": ""}
        for item in self.output:
            if item["type"] in texts and item["content"]:
                texts[item["type"]] += item["content"][0]["text"]
        calls = [{"type": "function", "id": i["call_id"], "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        return Reply(texts["reasoning"] or None, texts["message"], calls)

    def feed(self, field: str, value: Any, timings: dict[str, Any] | None = None) -> list[bytes]:
        """The events of one splitter delta."""
        return self.tool_calls(value, timings) if field == "tool_calls" else self.delta(field, value, timings)

    def delta(self, field: str, text: str, timings: dict[str, Any] | None = None) -> list[bytes]:
        """The events of one text delta; ``timings`` (``timings_per_token``) go on the delta event."""
        out = []
        if self.open != field:
            out += self.close()
            out += self.open_item(field)
        self.text += text
        item = self.output[-1]
        kind = "response.reasoning_text.delta" if field == "reasoning_content" else "response.output_text.delta"
        extra: dict[str, Any] = {} if field == "reasoning_content" else {"logprobs": []}
        if timings is not None:
            extra["timings"] = timings
        out.append(self.event(kind, item_id=item["id"], output_index=len(self.output) - 1, content_index=0, delta=text, **extra))
        return out

    def tool_calls(self, deltas: list[dict[str, Any]], timings: dict[str, Any] | None = None) -> list[bytes]:
        """The events of OpenAI ``tool_calls`` deltas: a delta with a name adds a ``function_call``
        item, the arguments pieces are its ``response.function_call_arguments.delta`` events."""
        out = []
        for delta in deltas:
            function = delta.get("function") or {}
            if "name" in function:
                out += self.close()
                self.open, self.text = "tool_calls", ""
                item = function_call_item({"id": delta["id"], "function": function}, status="in_progress")
                self.output.append(item)
                out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
            piece = function.get("arguments") or ""
            if piece and self.open == "tool_calls":
                self.text += piece
                item = self.output[-1]
                extra = {"timings": timings} if timings is not None else {}
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=len(self.output) - 1, delta=piece, **extra))
        return out

    def open_item(self, field: str) -> list[bytes]:
        self.open, self.text = field, ""
        if field == "reasoning_content":
            item: dict[str, Any] = {"id": item_id("rs_"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(item_id("msg_"), "", status="in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        index = len(self.output) - 1
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part),
        ]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, old = len(self.output) - 1, self.output[-1]
        if self.open == "tool_calls":
            item = {**old, "arguments": self.text, "status": "completed"}
            self.output[-1] = item
            self.open = None
            return [
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=self.text),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        if self.open == "reasoning_content":
            item = reasoning_item(old["id"], self.text)
            done = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=self.text)
        else:
            item = message_item(old["id"], self.text)
            done = self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=self.text, logprobs=[])
        self.output[-1] = item
        self.open = None
        part = item["content"][0]
        return [
            done,
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


async def _stream(ctx: ServerContext, job: ChatJob, body: Mapping[str, Any]) -> AsyncIterator[bytes]:
    """The Responses events, items streamed as they are read, with llama-server's telemetry:
    ``return_progress`` sends a ``response.in_progress`` per progress report (``prompt_progress``,
    and ``timings`` with ``timings_per_token``), ``timings_per_token`` puts ``timings`` on each
    token's last delta, and ``response.completed`` (also after ``max_output_tokens``) carries
    ``timings`` beside ``response``."""
    rid, created = response_id(), fmt.now()
    events = ResponseEvents()
    splitter = reply_splitter(ctx, job)
    res = fmt.Result(index=0, request=job.requests[0])
    per_token = job.opts.timings_per_token
    progress = PromptProgress.for_request(ctx, per_token) if job.requests[0].return_progress else None
    start = response_body(rid, created, ctx, body, "in_progress", [], None)
    yield events.event("response.created", response=start)
    if progress is None:  # otherwise each progress report is a response.in_progress event
        yield events.event("response.in_progress", response=start)
    async for _, event in ctx.run(job.requests):
        if isinstance(event, ErrorEvent):
            yield events.event("error", code="server_error", message=ServerError(event.message).message, param=None)
            return
        if isinstance(event, ProgressEvent) and progress is not None:
            for report in progress.feed(0, event):
                yield events.event("response.in_progress", **report.attach({"response": start}))
            continue
        if not isinstance(event, (TokenEvent, FinishEvent)):
            continue
        deltas = stream_deltas(ctx, splitter, res, event)
        timings = fmt.timings_json(event) if per_token else None  # text held back to the finish has them too
        for k, (field, value) in enumerate(deltas):
            for chunk in events.feed(field, value, timings if k == len(deltas) - 1 else None):
                yield chunk
        if isinstance(event, FinishEvent):
            for chunk in events.close():
                yield chunk
            if not events.output:
                for chunk in events.open_item("content") + events.close():  # an empty reply is an empty message
                    yield chunk
            reply = events.reply()
            warm_up(ctx, job, _reply_message(reply))
            final = response_body(rid, created, ctx, body, "completed", events.output, usage_json(ctx, event, reply.reasoning))
            yield events.event("response.completed", response=final, timings=fmt.timings_json(event))


# ---------------------------------------------------------------------- /v1/responses/input_tokens


async def input_tokens(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_json(request)
    n = await count_prompt_tokens(ctx, to_chat_body(body, for_generation=False))
    return json_response({"object": "response.input_tokens", "input_tokens": n})


ROUTES = [
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/responses", responses, methods=["POST"]),
    Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
    Route("/responses/input_tokens", input_tokens, methods=["POST"]),
]

RESPONSE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
        "model": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}},
        "usage": {"type": ["object", "null"]},
    },
    "required": ["id", "object", "status", "model", "output"],
}
RESPONSES = Operation("OpenAI Responses (nothing is stored)", body=("responses",), ok=RESPONSE, media=(JSON, SSE), errors=(500,))
INPUT_TOKENS = Operation(
    "Prompt tokens of a Responses body",
    body=("responses",),
    ok={"type": "object", "properties": {"object": {"const": "response.input_tokens"}, "input_tokens": {"type": "integer"}}, "required": ["object", "input_tokens"]},
)
OPERATIONS = {
    ("POST", "/v1/responses"): RESPONSES,
    ("POST", "/responses"): RESPONSES,
    ("POST", "/v1/responses/input_tokens"): INPUT_TOKENS,
    ("POST", "/responses/input_tokens"): INPUT_TOKENS,
}
