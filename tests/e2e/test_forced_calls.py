"""Forced tool calls in each family's own syntax, through the real server and real templates.

The factory's qwen3 model (random weights) serves llama.cpp's templates with
``--chat-template-file``. With ``tool_choice: "required"`` every seeded reply is one valid call,
written in the template's syntax (the reply parser reads it back in that syntax), and a call sent
back as history is reused from the prompt cache past its opening marker on the next turn: the
template re-renders the generated call to the tokens that were generated.

The templates are ones whose markers the factory's vocabulary can write as text: Qwen3-Coder's
XML (its ``<tool_call>`` is one token there), GLM 4.6's ``<arg_key>`` tags (after the empty
``<think></think>`` block its history turns show), Hermes JSON, Mistral's
``[TOOL_CALLS]NAME[ARGS]{...}`` and Kimi K2's section markers (spelled byte by byte: the factory's
tokenizer has no such tokens, so they are text to it, as they are to the grammar).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.chat.conftest import read_llama_cpp_templates
from tests.conftest import SLOW, ServerProcess

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

# template -> the opening marker of its calls (what the next turn must reuse past)
TEMPLATES = {
    "Qwen3-Coder": "<tool_call>",
    "GLM-4.6": "<tool_call>",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "<tool_call>",
    "unsloth-mistral-Devstral-Small-2507": "[TOOL_CALLS]",
    "moonshotai-Kimi-K2": "<|tool_calls_section_begin|>",
}
DEFAULT_RUN = {"Qwen3-Coder"}


@pytest.fixture(scope="module", params=[pytest.param(t, marks=() if t in DEFAULT_RUN else SLOW) for t in TEMPLATES])
def served(request, server_factory, qwen3_dir, tmp_path_factory) -> tuple[str, ServerProcess]:
    name = request.param
    path = tmp_path_factory.mktemp("templates") / f"{name}.jinja"
    path.write_text(read_llama_cpp_templates()[name], encoding="utf-8")
    server = server_factory(["-m", str(qwen3_dir), "-np", "1", "-c", "4096", "-b", "64", "--chat-template-file", str(path),
                             "--prompt-cache-min-prefix", "16"])
    return name, server


def forced(client: openai.OpenAI, seed: int, messages: list[dict[str, Any]] = QUESTION, **extra: Any) -> Any:
    return client.chat.completions.create(model="x", messages=messages, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=160, temperature=1.0, seed=seed,
                                          extra_body={"prompt_cache_key": f"forced-{seed}", **extra})


def test_required_always_yields_a_valid_call_that_the_next_turn_reuses(served) -> None:
    name, server = served
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    for seed in range(3):
        reply = forced(client, seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert not choice.message.content
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

        # The call goes back as history: the next prompt is reused past the call's opening marker
        # (its text was generated in the template's own syntax).
        assistant = {"role": "assistant", "content": "", "tool_calls": [call.model_dump(exclude_none=True)]}
        history = [*QUESTION, assistant, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
        marker_tokens = httpx.post(server.base_url + "/tokenize", json={"content": TEMPLATES[name]}, timeout=30).json()["tokens"]
        nxt = client.chat.completions.create(model="x", messages=history, tools=TOOLS, max_tokens=2, temperature=0,
                                             extra_body={"prompt_cache_key": f"forced-{seed}"})
        reused = nxt.usage.prompt_tokens_details.cached_tokens
        generated_from = reply.usage.prompt_tokens
        assert reused >= generated_from + len(marker_tokens), (name, seed, reused, generated_from, call)


def test_a_forced_call_cut_short_is_never_content(served) -> None:
    """``max_tokens`` cuts a forced call before its name is read: no call, and no fragment of
    one returned as content, whole or streamed (measured 12-06 before: the cut call's text came
    back as content)."""
    _, server = served
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    body = {"model": "x", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 3, "temperature": 0}
    whole = client.chat.completions.create(**body)
    assert whole.choices[0].finish_reason == "length"
    assert not whole.choices[0].message.content and not whole.choices[0].message.tool_calls
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**body, stream=True)
                       if chunk.choices)
    assert streamed == ""
