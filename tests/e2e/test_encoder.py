"""BERT-family encoders served through real servers: embeddings (openai client, float and
base64), a cross-encoder on the rerank routes, a GGUF beside its directory, and what an encoder
refuses (generation, inputs longer than its position table) while staying healthy.

References: transformers (PyTorch, CPU) on the factory directories (``testing/encoders.py``).
"""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import LLAMA_SERVER, ServerProcess, start_llama_server, tiny_encoder
from tests.encoders.test_encoders import cosine

pytestmark = pytest.mark.e2e

TEXTS = ["hello world", "The quick storm moved windows of a little year.", "a",
         "Every public name very changes much member against no winter."]
QUERY = "what moved the quick storm"
DOCUMENTS = ["The quick storm moved the windows.", "A little year shows the job.", "storm storm storm",
             "Every public name very changes much member against no winter."]
NO_LOGITS = "the current context does not support logits computation. skipping"


@pytest.fixture(scope="module")
def torch_mod():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_server(server_factory) -> ServerProcess:
    return server_factory(["-m", str(tiny_encoder("bert")), "--embeddings", "-np", "2", "--alias", "tiny-bert"])


@pytest.fixture(scope="module")
def xlmr_gguf_server(server_factory) -> ServerProcess:
    return server_factory(["-m", str(tiny_encoder("xlm-roberta", gguf=True)), "--embeddings", "-np", "1"])


@pytest.fixture(scope="module")
def rerank_server(server_factory) -> ServerProcess:
    return server_factory(["-m", str(tiny_encoder("bert-reranker")), "--rerank", "-np", "1"])


def client_for(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


def reference_vectors(torch_mod, transformers_mod, kind: str, pooling: str) -> list[np.ndarray]:
    directory = str(tiny_encoder(kind))
    tokenizer = transformers_mod.AutoTokenizer.from_pretrained(directory)
    model = transformers_mod.AutoModel.from_pretrained(directory, dtype=torch_mod.float32).eval()
    out = []
    for text in TEXTS:
        with torch_mod.no_grad():
            hidden = model(input_ids=torch_mod.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0].numpy()
        vec = hidden.mean(axis=0) if pooling == "mean" else hidden[0]
        out.append(vec / np.linalg.norm(vec))
    return out


def test_openai_client_float_and_base64(bert_server, torch_mod, transformers_mod) -> None:
    client = openai.OpenAI(base_url=f"{bert_server.base_url}/v1", api_key="none")
    floats = client.embeddings.create(model="tiny-bert", input=TEXTS)
    encoded = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="base64")
    expected = reference_vectors(torch_mod, transformers_mod, "bert", "mean")  # the directory says mean
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.usage.prompt_tokens > 2 * len(TEXTS)  # [CLS] and [SEP] count too
    for item, want in zip(floats.data, expected):
        assert len(item.embedding) == 32
        assert cosine(item.embedding, want) > 1 - 1e-4
        assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-4  # embd_normalize 2 by default
    raw = httpx.post(f"{bert_server.base_url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}, timeout=60).json()
    for item, plain in zip(raw["data"], floats.data):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, plain.embedding, rtol=1e-6, atol=1e-7)
    assert len(encoded.data) == len(TEXTS)


def test_langchain_openai_embeddings(bert_server, torch_mod, transformers_mod) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    emb = langchain_openai.OpenAIEmbeddings(model="tiny-bert", base_url=bert_server.base_url + "/v1", api_key="none",
                                            check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS)
    expected = reference_vectors(torch_mod, transformers_mod, "bert", "mean")
    assert len(docs) == len(TEXTS)
    for got, want in zip(docs, expected):
        assert cosine(got, want) > 1 - 1e-4
    assert cosine(emb.embed_query(TEXTS[1]), expected[1]) > 1 - 1e-4


def test_native_shape_and_normalisation(bert_server) -> None:
    with client_for(bert_server) as c:
        r = c.post("/embedding", json={"content": TEXTS[1], "embd_normalize": -1})
        assert r.status_code == 200, r.text
        raw = np.array(r.json()[0]["embedding"])
        assert raw.shape == (1, 32)
        r = c.post("/embeddings", json={"input": TEXTS[1], "embd_normalize": 0})
        scaled = np.array(r.json()[0]["embedding"])
        assert abs(np.abs(scaled).max() - 32760.0) < 0.1
        assert cosine(raw, scaled) > 1 - 1e-6


