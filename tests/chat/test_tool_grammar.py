"""Forced tool calls in each template's own syntax (``chat/tool_grammar.py``), without a model.

For llama.cpp's templates that render calls: the grammar built from the template's learned syntax
accepts the template's own render of one call and of two (the text a model emits for them: its
literal parts are the template's, whitespace and key order included), and random walks through
the grammar's masks (a real tokenizer, random allowed tokens) always give text that the reply
parser reads back as valid calls to the offered tools, with no content around them.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlxcel_compat.chat.call_layout import call_layout
from mlxcel_compat.chat.reply_parser import collect_arg_types
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.chat.tool_calls import ReplyOptions, parse_reply
from mlxcel_compat.chat.tool_grammar import forced_calls, lazy_trigger, tool_call_grammar
from mlxcel_compat.engine.grammar import Constraint, GrammarCompiler, compute_masks
from tests.chat.conftest import read_llama_cpp_templates
from tests.chat.test_tool_syntax import WITHOUT_CALLS
from tests.chat.tool_round_trip import emission
from tests.conftest import SLOW, tiny_model

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}, "dst": {"type": "boolean"}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}, "K7p2Rq9Zx"), ("get_time", {"zone": 2, "dst": True}, "M3n8Vb1Ty")]

# Every template that renders calls is written (MiniMax M3's nested object and list values have
# their own test: test_minimax_m3_writes_objects_and_lists_as_elements).

# The default run: a few formats (JSON call, XML tags, GLM tags, name + JSON arguments, Kimi's
# sections, Harmony) written, and random walks in one; scripts/test.sh --slow runs every template.
DEFAULT_WRITES = {"Qwen-Qwen2.5-7B-Instruct", "Qwen3-Coder", "GLM-4.6", "unsloth-mistral-Devstral-Small-2507",
                  "moonshotai-Kimi-K2", "openai-gpt-oss-120b"}
DEFAULT_WALKS = {"Qwen3-Coder"}


WITH_CALLS = sorted(set(read_llama_cpp_templates()) - WITHOUT_CALLS)
WRITES = [pytest.param(s, marks=() if s in DEFAULT_WRITES else SLOW) for s in WITH_CALLS]
WALKS = [pytest.param(s, marks=() if s in DEFAULT_WALKS else SLOW) for s in WITH_CALLS]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(tiny_model("qwen3")))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    eog = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return GrammarCompiler(tokenizer, 8192, eog)


_TEMPLATES: dict[str, ChatTemplate] = {}


def template_of(stem: str, templates: dict[str, str]) -> ChatTemplate:
    if stem not in _TEMPLATES:
        _TEMPLATES[stem] = ChatTemplate(templates[stem], bos_token="<s>", eos_token="</s>")
    return _TEMPLATES[stem]


def assistant(n: int) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}} for name, args, call_id in CALLS[:n]]}


def grammar_for(template: ChatTemplate, compiler: GrammarCompiler, thinking_open: bool, parallel: bool = True, **extra: Any) -> str:
    syntax = template.syntax()
    return tool_call_grammar(TOOLS, parallel=parallel, syntax=syntax, thinking_open=thinking_open, spell=compiler.lark_literal,
                             mark=compiler.lark_marker, layout=call_layout(template, forced_calls(syntax)), **extra)


def after_the_prompt(syntax: Any, text: str, prompts: list[str]) -> str:
    """What the model writes after the generation prompt for ``text`` (the history turn's part):
    where the prompt opened a reasoning block that the history turn leaves out (QwQ drops past
    reasoning), the block's end first."""
    end = syntax.reasoning.end.strip() if syntax.reasoning else ""
    if len(prompts) > 1 and end and syntax.reply_starts_in_reasoning(prompts[0]) and end not in text:
        return end + text
    if len(prompts) > 1:  # the history turn opens again what the generation prompt ends with
        overlap = max((k for k in range(1, len(text) + 1) if prompts[0].endswith(text[:k]) and text[:k].strip()), default=0)
        return text[overlap:]
    return text


def feed(compiler: GrammarCompiler, tokenizer: Any, constraint: Constraint, text: str):
    state = compiler.new_state(constraint, tokenizer)
    for token in tokenizer.encode(text, add_special_tokens=False):
        state.accept(token)
    return state


@pytest.mark.parametrize("stem", WRITES)
def test_the_grammar_writes_what_the_template_renders(stem: str, llama_cpp_templates, compiler, tokenizer) -> None:
    template = template_of(stem, llama_cpp_templates)
    counts = (1, 2) if template.caps()["supports_parallel_tool_calls"] and forced_calls(template.syntax()).parallel else (1,)
    for n in counts:
        text, prompts = emission(template, assistant(n))
        lark = grammar_for(template, compiler, template.syntax().reply_starts_in_reasoning(prompts[0]))
        text = after_the_prompt(template.syntax(), text, prompts)
        state = feed(compiler, tokenizer, Constraint(lark=lark), text)
        assert state.error is None and state.matcher.is_accepting(), f"{n} call(s): {text!r}: {state.error}"


SEARCH = {"type": "function", "function": {"name": "search", "description": "", "parameters": {
    "type": "object", "properties": {
        "query": {"type": "string", "maxLength": 12},
        "filters": {"type": "object", "properties": {
            "max": {"type": "integer", "minimum": 0, "maximum": 99}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}},
            "strict": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}},
            "required": ["max"], "additionalProperties": False}},
    "required": ["query", "filters"], "additionalProperties": False}}}


