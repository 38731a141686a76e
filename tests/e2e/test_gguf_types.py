"""End to end on MXFP4 and i-quant GGUFs (tests/gguf/test_types.py's files: the tiny llama with
an FFN of 256): a server started on each says what keeps and computes its weights, /props names
the file type as llama-server does, and completions run, a prompt-cache hit giving the cold
run's output exactly."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.gguf.test_types import FILE_TYPE_NAMES, ensure_type_gguf

pytestmark = pytest.mark.e2e

# gpt-oss's experts' type (every matrix MXFP4, repacked by ggml), and an i-quant of 256-value
# blocks (ffn_down; the other matrices in its fallback, IQ4_NL)
KERNELS = {"mxfp4": ("blocks mxfp4", "computed by ggml mxfp4 x q8_0"),
           "iq2_xxs": ("blocks iq2_xxs", "computed by ggml iq2_xxs x q8_K")}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 5


@pytest.fixture(scope="module", params=list(KERNELS))
def typed_server(request: pytest.FixtureRequest, server_factory) -> tuple[str, ServerProcess]:
    path = ensure_type_gguf(request.param)
    return request.param, server_factory(["-m", str(path), "-np", "2", "-c", "1024", "-b", "32", "--props"])


def _complete(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0, "ignore_eos": True,
                                         **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_server_reports_the_type_and_completes(typed_server: tuple[str, ServerProcess]) -> None:
    gguf_type, server = typed_server
    log = server.log()
    label, kernel = KERNELS[gguf_type]
    assert f"- type {gguf_type:>5s}:" in log and label in log and kernel in log
    assert "expanded to float32" not in log and "decode step: CPU decode runtime" in log
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        assert client.get("/props").json()["model_ftype"] == FILE_TYPE_NAMES[gguf_type]
        cold = _complete(client, cache_prompt=False)
        first = _complete(client)
        warm = _complete(client)
    assert cold["tokens_predicted"] == 10 and cold["content"]
    assert warm["timings"]["cache_n"] > 0 and warm["timings"]["prompt_n"] < first["timings"]["prompt_n"]
    assert first["content"] == cold["content"] and warm["content"] == cold["content"]
