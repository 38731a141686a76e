"""Prompt rendering: a parsed chat request through the model's template, as llama-server renders it.

``render_chat`` gives the prompt text, with llama.cpp's assistant prefill and the date variables
llama.cpp hands every template (``date_context``). The other renders serve the prompt cache: the
history before the new input (``render_history_boundary``), the text up to an explicit cache
breakpoint (``render_prefix``) and the history the next turn will start with
(``render_next_history``), each rendered closed and, where it is compared with the prompt,
clipped to their common prefix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from mlxcel_compat.chat.request import ChatRequest
from mlxcel_compat.chat.template import ChatTemplate

__all__ = [
    "date_context",
    "render_chat",
    "render_history_boundary",
    "render_next_history",
    "render_prefix",
]


# Render arguments that chat_template_kwargs must not bind (they would clash or override).
_RENDER_ARGUMENTS = (
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
)


def date_context(now: datetime | None = None) -> dict[str, str]:
    """The date variables llama.cpp gives every template (``common_chat_extra_context``).

    Local time, as llama.cpp formats it: ``date_string`` (``"02 Dec 2026"``, read by the Llama
    3.x templates, which otherwise print a fixed fallback date) and ``datetime``
    (``"Dec 02 2026"``, read by Firefunction v2). ``chat_template_kwargs`` override them.
    """
    now = now or datetime.now()
    return {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y")}


def _render_kwargs(template: ChatTemplate, chat: ChatRequest) -> dict[str, Any]:
    """The template variables of a request, as llama-server gives them.

    Today's date; ``preserve_reasoning: true`` (llama-server's default, off with
    ``--no-reasoning-preserve``: past reasoning stays in the history, so the prompt of the next
    turn starts with this one's and the prompt cache keeps hitting); the request's kwargs over
    those; and ``enable_thinking``, true where llama-server finds reasoning in the template
    (``ChatTemplate.supports_thinking``), unless the kwargs say.
    """
    kwargs: dict[str, Any] = {**date_context(), "preserve_reasoning": True}
    kwargs.update((k, v) for k, v in chat.template_kwargs.items() if k not in _RENDER_ARGUMENTS)
    if "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = template.supports_thinking()
    return kwargs


def render_chat(template: ChatTemplate, chat: ChatRequest) -> str:
    """The final prompt text for a parsed request.

    With prefill, the messages before the trailing assistant message are rendered with a
    generation prompt and the assistant's text is appended (llama-server's
    ``--prefill-assistant``), so the model continues that text. ``continue_final_message``
    instead renders the whole conversation and cuts it right after the final message's text.

    Raises:
        TemplateError: the template failed or refused the conversation.
    """
    template = template.for_tools(chat.render_tools)
    kwargs = _render_kwargs(template, chat)
    if chat.prefill:
        head, last = chat.messages[:-1], chat.messages[-1]
        prompt = template.render(
            head, tools=chat.render_tools, add_generation_prompt=True, **kwargs
        )
        return prompt + _prefill_text(last)
    return template.render(
        chat.messages,
        tools=chat.render_tools,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_field if chat.continue_final_message else False,
        **kwargs,
    )


def _prefill_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        # llama-server joins the prefilled message's text parts with a blank line.
        return "\n\n".join(part.get("text", "") for part in content)
    return content or ""


def render_history_boundary(template: ChatTemplate, chat: ChatRequest, prompt: str) -> str:
    """The rendered history of ``chat``, clipped to its common prefix with ``prompt``.

    History is the conversation without its trailing new input (the user or tool messages after
    the last assistant or system message). It is rendered closed (no generation prompt) and
    clipped because templates may render the last history turn differently once a new turn
    follows. Returns ``""`` when there is no history.
    """
    end = len(chat.messages)
    while end > 0 and chat.messages[end - 1]["role"] not in ("assistant", "system"):
        end -= 1
    if end == 0:
        return ""
    template = template.for_tools(chat.render_tools)
    history = template.render_history(chat.messages[:end], tools=chat.render_tools, **_render_kwargs(template, chat))
    return os.path.commonprefix([history, prompt])


def render_prefix(template: ChatTemplate, chat: ChatRequest, n_messages: int, n_parts: int | None, prompt: str) -> str:
    """The rendered start of the conversation up to a block, clipped to its common prefix with ``prompt``.

    The first ``n_messages`` messages are rendered closed (no generation prompt), the last of
    them cut to its first ``n_parts`` content parts when given; tools render as in the prompt.
    Zero messages render the tools (and whatever the template puts before any message). Used
    for explicit cache breakpoints (``cache_control``): the clip keeps exactly the prompt text
    that ends at the marked block.
    """
    messages = [dict(m) for m in chat.messages[:n_messages]]
    if messages and n_parts is not None and isinstance(messages[-1].get("content"), list):
        messages[-1]["content"] = messages[-1]["content"][:n_parts]
    template = template.for_tools(chat.render_tools)
    text = template.render_history(messages, tools=chat.render_tools, **_render_kwargs(template, chat))
    return os.path.commonprefix([text, prompt])


def render_next_history(template: ChatTemplate, chat: ChatRequest, reply: Mapping[str, Any]) -> str:
    """The history the next turn will start with: this conversation plus ``reply``, closed.

    Used to warm up a session's snapshot in the background before its next turn arrives.
    """
    messages = [*chat.messages, dict(reply)]
    template = template.for_tools(chat.render_tools)
    return template.render_history(messages, tools=chat.render_tools, **_render_kwargs(template, chat))
