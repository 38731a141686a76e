"""End to end: media sent to this text-only server gets llama-server's message and status on
every route (llama-server without ``--mmproj``; issue 29.3).

llama-server converts every API's media into OpenAI chat ``image_url`` / ``input_audio`` /
``input_video`` parts, and its chat parser throws a ``std::runtime_error`` for each one the model
cannot take: ``ex_wrapper`` answers 500 ``server_error`` with "image input is not supported -
hint: if this is unexpected, you may need to provide the mmproj" (``server-common.cpp``). So an
Anthropic image block or a ``tool_result`` holding one, and a Responses ``input_image`` (also in a
``function_call_output``) are 500s too. Raw prompts with ``multimodal_data`` are tokenized inside
the completion handler, whose errors are all 400s: "Multimodal data provided, but model does
not support multimodal requests." The requests below are the shapes the official clients send.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

HINT = "hint: if this is unexpected, you may need to provide the mmproj"
IMAGE_ERROR = f"image input is not supported - {HINT}"
PNG = "iVBORw0KGgo="
DATA_URL = f"data:image/png;base64,{PNG}"


@pytest.fixture()
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def assert_llama_500(response: httpx.Response, message: str = IMAGE_ERROR) -> None:
    assert response.status_code == 500, response.text
    assert response.json() == {"error": {"code": 500, "message": message, "type": "server_error"}}


# ---------------------------------------------------------------------- OpenAI chat


@pytest.mark.parametrize(
    "part, kind",
    [
        ({"type": "image_url", "image_url": {"url": DATA_URL}}, "image"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
        ({"type": "input_video", "input_video": {"url": "data:video/mp4;base64,AAAA"}}, "video"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video"),
    ],
)
def test_openai_chat_media_is_llama_servers_500(oai: openai.OpenAI, part: dict[str, Any], kind: str) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}])
    assert info.value.status_code == 500
    assert info.value.body == {"code": 500, "message": f"{kind} input is not supported - {HINT}", "type": "server_error"}


def test_openai_tool_message_with_an_image_is_a_500(http: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "snap", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]},
    ]
    for path in ("/v1/chat/completions", "/apply-template", "/v1/chat/completions/input_tokens"):
        assert_llama_500(http.post(path, json={"messages": messages, "max_tokens": 2}))


# ---------------------------------------------------------------------- Anthropic Messages


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}


def test_anthropic_image_block_is_a_500(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.InternalServerError) as info:
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [IMAGE_BLOCK, {"type": "text", "text": "what is this?"}]}])
    assert info.value.status_code == 500
    assert info.value.body == {"type": "error", "error": {"type": "api_error", "message": IMAGE_ERROR}}


def test_anthropic_tool_result_holding_an_image_is_a_500(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    """Claude Code sends screenshots back this way; llama-server keeps the image as a part of the
    tool message, which its parser then refuses (500, not 400)."""
    messages = [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "here"}, IMAGE_BLOCK]}]},
    ]
    tools = [{"name": "screenshot", "description": "take one", "input_schema": {"type": "object", "properties": {}}}]
    with pytest.raises(anthropic.InternalServerError) as info:
        claude.messages.create(model="tiny", max_tokens=2, tools=tools, messages=messages)
    assert info.value.body["error"]["message"] == IMAGE_ERROR
    counted = http.post("/v1/messages/count_tokens", json={"model": "tiny", "tools": tools, "messages": messages})
    assert counted.status_code == 500 and counted.json()["error"]["message"] == IMAGE_ERROR
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    messages[-1]["content"][0]["content"] = [url_image]
    with pytest.raises(anthropic.InternalServerError, match="image input is not supported"):
        claude.messages.create(model="tiny", max_tokens=2, tools=tools, messages=messages)


# ---------------------------------------------------------------------- OpenAI Responses


def test_responses_input_image_is_a_500(oai: openai.OpenAI, http: httpx.Client) -> None:
    content = [{"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": DATA_URL}]
    with pytest.raises(openai.InternalServerError) as info:
        oai.responses.create(model="tiny", max_output_tokens=2, input=[{"role": "user", "content": content}])
    assert info.value.body == {"code": 500, "message": IMAGE_ERROR, "type": "server_error"}
    assert_llama_500(http.post("/v1/responses/input_tokens", json={"input": [{"role": "user", "content": content}]}))
    output = [{"type": "input_image", "image_url": DATA_URL}]
    items = [
        {"role": "user", "content": "take a screenshot"},
        {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]
    assert_llama_500(http.post("/v1/responses", json={"input": items, "max_output_tokens": 2}))


def test_responses_input_file_and_missing_image_url_are_llama_servers_400s(http: httpx.Client) -> None:
    def ask(part: dict[str, Any]) -> httpx.Response:
        return http.post("/v1/responses", json={"input": [{"role": "user", "content": [part]}], "max_output_tokens": 2})

    response = ask({"type": "input_file", "file_id": "file_1"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "'input_file' is not supported by llamacpp at this moment"
    response = ask({"type": "input_image", "detail": "auto"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "'image_url' is required"


# ---------------------------------------------------------------------- raw prompts


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_multimodal_data_prompt_is_llama_servers_400(http: httpx.Client, path: str) -> None:
    prompt = {"prompt_string": "describe <__media__>", "multimodal_data": [PNG]}
    response = http.post(path, json={"prompt": prompt, "n_predict": 2, "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "Multimodal data provided, but model does not support multimodal requests."
    assert error["type"] == "invalid_request_error"
