"""Tests for mlxcel_compat.chat.template (with .sandbox, .template_inputs, .template_caps): sandboxed rendering, helpers, caps, built-ins."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from mlxcel_compat.chat import sandbox
from mlxcel_compat.chat.render import render_chat
from mlxcel_compat.chat.request import parse_chat_request
from mlxcel_compat.chat.sandbox import TemplateError
from mlxcel_compat.chat.template import BUILTIN_TEMPLATES, ChatTemplate

# A ChatML template in the style of Qwen3, written for these tests: tools as JSON lines in the
# system prompt, Hermes tool calls, tool responses as user turns, reasoning kept only after the
# last user turn unless preserve_thinking is set, and an empty think block when thinking is off.
TOOL_CHATML = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
{{- '# Tools\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if m.reasoning_content and (loop.index0 > ns.last_user or (preserve_thinking is defined and preserve_thinking)) -%}
{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' -}}
{%- endif -%}
{{- m.content -}}
{%- for tc in m.tool_calls or [] -%}
{{- '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

# No system role (refused), no tools, string content only.
PLAIN = r"""
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- raise_exception('System role not supported') -}}{%- endif -%}
{{- m.role + ': ' + m.content + '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}
"""

# Only typed content: iterates the parts of every message.
TYPED_ONLY = r"""
{%- for m in messages -%}
{{- m.role + ':' -}}
{%- for part in m.content -%}{%- if part.type == 'text' -%}{{- '[' + part.text + ']' -}}{%- endif -%}{%- endfor -%}
{{- '\n' -}}
{%- endfor -%}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def make_template(source: str = TOOL_CHATML, **kwargs: Any) -> ChatTemplate:
    return ChatTemplate(source, **kwargs)


# --- rendering ------------------------------------------------------------------------------


def test_render_matches_handwritten_prompt() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather?"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert make_template().render(messages) == expected


def test_render_tools_and_tool_calls_handwritten() -> None:
    messages = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call_1",
                    # An OpenAI client sends a JSON string; this template wants an object.
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    expected = (
        "<|im_start|>system\nSys\n\n# Tools\n<tools>\n"
        + json.dumps(WEATHER_TOOL, ensure_ascii=False)
        + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nParis?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert make_template().render(messages, tools=[WEATHER_TOOL]) == expected


def test_render_does_not_mutate_caller_messages() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    make_template().render(messages, add_generation_prompt=False)
    assert call["function"]["arguments"] == '{"a": 1}'
    assert "thinking" not in messages[0]


def test_enable_thinking_false_renders_empty_think_block() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    on = make_template().render(messages, enable_thinking=True)
    off = make_template().render(messages, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_preserve_thinking_kwarg_and_preserve_reasoning_switch() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "OLD-REASONING"},
        {"role": "user", "content": "c"},
    ]
    tpl = make_template()
    assert "OLD-REASONING" not in tpl.render(messages)
    assert "<think>\nOLD-REASONING\n</think>\n\nb" in tpl.render(messages, preserve_thinking=True)
    # llama.cpp's switch sets preserve_thinking (and friends) ...
    assert "OLD-REASONING" in tpl.render(messages, preserve_reasoning=True)
    # ... but an explicit kwarg still wins over the derived value.
    assert "OLD-REASONING" not in tpl.render(
        messages, preserve_reasoning=True, preserve_thinking=False
    )


def test_special_tokens_are_globals_and_kwargs_override_them() -> None:
    tpl = make_template(
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}",
        bos_token="<s>",
        eos_token="</s>",
        special_tokens={"pad_token": "<pad>"},
    )
    assert tpl.render([]) == "<s>|</s>|<pad>"
    assert tpl.render([], bos_token="[B]") == "[B]|</s>|<pad>"


def test_reserved_kwargs_cannot_replace_render_arguments() -> None:
    tpl = make_template("{{ messages | length }}-{{ add_generation_prompt }}")
    kwargs = {"messages": []}
    out = tpl.render([{"role": "user", "content": "x"}], **kwargs)
    assert out == "1-True"


def test_documents_and_custom_kwargs_reach_the_template() -> None:
    tpl = make_template("{% for d in documents %}{{ d.title }};{% endfor %}{{ custom }}")
    out = tpl.render([], documents=[{"title": "A", "text": "t"}], custom="K")
    assert out == "A;K"


def test_render_history_is_prefix_of_next_full_render() -> None:
    history = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
    ]
    tpl = make_template()
    closed = tpl.render_history(history)
    assert closed.endswith("two<|im_end|>\n")
    full = tpl.render(history + [{"role": "user", "content": "three"}])
    assert full.startswith(closed)
    assert len(full) > len(closed)
    # Same messages with a generation prompt: the history is a prefix too.
    assert tpl.render(history).startswith(closed)


