"""Embeddings through real servers: llama-server's routes, shapes and errors, the official openai
client (base64 included) and LangChain's ``OpenAIEmbeddings``.

The reference vectors come from Hugging Face transformers (PyTorch, CPU) on the same factory
weights; a GGUF is checked against its directory's weights.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ServerProcess, tiny_model

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a", "Rerankers sort what retrieval finds.",
         "Lighthouses guide ships along the rocky coast at night."]
NOT_ENABLED = "This server does not support embeddings. Start it with `--embeddings`"


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def hidden():
    """transformers' final hidden states of a factory model for a token list."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    models: dict[str, Any] = {}

    def run(family: str, tokens: list[int]) -> np.ndarray:
        if family not in models:
            models[family] = transformers.AutoModel.from_pretrained(str(tiny_model(family)), dtype=torch.float32).eval()
        with torch.no_grad():
            return models[family](input_ids=torch.tensor([tokens])).last_hidden_state[0].numpy()

    return run


@pytest.fixture(scope="module")
def last_server(server_factory) -> ServerProcess:
    return server_factory(["-m", str(tiny_model("qwen3")), "--embeddings", "--pooling", "last", "-np", "2", "-c", "1024",
                           "--alias", "tiny-embed"])


@pytest.fixture(scope="module")
def gguf_server(server_factory, tmp_path_factory) -> ServerProcess:
    """A GGUF whose metadata says pooling mean (no --pooling), with a 16-token physical batch."""
    from mlxcel_compat.testing.gguf_writer import write_gguf

    out = tmp_path_factory.mktemp("embed-gguf") / "qwen3-mean.gguf"
    write_gguf("qwen3", "tiny", out, "f32", model_dir=tiny_model("qwen3"), pooling="mean")
    return server_factory(["-m", str(out), "--embeddings", "-ub", "16", "-np", "1", "-c", "512", "--metrics"])


@pytest.fixture(scope="module")
def none_server(server_factory) -> ServerProcess:
    """The tiny llama declares no pooling: none, one vector per token."""
    return server_factory(["-m", str(tiny_model("llama")), "--embeddings", "-np", "1", "-c", "512", "-ub", "1024", "-b", "1024"])


def client_for(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


def tokens_of(c: httpx.Client, text: str) -> list[int]:
    r = c.post("/tokenize", json={"content": text, "add_special": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_without_the_flag_every_route_is_501(http) -> None:
    for path in ("/embedding", "/embeddings", "/v1/embeddings"):
        r = http.post(path, json={"input": "hello"})
        assert r.status_code == 501, (path, r.text)
        assert r.json() == {"error": {"code": 501, "message": NOT_ENABLED, "type": "not_supported_error"}}


def test_openai_client_embeddings_equal_the_reference(last_server, hidden) -> None:
    client = openai.OpenAI(base_url=last_server.base_url + "/v1", api_key="none")
    got = client.embeddings.create(model="anything", input=TEXTS)  # the client asks for base64 and decodes it
    as_float = client.embeddings.create(model="anything", input=TEXTS, encoding_format="float")
    with client_for(last_server) as c:
        tokens = [tokens_of(c, t) for t in TEXTS]
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    assert got.model == "anything" and got.object == "list"
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, tokens))
    for t, b64, flt in zip(tokens, got.data, as_float.data):
        want = hidden("qwen3", t)[-1]
        assert cosine(b64.embedding, want) > 1 - 1e-4
        assert abs(np.linalg.norm(flt.embedding) - 1.0) < 1e-5  # embd_normalize 2 by default
        np.testing.assert_allclose(np.asarray(b64.embedding, np.float32), np.asarray(flt.embedding, np.float32), rtol=1e-6, atol=1e-7)


def test_base64_is_little_endian_float32(last_server) -> None:
    with client_for(last_server) as c:
        b = c.post("/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"}).json()
        f = c.post("/v1/embeddings", json={"input": "hello world"}).json()
    item = b["data"][0]
    assert item["encoding_format"] == "base64" and item["object"] == "embedding" and item["index"] == 0
    assert "encoding_format" not in f["data"][0]
    decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(f["data"][0]["embedding"], np.float32))
    assert f["model"] == "tiny-embed"  # no model in the body: the server's name


