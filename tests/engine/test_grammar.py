"""Constrained decoding on the engine: a random-weight model, so only the grammar makes the text valid.

Each grammar is our own bounded equivalent of one of llama.cpp's sample grammars (grammars/*.gbnf);
every output is checked by an independent reader (Python's ``json``, or a regular expression written
separately from the grammar), for 50 seeds each, all submitted at once so they decode as batched rows
with a mask each.
"""

from __future__ import annotations

import json
import queue
import re

import jsonschema
import pytest

from mlxcel_compat.engine.grammar import Constraint, GrammarTrigger, lark_from_gbnf, lark_from_json_schema
from mlxcel_compat.engine.request import GenerationRequest
from mlxcel_compat.engine.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness, Run, collect

pytestmark = pytest.mark.engine

SEEDS = range(50)

JSON_GBNF = r"""
root    ::= object
object  ::= "{" ws ( member ( "," ws member ){0,3} )? "}"
member  ::= string ":" ws value
value   ::= inner | list | scalar
inner   ::= "{" ws ( string ":" ws scalar ( "," ws string ":" ws scalar ){0,2} )? "}"
list    ::= "[" ws ( scalar ( "," ws scalar ){0,3} )? "]"
scalar  ::= string | number | "true" | "false" | "null"
string  ::= "\"" [a-zA-Z0-9 _-]{0,12} "\""
number  ::= "-"? ( "0" | [1-9] [0-9]{0,5} ) ( "." [0-9]{1,4} )?
ws      ::= [ \n]{0,2}
"""

LIST_GBNF = r"""
root ::= item{1,4}
item ::= "- " [a-z ]{1,20} "\n"
"""
LIST_RE = re.compile(r"(?:- [a-z ]{1,20}\n){1,4}")

ARITHMETIC_GBNF = r"""
root  ::= line{1,2}
line  ::= expr " = " num "\n"
expr  ::= term ( [-+*/] term ){0,3}
term  ::= ident | num | "(" inner ")"
inner ::= atom ( [-+*/] atom ){0,2}
atom  ::= ident | num
ident ::= [a-z] [a-z0-9_]{0,5}
num   ::= [0-9]{1,4}
"""
_ATOM = r"(?:[a-z][a-z0-9_]{0,5}|[0-9]{1,4})"
_TERM = rf"(?:{_ATOM}|\({_ATOM}(?:[-+*/]{_ATOM}){{0,2}}\))"
ARITHMETIC_RE = re.compile(rf"(?:{_TERM}(?:[-+*/]{_TERM}){{0,3}} = [0-9]{{1,4}}\n){{1,2}}")

CHESS_GBNF = r"""
root   ::= "1. " move " " move "\n" ( "2. " move " " move "\n" )?
move   ::= ( pawn | piece | castle ) [+#]?
pawn   ::= ( [a-h] "x" )? [a-h] [1-8] ( "=" [NBRQ] )?
piece  ::= [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]
castle ::= "O-O" "-O"?
"""
_MOVE = r"(?:(?:[a-h]x)?[a-h][1-8](?:=[NBRQ])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?"
CHESS_RE = re.compile(rf"1\. {_MOVE} {_MOVE}\n(?:2\. {_MOVE} {_MOVE}\n)?")

HIRAGANA_GBNF = 'root ::= [ぁ-ゟ]{2,6} "。"'
HIRAGANA_RE = re.compile(r"[ぁ-ゟ]{2,6}。")

KEY_RE = re.compile(r"[a-zA-Z0-9 _-]{0,12}")


def _scalar_ok(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and KEY_RE.fullmatch(value) is not None)


def json_ok(text: str) -> bool:
    data = json.loads(text)
    if not isinstance(data, dict) or len(data) > 4:
        return False
    for key, value in data.items():
        if not KEY_RE.fullmatch(key):
            return False
        if isinstance(value, dict):
            if len(value) > 3 or not all(KEY_RE.fullmatch(k) and _scalar_ok(v) for k, v in value.items()):
                return False
        elif isinstance(value, list):
            if len(value) > 4 or not all(_scalar_ok(v) for v in value):
                return False
        elif not _scalar_ok(value):
            return False
    return True


