"""The round trip of a template's tool calls: render them, take the model's part, parse it back.

For one chat template: an assistant message with one call (and two, where the template takes
parallel calls), with reasoning, is rendered after a user turn. The assistant part of the rendered
text is what that model emits for the message: the text after the generation prompt, up to what
every turn ends with (the end-of-turn token the generation stops at). It is parsed in the syntax
the server learns from the template, whole and streamed in several chunkings (one character at a
time, token-sized pieces, seeded random splits); every parse must give back the same calls
(names, arguments, and ids where the template writes them), the reasoning when the template shows
it, and no other content.

``tests/chat/test_tool_syntax.py`` asserts it for llama.cpp's templates, and
``scripts/tool_calls_table.py`` writes docs/tool-calls.md's table from the same rows.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from mlxcel_compat.chat.reply_parser import TextDelta, collect_arg_types
from mlxcel_compat.chat.syntax import ChatSyntax, Lit, TaggedArgs
from mlxcel_compat.chat.syntax_probe import common_prefix, common_suffix
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.chat.tool_calls import CallCollector, ReplyOptions, open_parser, parse_reply

KWARGS = {"enable_thinking": True, "date_string": "01 Jan 2026", "datetime": "Jan 01 2026"}
USER = [{"role": "user", "content": "What is the weather in Paris, and what should I pack?"}]
REASONING = "The user wants the weather; I will call the tool."
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object", "additionalProperties": {"type": "string"}}}, "required": ["query"]}}},
]
# Ids of 9 letters and digits: Mistral's templates refuse any other.
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}, "K7p2Rq9Zx"),
    ("search", {"query": 'rain gear "best" <b> & co', "filters": {"max": 20, "tags": ["a", "b"]}}, "M3n8Vb1Ty"),
]
TOKEN_PIECES = re.compile(r"<[^<>]{0,48}>|\[[A-Z_/]+\]|\w+|\s+|.", re.DOTALL)


@dataclass
class RoundTrip:
    """One template's result: what was rendered, and what went wrong (nothing, when it passed)."""

    stem: str
    format: str
    origin: str
    calls: list[int] = field(default_factory=list)  # the call counts rendered (1, and 2 when parallel)
    reasoning: bool = False  # the template rendered the reasoning, and it came back
    without_calls: str = ""  # why the template cannot carry calls (empty when it can)
    problems: list[str] = field(default_factory=list)


def _render(template: ChatTemplate, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return template.render(messages, tools=TOOLS, add_generation_prompt=generation_prompt, **KWARGS)


def emission(template: ChatTemplate, message: dict[str, Any]) -> tuple[str, list[str]]:
    """``(emitted, prompts)``: the text a model emits for ``message``, and the prompts it may follow.

    Where the generation prompt and the history turn part (the prompt opens a reasoning block the
    history turn shows without its opening line, or closes one the history turn opens), the emitted
    text starts where they part, and it may follow either the generation prompt or what the two share.
    """
    prompt = _render(template, USER, True)
    full = _render(template, [*USER, message], False)
    plain = _render(template, [*USER, {"role": "assistant", "content": "A plain answer."}], False)
    end = common_suffix(full, plain)  # what every turn ends with: the generation stops there
    body = full[: len(full) - len(end)] if end else full
    if body.startswith(prompt):
        return body[len(prompt):], [prompt]
    shared = common_prefix(prompt, body)
    return body[len(shared):], [prompt, shared]


def chunkings(text: str) -> dict[str, list[str]]:
    """The pieces a stream may deliver ``text`` in."""
    out = {"characters": list(text), "tokens": TOKEN_PIECES.findall(text)}
    for seed in (1, 2, 3):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            pieces.append(text[i: i + n])
            i += n
        out[f"random {seed}"] = pieces
    return out


def _streamed(syntax: Any, options: ReplyOptions, pieces: list[str]) -> tuple[str | None, str, list[dict[str, Any]]]:
    parser, calls = open_parser(syntax, options), CallCollector(options.parallel)
    fields = {"content": "", "reasoning_content": ""}
    for event in [e for piece in pieces for e in parser.push(piece)] + parser.finish():
        if isinstance(event, TextDelta):
            fields[event.field] += event.text
        else:
            calls.add(event)
    return fields["reasoning_content"] or None, fields["content"], calls.calls


def _check_calls(n: int, text: str, parsed: list[dict[str, Any]]) -> list[str]:
    got = []
    for call in parsed:
        try:
            got.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
        except ValueError:
            got.append((call["function"]["name"], call["function"]["arguments"]))
    problems = [] if got == [(name, args) for name, args, _ in CALLS[:n]] else [f"{n} call(s) read back as {got}"]
    for (_, _, call_id), call in zip(CALLS, parsed):
        if call_id in text and call["id"] != call_id:
            problems.append(f"id {call['id']!r} instead of the rendered {call_id!r}")
    return problems


def round_trip(stem: str, source: str) -> RoundTrip:
    """Render, take apart and compare, for one template source."""
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    syntax = template.syntax()
    origin = syntax.origin + ("; Hermes calls assumed" if any(n.startswith("no calls") for n in syntax.notes) else "")
    row = RoundTrip(stem, syntax.format, origin)
    caps = template.caps()
    if not caps["supports_tool_calls"]:
        try:
            _render(template, [*USER, _message(1)], False)
            row.without_calls = "renders no tool calls"
        except Exception as exc:  # the template refuses a call: say why
            row.without_calls = f"rendering a call fails: {exc}"
        return row
    reasoning_seen = []
    for n in (1, 2) if caps["supports_parallel_tool_calls"] else (1,):
        text, prompts = emission(template, _message(n))
        opened = any(syntax.reply_starts_in_reasoning(prompt) for prompt in prompts)
        if opened and (syntax.reasoning is None or syntax.reasoning.end not in text):
            opened = False  # the history turn left out the block the prompt opened: it shows what follows
        options = ReplyOptions(in_reasoning=opened, tools=True, arg_types=collect_arg_types(TOOLS))
        whole = parse_reply(syntax, text, options)
        row.calls.append(n)
        row.problems += _check_calls(n, text, whole.tool_calls)
        if whole.content.strip():
            row.problems.append(f"stray content {whole.content!r} from {text!r}")
        if REASONING in text:
            reasoning_seen.append(whole.reasoning == REASONING)
            if whole.reasoning != REASONING:
                row.problems.append(f"reasoning read as {whole.reasoning!r} from {text!r}")
        for name, pieces in chunkings(text).items():
            reasoning, content, calls = _streamed(syntax, options, pieces)
            if (reasoning, content, [c["function"] for c in calls]) != (whole.reasoning, whole.content, [c["function"] for c in whole.tool_calls]):
                row.problems.append(f"streamed in {name} it reads {reasoning!r} {content!r} {calls}")
    row.reasoning = bool(reasoning_seen) and all(reasoning_seen)
    return row


def _message(n: int) -> dict[str, Any]:
    calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
             for name, args, call_id in CALLS[:n]]
    return {"role": "assistant", "content": "", "tool_calls": calls, "reasoning_content": REASONING}


