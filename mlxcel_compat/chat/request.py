"""OpenAI chat request parsing: a ``/v1/chat/completions`` body to a :class:`ChatRequest`.

``parse_chat_request`` validates a ``/v1/chat/completions`` (or ``/apply-template``) body the way
llama-server's ``oaicompat_chat_params_parse`` and ``common_chat_msgs_parse_oaicompat`` do, with
their error wording, and normalizes messages to the shape llama.cpp hands its templates:
only ``role``, ``content``, ``tool_calls``, ``reasoning_content``, ``name`` and ``tool_call_id``
survive, a missing or null ``content`` becomes ``""``, and tool-call arguments are JSON strings
(the template layer turns them back into objects for templates that want objects).

``render_chat`` (``chat/render.py``) turns a parsed request into prompt text, including
llama.cpp's assistant prefill. A finished generation is taken apart for the response by
``parse_reply`` (``chat/tool_calls.py``), a streamed one by ``ReplyStream``
(``chat/stream_splitter.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AudioSource",
    "ChatRequest",
    "ChatRequestError",
    "parse_chat_request",
]

_MEDIA_HINT = "hint: if this is unexpected, you may need to provide the mmproj"
# llama-server takes "video_url" as another name of "input_video".
_MEDIA_PART_KINDS = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}
_TOOL_CHOICES = ("auto", "none", "required")
_CONTINUE_FIELDS = ("content", "reasoning_content")


@dataclass(frozen=True)
class AudioSource:
    """An ``input_audio`` part (or an audio ``multimodal_data`` item): base64 data and its format."""

    data: Any
    format: Any = None  # "wav" | "mp3" from the part; None: told by the bytes


class ChatRequestError(Exception):
    """A chat body that llama-server would refuse.

    ``status_code`` is 400, except for media parts the server cannot take: llama-server throws
    those as a server error (500, ``server_error``) and clients match on that, so it is kept.
    """

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass
class ChatRequest:
    """A validated chat body, ready to render."""

    # Normalized OpenAI messages (see the module docstring for the shape).
    messages: list[dict[str, Any]]
    # Normalized function tools: {"type":"function","function":{name, description, parameters}}.
    tools: list[dict[str, Any]]
    # "auto", "none", "required", or the forced function's name.
    tool_choice: str
    add_generation_prompt: bool
    # Continue the final message in place (HF semantics); needs add_generation_prompt false.
    continue_final_message: bool
    # chat_template_kwargs: server defaults overlaid by the request (and reasoning_effort).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Which field of the final message continue_final_message continues.
    continue_field: str = "content"
    # llama.cpp --prefill-assistant: the trailing assistant message is appended after the
    # generation prompt so the model carries on from it.
    prefill: bool = False
    # The image sources (``image_url.url`` values) in message order, each rendered as one
    # ``{"type": "image"}`` part; only when the model takes images (``parse_chat_request(images=...)``).
    images: list[Any] = field(default_factory=list)

    @property
    def render_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template sees: all of them whatever ``tool_choice`` says (it changes what
        is generated, not the prompt, as in llama-server); none when the list is empty."""
        return self.tools or None

    @property
    def callable_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call: none when ``tool_choice`` is "none" or the list is empty."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tools

    @property
    def enable_thinking(self) -> bool:
        """Effective thinking switch; llama.cpp passes ``enable_thinking=true`` unless told not to."""
        return self.template_kwargs.get("enable_thinking", True) is not False


