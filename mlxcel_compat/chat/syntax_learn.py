"""A family's reply syntax, read from its chat template by rendering sentinel turns.

The idea is llama-server's auto-parser (b11312, ``common/chat-diff-analyzer.cpp``), built here in
this project's own way: render assistant turns that differ in one thing (reasoning or not, one
call or two, one argument or two, a string or a number) and read the markers from where the
sentinels land (``chat/syntax_probe.py``). The result is a plain :class:`ChatSyntax`, checked
before it is used: the template's own renders must parse back to the calls they were rendered
from, or the tools part is dropped with a note saying why.

What is learned:

- **reasoning**: the text before and after a reasoning sentinel (``<think>`` / ``</think>``), from
  a turn with reasoning and content, else a ``thinking`` content part, else a turn with reasoning
  and a call (templates that show reasoning only next to calls); what the generation prompt opens;
- **content**: markers a template wraps the answer in (``<|START_RESPONSE|>``);
- **tool calls**: whether a call is one JSON object (and at which keys its name, arguments and id
  sit), or a name, an id and arguments between markers; arguments as a JSON object or one tagged
  argument after another (their key and value markers, from a two-argument call; a marker that
  says the value's type, from calls with values of each type); the markers that open and close a
  call and the section around several calls, from a two-call turn; a call counter in the id
  (Kimi K2's ``functions.NAME:0``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Union

from mlxcel_compat.chat.arg_encodings import bracket_end, gemma_arguments, python_arguments
from mlxcel_compat.chat.call_reader import CallArgs, CallStart
from mlxcel_compat.chat.reply_parser import MarkersParser
from mlxcel_compat.chat.syntax import (
    CallId,
    CallIndex,
    ChatSyntax,
    GemmaArgs,
    JsonArgs,
    JsonCall,
    KeySuffix,
    Lit,
    Name,
    Part,
    PythonArgs,
    ReasoningSyntax,
    TaggedArgs,
    ToolSyntax,
    core,
)
from mlxcel_compat.chat.syntax_probe import (
    ARG_INT,
    CONTENT,
    FN1,
    FN2,
    ID1,
    ID2,
    K1,
    K2,
    REASONING,
    V1,
    V2,
    Renderer,
    TemplateProbes,
    Turn,
    common_prefix,
    common_suffix,
    probe_call,
    segments,
)

__all__ = ["learn_syntax"]

_DECODER = json.JSONDecoder()
# Values of each JSON type a typed-marker template (Kimi K3, DeepSeek DSML) may mark differently.
_TYPED_VALUES: tuple[Any, ...] = (ARG_INT, True, {"x": 1}, [1, 2])


class _Unreadable(Exception):
    """The analysis cannot read this part of the template's syntax."""


def learn_syntax(render: Renderer, source: str, caps: Mapping[str, bool], kwargs: Mapping[str, Any]) -> ChatSyntax:
    """The syntax of the template ``render`` renders with (``source`` is its text, ``caps`` its
    capabilities, ``kwargs`` the variables a request renders it with)."""
    probes = TemplateProbes(render, dict(kwargs))
    notes: list[str] = []
    reasoning = _learn_reasoning(probes, source, caps)
    content_start, content_end = _learn_content(probes, reasoning, bool(caps.get("supports_tool_calls")))
    tools: list[ToolSyntax] = []
    if caps.get("supports_tool_calls"):
        try:
            tools.append(_learned_tools(probes, caps, reasoning))
        except _Unreadable as exc:
            notes.append(f"tool calls: {exc}")
        if "builtin_tools" in source:  # Llama 3.1 writes calls to its built-in tools another way
            builtin = TemplateProbes(render, {**kwargs, "builtin_tools": [FN1, FN2]})
            try:
                extra = _learned_tools(builtin, caps, reasoning)
            except _Unreadable as exc:
                notes.append(f"built-in tool calls: {exc}")
            else:
                if extra not in tools:
                    tools.append(extra)
    syntax = ChatSyntax(
        format=_format_name(tools),
        reasoning=reasoning,
        tools=tuple(tools),
        content_start=content_start,
        content_end=content_end,
        notes=tuple(notes),
    )
    return syntax


# --- reasoning and content ---------------------------------------------------------------------