# The feature list of the issue: required and optional properties, enums, const, nested objects,
# arrays with min/max items, strings with patterns and lengths, bounded numbers and integers,
# anyOf, and $ref/$defs.
SCHEMA = {
    "type": "object",
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x", "y"], "additionalProperties": False}},
    "properties": {
        "kind": {"const": "shape"},
        "name": {"type": "string", "minLength": 2, "maxLength": 8},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "number", "minimum": 0.5, "maximum": 10},
        "count": {"type": "integer", "minimum": 1, "maximum": 500},
        "origin": {"$ref": "#/$defs/point"},
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
        "label": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}, {"type": "null"}]},
        "meta": {"type": "object", "properties": {"visible": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["visible"], "additionalProperties": False},
    },
    "required": ["kind", "name", "code", "color", "count", "origin", "points"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def harness():
    h = EngineHarness(tiny_model("llama"), n_parallel=8, batch_size=64)
    yield h
    h.close()


def request(h: EngineHarness, lark: str, seed: int, n_predict: int, prompt: str = "Write it:", **constraint: object) -> GenerationRequest:
    req = h.request(h.tokenizer.encode(prompt), n_predict=n_predict)
    req.sampling = SamplingParams(temperature=1.0, seed=seed)
    req.constraint = Constraint(lark=lark, **constraint)  # type: ignore[arg-type]
    h.engine.grammars.compile(lark)  # as the HTTP side does before submitting
    return req


def run_all(h: EngineHarness, requests: list[GenerationRequest]) -> list[tuple[str, Run]]:
    """Submit together (batched decode, one mask per row), then collect each."""
    sinks = []
    for req in requests:
        events: queue.Queue = queue.Queue()
        h.engine.submit(req, events.put)
        sinks.append(events)
    runs = [collect(events) for events in sinks]
    # The text as the server sends it: an end-of-generation token adds none.
    return [(h.tokenizer.decode(run.tokens, skip_special_tokens=True), run) for run in runs]


@pytest.mark.parametrize(
    ("grammar", "valid"),
    [
        (JSON_GBNF, json_ok),
        (LIST_GBNF, lambda text: LIST_RE.fullmatch(text) is not None),
        (ARITHMETIC_GBNF, lambda text: ARITHMETIC_RE.fullmatch(text) is not None),
        (CHESS_GBNF, lambda text: CHESS_RE.fullmatch(text) is not None),
        (HIRAGANA_GBNF, lambda text: HIRAGANA_RE.fullmatch(text) is not None),
    ],
    ids=["json", "list", "arithmetic", "chess", "hiragana"],
)
def test_sample_grammars_hold_for_50_seeds(harness, grammar, valid):
    lark = lark_from_gbnf(grammar)
    results = run_all(harness, [request(harness, lark, seed, n_predict=600) for seed in SEEDS])
    for seed, (text, run) in zip(SEEDS, results):
        # Every grammar is bounded, so each run must end because the grammar is complete (or the
        # model chose EOS where the grammar accepts), never on the token budget.
        assert run.finish.stop_type == "eos", (seed, text)
        assert valid(text), (seed, text)
    assert len({text for text, _ in results}) > 10  # the seeds really sample different texts


def test_json_schema_features_validate(harness):
    lark = lark_from_json_schema(SCHEMA)
    seeds = range(16)
    results = run_all(harness, [request(harness, lark, seed, n_predict=800) for seed in seeds])
    for seed, (text, run) in zip(seeds, results):
        assert run.finish.stop_type == "eos", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    optional_seen = {key for text, _ in results for key in json.loads(text)} - set(SCHEMA["required"])
    assert optional_seen  # optional properties are generated too, not only the required ones


def test_exact_repetition_gives_exactly_five_a(harness):
    for seed in (1, 2):
        [(text, run)] = run_all(harness, [request(harness, lark_from_gbnf('root ::= "a"{5,5}'), seed, n_predict=50)])
        assert text == "aaaaa"
        assert run.finish.stop_type == "eos"
        assert run.finish.n_decoded == len(run.tokens) <= 5  # stopped as soon as the grammar completed


def test_completion_stops_even_with_ignore_eos(harness):
    req = request(harness, lark_from_gbnf('root ::= "yes" | "no"'), 3, n_predict=50)
    req.sampling.ignore_eos = True
    [(text, run)] = run_all(harness, [req])
    assert text in ("yes", "no") and run.finish.stop_type == "eos"


def test_unsatisfiable_within_n_predict_ends_on_the_limit(harness):
    [(text, run)] = run_all(harness, [request(harness, lark_from_gbnf('root ::= "ab"{200,200}'), 4, n_predict=5)])
    assert run.finish.stop_type == "limit"
    assert len(run.tokens) == 5
    assert text and ("ab" * 200).startswith(text)  # the partial output is a valid prefix


def test_batched_rows_match_single_rows(harness):
    """A row's mask is its own: the same seeds give the same texts alone and eight at a time."""
    lark = lark_from_json_schema(SCHEMA["$defs"]["point"])
    together = [text for text, _ in run_all(harness, [request(harness, lark, seed, n_predict=100) for seed in range(8)])]
    alone = [run_all(harness, [request(harness, lark, seed, n_predict=100)])[0][0] for seed in range(8)]
    assert together == alone


def test_greedy_constrained_picks_the_best_token_the_grammar_allows(harness):
    """temperature 0: the token is the argmax over the tokens the grammar allows (the mask comes
    before the draw), computed here from the raw log-probabilities of the whole vocabulary."""
    req = request(harness, lark_from_gbnf("root ::= [0-9]{3}"), 5, n_predict=10)
    req.sampling = SamplingParams(temperature=0.0, seed=5)
    vocab = harness.engine.grammars.vocab_size
    req.n_probs = vocab
    [(text, run)] = run_all(harness, [req])
    assert re.fullmatch(r"[0-9]{3}", text)
    pieces = {t: harness.tokenizer.decode([t]) for t in range(vocab)}
    allowed = [t for t, piece in pieces.items() if re.fullmatch(r"[0-9]{1,3}", piece)]
    raw = run.logprobs[0]
    assert run.tokens[0] == max(allowed, key=lambda t: raw[t])
    assert max(raw, key=raw.get) not in allowed  # unconstrained, greedy would have picked another token


def _trigger_run(harness, triggers, bias, grammar, preserved=()):
    lark = lark_from_gbnf(grammar)
    req = request(harness, lark, 7, n_predict=40, lazy=True, triggers=tuple(triggers), preserved_tokens=tuple(preserved))
    req.sampling.logit_bias = bias
    [(text, run)] = run_all(harness, [req])
    return text, run


def test_lazy_token_trigger_constrains_only_after_the_token(harness):
    tool_open = harness.tokenizer.convert_tokens_to_ids("<tool_call>")
    # The bias makes the model open at once; before the trigger nothing is constrained.
    text, run = _trigger_run(
        harness, [GrammarTrigger(0, "<tool_call>", tool_open)], {tool_open: 30.0}, 'root ::= "<tool_call>" [0-9]{4} "</tool_call>"', preserved=[tool_open]
    )
    assert run.finish.stop_type == "eos"
    head, sep, tail = text.partition("<tool_call>")
    assert sep and re.fullmatch(r"[0-9]{4}</tool_call>", tail), text


def test_lazy_pattern_trigger_starts_the_grammar_at_its_group(harness):
    # The first letter triggers; the grammar takes over from the capture group (that letter), so
    # the rest of the triggering token is already the grammar's.
    text, run = _trigger_run(harness, [GrammarTrigger(2, "([a-z])")], {}, 'root ::= [^0-9]{1,40} [0-9]{3} "."')
    assert run.finish.stop_type == "eos", text
    start = re.search(r"[a-z]", text).start()
    assert re.fullmatch(r"[^0-9]{1,40}[0-9]{3}\.", text[start:]), text


def test_lazy_grammar_never_triggered_is_free_text(harness):
    text, run = _trigger_run(harness, [GrammarTrigger(1, "zqxzqxzqx")], {}, 'root ::= "never"')
    assert run.finish.stop_type in ("limit", "eos")
    assert "never" not in text and len(run.tokens) > 0
