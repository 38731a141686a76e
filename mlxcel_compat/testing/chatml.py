"""The factory's ChatML chat template, with or without reasoning support.

Every text family and the vision families render chats with it (``tokenizer_config.json``'s
``chat_template``), so chat, reasoning and tool-calling tests run on a real template.
"""

from __future__ import annotations

import re

# A ChatML template. Lines between the ``{#- thinking #}`` / ``{#- /thinking #}``
# markers are kept only for the families that reason (qwen3, qwen3_next), so a
# non-thinking template does not mention ``<think>`` at all (servers detect
# reasoning support from the template text, as llama.cpp does).
#
# Reasoning of an assistant turn is rendered when ``preserve_thinking`` is true,
# or when the turn comes after the last user message (the tool-calling loop of
# the turn being generated); otherwise it is dropped from the history.
_CHAT_TEMPLATE_SOURCE = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- raise_exception('Message content must be a string or a list of parts.') -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if bos_token is defined and bos_token %}
    {{- bos_token }}
{%- endif %}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- render_content(messages[0].content) ~ '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nThese functions are available. Each signature is a JSON object' }}
    {{- ' on its own line inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, answer with a JSON object holding its "name"' }}
    {{- ' and its "arguments" between <tool_call></tool_call> tags, like this:\n' }}
    {{- '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n' }}
    {{- '</tool_call><|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' ~ render_content(messages[0].content) ~ '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('Only the first message may have the system role.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' ~ render_content(message.content) ~ '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = render_content(message.content) %}
        {{- '<|im_start|>assistant\n' }}
{#- thinking #}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- set reasoning = reasoning.strip('\n') %}
        {%- set content = content.lstrip('\n') %}
        {%- if reasoning and (preserve_thinking or loop.index0 > ns.last_user) %}
            {{- '<think>\n' ~ reasoning ~ '\n</think>\n\n' }}
        {%- endif %}
{#- /thinking #}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": ' ~ (tool_call.name | tojson) ~ ', "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ render_content(message.content) ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{#- thinking #}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{#- /thinking #}
{%- endif %}
"""

_THINKING_BLOCK = re.compile(r"\{#- thinking #\}.*?\{#- /thinking #\}\n", re.DOTALL)
_THINKING_MARKER = re.compile(r"\{#- /?thinking #\}\n")


def chat_template(thinking: bool) -> str:
    """The ChatML template, with or without reasoning support."""
    if thinking:
        source = _THINKING_MARKER.sub("", _CHAT_TEMPLATE_SOURCE)
    else:
        source = _THINKING_BLOCK.sub("", _CHAT_TEMPLATE_SOURCE)
    return source.strip() + "\n"
