"""End to end: llama-server command lines that name a GGUF start unchanged.

``-m FILE.gguf``; ``LLAMA_ARG_MODEL`` alone; ``-hf user/repo:quant --offline`` with
``LLAMA_CACHE``. The servers answer /completion and chat with the GGUF's own chat template,
report the file in /props and /v1/models, and the prompt cache hits as it does for HF models.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE
from tests.model.test_hub import populate_cache

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def llama_gguf() -> Path:
    return ensure_gguf("llama", "tiny", "f32", cache_dir=MODEL_CACHE)


@pytest.fixture(scope="module")
def gguf_server(server_factory, llama_gguf: Path):
    return server_factory(["-m", str(llama_gguf), "-np", "2", "-c", "1024", "-b", "32", "--props"])


def _complete(client: httpx.Client, prompt: str, n: int = 12) -> dict:
    response = client.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0,
                                                "cache_prompt": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_gguf_server_completes_like_the_hf_directory(gguf_server, server) -> None:
    with httpx.Client(base_url=gguf_server.base_url, timeout=60) as g, httpx.Client(base_url=server.base_url, timeout=60) as h:
        ours, theirs = _complete(g, PROMPT), _complete(h, PROMPT)
        assert ours["content"] == theirs["content"] and ours["tokens_predicted"] == 12
        assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]
        assert g.post("/tokenize", json={"content": PROMPT}).json() == h.post("/tokenize", json={"content": PROMPT}).json()


def test_prompt_cache_hits_on_a_gguf_model(gguf_server) -> None:
    with httpx.Client(base_url=gguf_server.base_url, timeout=60) as client:
        cold = _complete(client, PROMPT + "Once more:")
        warm = _complete(client, PROMPT + "Once more:")
        assert warm["tokens_cached"] > 0 and warm["timings"]["cache_n"] > 0
        assert warm["timings"]["prompt_n"] < cold["timings"]["prompt_n"]
        assert warm["content"] == cold["content"]


def test_props_and_models_describe_the_file(gguf_server, llama_gguf: Path) -> None:
    file = open_gguf(llama_gguf)
    with httpx.Client(base_url=gguf_server.base_url, timeout=60) as client:
        props = client.get("/props").json()
        assert props["model_path"] == str(llama_gguf)
        assert props["model_ftype"] == "all F32"
        assert props["chat_template"] == file.metadata["tokenizer.chat_template"]
        assert props["bos_token"] == "<|begin_of_text|>"
        models = client.get("/v1/models").json()
        entry = models["data"][0]
        assert entry["id"] == llama_gguf.name
        meta = entry["meta"]
        assert meta["n_params"] == file.n_params and meta["size"] == file.size_bytes
        assert meta["n_ctx_train"] == file.metadata["llama.context_length"]
        assert meta["n_vocab"] == len(file.metadata["tokenizer.ggml.tokens"])
        assert meta["n_embd"] == file.metadata["llama.embedding_length"]
        assert models["models"][0]["details"]["format"] == "gguf"
    log = gguf_server.log()
    assert f"loaded GGUF {llama_gguf}" in log and "arch llama, file type all F32" in log
    assert "- type   f32:   21 tensors" in log and "loading " in log and "100%" in log


def test_llama_arg_model_alone_serves_chat_with_the_gguf_template(server_factory) -> None:
    path = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    server = server_factory([], env={"LLAMA_ARG_MODEL": str(path)})
    client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    chat = client.chat.completions.create(model="x", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens <= 6
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        rendered = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
        assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
        thinking_off = rendered + "<think>\n\n</think>\n\n"  # what enable_thinking=false appends
        assert chat.usage.prompt_tokens == len(http.post("/tokenize", json={"content": thinking_off}).json()["tokens"])
        props = http.get("/props").json()
        assert props["model_ftype"] == "Q8_0" and props["model_path"] == str(path)
        assert "<think>" in props["chat_template"]


def test_hf_repo_offline_from_llama_cache(server_factory, tmp_path: Path) -> None:
    cache = tmp_path / "llama-cache"
    q8 = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    snapshot = populate_cache(cache, "acme/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-Q2_K.gguf": q8})
    server = server_factory(["-hf", "acme/tiny-GGUF:Q8_0", "--offline"], env={"LLAMA_CACHE": str(cache)})
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        props = http.get("/props").json()
        assert props["model_path"] == str(snapshot / "tiny-Q8_0.gguf")
        assert http.get("/v1/models").json()["data"][0]["id"] == "acme/tiny-GGUF:Q8_0"
        assert _complete(http, "Hello", 3)["tokens_predicted"] == 3


def test_hf_repo_offline_without_cache_fails_at_start(server_factory, tmp_path: Path) -> None:
    server = server_factory(["-hf", "acme/missing-GGUF:Q4_K_M", "--offline"],
                            env={"LLAMA_CACHE": str(tmp_path / "empty")}, wait=False)
    assert server.proc.wait(60) == 1
    log = server.log()
    assert "error: model 'acme/missing-GGUF:Q4_K_M': 'acme/missing-GGUF' is not in the local Hugging Face cache" in log


def test_named_templates_tool_use_for_requests_with_tools(server_factory, tmp_path: Path) -> None:
    """``tokenizer.chat_template.tool_use`` as llama-server uses it: ``/props`` reports it and a
    request with tools renders with it; other requests use the default template."""
    from tests.gguf.test_tokenizer import TOOL_USE, TOOLS, named_template_model

    _, path = named_template_model(tmp_path)
    server = server_factory(["-m", str(path)])
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        props = http.get("/props").json()
        assert props["chat_template_tool_use"] == TOOL_USE
        assert props["chat_template"] == open_gguf(path).metadata["tokenizer.chat_template"] != TOOL_USE
        plain = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
        tools = http.post("/apply-template", json={"messages": messages, "tools": TOOLS}).json()["prompt"]
        assert "get_weather" not in plain and plain.endswith("<|im_start|>assistant\n")
        assert tools.startswith("<|im_start|>tools\nget_weather\n<|im_end|>\n")
        n_tools_prompt = len(http.post("/tokenize", json={"content": tools, "add_special": True}).json()["tokens"])
    client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == n_tools_prompt