def _learn_reasoning(probes: TemplateProbes, source: str, caps: Mapping[str, bool]) -> ReasoningSyntax | None:
    prompt = probes.generation_prompt() or ""
    for turn in (probes.reasoning(), probes.reasoning_part()):
        if turn is None or REASONING not in turn.text or re.search(r"[\"']type[\"']", turn.text):
            continue  # (a template that prints the parts as a list does not read them)
        at = turn.text.index(REASONING)
        end_at = turn.text.find(CONTENT, at)
        if end_at < 0:
            continue
        start, after = turn.text[:at], turn.text[at + len(REASONING): end_at]
        content = probes.content()
        lead = _content_lead(content)
        shared = common_suffix(after, lead)
        if core(shared) and core(after[: len(after) - len(shared)]):
            after = after[: len(after) - len(shared)]
        if not core(start) and turn.prompt_extra:
            if core(turn.prompt_extra).startswith(core(after)):
                # The history turn opens the block where the generation prompt closes it at once
                # (thinking off): the opening marker is the last one the two share.
                shared = prompt[: len(prompt) - len(turn.prompt_extra)].rstrip()
                start = segments(shared)[-1] if shared.endswith((">", "]")) else ""
            else:  # the generation prompt opens the block with text the history turn leaves out
                return _reasoning("", after, turn.prompt_extra, probes, opener=core(turn.prompt_extra))
        return _reasoning(start, after, prompt, probes)
    if caps.get("supports_tool_calls"):
        with_call = probes.calls("reasoning_call", probe_call(FN1, {K1: V1}, ID1), reasoning=True)
        if with_call is not None and REASONING in with_call.text:
            at = with_call.text.index(REASONING)
            rest = [s for s in segments(with_call.text[at + len(REASONING):]) if not s.isspace()]
            if rest:
                return _reasoning(with_call.text[:at], rest[0], prompt, probes)
    tag = re.search(r"<([A-Za-z][\w:.\-]*)>\s*$", prompt)
    if tag and f"</{tag.group(1)}>" in source:
        opener = f"<{tag.group(1)}>"
        return ReasoningSyntax(opener, f"</{tag.group(1)}>", opener)
    if "</think>" in source:  # templates that drop the reasoning of past turns but know the block
        return ReasoningSyntax("<think>", "</think>", "<think>")
    return None


def _reasoning(start: str, end: str, prompt: str, probes: TemplateProbes, opener: str = "") -> ReasoningSyntax | None:
    """The block between ``start`` and ``end``; with no ``start`` the reply starts inside it, opened by
    the generation prompt (``opener``, found in ``prompt`` when not given)."""
    start, end = core(start), core(end)
    if not end:
        return None
    if start:
        return ReasoningSyntax(start, end, start)
    opener = opener or _opener(prompt, end, probes)
    is_marker = opener.startswith(("<", "[")) and opener.endswith((">", "]"))
    return ReasoningSyntax(opener if is_marker else "", end, opener)


def _opener(prompt: str, end: str, probes: TemplateProbes) -> str:
    """How the generation prompt opens the block: what it adds when thinking is on, else the marker
    at its end that mirrors ``end``, else its last line (a lead-in like Apriel's)."""
    closed = probes.generation_prompt(enable_thinking=False)
    if closed is not None and prompt.startswith(closed) and core(prompt[len(closed):]):
        return core(prompt[len(closed):])
    stripped = prompt.rstrip()
    if stripped.endswith((">", "]")):
        return _mirror(stripped, end)
    return stripped.rsplit("\n", 1)[-1].strip()


def _mirror(prompt: str, end: str) -> str:
    """The end of ``prompt`` that opens what ``end`` closes: as many segments as the end marker
    starts with, one of them different (``<|open|>think<|sep|>`` for ``<|close|>think<|sep|>``)."""
    ours, theirs = segments(prompt), segments(end)
    for k in range(min(len(theirs), len(ours)), 0, -1):
        if sum(a != b for a, b in zip(ours[-k:], theirs[:k])) == 1:
            return "".join(ours[-k:])
    return ours[-1]


def _content_lead(turn: Turn | None) -> str:
    """What a content-only turn writes before its content."""
    if turn is None or CONTENT not in turn.text:
        return ""
    return turn.text[: turn.text.index(CONTENT)]


