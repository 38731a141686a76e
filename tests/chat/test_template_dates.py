"""Templates that print today's date, rendered with the variables llama-server gives them.

llama.cpp gives every template ``date_string`` ("%d %b %Y") and ``datetime`` ("%b %d %Y"), local
time, which ``chat_template_kwargs`` override; and its Jinja engine treats a missing or null
operand of ``+`` next to a string as "". The templates below are written for these tests in the
shapes of the Llama 3.1 template (``date_string`` with a fixed fallback), the Llama 3.2 / 3.3
templates (``strftime_now`` when ``date_string`` is missing) and Firefunction v2 (``functions``
and ``datetime`` concatenated into the system prompt, tool calls after ``functools[``).
"""

from __future__ import annotations

from datetime import datetime

import pytest

from mlxcel_compat.chat.render import date_context, render_chat
from mlxcel_compat.chat.request import parse_chat_request
from mlxcel_compat.chat.sandbox import TemplateError
from mlxcel_compat.chat.template import ChatTemplate

LLAMA31_STYLE = r"""{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n<|eot_id|>" }}
{%- for m in messages %}
{%- if m.role == 'tool' %}{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}
{%- else %}{{- "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}{%- endif %}
"""

LLAMA32_STYLE = r"""{{- bos_token }}
{%- if not date_string is defined %}
{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nToday Date: " + date_string + "<|eot_id|>" }}
{%- for m in messages %}{{- "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}{%- endif %}
"""

FIREFUNCTION_STYLE = r"""{%- set suffix = "Available functions as JSON spec:\n" + functions + "\nToday is " + datetime + "." -%}
{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' + suffix + '<|eot_id|>' -}}
{%- for message in messages -%}
{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | default('', true)) -%}
{%- if message['tool_calls'] -%}
{%- set tool = namespace(calls=[]) -%}
{%- for call in message['tool_calls'] -%}{%- set tool.calls = tool.calls + ['{"name": "' + call['function']['name'] + '", "arguments": ' + call['function']['arguments'] + '}'] -%}{%- endfor -%}
{%- set content = content + ' functools[' + tool.calls | join(', ') + ']' -%}
{%- endif -%}
{{- content + '<|eot_id|>' -}}
{%- endfor -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _render(source: str, body: dict) -> tuple[str, set[str], set[str]]:
    """The prompt, and the ``date_string`` / ``datetime`` values of the render's instants (a
    render may straddle midnight)."""
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    before = datetime.now()
    text = render_chat(template, parse_chat_request(body))
    after = datetime.now()
    return text, {before.strftime("%d %b %Y"), after.strftime("%d %b %Y")}, {before.strftime("%b %d %Y"), after.strftime("%b %d %Y")}


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def test_date_context_is_llama_cpp_formats() -> None:
    assert date_context(datetime(2026, 3, 5, 23, 59)) == {"datetime": "Mar 05 2026", "date_string": "05 Mar 2026"}


def test_llama31_date_string_is_today() -> None:
    text, days, _ = _render(LLAMA31_STYLE, {"messages": [{"role": "user", "content": "Hi"}]})
    assert _between(text, "Today Date: ", "\n") in days
    assert "26 Jul 2024" not in text


def test_llama32_gets_the_same_date() -> None:
    text, days, _ = _render(LLAMA32_STYLE, {"messages": [{"role": "user", "content": "Hi"}]})
    assert _between(text, "Today Date: ", "<|eot_id|>") in days


def test_template_kwargs_override_the_date() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"date_string": "01 Jan 1999"}}
    text, _, _ = _render(LLAMA31_STYLE, body)
    assert "Today Date: 01 Jan 1999\n" in text


def test_firefunction_v2_renders_with_datetime_and_no_functions() -> None:
    """As in llama-server: ``functions`` stays undefined and concatenates as ""; tools reach the
    template only as ``tools``, which this template does not print."""
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": TOOLS,
    }
    text, _, stamps = _render(FIREFUNCTION_STYLE, body)
    assert "Available functions as JSON spec:\n\nToday is " in text
    assert _between(text, "Today is ", ".<|eot_id|>") in stamps
    assert ' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text


def test_plus_treats_missing_and_null_next_to_a_string_as_empty() -> None:
    render = lambda src, **kw: ChatTemplate(src).render([], **kw)  # noqa: E731
    assert render("{{ 'a' + missing + 'b' }}") == "ab"
    assert render("{{ none + 'x' }}|{{ 'y' + nothing }}", nothing=None) == "x|y"
    assert render("{{ 1 + 2 }}|{{ [1] + [2] }}|{{ 'a' + 'b' }}") == "3|[1, 2]|ab"
    with pytest.raises(TemplateError):
        render("{{ missing + 1 }}")  # only string concatenation is forgiven, as in llama.cpp
    with pytest.raises(TemplateError):
        render("{{ missing + none }}")
