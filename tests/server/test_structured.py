"""The grammar layer without a model: llguidance compilation and caching, lazy triggers, the
request rules of ``server/structured.py`` and the tool-call grammars (a real tokenizer, no MLX)."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlxcel_compat.chat.request import parse_chat_request
from mlxcel_compat.chat.tool_calls import parse_tool_calls
from mlxcel_compat.chat.tool_grammar import lazy_trigger, tool_call_grammar
from mlxcel_compat.engine.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    GrammarTrigger,
    compute_masks,
    lark_from_gbnf,
    lark_from_json_schema,
    unpack_masks,
)
from mlxcel_compat.server.errors import InvalidRequest
from mlxcel_compat.server.structured import StructuredOutput, server_default
from tests.conftest import tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
    },
}
ADD = {
    "type": "function",
    "function": {"name": "add", "description": "", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(tiny_model("qwen3")))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    eog = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return GrammarCompiler(tokenizer, 8192, eog)


@pytest.fixture()
def structured(compiler, tokenizer):
    return StructuredOutput(compiler, lambda text: tokenizer.encode(text, add_special_tokens=False))


def feed(compiler, tokenizer, constraint: Constraint, text: str):
    """A sequence's grammar state after the model "generated" ``text`` (tokenized normally)."""
    state = compiler.new_state(constraint, tokenizer)
    for token in tokenizer.encode(text, add_special_tokens=False):
        state.accept(token)
    return state


# ---------------------------------------------------------------------- compiler


def test_compiled_grammars_are_cached_by_text(compiler):
    lark = lark_from_gbnf('root ::= "cache" [0-9]{2}')
    before = (compiler.n_compiled, compiler.n_reused)
    first = compiler.compile(lark)
    assert compiler.compile(lark) is first
    assert (compiler.n_compiled, compiler.n_reused) == (before[0] + 1, before[1] + 1)


def test_errors_are_cached_and_readable(compiler):
    lark = lark_from_json_schema({"not": {"type": "string"}})
    for _ in range(2):
        with pytest.raises(GrammarError) as info:
            compiler.compile(lark)
    # llguidance's reason, without the echo of our generated Lark source
    assert str(info.value) == 'Unimplemented keys: ["not"]'


def test_gbnf_conversion_errors_name_the_problem():
    with pytest.raises(GrammarError, match="Rule 'nope' not found"):
        lark_from_gbnf("root ::= nope")


def test_lark_is_accepted_as_is():
    text = '%llguidance {}\nstart: "x"\n'
    assert lark_from_gbnf(text) == text


def test_empty_schema_means_any_object(compiler, tokenizer):
    state = feed(compiler, tokenizer, Constraint(lark=lark_from_json_schema({})), '{"k": [1, "x"]}')
    assert state.error is None and state.matcher.is_accepting()
    state = feed(compiler, tokenizer, Constraint(lark=lark_from_json_schema({})), "[1]")
    assert state.error is not None  # an array is not an object


def test_unpack_masks_bit_order():
    bits = np.zeros((1, 2), dtype=np.int32)
    bits[0, 0] = 1 | (1 << 5)
    bits[0, 1] = 1 << 1  # token 33
    mask = unpack_masks(bits, 40)
    assert mask.shape == (1, 40) and mask.dtype == bool
    assert np.flatnonzero(mask[0]).tolist() == [0, 5, 33]


def test_masks_allow_eos_only_where_the_grammar_accepts(compiler, tokenizer):
    eos = compiler.eog_ids
    constraint = Constraint(lark=lark_from_gbnf('root ::= "ab" "c"?'))
    start = compiler.new_state(constraint, tokenizer)
    accepting = feed(compiler, tokenizer, constraint, "ab")
    done = feed(compiler, tokenizer, constraint, "abc")
    masks = compute_masks([start, accepting, done], compiler.vocab_size)
    assert not masks[0][eos].any()  # nothing generated yet: no end
    assert masks[1][eos].all() and masks[1].sum() > len(eos)  # may end or add "c"
    assert done.complete and np.flatnonzero(masks[2]).tolist() == sorted(eos)