def _drop_reasoning(text: str, reasoning: ReasoningSyntax | None) -> str:
    """``text`` without a reasoning block (or the end of one the prompt opened) at its start."""
    if reasoning is None:
        return text
    stripped = text.lstrip()
    if reasoning.start and stripped.startswith(reasoning.start):
        end = stripped.find(reasoning.end, len(reasoning.start))
        if end >= 0:
            return stripped[end + len(reasoning.end):].lstrip()
    if stripped.startswith(reasoning.end):
        return stripped[len(reasoning.end):].lstrip()
    return text


def _learn_content(probes: TemplateProbes, reasoning: ReasoningSyntax | None, calls: bool) -> tuple[str, str]:
    """Markers around the answer text: what a content-only turn writes before the content (past any
    reasoning block), and after it up to what every turn ends with."""
    content = probes.content()
    if content is None or CONTENT not in content.text:
        return "", ""
    lead = core(_drop_reasoning(_content_lead(content), reasoning))
    tail = content.text[content.text.index(CONTENT) + len(CONTENT):]
    call = probes.one_call() if calls else None
    end = ""
    if call is not None:
        turn_end = common_suffix(content.text, call.text)
        end = core(tail[: len(tail) - len(turn_end)])
    return lead, end


# --- tool calls --------------------------------------------------------------------------------


def _learned_tools(probes: TemplateProbes, caps: Mapping[str, bool], reasoning: ReasoningSyntax | None) -> ToolSyntax:
    tools = _learn_tools(probes, caps, reasoning)
    _verify(tools, reasoning, probes)
    return tools


def _learn_tools(probes: TemplateProbes, caps: Mapping[str, bool], reasoning: ReasoningSyntax | None) -> ToolSyntax:
    content = probes.content()
    one = probes.one_call()
    if one is None:
        raise _Unreadable("the template refuses an assistant message with a tool call")
    content_text = content.text if content is not None else ""
    turn_end = common_suffix(content_text, one.text) if content_text else ""
    preamble = common_prefix(content_text, one.text) if content_text else ""

    def section(turn: Turn | None) -> str | None:
        if turn is None:
            return None
        text = turn.text
        if turn_end and text.endswith(turn_end):
            text = text[: len(text) - len(turn_end)]
        if preamble and text.startswith(preamble):
            text = text[len(preamble):]
        return _drop_reasoning(text, reasoning)

    t1 = section(one)
    assert t1 is not None
    two_args = section(probes.two_args())
    t2 = section(probes.two_calls()) if caps.get("supports_parallel_tool_calls") else None
    json_call = _find_json_call(t1)
    encoding: _Encoding = None
    if json_call is not None:
        fields1 = [json_call]
    else:
        if _find_json_args(t1, {K1: V1}):
            encoding = JsonArgs()
        else:
            encoded = _find_encoded_args(t1, {K1: V1}, t1.find(FN1))
            encoding = encoded[2] if encoded else _learn_tagged(two_args, probes, section)
        fields1 = _fields(t1, FN1, ID1, {K1: V1}, encoding)
    call, section_start, section_end, separator = _split_calls(t1, fields1, t2, encoding)
    id_style = "call" if probes.accepts_id("call_" + "a1b2c3d4e5f6g7h8i9j0k1l2") else "alnum9"
    return ToolSyntax(
        call=call,
        section_start=section_start,
        section_end=section_end,
        separator=separator,
        parallel=bool(caps.get("supports_parallel_tool_calls")),
        id_style=id_style,
    )


def _find_json_args(text: str, arguments: dict[str, Any]) -> tuple[int, int] | None:
    """Where ``arguments`` sit in ``text`` as a JSON object (or a JSON string holding one)."""
    for m in re.finditer(r"[{\"]", text):
        try:
            value, end = _DECODER.raw_decode(text, m.start())
        except ValueError:
            continue
        if value == arguments:
            return m.start(), end
        if isinstance(value, str):
            try:
                if json.loads(value) == arguments:
                    return m.start(), end
            except ValueError:
                pass
    return None