def test_minimax_m3_writes_objects_and_lists_as_elements(llama_cpp_templates, compiler, tokenizer) -> None:
    """MiniMax M3 renders an object argument as elements nested in its tags and a list as
    ``<item>`` elements (``<filters>NS<max>20NS</max>...``): the grammar accepts the template's
    render of such a call, and random walks through it read back as valid calls."""
    template = template_of("MiniMax-M3", llama_cpp_templates)
    syntax = template.syntax()
    arguments = {"query": "rain", "filters": {"max": 20, "tags": ["a", "b"], "strict": {"on": True}}}
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "K7p2Rq9Zx", "type": "function", "function": {"name": "search", "arguments": json.dumps(arguments)}}]}
    prompt = template.render([{"role": "user", "content": "hi"}], tools=[SEARCH], add_generation_prompt=True)
    full = template.render([{"role": "user", "content": "hi"}, message], tools=[SEARCH], add_generation_prompt=False)
    assert full.startswith(prompt)
    text = full[len(prompt): full.index("</tool_call>", len(prompt)) + len("</tool_call>")]
    assert "<filters>]<]minimax[>[<max>20" in text and "<item>a" in text  # the nesting this test is about
    thinking_open = syntax.reply_starts_in_reasoning(prompt)
    constraint = Constraint(lark=tool_call_grammar([SEARCH], parallel=False, syntax=syntax, spell=compiler.lark_literal,
                                                   mark=compiler.lark_marker, thinking_open=thinking_open,
                                                   layout=call_layout(template, forced_calls(syntax))))
    state = feed(compiler, tokenizer, constraint, text)
    assert state.error is None and state.matcher.is_accepting(), state.error
    assert feed(compiler, tokenizer, constraint, text.replace("<max>20", '<max>"20"')).error is not None
    rng = random.Random("MiniMax-M3")
    finished = [t for t in (random_walk(compiler, tokenizer, constraint, rng) for _ in range(4)) if t is not None]
    assert len(finished) >= 2
    for walk in finished:
        parsed = parse_reply(syntax, walk, ReplyOptions(tools=True, in_reasoning=thinking_open, parallel=False,
                                                        arg_types=collect_arg_types([SEARCH])))
        assert [c["function"]["name"] for c in parsed.tool_calls] == ["search"] and not parsed.content.strip(), walk
        jsonschema.validate(json.loads(parsed.tool_calls[0]["function"]["arguments"]), SEARCH["function"]["parameters"])


def random_walk(compiler: GrammarCompiler, tokenizer: Any, constraint: Constraint, rng: random.Random, limit: int = 1000) -> str | None:
    """Text a model could write under ``constraint``: random allowed tokens, leaning towards
    closing characters in free text so that strings end; None when ``limit`` tokens did not end it."""
    state = compiler.new_state(constraint, tokenizer)
    pieces: list[int] = []
    eos = set(compiler.eog_ids)
    for _ in range(limit):
        if state.complete:
            return tokenizer.decode(pieces)
        allowed = np.flatnonzero(compute_masks([state], compiler.vocab_size)[0])
        assert state.error is None and allowed.size, state.error
        ends = [t for t in allowed if t in eos]
        if ends and rng.random() < 0.5:
            return tokenizer.decode(pieces)
        choices = [t for t in allowed if t not in eos] or ends
        if len(choices) > 40 and rng.random() < 0.6:
            closing = [t for t in choices if tokenizer.decode([t])[:1] in "<\"'}])\n,|[:"]
            choices = closing or choices
        token = int(rng.choice(choices))
        pieces.append(token)
        state.accept(token)
    return None


def assert_valid_calls(syntax: Any, text: str, thinking_open: bool, parallel: bool) -> list[dict[str, Any]]:
    parsed = parse_reply(syntax, text, ReplyOptions(tools=True, in_reasoning=thinking_open, parallel=parallel,
                                                    arg_types=collect_arg_types(TOOLS)))
    assert parsed.tool_calls, f"no call read from {text!r}"
    assert not parsed.content.strip(), f"content {parsed.content!r} around the calls in {text!r}"
    for call in parsed.tool_calls:
        name = call["function"]["name"]
        assert name in SCHEMAS, text
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return parsed.tool_calls


