"""Rendering pinned to llama-server's, without llama-server.

``scripts/check_apply_template.py`` compares ``/apply-template`` of llama-server b11312 and of this
server for all 70 of llama.cpp's templates (docs/chat-templates.md). This test keeps what it
established: ``apply_template_pins.json`` holds llama-server's prompts for a handful of templates
and cases (``apply_template_bodies.PINNED``: the tool histories of Llama 3.1, Mistral Nemo, Qwen3,
DeepSeek V3.1, gpt-oss and GLM 4.6, and a case for each change llama-server makes to the messages
or the variables), written by the script's ``--pin``; each is rendered here the way the server
renders it (``parse_chat_request``, then ``render_chat`` through the template as the server loads
it) and must come out byte for byte the same, today's date filled in where llama-server's had it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from mlxcel_compat.chat.render import render_chat
from mlxcel_compat.chat.request import parse_chat_request
from mlxcel_compat.chat.template import ChatTemplate
from tests.chat.apply_template_bodies import PINNED, case_body

PINS = json.loads((Path(__file__).parent / "apply_template_pins.json").read_text(encoding="utf-8"))
CASES = [(name, case) for name, cases in PINNED.items() for case in cases]


def test_every_pinned_case_has_llama_servers_prompt() -> None:
    assert {(name, case) for name, cases in PINS["prompts"].items() for case in cases} == set(CASES)


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_render_equals_llama_servers(llama_cpp_templates: dict[str, str], name: str, case: str) -> None:
    template = ChatTemplate(llama_cpp_templates[name], bos_token=PINS["bos_token"], eos_token=PINS["eos_token"],
                            add_bos=PINS["add_bos"])
    expected = PINS["prompts"][name][case]
    today = datetime.now()
    for fmt in ("%d %b %Y", "%b %d %Y", "%Y-%m-%d"):
        expected = expected.replace(f"<<date:{fmt}>>", today.strftime(fmt))
    assert render_chat(template, parse_chat_request(case_body(case))) == expected
