"""Chat templates and chat-request handling for the chat routes.

``template`` compiles and renders sandboxed Jinja chat templates (HF semantics; the environment in
``sandbox``, the inputs shaped in ``template_inputs``) and detects their capabilities
(``template_caps``); ``builtin_templates`` renders llama.cpp's C++ formats by name. ``request``
validates OpenAI chat bodies llama-server style and ``render`` renders the final prompt;
``reasoning``, ``tool_calls`` and ``stream_splitter`` parse reasoning and tool calls out of
generations, and ``tool_grammar`` forces well-formed calls.
"""

from __future__ import annotations

from mlxcel_compat.chat.reasoning import prompt_opens_thinking, split_reasoning
from mlxcel_compat.chat.render import render_chat, render_history_boundary
from mlxcel_compat.chat.request import ChatRequest, ChatRequestError, parse_chat_request
from mlxcel_compat.chat.sandbox import TemplateError
from mlxcel_compat.chat.template import BUILTIN_TEMPLATES, ChatTemplate
from mlxcel_compat.chat.tool_calls import parse_tool_calls

__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatRequest",
    "ChatRequestError",
    "ChatTemplate",
    "TemplateError",
    "parse_chat_request",
    "parse_tool_calls",
    "prompt_opens_thinking",
    "render_chat",
    "render_history_boundary",
    "split_reasoning",
]
