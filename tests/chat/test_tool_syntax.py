"""Every family's tool-call and reasoning syntax, learned from llama.cpp's real templates.

The round trip (``tests/chat/tool_round_trip.py``) renders calls through each of llama.cpp
b11312's 70 templates and parses the model's part back, whole and streamed; docs/tool-calls.md's
table is generated from the same rows (``scripts/tool_calls_table.py``) and checked here.
"""

from __future__ import annotations

import pytest

from mlxcel_compat.chat.syntax import CallIndex, JsonCall, KeySuffix, Lit, Name, TaggedArgs
from mlxcel_compat.chat.template import ChatTemplate
from tests.chat.conftest import read_llama_cpp_templates
from mlxcel_compat.chat.tool_calls import ReplyOptions
from tests.chat.tool_round_trip import RoundTrip, damaged_replies, parses_alike, round_trip, table
from tests.conftest import REPO_ROOT

TOOL_CALLS_MD = REPO_ROOT / "docs" / "tool-calls.md"
TABLE_START, TABLE_END = "<!-- round-trip table: start -->\n", "<!-- round-trip table: end -->\n"

# Templates that cannot carry tool calls, and why (any other template must round-trip).
WITHOUT_CALLS = {
    "HuggingFaceTB-SmolLM3-3B", "LFM2-8B-A1B", "LFM2.5-Instruct", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "google-gemma-2-2b-it", "ibm-granite-granite-3.3-2B-Instruct", "llama-cpp-rwkv-world",
    "microsoft-Phi-3.5-mini-instruct",
}

_ROWS: dict[str, RoundTrip] = {}


def _row(stem: str, templates: dict[str, str]) -> RoundTrip:
    if stem not in _ROWS:
        _ROWS[stem] = round_trip(stem, templates[stem])
    return _ROWS[stem]


@pytest.mark.parametrize("stem", sorted(read_llama_cpp_templates()))
def test_calls_round_trip_whole_and_streamed(stem: str, llama_cpp_templates: dict[str, str]) -> None:
    row = _row(stem, llama_cpp_templates)
    assert not row.problems, "\n".join(row.problems)
    assert bool(row.without_calls) == (stem in WITHOUT_CALLS), row.without_calls or "the template renders calls"


@pytest.mark.parametrize("stem", sorted(set(read_llama_cpp_templates()) - WITHOUT_CALLS))
def test_damaged_replies_parse_the_same_whole_and_streamed(stem: str, llama_cpp_templates: dict[str, str]) -> None:
    """A call broken anywhere (markers, JSON and text spliced into it) gives the same content,
    reasoning and calls whole and streamed: what streaming has announced, a whole parse announces
    too, and the rest is content."""
    template = ChatTemplate(llama_cpp_templates[stem])
    syntax = template.syntax()
    problems = []
    for i, text in enumerate(damaged_replies(template, syntax, seed=sum(map(ord, stem)))):
        problems += parses_alike(syntax, text, ReplyOptions(tools=True, in_reasoning=bool(i % 2)))
    assert not problems, "\n".join(problems[:3])


def test_the_docs_table_is_the_round_trip(llama_cpp_templates: dict[str, str]) -> None:
    rows = [_row(stem, llama_cpp_templates) for stem in sorted(llama_cpp_templates)]
    text = TOOL_CALLS_MD.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text
    current = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert current == table(rows), "run python scripts/tool_calls_table.py"


def _syntax(stem: str, templates: dict[str, str]):
    return ChatTemplate(templates[stem]).syntax()


def test_learned_syntaxes_read_as_each_family_writes(llama_cpp_templates: dict[str, str]) -> None:
    """A few families' learned syntax, spelled out: what the analysis must read from them."""
    qwen_coder = _syntax("Qwen3-Coder", llama_cpp_templates).tools[0]
    assert qwen_coder.call[:2] == (Lit("<tool_call>\n<function="), Name())
    tagged = next(p for p in qwen_coder.call if isinstance(p, TaggedArgs))
    assert tagged.key_prefix.strip() == "<parameter=" and tagged.value_suffix.strip() == "</parameter>"
    dsml = next(p for p in _syntax("deepseek-ai-DeepSeek-V3.2", llama_cpp_templates).tools[0].call if isinstance(p, TaggedArgs))
    assert set(dsml.key_suffixes) == {KeySuffix('" string="true">', "string"), KeySuffix('" string="false">', "json")}
    kimi = _syntax("moonshotai-Kimi-K2", llama_cpp_templates).tools[0]
    assert kimi.section_start == "<|tool_calls_section_begin|>"
    assert CallIndex("functions.{name}:{index}") in kimi.call
    nemo = _syntax("mistralai-Mistral-Nemo-Instruct-2407", llama_cpp_templates).tools[0]
    assert nemo.section_start == "[TOOL_CALLS][" and nemo.id_style == "alnum9"
    assert nemo.call == (JsonCall(("name",), ("arguments",), ("id",), id_after_args=True),)
    llama = _syntax("meta-llama-Llama-3.1-8B-Instruct", llama_cpp_templates)
    assert [t.call[0] for t in llama.tools] == [JsonCall(("name",), ("parameters",)), Lit("<|python_tag|>")]
    apriel = _syntax("Apriel-1.6-15b-Thinker-fixed", llama_cpp_templates).reasoning
    assert (apriel.start, apriel.end, apriel.opener) == ("", "[BEGIN FINAL RESPONSE]", "Here are my reasoning steps:")
    assert _syntax("openai-gpt-oss-120b", llama_cpp_templates).dialect == "harmony"
    assert _syntax("meetkai-functionary-medium-v3.2", llama_cpp_templates).dialect == "functionary_v3_2"


def test_table_rows_name_every_template(llama_cpp_templates: dict[str, str]) -> None:
    text = TOOL_CALLS_MD.read_text(encoding="utf-8")
    for stem in llama_cpp_templates:
        assert f"| {stem} |" in text