def parse_chat_request(
    body: Mapping[str, Any],
    *,
    default_template_kwargs: Mapping[str, Any] | None = None,
    prefill_assistant: bool = True,
    images: bool = False,
    audio: bool = False,
) -> ChatRequest:
    """Validate and normalize an OpenAI chat body.

    Args:
        body: the decoded JSON body.
        default_template_kwargs: ``--chat-template-kwargs`` (already parsed).
        prefill_assistant: ``--prefill-assistant`` (llama.cpp default on).
        images: the model takes images: ``image_url`` parts become ``{"type": "image"}`` parts and
            their sources are collected in ``ChatRequest.images`` (otherwise llama-server's 500).
        audio: the model takes audio: ``input_audio`` parts become ``{"type": "audio"}`` parts and
            their ``AudioSource``s join the same list, in message order (otherwise the 500).

    Raises:
        ChatRequestError: with llama-server's wording where it has one.
    """
    if not isinstance(body, Mapping):
        raise ChatRequestError("Expected the request body to be an object")
    if "messages" not in body:
        raise ChatRequestError("'messages' is required")
    raw_messages = body["messages"]
    if not isinstance(raw_messages, list):
        raise ChatRequestError("Expected 'messages' to be an array")
    sources: list[Any] | None = [] if images or audio else None
    kinds = frozenset(k for k, on in (("image", images), ("audio", audio)) if on)
    messages = [_parse_message(m, sources, kinds) for m in raw_messages]

    tools = _parse_tools(body.get("tools"))
    tool_choice = _parse_tool_choice(body.get("tool_choice"))
    template_kwargs = _merge_template_kwargs(body, default_template_kwargs)

    add_generation_prompt = _optional_bool(body, "add_generation_prompt", True)
    continue_final_message, continue_field = _parse_continue(body.get("continue_final_message"))
    if continue_final_message and add_generation_prompt:
        raise ChatRequestError(
            "Cannot use both add_generation_prompt and continue_final_message; "
            "set add_generation_prompt to false to continue the final message"
        )

    trailing_assistant = bool(messages) and messages[-1]["role"] == "assistant"
    if trailing_assistant and (prefill_assistant or continue_final_message):
        if len(messages) > 1 and messages[-2]["role"] == "assistant":
            raise ChatRequestError(
                "Cannot have 2 or more assistant messages at the end of the list."
            )
    prefill = trailing_assistant and prefill_assistant and not continue_final_message
    if prefill:
        # llama.cpp renders the history with a generation prompt, then appends the prefix.
        add_generation_prompt = True

    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        continue_field=continue_field,
        prefill=prefill,
        images=sources or [],
    )


def _dump(value: Any) -> str:
    # Compact like nlohmann's dump(), used in llama.cpp's messages.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _parse_error(detail: str) -> ChatRequestError:
    return ChatRequestError(f"Failed to parse messages: {detail}")