def _path_to(value: Any, wanted: Any, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        found = item == wanted
        if not found and isinstance(item, str) and isinstance(wanted, dict):
            try:
                found = json.loads(item) == wanted
            except ValueError:
                found = False
        if found:
            return (*path, key)
        inner = _path_to(item, wanted, (*path, key))
        if inner is not None:
            return inner
    return None


def _find_json_call(text: str) -> tuple[int, int, Part] | None:
    """The call as one JSON object naming the function: its span and key paths."""
    for m in re.finditer(r"\{", text):
        try:
            value, end = _DECODER.raw_decode(text, m.start())
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        if FN1 in value and value[FN1] == {K1: V1}:
            return m.start(), end, JsonCall(name_path=(), args_path=(), name_is_key=True)
        name_path = _path_to(value, FN1)
        args_path = _path_to(value, {K1: V1})
        if name_path is None or args_path is None:
            continue
        id_path = _path_to(value, ID1)
        args_as_string = isinstance(_get(value, args_path), str)
        keys = list(value)
        id_after = id_path is not None and keys.index(id_path[0]) > keys.index(args_path[0])
        return m.start(), end, JsonCall(name_path, args_path, id_path, False, args_as_string, id_after)
    return None


def _get(value: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


# How a call's arguments are written when the name is outside them: a JSON object, Python keyword
# arguments, Gemma's object, or tagged (with the value's closing marker).
_Encoding = Union[JsonArgs, PythonArgs, GemmaArgs, tuple[TaggedArgs, str], None]


def _find_encoded_args(text: str, arguments: dict[str, Any], after: int) -> tuple[int, int, Part] | None:
    """``arguments`` written as Python keyword arguments or as Gemma's object, after ``after``."""
    for m in re.finditer(r"[({]", text[after:]):
        start = after + m.start()
        end = bracket_end(text, start, m.group(), ")" if m.group() == "(" else "}")
        if end is None:
            continue
        if m.group() == "(" and python_arguments(text[start:end]) == arguments:
            return start, end, PythonArgs()
        if m.group() == "{" and gemma_arguments(text[start:end]) == arguments:
            return start, end, GemmaArgs()
    return None


def _fields(text: str, name: str, call_id: str, arguments: dict[str, Any], encoding: _Encoding,
            after: int = 0) -> list[tuple[int, int, Part]]:
    """The name, id and arguments of the call to ``name`` in ``text`` (from ``after``), by position."""
    at = text.find(name, after)
    if at < 0:
        raise _Unreadable(f"the call's name is not in the rendered call: {text!r}")
    fields: list[tuple[int, int, Part]] = [(at, at + len(name), Name())]
    id_at = text.find(call_id, after)
    if id_at >= 0:
        fields.append((id_at, id_at + len(call_id), CallId()))
    if isinstance(encoding, JsonArgs):
        span = _find_json_args(text[after:], arguments)
        if span is None:
            raise _Unreadable(f"the call's arguments are not JSON as in the first call: {text!r}")
        fields.append((after + span[0], after + span[1], JsonArgs()))
    elif isinstance(encoding, (PythonArgs, GemmaArgs)):
        found = _find_encoded_args(text, arguments, at)
        if found is None:
            raise _Unreadable(f"the call's arguments are not written as in the first call: {text!r}")
        fields.append(found)
    else:
        assert encoding is not None
        args, value_suffix = encoding
        key, value = next(iter(arguments.items()))
        key_at = text.find(key, at + len(name))
        start = key_at - len(args.key_prefix)
        value_at = text.find(value, key_at)
        closing = value_suffix.replace("{key}", key)
        end = value_at + len(value) + len(closing)
        if start < 0 or text[start:key_at] != args.key_prefix or text[value_at + len(value): end] != closing:
            raise _Unreadable(f"the tagged argument markers do not fit the one-argument call: {text!r}")
        fields.append((start, end, args))
    return sorted(fields, key=lambda f: f[0])


def _learn_tagged(two_args: str | None, probes: TemplateProbes, section: Any) -> tuple[TaggedArgs, str]:
    """Key and value markers from a call with a string argument and a number argument."""
    if two_args is None:
        raise _Unreadable("the template refuses a call with two arguments")
    text = two_args
    name_end = text.find(FN1) + len(FN1)
    k1 = text.find(K1, name_end)
    v1 = text.find(V1, k1 + len(K1))
    k2 = text.find(K2, v1 + len(V1))
    n = text.find(str(ARG_INT), k2 + len(K2))
    if min(name_end - len(FN1), k1, v1, k2, n) < 0:
        raise _Unreadable(f"the arguments are not written as keys and values: {text!r}")
    before_key = text[name_end:k1]
    string_suffix = text[k1 + len(K1): v1]
    between = text[v1 + len(V1): k2].replace(K1, "{key}")
    after = text[n + len(str(ARG_INT)):].replace(K2, "{key}")
    key_prefix = common_suffix(before_key, between)
    value_suffix = common_prefix(between, after)
    if not core(key_prefix) or not core(value_suffix):
        raise _Unreadable(f"no markers around the arguments' keys and values: {text!r}")
    if len(value_suffix) + len(key_prefix) > len(between):
        key_prefix = between[len(value_suffix):]
    separator = between[len(value_suffix): len(between) - len(key_prefix)]
    suffixes = [KeySuffix(string_suffix, "string")]
    for value in _TYPED_VALUES:
        turn = section(probes.calls(f"typed:{value!r}", probe_call(FN1, {K2: value}, ID1)))
        if turn is None:
            continue
        key_at = turn.find(K2)
        value_at = turn.find(json.dumps(value), key_at)
        if key_at < 0 or value_at < 0:
            continue
        text_suffix = turn[key_at + len(K2): value_at]
        if text_suffix not in (s.text for s in suffixes):
            suffixes.append(KeySuffix(text_suffix, "json"))
    if len(suffixes) == 1:  # one marker for every type: the schema says what the value is
        suffixes = [KeySuffix(string_suffix, "schema")]
    return TaggedArgs(key_prefix, tuple(suffixes), value_suffix, separator), value_suffix


def _inner(text: str, fields: list[tuple[int, int, Part]]) -> list[Part]:
    """The fields with the literal text between them (not before the first nor after the last)."""
    parts: list[Part] = []
    position = fields[0][0]
    for start, end, part in fields:
        if start < position:
            raise _Unreadable(f"the call's fields overlap: {text!r}")
        if text[position:start]:
            parts.append(Lit(text[position:start]))
        parts.append(part)
        position = end
    return parts


def _split_calls(t1: str, fields1: list[tuple[int, int, Part]], t2: str | None,
                 encoding: _Encoding) -> tuple[tuple[Part, ...], str, str, str]:
    """The call's parts, and the section's start, end and separator (from a two-call turn)."""
    head, tail = t1[: fields1[0][0]], t1[fields1[-1][1]:]
    section_start = section_end = separator = ""
    inner = _inner(t1, fields1)
    if t2 is not None:
        first = _fields_like(t2, fields1, FN1, ID1, {K1: V1}, encoding, 0)
        second = _fields_like(t2, fields1, FN2, ID2, {K1: V2}, encoding, first[-1][1])
        a, b, c = t2[: first[0][0]], t2[first[-1][1]: second[0][0]], t2[second[-1][1]:]
        call_start, call_end = common_suffix(a, b), common_prefix(b, c)
        if len(call_start) + len(call_end) > len(b):
            call_end = b[: len(b) - len(call_start)]
        separator = b[len(call_end): len(b) - len(call_start)]
        section_start, section_end = a[: len(a) - len(call_start)], c[len(call_end):]
        if not head.startswith(section_start) or not tail.endswith(section_end):
            raise _Unreadable(f"one call and two calls are written differently: {t1!r} / {t2!r}")
        inner = _with_index(_inner(t2, first), _inner(t2, second), inner, a)
        head, tail = head[len(section_start):], tail[: len(tail) - len(section_end)]
    parts: list[Part] = []
    for part in [Lit(head), *inner, Lit(tail)]:
        if isinstance(part, Lit) and FN1 in part.text:  # the name written twice (Muse Glimmer)
            before, after = part.text.split(FN1, 1)
            parts += [Lit(before), Name(), Lit(after)]
        else:
            parts.append(part)
    # Whitespace between parts is optional when reading, so whitespace-only literals say nothing.
    return tuple(p for p in parts if not (isinstance(p, Lit) and not core(p.text))), section_start, section_end, separator


def _fields_like(text: str, model: list[tuple[int, int, Part]], name: str, call_id: str, arguments: dict[str, Any],
                 encoding: _Encoding, after: int) -> list[tuple[int, int, Part]]:
    if isinstance(model[0][2], JsonCall):
        for m in re.finditer(r"\{", text[after:]):
            start = after + m.start()
            try:
                value, end = _DECODER.raw_decode(text, start)
            except ValueError:
                continue
            if isinstance(value, dict) and (name in value or _path_to(value, name) is not None):
                return [(start, end, model[0][2])]
        raise _Unreadable(f"the second call is not a JSON object like the first: {text!r}")
    return _fields(text, name, call_id, arguments, encoding, after)


def _with_index(first: list[Part], second: list[Part], one: list[Part], head: str) -> list[Part]:
    """A literal holding the call's position (``:0`` then ``:1``) becomes a :class:`CallIndex`."""
    if len(first) != len(second):
        raise _Unreadable("two calls have different shapes")
    for i, (a, b) in enumerate(zip(first, second)):
        if a == b or not (isinstance(a, Lit) and isinstance(b, Lit)):
            continue
        ma, mb = re.search(r"\d+", a.text), re.search(r"\d+", b.text)
        if ma is None or mb is None or a.text[: ma.start()] != b.text[: mb.start()] or a.text[ma.end():] != b.text[mb.end():]:
            continue  # the call's own head or tail differ: left to the section analysis
        if int(mb.group()) != int(ma.group()) + 1:
            raise _Unreadable("two calls differ in more than a counter")
        before_name = "".join(p.text for p in first[: next(j for j, p in enumerate(first) if isinstance(p, Name))]
                              if isinstance(p, Lit)) or head
        plain = segments(before_name)[-1] if before_name else ""
        # An id only when the counter is part of a name-like id (``functions.NAME:0``).
        name_like = re.fullmatch(r"[\w.]*", plain) is not None and re.fullmatch(r"[\w.:]*", a.text[: ma.start()]) is not None
        template = plain + "{name}" + a.text[: ma.start()] + "{index}" if name_like else ""
        pieces = [Lit(a.text[: ma.start()]), CallIndex(template), Lit(a.text[ma.end():])]
        return one[:i] + [p for p in pieces if not (isinstance(p, Lit) and not p.text)] + one[i + 1:]
    return one


# --- checking and naming -------------------------------------------------------------------------


def _verify(tools: ToolSyntax, reasoning: ReasoningSyntax | None, probes: TemplateProbes) -> None:
    """The template's own call renders must parse back to the calls they were rendered from."""
    syntax = ChatSyntax("check", reasoning=reasoning, tools=(tools,))
    cases = [(probes.one_call(), [(FN1, {K1: V1}, ID1)]), (probes.no_args(), [(FN1, {}, ID1)]),
             (probes.two_args(), [(FN1, {K1: V1, K2: ARG_INT}, ID1)])]
    if tools.parallel:
        cases.append((probes.two_calls(), [(FN1, {K1: V1}, ID1), (FN2, {K1: V2}, ID2)]))
    for turn, expected in cases:
        if turn is None:
            continue
        calls = _parse_calls(syntax, turn, probes.generation_prompt() or "")
        got = [(name, args) for name, args, _ in calls]
        want = [(name, args) for name, args, _ in expected]
        if got != want:
            raise _Unreadable(f"the learned syntax reads {got} from a render of {want}: {turn.text!r} SYNTAX {tools}")


def _parse_calls(syntax: ChatSyntax, turn: Turn, prompt: str) -> list[tuple[str, Any, str]]:
    # A turn that starts where the generation prompt ends starts inside the block the prompt opened;
    # one that parts from it earlier is a history turn whose reasoning the template dropped.
    in_reasoning = not turn.prompt_extra and syntax.reply_starts_in_reasoning(prompt)
    parser = MarkersParser(syntax, in_reasoning=in_reasoning)
    events = parser.push(turn.text) + parser.finish()
    calls: dict[int, list[Any]] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = [event.name, "", event.id]
        elif isinstance(event, CallArgs):
            calls[event.index][1] += event.text
    out = []
    for name, args, call_id in calls.values():
        try:
            out.append((name, json.loads(args), call_id))
        except ValueError:
            out.append((name, args, call_id))
    return out


def _format_name(tools: list[ToolSyntax]) -> str:
    """A short name of how calls are written, for logs and the docs' table."""
    if not tools:
        return "content only"
    names = []
    for format_ in tools:
        kinds = {type(p) for p in format_.call}
        if JsonCall in kinds:
            names.append("JSON call")
        elif TaggedArgs in kinds:
            names.append("tagged arguments")
        elif PythonArgs in kinds:
            names.append("Python arguments")
        elif GemmaArgs in kinds:
            names.append("Gemma arguments")
        else:
            names.append("name + JSON arguments")
    return " / ".join(names)
