"""The reply parser's rules on hand-written syntaxes: holding back, giving back, streaming calls.

llama.cpp's real templates are the round trip's (tests/chat/test_tool_syntax.py); here each rule
is checked on its own, on syntaxes spelled out in the test, and a template written for the test in
a syntax no model uses shows that a new family needs no code.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from mlxcel_compat.chat.arg_encodings import gemma_arguments, python_arguments
from mlxcel_compat.chat.call_reader import CallArgs, CallStart
from mlxcel_compat.chat.json_scan import JsonScanner, close_json
from mlxcel_compat.chat.message_parsers import FunctionaryV32Parser, HarmonyParser
from mlxcel_compat.chat.reply_parser import MarkersParser, TextDelta
from mlxcel_compat.chat.syntax import (
    CallId,
    CallIndex,
    ChatSyntax,
    JsonArgs,
    JsonCall,
    KeySuffix,
    Lit,
    Name,
    ReasoningSyntax,
    TaggedArgs,
    ToolSyntax,
)
from mlxcel_compat.chat.syntax_learn import learn_syntax
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply

THINK = ReasoningSyntax("<think>", "</think>", "<think>")
HERMES = ChatSyntax("JSON call", THINK, (ToolSyntax((Lit("<tool_call>\n"), JsonCall(), Lit("\n</tool_call>")), separator="\n"),))
QWEN_CODER = ChatSyntax("tagged", THINK, (ToolSyntax((
    Lit("<tool_call>\n<function="), Name(), Lit(">\n"),
    TaggedArgs("<parameter=", (KeySuffix(">\n"),), "\n</parameter>\n"),
    Lit("</function>\n</tool_call>")), separator="\n"),))
DSML = ChatSyntax("tagged", THINK, (ToolSyntax((
    Lit('<｜DSML｜invoke name="'), Name(), Lit('">\n'),
    TaggedArgs('<｜DSML｜parameter name="', (KeySuffix('" string="true">', "string"), KeySuffix('" string="false">', "json")),
               "</｜DSML｜parameter>\n"), Lit("</｜DSML｜invoke>")), section_start="<｜DSML｜function_calls>",
    section_end="</｜DSML｜function_calls>"),))


def events_of(syntax: ChatSyntax, pieces: list[str], **options: Any) -> list[Any]:
    parser = MarkersParser(syntax, **options)
    return [e for piece in pieces for e in parser.push(piece)] + parser.finish()


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    content = "".join(e.text for e in events if isinstance(e, TextDelta) and e.field == "content")
    reasoning = "".join(e.text for e in events if isinstance(e, TextDelta) and e.field == "reasoning_content")
    calls: dict[int, list[Any]] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.text
    return reasoning, content, [(name, json.loads(args)) for name, args in calls.values()]


def splits(text: str, seed: int) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[i: i + n])
        i += n
    return pieces


# --- the JSON scanner ---------------------------------------------------------------------------


def test_json_scanner_finds_the_end_in_any_pieces_and_fails_at_the_first_bad_character() -> None:
    doc = '{"name": "f", "arguments": {"a": [1, -2.5e3, "x\\"y}"], "b": null, "c": true}} tail'
    for size in (1, 2, 5, 100):
        scanner, text = JsonScanner(0, frozenset({("name",), ("arguments",)})), ""
        for i in range(0, len(doc), size):
            text += doc[i: i + size]
            scanner.feed(text)
            while scanner.paused:  # it stops at each watched value's start and end
                scanner.feed(text)
        assert scanner.done and text[: scanner.pos] == doc[: doc.index(" tail")]
        assert scanner.strings[("name",)] == "f"
        args = text[scanner.starts[("arguments",)]: scanner.ends[("arguments",)]]
        assert json.loads(args) == {"a": [1, -2500.0, 'x"y}'], "b": None, "c": True}
    bad = JsonScanner(0)
    bad.feed('{"a": 1, oops')
    assert bad.failed and bad.pos == len('{"a": 1, ')


@pytest.mark.parametrize("cut, closed", [
    ('{"a": "x', '{"a": "x"}'), ('{"a": [1, 2', '{"a": [1, 2]}'), ('{"a": 1', '{"a": 1}'), ('{"a":', '{"a":null}'),
    ('{"a"', '{"a": null}'), ("{", "{}"), ('{"a": 1,', None),
])
def test_a_cut_json_value_is_completed_where_it_can_be(cut: str, closed: str | None) -> None:
    assert close_json(cut) == closed
    if closed is not None:
        json.loads(closed)


# --- holding back and giving back ---------------------------------------------------------------


def test_text_that_may_become_a_marker_is_held_only_while_it_may() -> None:
    parser = MarkersParser(HERMES)
    assert parser.push("a <tool") == [TextDelta("content", "a")]
    assert parser.push("box> b") == [TextDelta("content", " <toolbox> b")]
    assert parser.push(" <") == []  # a space, then what may open a call
    assert parser.push("x") == [TextDelta("content", " <x")]


def test_text_that_turns_out_to_be_no_call_is_given_back_and_a_later_call_still_counts() -> None:
    text = 'Use <tool_call>{"oops"} like that.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    for pieces in ([text], list(text), splits(text, 1)):
        assert summary(events_of(HERMES, pieces, tools=True)) == ("", 'Use <tool_call>{"oops"} like that.', [("f", {"x": 1})])


def test_calls_stay_content_when_the_request_offers_no_tools() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert summary(events_of(HERMES, [text], tools=False)) == ("", text, [])


def test_a_call_is_announced_at_its_name_and_its_arguments_stream_in_pieces() -> None:
    text = '<tool_call>\n{"name": "write", "arguments": {"path": "a.txt", "text": "' + "word " * 40 + '"}}\n</tool_call>'
    events = events_of(HERMES, list(text), tools=True)
    starts = [i for i, e in enumerate(events) if isinstance(e, CallStart)]
    pieces = [e for e in events if isinstance(e, CallArgs)]
    assert starts == [0] and events[0].name == "write"
    assert len(pieces) > 40  # one piece per character pushed, about
    assert json.loads("".join(p.text for p in pieces))["path"] == "a.txt"


def test_tagged_string_values_stream_and_become_json() -> None:
    value = 'line one\nline "two" <b>\n'
    text = f"<tool_call>\n<function=edit>\n<parameter=text>\n{value}\n</parameter>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"
    events = events_of(QWEN_CODER, list(text), tools=True, arg_types={"edit": {"text": "string", "count": "integer"}})
    assert summary(events)[2] == [("edit", {"text": value, "count": 3})]
    assert sum(isinstance(e, CallArgs) for e in events) > len(value) // 2  # the string came piece by piece
    # Without a schema, "3" reads as the number it looks like; declared a string, it stays one.
    untyped = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    assert summary(events_of(QWEN_CODER, [untyped], tools=True))[2] == [("f", {"n": 3})]
    typed = summary(events_of(QWEN_CODER, [untyped], tools=True, arg_types={"f": {"n": "string"}}))[2]
    assert typed == [("f", {"n": "3"})]


def test_typed_key_markers_say_how_a_value_is_written() -> None:
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="s" string="true">[1, 2]</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="j" string="false">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    for pieces in ([text], list(text)):
        assert summary(events_of(DSML, pieces, tools=True))[2] == [("f", {"s": "[1, 2]", "j": [1, 2]})]


def test_tagged_values_written_as_python_literals_cdata_or_nested_elements() -> None:
    python_literal = "<tool_call>\n<function=f>\n<parameter=o>\n{'max': 20, 'ok': True}\n</parameter>\n</function>\n</tool_call>"
    assert summary(events_of(QWEN_CODER, [python_literal], tools=True))[2] == [("f", {"o": {"max": 20, "ok": True}})]
    cdata = "<tool_call>\n<function=f>\n<parameter=q>\n<![CDATA[a < b & c]]>\n</parameter>\n</function>\n</tool_call>"
    for pieces in ([cdata], list(cdata)):
        assert summary(events_of(QWEN_CODER, pieces, tools=True, arg_types={"f": {"q": "string"}}))[2] == [("f", {"q": "a < b & c"})]
    nested = ChatSyntax("tagged", None, (ToolSyntax((Lit("<invoke name=\""), Name(), Lit("\">"),
                                                     TaggedArgs("<", (KeySuffix(">"),), "</{key}>"), Lit("</invoke>"))),))
    text = '<invoke name="f"><filters><max>20</max><tags><item>a</item><item>b</item></tags></filters></invoke>'
    assert summary(events_of(nested, [text], tools=True, arg_types={"f": {"filters": "object"}}))[2] == [
        ("f", {"filters": {"max": 20, "tags": ["a", "b"]}})]


def test_a_call_cut_short_keeps_what_was_read_completed_into_json() -> None:
    json_cut = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x'
    assert summary(events_of(HERMES, list(json_cut), tools=True))[2] == [("f", {"a": [1, "x"]})]
    tagged_cut = "<tool_call>\n<function=f>\n<parameter=a>\nhalf a val"
    assert summary(events_of(QWEN_CODER, list(tagged_cut), tools=True, arg_types={"f": {"a": "string"}}))[2] == [("f", {"a": "half a val"})]
    no_name = "<tool_call>\n<function="
    assert summary(events_of(QWEN_CODER, list(no_name), tools=True)) == ("", no_name, [])


def test_the_buffer_keeps_only_what_may_be_looked_at_again() -> None:
    parser = MarkersParser(QWEN_CODER, tools=True, arg_types={"w": {"text": "string"}})
    events = parser.push("<tool_call>\n<function=w>\n<parameter=text>\n")
    for _ in range(20000):
        events += parser.push("abcd ")
    assert len(parser.buf) < 4096  # a 100 KB argument streamed through a small buffer
    events += parser.push("\n</parameter>\n</function>\n</tool_call>") + parser.finish()
    assert summary(events)[2] == [("w", {"text": "abcd " * 20000})]


# --- ids, sections, several formats -------------------------------------------------------------


def test_ids_come_from_the_reply_where_the_format_writes_them() -> None:
    mistral = ChatSyntax("name + JSON", None, (ToolSyntax((Lit("[TOOL_CALLS]"), Name(), Lit("[CALL_ID]"), CallId(), Lit("[ARGS]"), JsonArgs()), id_style="alnum9"),))
    calls = parse_reply(mistral, '[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1}', ReplyOptions(tools=True)).tool_calls
    assert calls[0]["id"] == "abc123XYZ" and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    # A format without ids gets made-up ones in the shape the template takes back (Devstral: 9 characters).
    devstral = ChatSyntax("name + JSON", None, (ToolSyntax((Lit("[TOOL_CALLS]"), Name(), Lit("[ARGS]"), JsonArgs()), id_style="alnum9"),))
    (made_up,) = parse_reply(devstral, '[TOOL_CALLS]f[ARGS]{}', ReplyOptions(tools=True)).tool_calls
    assert len(made_up["id"]) == 9 and made_up["id"].isalnum()
    kimi = ChatSyntax("name + JSON", None, (ToolSyntax((Lit("<|tool_call_begin|>functions."), Name(), Lit(":"), CallIndex("functions.{name}:{index}"),
                                                        Lit("<|tool_call_argument_begin|>"), JsonArgs(), Lit("<|tool_call_end|>")),
                                                       section_start="<|tool_calls_section_begin|>", section_end="<|tool_calls_section_end|>"),))
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    assert [c["id"] for c in parse_reply(kimi, text, ReplyOptions(tools=True)).tool_calls] == ["functions.f:0", "functions.g:1"]
    nemo = ChatSyntax("JSON call", None, (ToolSyntax((JsonCall(("name",), ("arguments",), ("id",), id_after_args=True),),
                                                     section_start="[TOOL_CALLS][", section_end="]", separator=","),))
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}, {"name": "g", "arguments": {}, "id": "ABCDEFGHI"}]'
    for pieces in ([text], list(text)):
        parser = MarkersParser(nemo, tools=True)
        starts = [e for piece in pieces for e in parser.push(piece) if isinstance(e, CallStart)]
        assert [(s.id, s.name) for s in starts] == [("abcdefghi", "f"), ("ABCDEFGHI", "g")]


def test_parallel_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in parse_reply(HERMES, text, ReplyOptions(tools=True, parallel=False)).tool_calls] == ["a"]


def test_other_argument_encodings() -> None:
    assert python_arguments("(city='Paris', days=3, tags=['a'], ok=True, none=None)") == {
        "city": "Paris", "days": 3, "tags": ["a"], "ok": True, "none": None}
    assert python_arguments("('positional')") is None
    assert gemma_arguments('{city:<|"|>Paris, "FR"<|"|>,days:3,inner:{ok:true}}') == {
        "city": 'Paris, "FR"', "days": 3, "inner": {"ok": True}}


# --- the two hand-written dialects ----------------------------------------------------------------


def _message_summary(parser: Any, text: str, pieces: list[str] | None = None) -> tuple[str, str, list[tuple[str, Any]]]:
    return summary([e for piece in (pieces or [text]) for e in parser.push(piece)] + parser.finish())


@pytest.mark.parametrize("header", [
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
])
def test_harmony_reads_reasoning_calls_and_answers(header: str) -> None:
    text = "<|channel|>analysis<|message|>Need weather.<|end|>" + header + '{"city": "Paris"}<|call|>'
    for pieces in ([text], list(text)):
        assert _message_summary(HarmonyParser(tools=True), text, pieces) == ("Need weather.", "", [("get_weather", {"city": "Paris"})])
    answer = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    assert _message_summary(HarmonyParser(), answer) == ("Think.", "It is sunny.", [])
    assert _message_summary(HarmonyParser(reasoning=False), answer) == ("", "Think.It is sunny.", [])


def test_functionary_v3_2_reads_text_and_calls_by_recipient() -> None:
    text = 'all\nLet me look.>>>get_weather\n{"city": "Paris"}>>>python\nprint(1)'
    for pieces in ([text], list(text)):
        assert _message_summary(FunctionaryV32Parser(tools=True), text, pieces) == (
            "", "Let me look.", [("get_weather", {"city": "Paris"}), ("python", {"code": "print(1)"})])


# --- learning a syntax no model uses -------------------------------------------------------------

NEW_FAMILY = r"""
{%- for m in messages -%}
{{- '<|' + m.role + '|>' -}}
{%- if m.reasoning_content -%}{{- '<<ponder>>' + m.reasoning_content + '<</ponder>>' -}}{%- endif -%}
{{- m.content or '' -}}
{%- for tc in m.tool_calls or [] -%}
{{- '<<act id="' + tc.id + '" fn="' + tc.function.name + '">>' -}}
{%- for k, v in tc.function.arguments.items() -%}{{- '<<' + k + '>>' + (v if v is string else v | tojson) + '<</' + k + '>>' -}}{%- endfor -%}
{{- '<</act>>' -}}
{%- endfor -%}
{{- '<|end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}
"""


def test_a_new_family_is_learned_from_its_template() -> None:
    template = ChatTemplate(NEW_FAMILY)
    syntax = template.syntax()
    assert syntax.origin == "learned" and syntax.reasoning == ReasoningSyntax("<<ponder>>", "<</ponder>>", "<<ponder>>")
    (tools,) = syntax.tools
    assert CallId() in tools.call and Name() in tools.call and any(isinstance(p, TaggedArgs) for p in tools.call)
    reply = '<<ponder>>Two calls.<</ponder>><<act id="x1" fn="get_weather">><<city>>Paris<</city>><<days>>3<</days>><</act>><<act id="x2" fn="search">><<q>>a "b"<</q>><</act>>'
    for pieces in ([reply], list(reply), splits(reply, 3)):
        parsed = parse_reply(syntax, "".join(pieces), ReplyOptions(tools=True))
        assert parsed.reasoning == "Two calls." and parsed.content == ""
        assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
            ("x1", "get_weather", {"city": "Paris", "days": 3}), ("x2", "search", {"q": 'a "b"'})]


def test_a_syntax_that_does_not_read_back_is_dropped_with_a_note() -> None:
    # Calls rendered as prose: no markers to read, so no call format (the reply stays content).
    prose = ("{%- for m in messages -%}{{ m.role }}: {{ m.content or '' }}{%- for tc in m.tool_calls or [] -%}"
             "I would call {{ tc.function.name }} now.{%- endfor %}\n{%- endfor -%}")
    template = ChatTemplate(prose)
    learned = learn_syntax(template.render, prose, {**template.caps(), "supports_tool_calls": True}, {})
    assert learned.tools == () and any(note.startswith("tool calls:") for note in learned.notes)


def test_a_bare_json_call_needs_its_arguments_key() -> None:
    """Llama 3.x writes calls as bare objects: an object that only has a "name" is prose."""
    llama = ChatSyntax("JSON call", None, (ToolSyntax((JsonCall(("name",), ("parameters",)),), parallel=False),))
    prose = 'The record is {"name": "John", "age": 3}.'
    assert parse_reply(llama, prose, ReplyOptions(tools=True)).tool_calls == []
    assert parse_reply(llama, prose, ReplyOptions(tools=True)).content == prose
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    (parsed,) = parse_reply(llama, call, ReplyOptions(tools=True)).tool_calls
    assert parsed["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