def test_one_batched_request_equals_single_requests(last_server) -> None:
    with client_for(last_server) as c:
        batch = c.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
        for i, text in enumerate(TEXTS):
            alone = c.post("/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
            np.testing.assert_allclose(batch[i]["embedding"], alone, atol=1e-5)


@pytest.mark.parametrize("mode", [-1, 0, 1, 2, 3])
def test_embd_normalize_options(last_server, hidden, mode) -> None:
    with client_for(last_server) as c:
        r = c.post("/embedding", json={"content": TEXTS[1], "embd_normalize": mode})
        tokens = tokens_of(c, TEXTS[1])
    assert r.status_code == 200, r.text
    vec = np.asarray(r.json()[0]["embedding"][0], np.float64)
    raw = hidden("qwen3", tokens)[-1].astype(np.float64)
    total = {-1: 1.0, 0: np.abs(raw).max() / 32760.0, 2: np.linalg.norm(raw)}.get(mode)
    if total is None:
        total = (np.abs(raw) ** mode).sum() ** (1 / mode)
    np.testing.assert_allclose(vec, raw / total, rtol=2e-3, atol=1e-4 * np.abs(raw / total).max())


def test_content_text_parts_equal_the_same_string(last_server) -> None:
    """An OpenAI content array's text parts are joined into one input (llama-server's
    tokenize_oai_content_array), alone or among other inputs."""
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    with client_for(last_server) as c:
        r = c.post("/v1/embeddings", json={"input": ["hello world", parts, "a"]})
        single = c.post("/v1/embeddings", json={"input": parts})
    assert r.status_code == 200 and single.status_code == 200, (r.text, single.text)
    data = r.json()["data"]
    assert data[0]["embedding"] == data[1]["embedding"] != data[2]["embedding"]
    assert single.json()["data"][0]["embedding"] == data[0]["embedding"]


def test_native_shapes_and_content_forcing_them(last_server) -> None:
    with client_for(last_server) as c:
        native = c.post("/embeddings", json={"content": ["hello world", "a"]}).json()
        forced = c.post("/v1/embeddings", json={"content": "hello world"}).json()
        token_ids = c.post("/embedding", json={"input": tokens_of(c, "hello world")}).json()
    assert [e["index"] for e in native] == [0, 1]
    assert all(len(e["embedding"]) == 1 and len(e["embedding"][0]) == 64 for e in native)  # 2-D: one pooled row
    assert isinstance(forced, list) and forced[0]["embedding"] == native[0]["embedding"]
    np.testing.assert_allclose(token_ids[0]["embedding"], native[0]["embedding"], atol=1e-6)


@pytest.mark.parametrize(("body", "message"), [
    ({}, '"input" or "content" must be provided'),
    ({"input": "x", "encoding_format": "int8"}, "The format to return the embeddings in. Can be either float or base64"),
    ({"input": ""}, "Input content cannot be empty"),
    ({"input": ["a", ""]}, "Input content cannot be empty"),
    ({"input": []}, '"input" must not be empty'),
    ({"input": [10**9]}, "Prompt contains invalid tokens"),
    ({"input": "x", "embd_normalize": "2"}, "embd_normalize must be an integer"),
    ({"input": {"content": "string"}}, '"content" must be an array'),
    ({"input": {"content": [{"type": "unknown"}]}}, "unsupported content[].type"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}},
     "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"),
    ({"input": [{"prompt_string": "a <__media__>", "multimodal_data": ["AAAA"]}]},
     "Multimodal data provided, but model does not support multimodal requests."),
])
def test_bad_input_is_a_400(last_server, body, message) -> None:
    with client_for(last_server) as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"code": 400, "message": message, "type": "invalid_request_error"}


def test_completions_still_work_and_embeddings_stay_out_of_the_prompt_cache(last_server) -> None:
    with client_for(last_server) as c:
        c.post("/v1/cache/reset").raise_for_status()
        before = c.get("/v1/cache/stats").json()
        for _ in range(2):
            assert c.post("/v1/embeddings", json={"input": TEXTS}).status_code == 200
        after = c.get("/v1/cache/stats").json()
        r = c.post("/completion", json={"prompt": TEXTS[1], "n_predict": 4, "temperature": 0})
    assert (before["entries"], before["bytes"]) == (after["entries"], after["bytes"]) == (0, 0)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4


def test_gguf_pools_as_its_metadata_says(gguf_server, hidden) -> None:
    with client_for(gguf_server) as c:
        r = c.post("/v1/embeddings", json={"input": TEXTS[:2]})
        tokens = [tokens_of(c, t) for t in TEXTS[:2]]
    assert r.status_code == 200, r.text
    for t, item in zip(tokens, r.json()["data"]):
        assert cosine(item["embedding"], hidden("qwen3", t).mean(axis=0)) > 1 - 1e-4


def _llamacpp_counters(c: httpx.Client) -> dict[str, float]:
    lines = c.get("/metrics").text.splitlines()
    return {line.split()[0][len("llamacpp:"):]: float(line.split()[1]) for line in lines if line.startswith("llamacpp:")}