def test_generation_is_refused_and_the_server_stays_up(bert_server) -> None:
    with client_for(bert_server) as c:
        for path, body in (
            ("/completion", {"prompt": "hello", "n_predict": 4}),
            ("/completion", {"prompt": "hello", "stream": True}),
            ("/v1/completions", {"prompt": "hello", "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 500, (path, r.text)
            assert r.headers["content-type"].startswith("application/json"), path
            assert r.json()["error"] == {"code": 500, "message": NO_LOGITS, "type": "server_error"}, path
        assert c.get("/health").json() == {"status": "ok"}
        props = c.get("/props")
        assert props.status_code == 200
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-bert"


def test_too_long_for_the_position_table(bert_server) -> None:
    """64 positions: a longer input gets llama-server's 400 and the next request is served."""
    long_text = " ".join(["storm"] * 100)
    with client_for(bert_server) as c:
        r = c.post("/v1/embeddings", json={"input": ["hello", long_text]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "exceed_context_size_error"
        assert error["message"] == "input (102 tokens) is larger than the max context size (64 tokens). skipping"
        assert c.get("/health").json() == {"status": "ok"}
        r = c.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 32


def test_gguf_encoder_matches_its_directory(xlmr_gguf_server, torch_mod, transformers_mod) -> None:
    """An XLM-R GGUF (UGM vocabulary, position table cut at pad_token_id + 1) against
    transformers on its directory: CLS pooling, from the file's pooling_type."""
    expected = reference_vectors(torch_mod, transformers_mod, "xlm-roberta", "cls")
    with client_for(xlmr_gguf_server) as c:
        r = c.post("/v1/embeddings", json={"input": TEXTS})
        assert r.status_code == 200, r.text
        for item, want in zip(r.json()["data"], expected):
            assert cosine(item["embedding"], want) > 1 - 1e-4
        assert c.post("/v1/rerank", json={"query": "a", "documents": ["b"]}).status_code == 501


def test_cross_encoder_rerank(rerank_server, torch_mod, transformers_mod) -> None:
    directory = str(tiny_encoder("bert-reranker"))
    tokenizer = transformers_mod.AutoTokenizer.from_pretrained(directory)
    model = transformers_mod.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch_mod.float32).eval()
    with torch_mod.no_grad():
        logits = model(**tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")).logits[:, 0].numpy()
    order = [int(i) for i in np.argsort(-logits)]
    with client_for(rerank_server) as c:
        r = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        for x in results:
            assert abs(x["relevance_score"] - float(logits[x["index"]])) < 1e-4
        top = c.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()["results"]
        assert [x["index"] for x in top] == order[:2]
        tei = c.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True}).json()
        assert [x["index"] for x in tei] == order and tei[0]["text"] == DOCUMENTS[order[0]]
        long_doc = " ".join(["storm"] * 80)
        r = c.post("/v1/rerank", json={"query": QUERY, "documents": [long_doc]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text
        assert c.get("/health").json() == {"status": "ok"}



@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="the llama-server binary (b11312) is not built on this machine")
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic-bert"])
def test_embeddings_equal_the_real_llama_server(server_factory, kind: str) -> None:
    """The same GGUF in llama-server: the same tokens, vectors (its GELU and float paths differ
    from ours by ~1e-4 a value), generation error and too-long error."""
    gguf = tiny_encoder(kind, gguf=True)
    ours = server_factory(["-m", str(gguf), "--embeddings", "-np", "1"])
    proc, theirs = start_llama_server(["-m", str(gguf), "--embeddings", "-np", "1", "-t", "1"])
    texts = [*TEXTS, "Ünïcode   spaces\tand CAPS", "  two  blanks "]
    try:
        with httpx.Client(timeout=60) as c:
            for text in texts:
                a, b = (c.post(u + "/tokenize", json={"content": text, "add_special": True}).json() for u in (ours.base_url, theirs))
                assert a == b, text
            a, b = (c.post(u + "/v1/embeddings", json={"input": texts}).json() for u in (ours.base_url, theirs))
            assert a["usage"] == b["usage"]
            for x, y in zip(a["data"], b["data"]):
                assert cosine(x["embedding"], y["embedding"]) > 1 - 1e-4
            for path, body in (("/completion", {"prompt": "hi"}), ("/completion", {"prompt": "hi", "stream": True}),
                               ("/v1/embeddings", {"input": " ".join(["storm"] * 100)})):
                a, b = (c.post(u + path, json=body) for u in (ours.base_url, theirs))
                assert (a.status_code, a.json()) == (b.status_code, b.json()), path
    finally:
        proc.terminate()
        proc.wait(10)


def test_without_the_flag(server_factory) -> None:
    """An encoder served without --embeddings: embeddings answer llama-server's 501, generation
    its 500, and the server is up (a NomicBERT directory)."""
    server = server_factory(["-m", str(tiny_encoder("nomic-bert")), "-np", "1"])
    with client_for(server) as c:
        r = c.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 501
        assert r.json()["error"]["message"] == "This server does not support embeddings. Start it with `--embeddings`"
        r = c.post("/completion", json={"prompt": "hello"})
        assert (r.status_code, r.json()["error"]["message"]) == (500, NO_LOGITS)
        assert c.get("/health").json() == {"status": "ok"}
