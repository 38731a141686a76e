"""Templates that print today's date, and the variables llama.cpp's chat handlers add for them.

The templates below are written for these tests in the shapes of the Llama 3.1 template
(``date_string`` with a fixed fallback), the Llama 3.2 / 3.3 templates (``strftime_now`` when
``date_string`` is missing) and Firefunction v2 (``functions`` and ``datetime`` concatenated into
the system prompt, tool calls after ``functools[``).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from mlxcel_compat.chat.format_context import FIREFUNCTION_V2, LLAMA_3_X, FormatContext, template_family
from mlxcel_compat.chat.messages import parse_chat_request, render_chat
from mlxcel_compat.chat.template import ChatTemplate, TemplateError

LLAMA31_STYLE = r"""{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools and not tools_in_user_message %}{{- "Tools: " + (tools | map(attribute='function.name') | join(',')) + "\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n<|eot_id|>" }}
{%- for m in messages %}
{%- if m.role == 'user' and tools and tools_in_user_message and loop.first %}{{- "<|start_header_id|>user<|end_header_id|>\n\nTools inline\n" + m.content + "<|eot_id|>" }}
{%- elif m.role == 'tool' %}{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}
{%- else %}{{- "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}{%- endif %}
"""

LLAMA32_STYLE = r"""{{- bos_token }}
{%- if not date_string is defined %}
{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nToday Date: " + date_string + "<|eot_id|>" }}
{%- for m in messages %}
{%- if m.role == 'tool' %}{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}
{%- else %}{{- "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>" }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}{%- endif %}
"""

FIREFUNCTION_STYLE = r"""{%- set suffix = "Available functions as JSON spec:\n" + functions + "\nToday is " + datetime + "." -%}
{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' + suffix + '<|eot_id|>' -}}
{%- for message in messages -%}
{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | default('', true)) -%}
{%- if message['tool_calls'] -%}
{%- set calls = namespace(items=[]) -%}
{%- for call in message['tool_calls'] -%}{%- set calls.items = calls.items + ['{"name": "' + call['function']['name'] + '", "arguments": ' + call['function']['arguments'] + '}'] -%}{%- endfor -%}
{%- set content = content + ' functools[' + calls.items | join(', ') + ']' -%}
{%- endif -%}
{{- content + '<|eot_id|>' -}}
{%- endfor -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _dates(fmt: str, before: datetime, after: datetime) -> set[str]:
    """Every value of ``fmt`` between two instants (a render may straddle midnight)."""
    return {before.strftime(fmt), after.strftime(fmt)}


def _render(source: str, body: dict) -> tuple[str, datetime, datetime]:
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    before = datetime.now()
    text = render_chat(template, parse_chat_request(body))
    return text, before, datetime.now()


def _today_line(text: str, prefix: str) -> str:
    return text.split(prefix, 1)[1].split("\n", 1)[0].split("<|eot_id|>", 1)[0]


def test_families_are_detected_by_llama_cpp_markers() -> None:
    assert template_family(LLAMA31_STYLE) == LLAMA_3_X
    assert template_family(LLAMA32_STYLE) == LLAMA_3_X
    assert template_family(FIREFUNCTION_STYLE) == FIREFUNCTION_V2
    # Functionary v3.1 also has an ipython header but its own handler (no date): not extended.
    assert template_family("<|start_header_id|>ipython<|end_header_id|> <function=x>") is None
    assert template_family("<|im_start|>{{ messages }}") is None
    assert FormatContext.of("plain").apply(TOOLS) == (TOOLS, {})


def test_llama31_date_string_is_today_in_its_format() -> None:
    text, before, after = _render(LLAMA31_STYLE, {"messages": [{"role": "user", "content": "Hi"}]})
    assert _today_line(text, "Today Date: ") in _dates("%d %b %Y", before, after)
    assert "26 Jul 2024" not in text


def test_llama32_strftime_now_and_date_string_agree() -> None:
    text, before, after = _render(LLAMA32_STYLE, {"messages": [{"role": "user", "content": "Hi"}]})
    assert _today_line(text, "Today Date: ") in _dates("%d %b %Y", before, after)


def test_llama_handler_puts_tools_in_the_system_message() -> None:
    """llama.cpp sets ``tools_in_user_message`` false for Llama 3.x, so tools go to the system turn."""
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    text, _, _ = _render(LLAMA31_STYLE, body)
    assert "Tools: get_weather" in text
    assert "Tools inline" not in text


def test_handler_variables_win_over_template_kwargs() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"date_string": "01 Jan 1999"}}
    text, before, after = _render(LLAMA31_STYLE, body)
    assert _today_line(text, "Today Date: ") in _dates("%d %b %Y", before, after)


def test_firefunction_v2_renders_with_functions_and_datetime() -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    text, before, after = _render(FIREFUNCTION_STYLE, body)
    assert json.dumps(TOOLS, indent=2) in text
    stamp = text.split("Today is ", 1)[1].split(".<|eot_id|>", 1)[0]
    assert stamp.endswith(" GMT")
    parsed = datetime.strptime(stamp, "%b %d %Y %H:%M:%S GMT")
    assert before - timedelta(seconds=1) <= parsed <= after + timedelta(seconds=1)


def test_firefunction_v2_without_tools_and_with_a_tool_call_history() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    }
    text, _, _ = _render(FIREFUNCTION_STYLE, body)
    assert "Available functions as JSON spec:\n\nToday is " in text  # functions = "" without tools
    assert ' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text


def test_firefunction_v2_without_the_handler_fails_to_render() -> None:
    """The failure llama.cpp's handler avoids: the template concatenates undefined variables."""
    template = ChatTemplate(FIREFUNCTION_STYLE)
    template._format = FormatContext(None)
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "Hi"}])