TABLE_HEADER = "| template | format | calls | reasoning | streamed | syntax from |\n|---|---|---|---|---|---|\n"


def table(rows: list[RoundTrip]) -> str:
    """docs/tool-calls.md's table: one row per template, every column from the round trip."""
    lines = [TABLE_HEADER]
    for row in rows:
        if row.without_calls:
            lines.append(f"| {row.stem} | {row.format} | none: {row.without_calls} | - | - | {row.origin} |\n")
            continue
        status = "pass" if not row.problems else "FAIL"
        calls = " and ".join(str(n) for n in row.calls)
        reasoning = "round trip" if row.reasoning else "not rendered"
        lines.append(f"| {row.stem} | {row.format} | {calls}: {status} | {reasoning} | characters, tokens, random: {status} | {row.origin} |\n")
    return "".join(lines)


def damaged_replies(template: ChatTemplate, syntax: ChatSyntax, seed: int, count: int = 12) -> list[str]:
    """Replies a model might write by mistake: the template's own call render cut at a random
    place, with the syntax's markers, pieces of JSON and stray text spliced in."""
    rng = random.Random(seed)
    pieces = ['{"name": "f", "arguments": {"a": 1}}', "{", "}", '"', "\\", "f", "true", "hello ", "\n", " ", "[", "]", "<", ">",
              "get_weather", '{"a": "b"}', "(x=1)", '<|"|>']
    for format_ in syntax.tools:
        pieces += [format_.section_start, format_.section_end, format_.separator]
        for part in format_.call:
            if isinstance(part, Lit):
                pieces.append(part.text)
            elif isinstance(part, TaggedArgs):
                pieces += [part.key_prefix, part.value_suffix.replace("{key}", "city"), *(s.text for s in part.key_suffixes)]
    if syntax.reasoning is not None:
        pieces += [syntax.reasoning.start, syntax.reasoning.end]
    pieces = [p for p in pieces if p]
    rendered, _ = emission(template, _message(2 if template.caps()["supports_parallel_tool_calls"] else 1))
    replies = []
    for _ in range(count):
        junk = [rng.choice(pieces) for _ in range(rng.randint(1, 10))]
        cut = rng.randint(0, len(rendered))
        replies.append(rendered[:cut] + "".join(junk) + rendered[cut:])
    return replies


def parses_alike(syntax: ChatSyntax, text: str, options: ReplyOptions) -> list[str]:
    """Where ``text`` parses differently whole, one character at a time and in random pieces."""
    whole = parse_reply(syntax, text, options)
    expected = (whole.reasoning, whole.content, [c["function"] for c in whole.tool_calls])
    problems = []
    for name, pieces in chunkings(text).items():
        reasoning, content, calls = _streamed(syntax, options, pieces)
        if (reasoning, content, [c["function"] for c in calls]) != expected:
            problems.append(f"{text!r} streamed in {name} reads {reasoning!r} {content!r} {calls}, whole {expected}")
    return problems