def test_embedding_prompts_are_counted_in_metrics(gguf_server) -> None:
    """An embedding job's prompt costs decode calls as a prefill does (llama-server runs it through
    its slots): its tokens count in prompt_tokens_total, in batches of the 16-token physical batch,
    and nothing is predicted."""
    with client_for(gguf_server) as c:
        before = _llamacpp_counters(c)
        r = c.post("/v1/embeddings", json={"input": ["hello world", "goodbye world, and the rest of it"]})
        after = _llamacpp_counters(c)
    n_tokens = r.json()["usage"]["prompt_tokens"]
    assert n_tokens > 16
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == n_tokens
    assert after["n_decode_total"] - before["n_decode_total"] == -(-n_tokens // 16)
    assert after["tokens_predicted_total"] == before["tokens_predicted_total"] == 0


def test_an_input_over_the_physical_batch_is_llama_servers_500(gguf_server) -> None:
    with client_for(gguf_server) as c:
        text = " ".join(TEXTS)
        n = len(tokens_of(c, text))
        r = c.post("/v1/embeddings", json={"input": text})
    assert n > 16 and r.status_code == 500
    assert r.json()["error"] == {
        "code": 500, "type": "server_error",
        "message": f"input ({n} tokens) is too large to process. increase the physical batch size (current batch size: 16)",
    }


def test_pooling_none_gives_token_vectors_and_no_openai_route(none_server, hidden) -> None:
    with client_for(none_server) as c:
        oai = c.post("/v1/embeddings", json={"input": "hello"})
        native = c.post("/embedding", json={"content": TEXTS[1], "embd_normalize": 2})
        tokens = tokens_of(c, TEXTS[1])
    assert oai.status_code == 400
    assert oai.json()["error"]["message"] == "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
    rows = np.asarray(native.json()[0]["embedding"])
    want = hidden("llama", tokens)
    assert rows.shape == want.shape == (len(tokens), 64)
    np.testing.assert_allclose(rows, want, atol=1e-3)  # unnormalised, whatever embd_normalize says


def test_langchain_openai_embeddings(last_server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: send the texts themselves (LangChain would otherwise
    # tokenize with tiktoken's OpenAI vocabulary, whose ids mean nothing to another model).
    emb = langchain_openai.OpenAIEmbeddings(model="tiny-embed", base_url=last_server.base_url + "/v1", api_key="none",
                                            check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS)
    query = emb.embed_query(TEXTS[3])
    assert len(docs) == len(TEXTS) and all(len(d) == 64 for d in docs)
    scores = [cosine(query, d) for d in docs]
    assert int(np.argmax(scores)) == 3 and scores[3] > 1 - 1e-5


# --------------------------------------------------------------------------- rerank

QUERY = "where is the cat"
DOCS = ["the cat sat on the mat", "stock markets fell sharply", "a kitten sleeping", "rain tomorrow", "cats and dogs"]
NOT_RERANKING = "This server does not support reranking. Start it with `--reranking`"
RERANK_PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


@pytest.fixture(scope="module")
def rerank_server(server_factory, tmp_path_factory) -> ServerProcess:
    """The factory's Qwen3-Reranker-style GGUF (cls.output rows, the rerank prompt), --rerank."""
    from mlxcel_compat.testing.gguf_writer import write_gguf

    out = tmp_path_factory.mktemp("rerank-gguf") / "qwen3-reranker.gguf"
    write_gguf("qwen3", "tiny", out, "f32", model_dir=tiny_model("qwen3"), reranker=True)
    return server_factory(["-m", str(out), "--rerank", "-np", "1", "-c", "1024", "--alias", "tiny-rerank"])


@pytest.fixture(scope="module")
def reference_scores():
    """transformers' causal LM on the same weights: softmax of the label tokens' logits at the
    last token of each pair's prompt (how Qwen3-Reranker is scored)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mlxcel_compat.encoders.rerank import QWEN3_RERANK_TEMPLATE
    from mlxcel_compat.testing.gguf_writer import rerank_label_ids

    directory = tiny_model("qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = list(rerank_label_ids(directory))

    def run(query: str, docs: list[str]) -> tuple[list[float], int]:
        scores, n_tokens = [], 0
        for doc in docs:
            text = QWEN3_RERANK_TEMPLATE.replace("{query}", query).replace("{document}", doc)
            tokens = tokenizer.encode(text, add_special_tokens=False)
            n_tokens += len(tokens)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens])).logits[0, -1, ids].double()
            scores.append(float(torch.softmax(logits, 0)[0]))
        return scores, n_tokens

    return run


def test_rerank_without_the_flag_is_501(http, last_server) -> None:
    with client_for(last_server) as c:  # embeddings with pooling last: still no reranking
        for path in RERANK_PATHS:
            for client in (http, c):
                r = client.post(path, json={"query": "q", "documents": ["d"]})
                assert r.status_code == 501, (path, r.text)
                assert r.json()["error"] == {"code": 501, "message": NOT_RERANKING, "type": "not_supported_error"}


def test_rerank_ordering_and_scores_equal_the_reference(rerank_server, reference_scores) -> None:
    want, n_tokens = reference_scores(QUERY, DOCS)
    with client_for(rerank_server) as c:
        r = c.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model"], body["object"]) == ("m", "list")
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in results:
        assert set(x) == {"index", "relevance_score"}
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4


def test_rerank_top_n_and_tei_shape(rerank_server, reference_scores) -> None:
    want, _ = reference_scores(QUERY, DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])
    with client_for(rerank_server) as c:
        jina = c.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
        tei = c.post("/reranking", json={"query": QUERY, "texts": DOCS, "return_text": True, "top_n": 3}).json()
        plain = c.post("/v1/reranking", json={"query": QUERY, "texts": DOCS}).json()
    assert [x["index"] for x in jina["results"]] == best[:2] and jina["model"] == "tiny-rerank"
    assert [x["index"] for x in tei] == best[:3]
    assert all(x["text"] == DOCS[x["index"]] and abs(x["score"] - want[x["index"]]) < 1e-4 for x in tei)
    assert isinstance(plain, list) and len(plain) == len(DOCS) and all(set(x) == {"index", "score"} for x in plain)


@pytest.mark.parametrize(("body", "message"), [
    ({"documents": ["d"]}, '"query" must be provided'),
    ({"query": 1, "documents": ["d"]}, '"query" must be a string'),
    ({"query": "q", "documents": []}, '"documents" must be a non-empty string array'),
    ({"query": "q"}, '"documents" must be a non-empty string array'),
    ({"query": "q", "documents": ["d", 3]}, '"documents" must be a non-empty string array'),
])
def test_bad_rerank_bodies_are_a_400(rerank_server, body, message) -> None:
    with client_for(rerank_server) as c:
        r = c.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"code": 400, "message": message, "type": "invalid_request_error"}


def test_an_input_over_the_context_is_llama_servers_400(none_server) -> None:
    """Text longer than the context but within --ubatch-size (token-id arrays, and text proven too
    long before tokenizing, get the server-wide "exceeds the available context size" 400)."""
    with client_for(none_server) as c:
        text = " ".join(TEXTS * 12)
        n = len(tokens_of(c, text))
        r = c.post("/embedding", json={"input": text})
    assert 512 < n <= 1024 and r.status_code == 400
    assert r.json()["error"] == {
        "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": n, "n_ctx": 512,
        "message": f"input ({n} tokens) is larger than the max context size (512 tokens). skipping",
    }


def test_rerank_on_a_plain_decoder_pools_as_llama_server(server_factory, hidden) -> None:
    """llama-server pools ``rank`` on any model: a decoder without a reranking head scores each
    pair (BOS, query, EOS, document, EOS, with the special tokens the vocabulary adds) by the
    first component of its last token's final hidden state. Checked against transformers."""
    server = server_factory(["-m", str(tiny_model("llama")), "--rerank", "-np", "1", "-c", "512"])
    docs = TEXTS[1:4]
    with client_for(server) as c:
        r = c.post("/v1/rerank", json={"query": TEXTS[0], "documents": docs})
        assert r.status_code == 200, r.text
        bare = c.post("/tokenize", json={"content": "a", "add_special": False}).json()["tokens"]
        full = c.post("/tokenize", json={"content": "a", "add_special": True}).json()["tokens"]
        start, end = full[: full.index(bare[0])], full[full.index(bare[-1]) + 1:]
        pairs = [start + tokens_of_plain(c, TEXTS[0]) + end + tokens_of_plain(c, d) + end for d in docs]
        assert c.post("/completion", json={"prompt": "hi", "n_predict": 2}).status_code == 200
    expected = [float(hidden("llama", tokens)[-1, 0]) for tokens in pairs]
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda i: -expected[i])
    assert r.json()["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-4)


def tokens_of_plain(c: httpx.Client, text: str) -> list[int]:
    return c.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"]


def test_an_embedding_request_wakes_a_sleeping_model(server_factory) -> None:
    import time

    server = server_factory(["-m", str(tiny_model("qwen3")), "--embeddings", "--pooling", "mean", "-np", "1", "-c", "512",
                             "--sleep-idle-seconds", "1"])
    with client_for(server) as c:
        before = c.post("/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]["embedding"]
        deadline = time.monotonic() + 30
        while not c.get("/props").json().get("is_sleeping") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get("/props").json()["is_sleeping"] is True
        r = c.post("/v1/embeddings", json={"input": TEXTS[1]})
        assert r.status_code == 200, r.text
        assert c.get("/props").json()["is_sleeping"] is False
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], before, atol=1e-6)