def _parse_message(raw: Any, images: list[Any] | None = None, kinds: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise _parse_error(f"Expected 'message' to be an object, got {_dump(raw)}")
    role = raw.get("role")
    # Presence rules first, as llama-server checks them before anything else.
    if role != "assistant" and "content" not in raw:
        raise ChatRequestError("All non-assistant messages must contain 'content'")
    if role == "assistant" and "content" not in raw and "tool_calls" not in raw:
        raise ChatRequestError("Assistant message must contain either 'content' or 'tool_calls'!")
    if "role" not in raw:
        raise _parse_error(f"Missing 'role' in message: {_dump(raw)}")
    if not isinstance(role, str):
        raise _parse_error(f"'role' must be a string: {_dump(raw)}")

    message: dict[str, Any] = {"role": role, "content": _parse_content(raw.get("content"), images, kinds)}
    if raw.get("tool_calls") is not None:
        calls = _parse_tool_calls_field(raw["tool_calls"])
        if calls:
            message["tool_calls"] = calls
    for key in ("reasoning_content", "name", "tool_call_id"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _parse_error(f"'{key}' must be a string: {_dump(raw)}")
        if value:
            message[key] = value
    return message


def _image_source(part: Mapping[str, Any]) -> Any:
    """The ``url`` of an OpenAI ``image_url`` part (also given as a bare string)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str):
        raise ChatRequestError("image_url part needs an image_url.url string")
    return url


def _audio_source(part: Mapping[str, Any]) -> Any:
    """An OpenAI ``input_audio`` part's ``{data, format}`` (llama-server takes wav and mp3)."""
    audio = part.get("input_audio")
    audio = audio if isinstance(audio, Mapping) else {}
    data, fmt = audio.get("data"), audio.get("format")
    if fmt not in ("wav", "mp3"):
        raise ChatRequestError("input_audio.format must be either 'wav' or 'mp3'")
    if not isinstance(data, str) or not data:
        raise ChatRequestError("input_audio part needs an input_audio.data base64 string")
    return AudioSource(data, fmt)


def _parse_content(content: Any, images: list[Any] | None = None,
                   kinds: frozenset[str] = frozenset({"image"})) -> str | list[dict[str, str]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatRequestError("Expected 'content' to be a string or an array")
    parts: list[dict[str, str]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "image_url" and images is not None and "image" in kinds:
            images.append(_image_source(part))
            parts.append({"type": "image"})
            continue
        if kind == "input_audio" and images is not None and "audio" in kinds:
            images.append(_audio_source(part))
            parts.append({"type": "audio"})
            continue
        if kind in _MEDIA_PART_KINDS:
            # A modality the model does not take (video: none here): llama-server's 500.
            raise ChatRequestError(
                f"{_MEDIA_PART_KINDS[kind]} input is not supported - {_MEDIA_HINT}",
                status_code=500,
            )
        if kind != "text":
            raise ChatRequestError("unsupported content[].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise _parse_error(f"Missing 'text' in content part: {_dump(part)}")
        parts.append({"type": "text", "text": text})
    # llama.cpp treats an empty part list like no content.
    return parts if parts else ""


def _parse_tool_calls_field(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise _parse_error(f"Expected 'tool_calls' to be an array, got {_dump(raw)}")
    calls: list[dict[str, Any]] = []
    for call in raw:
        if not isinstance(call, Mapping) or "type" not in call:
            raise _parse_error(f"Missing tool call type: {_dump(call)}")
        if call["type"] != "function":
            raise _parse_error(f"Unsupported tool call type: {_dump(call)}")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise _parse_error(f"Missing tool call function: {_dump(call)}")
        name = function.get("name")
        if not isinstance(name, str):
            raise _parse_error(f"Missing tool call name: {_dump(call)}")
        if "arguments" not in function:
            raise _parse_error(f"Missing tool call arguments: {_dump(call)}")
        arguments = function["arguments"]
        if not isinstance(arguments, str):
            arguments = _dump(arguments)
        normalized: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        call_id = call.get("id")
        if isinstance(call_id, str) and call_id:
            normalized["id"] = call_id
        calls.append(normalized)
    return calls


def _tools_error(detail: str) -> ChatRequestError:
    return ChatRequestError(f"Failed to parse tools: {detail}")


def _parse_tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _tools_error(f"Expected 'tools' to be an array, got {_dump(raw)}")
    tools: list[dict[str, Any]] = []
    for tool in raw:
        if not isinstance(tool, Mapping) or "type" not in tool:
            raise _tools_error(f"Missing tool type: {_dump(tool)}")
        if tool["type"] != "function":
            raise _tools_error(f"Unsupported tool type: {_dump(tool)}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise _tools_error(f"Missing tool function: {_dump(tool)}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _tools_error(f"Missing tool name: {_dump(tool)}")
        description = function.get("description")
        if description is None:
            description = ""
        if not isinstance(description, str):
            raise _tools_error(f"Tool description must be a string: {_dump(tool)}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, Mapping):
            raise _tools_error(f"Tool parameters must be an object: {_dump(tool)}")
        # llama.cpp hands templates exactly these three fields, with these defaults.
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": dict(parameters),
                },
            }
        )
    return tools


def _parse_tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in _TOOL_CHOICES:
            raise ChatRequestError(f"Invalid tool_choice: {raw}")
        return raw
    if isinstance(raw, Mapping):
        function = raw.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if raw.get("type") == "function" and isinstance(name, str) and name:
            return name
    raise ChatRequestError(f"Invalid tool_choice: {_dump(raw)}")


def _json_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "number"
    if isinstance(value, list):
        return "array"
    return "object"


def _merge_template_kwargs(
    body: Mapping[str, Any], defaults: Mapping[str, Any] | None
) -> dict[str, Any]:
    merged: dict[str, Any] = dict(defaults or {})
    effort = body.get("reasoning_effort")
    # reasoning_effort "none" turns thinking off (unless the kwargs say otherwise) ...
    if effort == "none":
        merged["enable_thinking"] = False
    requested = body.get("chat_template_kwargs")
    if requested is not None:
        if not isinstance(requested, Mapping):
            raise ChatRequestError("'chat_template_kwargs' must be an object")
        merged.update(requested)
    # ... and any other effort reaches the template as ``reasoning_effort``, as in llama-server.
    if effort == "none":
        merged.pop("reasoning_effort", None)
    elif isinstance(effort, str) and effort:
        merged["reasoning_effort"] = effort
    if merged.get("enable_thinking", False) is None:
        del merged["enable_thinking"]
    thinking = merged.get("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise ChatRequestError(
            f'invalid type for "enable_thinking" (expected boolean, got {_json_type(thinking)})'
        )
    return merged


def _optional_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatRequestError(f"'{key}' must be a boolean")
    return value


def _parse_continue(raw: Any) -> tuple[bool, str]:
    if raw is None or raw is False:
        return False, "content"
    if raw is True:
        return True, "content"
    if isinstance(raw, str) and raw in _CONTINUE_FIELDS:
        return True, raw
    raise ChatRequestError(
        "'continue_final_message' must be a boolean, \"content\" or \"reasoning_content\""
    )