def test_mask_slices_change_no_mask(compiler, tokenizer):
    """MASK_SLICES only shortcut the trie walk: inside bounded strings, at every length left, the
    mask equals the one walked token by token (slices off)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}, "t": {"type": "string", "maxLength": 40}}, "required": ["s", "t"]}
    lark = lark_from_json_schema(schema)
    unsliced = compiler.tokenizer.with_slices([])
    rng = np.random.default_rng(3)
    bits = np.zeros((2, compiler.mask_words), dtype=np.int32)
    for _ in range(3):
        state = compiler.new_state(Constraint(lark=lark), tokenizer)
        plain = llguidance.LLMatcher(unsliced, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        while not state.complete:
            state.fill_mask(bits[0])
            plain.unsafe_compute_mask_ptr(bits[1].ctypes.data, bits[1].nbytes)
            assert np.array_equal(bits[0], bits[1])
            allowed = [t for t in np.flatnonzero(unpack_masks(bits[:1], compiler.vocab_size)[0]) if t not in compiler.eog_ids]
            if not allowed:
                break
            token = int(rng.choice(allowed))
            state.accept(token)
            assert plain.consume_token(token)


# ---------------------------------------------------------------------- lazy triggers


def test_token_trigger(compiler, tokenizer):
    open_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    constraint = Constraint(lark=lark_from_gbnf('root ::= "<tool_call>" [0-9]+'), lazy=True, triggers=(GrammarTrigger(0, "<tool_call>", open_id),))
    state = feed(compiler, tokenizer, constraint, "free text, no rules")
    assert state.awaiting_trigger and not state.active
    state = feed(compiler, tokenizer, constraint, "free text <tool_call>12")
    assert state.active and state.error is None and state.matcher.is_accepting()


def test_word_trigger_anywhere_starts_at_the_word(compiler, tokenizer):
    constraint = Constraint(lark=lark_from_gbnf('root ::= "BEGIN" [a-z]{2}'), lazy=True, triggers=(GrammarTrigger(1, "BEGIN"),))
    state = feed(compiler, tokenizer, constraint, "some words BEGINok")
    assert state.complete and state.error is None


def test_pattern_trigger_starts_at_the_first_group(compiler, tokenizer):
    constraint = Constraint(lark=lark_from_gbnf('root ::= "=" [0-9]+'), lazy=True, triggers=(GrammarTrigger(2, r"total(=)"),))
    state = feed(compiler, tokenizer, constraint, "the total=42")
    assert state.active and state.error is None and state.matcher.is_accepting()


def test_full_pattern_trigger_must_match_all_the_text(compiler, tokenizer):
    constraint = Constraint(lark=lark_from_gbnf('root ::= "{" [a-z]* "}"'), lazy=True, triggers=(GrammarTrigger(3, r"\s*(\{)[\s\S]*"),))
    assert feed(compiler, tokenizer, constraint, "text then {").awaiting_trigger  # not at the start
    state = feed(compiler, tokenizer, constraint, "  {abc}")
    assert state.complete


def test_auto_tool_trigger_ignores_calls_inside_thinking(compiler, tokenizer):
    lark = tool_call_grammar([WEATHER], parallel=False, lazy=True)
    constraint = Constraint(lark=lark, lazy=True, triggers=(lazy_trigger([WEATHER], thinking_open=False),))
    assert feed(compiler, tokenizer, constraint, "<think>maybe <tool_call> later").awaiting_trigger
    state = feed(compiler, tokenizer, constraint, '<think>ok</think>Sure. <tool_call>\n{"name": "get_weather"')
    assert state.active and state.error is None
    in_thinking = Constraint(lark=lark, lazy=True, triggers=(lazy_trigger([WEATHER], thinking_open=True),))
    assert feed(compiler, tokenizer, in_thinking, "<tool_call> still thinking").awaiting_trigger
    assert feed(compiler, tokenizer, in_thinking, "done</think><tool_call>").active


# ---------------------------------------------------------------------- tool-call grammars


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_tool_call_grammar_accepts_the_template_syntax(compiler, tokenizer):
    lark = tool_call_grammar([WEATHER, ADD], parallel=False)
    text = call_text("get_weather", {"city": "Paris"})
    state = feed(compiler, tokenizer, Constraint(lark=lark), text)
    assert state.complete and state.error is None
    _, calls = parse_tool_calls(text)
    assert calls[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "text",
    [
        call_text("get_time", {}),  # not a given tool
        call_text("get_weather", {"town": "Paris"}),  # arguments against the schema
        call_text("add", {"a": "one"}),
        "Sure! " + call_text("add", {"a": 1}),  # "required": a call from the first token
    ],
)
def test_tool_call_grammar_rejects_invalid_calls(compiler, tokenizer, text):
    assert feed(compiler, tokenizer, Constraint(lark=tool_call_grammar([WEATHER, ADD], parallel=True)), text).error is not None


def test_parallel_calls(compiler, tokenizer):
    two = call_text("add", {"a": 1}) + "\n" + call_text("get_weather", {"city": "Oslo"})
    assert feed(compiler, tokenizer, Constraint(lark=tool_call_grammar([WEATHER, ADD], parallel=True)), two).error is None
    one_only = feed(compiler, tokenizer, Constraint(lark=tool_call_grammar([WEATHER, ADD], parallel=False)), two)
    assert one_only.error is not None


def test_thinking_prompt_may_close_before_the_call(compiler, tokenizer):
    lark = tool_call_grammar([ADD], parallel=False, thinking_open=True)
    assert feed(compiler, tokenizer, Constraint(lark=lark), "</think>\n" + call_text("add", {"a": 2})).complete


# ---------------------------------------------------------------------- request rules


def chat(tools=None, tool_choice=None, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    if tools is not None:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return body, parse_chat_request(body)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequest) as info:
        fn(*args, **kwargs)
    return info.value.message


def test_completion_grammar_wins_over_json_schema(structured):
    constraint = structured.for_completion({"grammar": 'root ::= "x"', "json_schema": {"type": "string"}}, response_format=False)
    assert 'start: "x"' in constraint.lark


def test_completion_response_format_only_on_v1(structured):
    body = {"response_format": {"type": "json_object"}}
    assert structured.for_completion(body, response_format=False) is None
    assert "%json" in structured.for_completion(body, response_format=True).lark


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"grammar": 'root ::= "x"', "json_schema": {}}, "Cannot use both json_schema and grammar"),
        ({"grammar": 'root ::= "x"', "response_format": {"type": "json_object"}}, 'Either "json_schema" or "grammar" can be specified, but not both'),
        ({"response_format": {"type": "yaml"}}, 'response_format type must be one of "text", "json_object" or "json_schema", but got: yaml'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}}, '"json_schema": Unimplemented keys: ["not"]'),
        ({"grammar": "root ::= (", "grammar_lazy": False}, "Failed to parse grammar: "),
        ({"grammar": 'root ::= "x"', "grammar_lazy": True}, "Error: no triggers set for lazy grammar!"),
        ({"grammar": 'root ::= "x"', "grammar_lazy": True, "grammar_triggers": [{"type": 7, "value": "x"}]}, "Unknown grammar trigger type"),
        ({"grammar": 'root ::= "x"', "grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": "<tool_call>"}]}, "Grammar trigger word should be marked as preserved token: <tool_call>"),
        ({"grammar": 'root ::= "x"', "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(unclosed"}]}, "Invalid grammar trigger pattern"),
    ],
)
def test_chat_rules(structured, extra, message):
    body, parsed = chat(**extra)
    assert message in error_of(structured.for_chat, body, parsed, "")


def test_custom_grammar_with_tools_is_refused(structured):
    body, parsed = chat(tools=[WEATHER], grammar='root ::= "x"')
    assert error_of(structured.for_chat, body, parsed, "") == "Cannot use custom grammar constraints with tools."
    body, parsed = chat(tools=[WEATHER], tool_choice="none", grammar='root ::= "x"')
    assert structured.for_chat(body, parsed, "") is not None  # tools off: the grammar is the constraint


def test_tool_choices(structured):
    body, parsed = chat(tools=[WEATHER, ADD])
    auto = structured.for_chat(body, parsed, "")
    assert auto.lazy and auto.triggers[0].type == 3
    body, parsed = chat(tools=[WEATHER, ADD], tool_choice="required")
    required = structured.for_chat(body, parsed, "")
    assert not required.lazy and "get_weather" in required.lark and '\\"add\\"' in required.lark
    body, parsed = chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    named = structured.for_chat(body, parsed, "")
    assert '\\"add\\"' in named.lark and "get_weather" not in named.lark
    body, parsed = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "not among the tools" in error_of(structured.for_chat, body, parsed, "")


def test_bad_tool_parameters_name_the_tool(structured):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}
    body, parsed = chat(tools=[WEATHER, bad], tool_choice="required")
    assert error_of(structured.for_chat, body, parsed, "").startswith("\"tools\": function 'bad': ")


def test_server_default_applies_only_without_a_constraint(compiler, tokenizer):
    class Settings:
        grammar = grammar_file = json_schema_file = None
        json_schema = '{"type": "object", "properties": {"n": {"type": "integer"}}}'

    default = server_default(Settings(), compiler)
    structured = StructuredOutput(compiler, lambda t: tokenizer.encode(t, add_special_tokens=False), default)
    assert structured.for_completion({}, response_format=False) is default
    assert structured.for_completion({"grammar": 'root ::= "x"'}, response_format=False) is not default
    body, parsed = chat(tools=[WEATHER], tool_choice="required")
    assert structured.for_chat(body, parsed, "") is not default
    Settings.json_schema = '{"not": {}}'
    with pytest.raises(ValueError, match="--json-schema: "):
        server_default(Settings(), compiler)
    Settings.json_schema, Settings.grammar = "{}", 'root ::= "x"'
    with pytest.raises(ValueError, match="only one of"):
        server_default(Settings(), compiler)


def test_auto_with_a_response_format_is_a_response_or_calls(structured, compiler, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    body, parsed = chat(tools=[ADD], response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    constraint = structured.for_chat(body, parsed, "")
    assert not constraint.lazy
    assert feed(compiler, tokenizer, constraint, '{"ok": true}').complete
    assert feed(compiler, tokenizer, constraint, call_text("add", {"a": 1})).error is None
    assert feed(compiler, tokenizer, constraint, "free text").error is not None


@pytest.mark.parametrize("field", ["json_schema", "response_format"])
def test_listed_properties_take_no_others_in_json_schemas_as_in_llama_cpp(structured, compiler, tokenizer, field):
    """``json_schema`` and ``response_format`` read objects as llama.cpp's json-schema-to-grammar
    does: one that lists its properties and says nothing of ``additionalProperties`` takes no
    others; ``"additionalProperties": true`` opens it again."""
    def constraint(schema):
        if field == "json_schema":
            return structured.for_completion({"json_schema": schema}, response_format=False)
        body, parsed = chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        return structured.for_chat(body, parsed, "")

    listed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert feed(compiler, tokenizer, constraint(listed), '{"ok": true}').complete
    assert feed(compiler, tokenizer, constraint(listed), '{"ok": true, "extra": 1}').error is not None
    assert feed(compiler, tokenizer, constraint({**listed, "additionalProperties": True}), '{"ok": true, "extra": 1}').error is None
    assert feed(compiler, tokenizer, constraint({"type": "object"}), '{"extra": 1}').error is None