@pytest.mark.parametrize("stem", WALKS)
def test_random_walks_through_the_grammar_are_valid_calls(stem: str, llama_cpp_templates, compiler, tokenizer) -> None:
    template = template_of(stem, llama_cpp_templates)
    syntax = template.syntax()
    prompt = template.render([{"role": "user", "content": "hi"}], tools=TOOLS, add_generation_prompt=True, enable_thinking=True)
    thinking_open = syntax.reply_starts_in_reasoning(prompt)
    constraint = Constraint(lark=grammar_for(template, compiler, thinking_open))
    rng = random.Random(stem)
    finished = [t for t in (random_walk(compiler, tokenizer, constraint, rng) for _ in range(4)) if t is not None]
    assert len(finished) >= 2
    for text in finished:
        assert_valid_calls(syntax, text, thinking_open, parallel=True)


def test_one_call_without_parallel_calls(llama_cpp_templates, compiler, tokenizer) -> None:
    template = template_of("Qwen3-Coder", llama_cpp_templates)
    one = Constraint(lark=grammar_for(template, compiler, False, parallel=False))
    two, _ = emission(template, assistant(2))
    assert feed(compiler, tokenizer, one, two).error is not None
    assert feed(compiler, tokenizer, one, emission(template, assistant(1))[0]).complete


def test_calls_must_name_an_offered_tool_with_valid_arguments(llama_cpp_templates, compiler, tokenizer) -> None:
    template = template_of("GLM-4.6", llama_cpp_templates)
    constraint = Constraint(lark=grammar_for(template, compiler, False))
    text, _ = emission(template, assistant(1))
    assert feed(compiler, tokenizer, constraint, text).error is None
    for wrong in (text.replace("get_weather", "get_wether"), text.replace("celsius", "kelvin"), "Sure! " + text):
        assert feed(compiler, tokenizer, constraint, wrong).error is not None, wrong


@pytest.mark.parametrize("stem", ["Qwen3-Coder", "unsloth-mistral-Devstral-Small-2507", "meta-llama-Llama-3.2-3B-Instruct",
                                  *(pytest.param(s, marks=SLOW) for s in ("moonshotai-Kimi-K2", "google-gemma-4-31B-it"))])
def test_lazy_grammar_starts_at_the_formats_opening_marker(stem: str, llama_cpp_templates, compiler, tokenizer) -> None:
    """"auto": free text, then the call from its opening marker on; nothing inside reasoning."""
    template = template_of(stem, llama_cpp_templates)
    syntax = template.syntax()
    lark = grammar_for(template, compiler, False, lazy=True)
    constraint = Constraint(lark=lark, lazy=True, triggers=(lazy_trigger(TOOLS, syntax),))
    text, _ = emission(template, assistant(1))
    reasoning = syntax.reasoning
    thinking = f"{reasoning.start}maybe {text.strip()} later" if reasoning and reasoning.start.strip() else None
    if thinking:
        assert feed(compiler, tokenizer, constraint, thinking).awaiting_trigger
    state = feed(compiler, tokenizer, constraint, "Let me check. " + text.lstrip())
    assert not state.awaiting_trigger and state.error is None and state.matcher.is_accepting()
    broken = feed(compiler, tokenizer, constraint, "Let me check. " + text.lstrip().replace("get_weather", "get_wether"))
    assert broken.error is not None


def test_special_tokens_are_written_as_token_references(compiler, tokenizer) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert compiler.lark_literal("a<|im_end|>b") == f'"a" <[{end}]> "b"'
    assert compiler.lark_literal("<tool_call>\n") == '"<tool_call>\\n"'  # an added token that is not special: text


def test_listed_properties_take_no_others_as_in_llama_cpp(llama_cpp_templates, compiler, tokenizer) -> None:
    """A tool with ``"properties": {}`` is called with ``{}`` (llama.cpp's reading: an object that
    lists its properties takes no others unless ``additionalProperties`` says so)."""
    template = template_of("Qwen-Qwen2.5-7B-Instruct", llama_cpp_templates)
    syntax = template.syntax()
    layout = call_layout(template, forced_calls(syntax))

    def state_after(parameters: dict[str, Any], arguments: str):
        tool = {"type": "function", "function": {"name": "where_am_i", "parameters": parameters}}
        lark = tool_call_grammar([tool], parallel=False, syntax=syntax, spell=compiler.lark_literal, mark=compiler.lark_marker, layout=layout)
        text = '<tool_call>\n{"name": "where_am_i", "arguments": ' + arguments + "}\n</tool_call>"
        return feed(compiler, tokenizer, Constraint(lark=lark), text)

    assert state_after({"type": "object", "properties": {}}, "{}").complete
    assert state_after({"type": "object", "properties": {}}, '{"x": 1}').error is not None
    assert state_after({"type": "object", "properties": {}, "additionalProperties": True}, '{"x": 1}').error is None
    assert state_after({"type": "object"}, '{"x": 1}').error is None