def test_continue_final_message_cuts_after_final_text() -> None:
    messages = [
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "1, 2,"},
    ]
    tpl = make_template()
    out = tpl.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert out == (
        "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"
    )
    with pytest.raises(TemplateError, match="cannot both be true"):
        tpl.render(messages, add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_reasoning_field() -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "let me"},
    ]
    out = make_template().render(
        messages, add_generation_prompt=False, continue_final_message="reasoning_content"
    )
    assert out.endswith("<|im_start|>assistant\n<think>\nlet me")


def test_continue_final_message_missing_field_is_an_error() -> None:
    with pytest.raises(TemplateError, match="no reasoning_content to continue"):
        make_template().render(
            [{"role": "assistant", "content": "x"}],
            add_generation_prompt=False,
            continue_final_message="reasoning_content",
        )


def test_typed_parts_are_joined_for_string_only_templates() -> None:
    tpl = ChatTemplate.builtin("chatml")
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = tpl.render([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nfirst\nsecond<|im_end|>\n"


def test_strings_are_wrapped_for_typed_only_templates() -> None:
    tpl = make_template(TYPED_ONLY)
    assert tpl.caps()["supports_typed_content"] is True
    assert tpl.caps()["supports_string_content"] is False
    out = tpl.render([{"role": "user", "content": "plain"}], add_generation_prompt=False)
    assert out == "user:[plain]\n"


def test_generation_tag_is_accepted() -> None:
    tpl = make_template("{% generation %}<{{ messages | length }}>{% endgeneration %}")
    assert tpl.render([{"role": "user", "content": "x"}]) == "<1>"


def test_template_is_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    tpl = make_template()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("template compiled again")

    monkeypatch.setattr(sandbox.ENVIRONMENT, "from_string", refuse)
    monkeypatch.setattr(sandbox.ENVIRONMENT, "parse", refuse)
    tpl.render([{"role": "user", "content": "x"}])
    tpl.caps()
    tpl.render([{"role": "user", "content": "y"}])


# --- errors and sandbox -------------------------------------------------------------------------


def test_raise_exception_becomes_template_error_with_message() -> None:
    tpl = make_template("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(TemplateError) as info:
        tpl.render([{"role": "user", "content": "x"}])
    assert info.value.message == "Conversation roles must alternate"
    assert info.value.status_code == 400


def test_system_prompt_goes_into_the_next_message_where_the_template_has_no_system_role() -> None:
    # PLAIN raises on a system message; llama-server merges it into the next message instead
    # (and drops it when nothing follows), so the template never sees one.
    tpl = make_template(PLAIN)
    assert tpl.caps()["supports_system_role"] is False
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tpl.render(messages, add_generation_prompt=False) == "user: Be brief.\nHi\n"
    assert tpl.render(messages[:1], add_generation_prompt=False) == ""


def test_undefined_attribute_access_is_template_error() -> None:
    with pytest.raises(TemplateError, match="undefined"):
        make_template("{{ missing.attribute }}").render([])


def test_python_errors_inside_template_are_template_errors() -> None:
    # int + str is a TypeError in Python; it must not escape as a 500. (str + None renders, as in
    # llama.cpp's Jinja engine: tests/chat/test_template_dates.py.)
    with pytest.raises(TemplateError):
        make_template("{{ 1 + messages[0].content }}").render([{"role": "user", "content": "x"}])


def test_syntax_error_is_template_error_at_construction() -> None:
    with pytest.raises(TemplateError, match="invalid chat template"):
        ChatTemplate("{% for m in messages %}")


def test_sandbox_blocks_dunder_access() -> None:
    # The attribute is withheld (renders as nothing) ...
    assert make_template("{{ ''.__class__ }}").render([]) == ""
    # ... and using it to walk further is refused.
    with pytest.raises(TemplateError, match="unsafe"):
        make_template("{{ ''.__class__.__mro__ }}").render([])
    assert make_template("{{ raise_exception.__globals__ }}").render([]) == ""


def test_sandbox_lets_templates_change_their_own_copies_and_namespace_refuses_private_names() -> None:
    # llama.cpp's engine runs Kimi K2's queue of call ids (.append, .pop); what a template gets
    # is copied for each render, so the change never reaches the caller or the next render.
    tpl = make_template("{% set l = [1] %}{% do l.append(2) %}{{ l }}{% do messages.append(3) %}"
                        "{% do extra.append(4) %}{{ extra }}")
    messages = [{"role": "user", "content": "x"}]
    extra = [0]
    assert tpl.render(messages, extra=extra) == "[1, 2][0, 4]"
    assert tpl.render(messages, extra=extra) == "[1, 2][0, 4]"
    assert messages == [{"role": "user", "content": "x"}] and extra == [0]
    with pytest.raises(TemplateError, match="unsafe"):
        make_template("{% do ''.__class__.__subclasses__() %}").render([])
    with pytest.raises(TemplateError, match="underscore"):
        make_template("{% set ns = namespace(_x=1) %}{{ ns._x }}").render([])
    # Namespaces themselves still work, and so does dict().
    out = make_template(
        "{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ dict(a=1).a }}"
    ).render([])
    assert out == "21"


# --- helpers ---------------------------------------------------------------------------------


def test_tojson_keeps_non_ascii_and_order_and_does_not_escape_html() -> None:
    tpl = make_template("{{ data | tojson }}")
    out = tpl.render([], data={"z": "é<b>", "a": 1})
    assert out == '{"z": "é<b>", "a": 1}'


def test_tojson_indent_and_separators() -> None:
    data = {"k": [1, 2]}
    assert make_template("{{ data | tojson(indent=2) }}").render([], data=data) == (
        '{\n  "k": [\n    1,\n    2\n  ]\n}'
    )
    assert (
        make_template("{{ data | tojson(separators=(',', ':')) }}").render([], data=data)
        == '{"k":[1,2]}'
    )
    assert make_template("{{ data | tojson(ensure_ascii=True) }}").render([], data="é") == (
        '"\\u00e9"'
    )


def test_strftime_now_uses_current_time(monkeypatch: pytest.MonkeyPatch) -> None:
    class FixedDatetime:
        @staticmethod
        def now() -> datetime:
            return datetime(2024, 7, 26, 13, 5)

    monkeypatch.setattr(sandbox, "datetime", FixedDatetime)
    out = make_template("{{ strftime_now('%d %b %Y %H:%M') }}").render([])
    assert out == "26 Jul 2024 13:05"


def test_supports_kwarg_reads_referenced_variables() -> None:
    tpl = make_template()
    assert tpl.supports_kwarg("enable_thinking")
    assert tpl.supports_kwarg("preserve_thinking")
    assert not tpl.supports_kwarg("reasoning_effort")
    # Names the template defines itself are not kwargs.
    assert not tpl.supports_kwarg("ns")
    assert not ChatTemplate.builtin("chatml").supports_kwarg("enable_thinking")


# --- caps -----------------------------------------------------------------------------------


def test_caps_of_tool_template() -> None:
    caps = make_template().caps()
    assert caps == {
        "supports_object_arguments": True,
        "supports_parallel_tool_calls": True,
        "supports_preserve_reasoning": True,
        "supports_reasoning_effort": False,
        "supports_string_content": True,
        "supports_system_role": True,
        "supports_tool_calls": True,
        "supports_tools": True,
        "supports_typed_content": False,
    }
    assert list(caps) == sorted(caps)


def test_caps_of_plain_template() -> None:
    caps = make_template(PLAIN).caps()
    assert caps["supports_system_role"] is False
    assert caps["supports_tools"] is False
    assert caps["supports_tool_calls"] is False
    assert caps["supports_parallel_tool_calls"] is False
    assert caps["supports_preserve_reasoning"] is False
    assert caps["supports_object_arguments"] is False
    assert caps["supports_string_content"] is True
    assert caps["supports_typed_content"] is False


def test_caps_string_arguments_and_single_tool_call() -> None:
    # Concatenates arguments as a string and only renders the first call.
    source = (
        "{%- for m in messages -%}{{- m.role + ':' + m.content -}}"
        "{%- if m.tool_calls -%}{{- '<call>' + m.tool_calls[0].function.arguments -}}"
        "{%- endif -%}{%- endfor -%}"
    )
    caps = make_template(source).caps()
    assert caps["supports_tool_calls"] is True
    assert caps["supports_object_arguments"] is False
    assert caps["supports_parallel_tool_calls"] is False


def test_caps_preserve_reasoning_needs_old_reasoning_in_output() -> None:
    # Keeps only the latest assistant reasoning, whatever the switch says.
    source = (
        "{%- for m in messages -%}"
        "{%- if loop.last or loop.revindex == 2 -%}{{- m.reasoning_content or '' -}}{%- endif -%}"
        "{{- m.content -}}{%- endfor -%}"
    )
    assert make_template(source).caps()["supports_preserve_reasoning"] is False


def test_caps_are_cached() -> None:
    tpl = make_template()
    first = tpl.caps()
    first["supports_tools"] = False  # a copy: the cache must not change
    assert tpl.caps()["supports_tools"] is True


# --- construction from tokenizers -----------------------------------------------------------


class FakeHFTokenizer:
    def __init__(self, chat_template: Any) -> None:
        self.chat_template = chat_template
        self.bos_token = "<s>"
        self.eos_token = "</s>"
        self.special_tokens_map = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "additional_special_tokens": ["<x>"],
        }
        self._tokenizer = object()  # like HF fast tokenizers: the Rust tokenizer


class FakeWrapper:
    """Like mlx-lm's TokenizerWrapper: the HF tokenizer sits in ``_tokenizer``."""

    def __init__(self, inner: FakeHFTokenizer) -> None:
        self._tokenizer = inner


def test_from_tokenizer_uses_model_template_and_tokens() -> None:
    tok = FakeHFTokenizer("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    for candidate in (tok, FakeWrapper(tok)):
        tpl = ChatTemplate.from_tokenizer(candidate)
        assert tpl.render([{"role": "user", "content": "x"}]) == "<s>x</s>"
        assert tpl.bos_token == "<s>" and tpl.eos_token == "</s>"


def test_from_tokenizer_named_templates_prefer_default() -> None:
    tok = FakeHFTokenizer({"default": "DEFAULT", "tool_use": "TOOLS"})
    tpl = ChatTemplate.from_tokenizer(tok)
    assert tpl.source == "DEFAULT"
    assert tpl.tool_use_source == "TOOLS"
    assert ChatTemplate.from_tokenizer(tok, override="tool_use").source == "TOOLS"
    only_tools = ChatTemplate.from_tokenizer(FakeHFTokenizer({"tool_use": "TOOLS"}))
    assert only_tools.source == "TOOLS"


def test_from_tokenizer_builtin_override_and_jinja_override() -> None:
    tok = FakeHFTokenizer("MODEL TEMPLATE")
    chatml = ChatTemplate.from_tokenizer(tok, override="chatml")
    assert chatml.source == BUILTIN_TEMPLATES["chatml"]
    assert chatml.name == "chatml"
    assert chatml.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    custom = ChatTemplate.from_tokenizer(tok, override="{{ 'custom:' + bos_token }}")
    assert custom.render([]) == "custom:<s>"
    assert custom.name is None


def test_from_tokenizer_without_template_falls_back_to_chatml() -> None:
    tpl = ChatTemplate.from_tokenizer(FakeHFTokenizer(None))
    assert tpl.source == BUILTIN_TEMPLATES["chatml"]


def test_builtin_names_render_as_llama_cpp() -> None:
    tok = FakeHFTokenizer("MODEL TEMPLATE")
    tpl = ChatTemplate.from_tokenizer(tok, override="llama3")
    assert tpl.name == "llama3" and tpl.source == "llama3"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": " Hi "}]
    # llama.cpp's C++ format: no BOS (tokenization adds it), content trimmed.
    assert tpl.render(messages) == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )

# --- what llama-server gives a template (docs/chat-templates.md) ----------------------------


def test_absent_tools_and_generation_prompt_stay_undefined() -> None:
    # llama-server leaves them out of the context (Hermes 2/3 iterate ``tools`` without a test).
    tpl = make_template("{{ tools is defined }}|{{ add_generation_prompt is defined }}|{% for t in tools %}{{ t.function.name }}{% endfor %}")
    assert tpl.render([], add_generation_prompt=False) == "False|False|"
    assert tpl.render([], tools=[WEATHER_TOOL], add_generation_prompt=True) == "True|True|get_weather"


class FakeBosTokenizer(FakeHFTokenizer):
    """Encodes every character as one id, with 1 (the BOS) in front when asked for special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_bos_is_left_out_where_the_tokenizer_adds_it() -> None:
    source = "{{ bos_token }}{{ messages[0].content }}{{ bos_token }}"
    messages = [{"role": "user", "content": "x"}]
    assert ChatTemplate(source, bos_token="<s>", add_bos=True).render(messages) == "x<s>"
    assert ChatTemplate(source, bos_token="<s>").render(messages) == "<s>x<s>"
    assert ChatTemplate.from_tokenizer(FakeBosTokenizer(source)).render(messages) == "x<s>"
    assert ChatTemplate.from_tokenizer(FakeHFTokenizer(source)).render(messages) == "<s>x<s>"


@pytest.mark.parametrize(
    ("source", "thinking"),
    [
        # The switch only changes the system prompt (Apertus): no reasoning, as llama-server finds.
        ("{{ 'Deliberation: ' + ('on' if enable_thinking else 'off') }}{% for m in messages %}{{ m.content }}{% endfor %}"
         "{% if add_generation_prompt %}<a>{% endif %}", False),
        # The switch changes the generation prompt (Qwen3's empty think block).
        ("{% for m in messages %}{{ m.content }}{% endfor %}"
         "{% if add_generation_prompt %}<a>{% if not enable_thinking %}<think></think>{% endif %}{% endif %}", True),
        # A past turn's reasoning shows.
        ("{{ enable_thinking }}{% for m in messages %}{{ m.reasoning_content or '' }}{{ m.content }}{% endfor %}", True),
        # enable_thinking is never read: the value cannot matter.
        ("{% for m in messages %}{{ m.content }}{% endfor %}", True),
    ],
)
def test_enable_thinking_defaults_to_whether_the_template_has_reasoning(source: str, thinking: bool) -> None:
    tpl = make_template(source)
    assert tpl.supports_thinking() is thinking
    if not tpl.supports_kwarg("enable_thinking"):
        return
    # What the template is given (printed first, where it changes no generation prompt).
    shown = make_template("{{ enable_thinking }}|" + source)
    assert shown.supports_thinking() is thinking
    rendered = render_chat(shown, parse_chat_request({"messages": [{"role": "user", "content": "q"}]}))
    assert rendered.startswith(f"{thinking}|")
    told = parse_chat_request({"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"enable_thinking": True}})
    assert render_chat(shown, told).startswith("True|")


def test_preserve_reasoning_and_reasoning_effort_reach_the_template() -> None:
    tpl = make_template("{{ preserve_reasoning }} {{ preserve_thinking }} {{ clear_thinking }} "
                        "{{ reasoning_effort is defined }} {{ reasoning_strength | default('-') }}")
    body = {"messages": [{"role": "user", "content": "q"}]}
    assert render_chat(tpl, parse_chat_request(body)) == "True True False False -"
    off = parse_chat_request({**body, "chat_template_kwargs": {"preserve_reasoning": False}, "reasoning_effort": "low"})
    assert render_chat(tpl, off) == "False False True True low"


def test_arguments_that_are_not_json_are_refused_where_the_template_takes_objects() -> None:
    # llama-server parses string arguments for such templates and refuses what does not parse.
    tpl = make_template()
    assert tpl.caps()["supports_object_arguments"] is True
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(TemplateError, match="Failed to parse tool call arguments as JSON"):
        tpl.render(messages)
    call["function"]["arguments"] = '{"city": "Paris"}'
    assert '"city": "Paris"' in tpl.render(messages)
