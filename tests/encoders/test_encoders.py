"""BERT-family encoders (``encoders/bert.py``: BERT, XLM-R, NomicBERT) on the engine side: loading a directory and a GGUF,
embeddings for every pooling and normalisation, and cross-encoder scores.

The reference is Hugging Face transformers (PyTorch, CPU) on the same factory directories
(``testing/encoders.py``): ``AutoModel``'s ``last_hidden_state`` pooled as sentence-transformers
pools it, and ``AutoModelForSequenceClassification``'s logits on the tokenizer's pair encoding.
Each reference input runs alone (no padding), while ours run batched: a mask that let padding
leak into the real tokens would show.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlxcel_compat.engine.embedding import EmbeddingJob, embed
from mlxcel_compat.encoders.pooling import model_pooling
from mlxcel_compat.encoders.rerank import CROSS_ENCODER, rank_head
from mlxcel_compat.server.api_embeddings import normalize
from tests.conftest import tiny_encoder

pytestmark = pytest.mark.engine

TEXTS = ["hello world", "The quick storm moved windows of a little year.", "a",
         "Every public name very changes much member against no winter, and its word produces its quick storm."]
QUERY = "what moved the quick storm"
DOCUMENTS = ["The quick storm moved the windows.", "A little year shows the job.", "storm storm storm",
             "Every public name very changes much member against no winter."]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def torch_mod():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def loaded():
    from mlxcel_compat.model.loader import load_model

    cache: dict[tuple[str, bool], Any] = {}

    def get(kind: str, gguf: bool = False) -> Any:
        if (kind, gguf) not in cache:
            cache[kind, gguf] = load_model(str(tiny_encoder(kind, gguf)), [])
        return cache[kind, gguf]

    return get


@pytest.fixture(scope="module")
def reference(torch_mod):
    """transformers' last hidden states of one text (alone, unpadded) and its token ids."""
    transformers = pytest.importorskip("transformers")
    models: dict[str, Any] = {}

    def run(kind: str, text: str) -> tuple[list[int], np.ndarray]:
        if kind not in models:
            directory = str(tiny_encoder(kind))
            models[kind] = (transformers.AutoTokenizer.from_pretrained(directory),
                            transformers.AutoModel.from_pretrained(directory, dtype=torch_mod.float32).eval())
        tokenizer, model = models[kind]
        ids = tokenizer(text)["input_ids"]
        with torch_mod.no_grad():
            return ids, model(input_ids=torch_mod.tensor([ids])).last_hidden_state[0].numpy()

    return run


def _pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "none":
        return hidden
    return (hidden.mean(axis=0) if pooling == "mean" else hidden[0])[None, :]


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic-bert"])
def test_loaded_as_an_encoder(loaded, kind: str) -> None:
    m = loaded(kind)
    assert m.kind == "encoder" and m.decoder is None
    assert getattr(m.model, "is_encoder", False)
    assert m.config["max_position_embeddings"] == 64
    if kind == "nomic-bert":  # rotary positions, SwiGLU, no biases
        layer = m.model.layers[0]
        assert "positions" not in m.model.embed and "gate" in layer and "bias" not in layer.q
    else:  # XLM-R's table has pad_token_id + 1 more rows than it has positions; they are dropped.
        assert m.model.embed.positions.weight.shape[0] == 64


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic-bert"])
@pytest.mark.parametrize("pooling", ["none", "mean", "cls"])
def test_embeddings_equal_transformers(loaded, reference, kind: str, pooling: str) -> None:
    m = loaded(kind)
    refs = [reference(kind, text) for text in TEXTS]
    prompts = [list(m.tokenizer.encode(text, add_special_tokens=True)) for text in TEXTS]
    assert prompts == [ids for ids, _ in refs], "the served tokenizer must match the checkpoint's"
    vectors = embed(m.model, EmbeddingJob(prompts=prompts, pooling=pooling, max_batch_tokens=512))
    for (ids, hidden), ours in zip(refs, vectors):
        expected = _pool(hidden, pooling)
        assert ours.shape == expected.shape
        for row_ours, row_ref in zip(ours, expected):
            assert cosine(row_ours, row_ref) > 1 - 1e-4
        for mode in (-1, 0, 2):
            got = np.stack([normalize(v, mode) for v in ours])
            want = np.stack([normalize(v.astype(np.float32), mode) for v in expected])
            scale = np.abs(want).max()
            assert np.abs(got - want).max() <= 1e-4 * scale, (mode, np.abs(got - want).max(), scale)
        if pooling != "none":
            assert abs(np.linalg.norm(normalize(ours[0], 2)) - 1.0) < 1e-5
            assert abs(np.abs(normalize(ours[0], 0)).max() - 32760.0) < 1e-2


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic-bert"])
def test_small_passes_equal_one_pass(loaded, kind: str) -> None:
    """Grouped in several passes (a 24-token batch) or all in one: the same vectors."""
    m = loaded(kind)
    prompts = [list(m.tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS]
    one = embed(m.model, EmbeddingJob(prompts=prompts, pooling="mean", max_batch_tokens=512))
    many = embed(m.model, EmbeddingJob(prompts=prompts, pooling="mean", max_batch_tokens=24))
    for a, b in zip(one, many):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "bert-reranker", "xlm-roberta-reranker", "nomic-bert"])
def test_gguf_is_the_directory(loaded, kind: str) -> None:
    """The GGUF (llama.cpp's names, vocabulary and position table) tokenizes and embeds as the directory."""
    d, g = loaded(kind), loaded(kind, gguf=True)
    assert g.kind == "encoder" and g.gguf is not None
    assert g.gguf.architecture == ("nomic-bert" if kind == "nomic-bert" else "bert")
    assert g.config["max_position_embeddings"] == d.config["max_position_embeddings"]
    assert g.n_params == d.n_params and g.gguf.weight_bytes == {"float32": d.size_bytes}
    for text in TEXTS:
        assert list(g.tokenizer.encode(text, add_special_tokens=True)) == list(d.tokenizer.encode(text, add_special_tokens=True))
    pooling = "rank" if kind.endswith("reranker") else "mean"
    if pooling == "rank":
        pairs_d = [CROSS_ENCODER.encode(d.tokenizer, QUERY, doc) for doc in DOCUMENTS]
        pairs_g = [CROSS_ENCODER.encode(g.tokenizer, QUERY, doc) for doc in DOCUMENTS]
        assert pairs_d == pairs_g
        jobs = [EmbeddingJob(prompts=[p for p, _ in pairs_d], pooling="rank", max_batch_tokens=512,
                             token_types=[t for _, t in pairs_d])]
    else:
        jobs = [EmbeddingJob(prompts=[list(d.tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS],
                             pooling=pooling, max_batch_tokens=512)]
    for job in jobs:
        for a, b in zip(embed(d.model, job), embed(g.model, job)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_declared_pooling() -> None:
    assert model_pooling(tiny_encoder("bert")) == "mean"
    assert model_pooling(tiny_encoder("xlm-roberta")) == "cls"
    assert model_pooling(tiny_encoder("bert-reranker")) == "rank"
    assert model_pooling(tiny_encoder("nomic-bert")) == "mean"
    assert model_pooling(tiny_encoder("xlm-roberta-reranker")) == "rank"
    for kind, pooling in (("bert", "mean"), ("xlm-roberta", "cls"), ("bert-reranker", "rank"), ("nomic-bert", "mean"),
                          ("xlm-roberta-reranker", "rank")):
        assert model_pooling(tiny_encoder(kind, gguf=True)) == pooling


@pytest.mark.parametrize("kind", ["bert-reranker", "xlm-roberta-reranker"])
def test_rerank_equals_transformers(loaded, torch_mod, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    directory = str(tiny_encoder(kind))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch_mod.float32).eval()
    batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
    with torch_mod.no_grad():
        expected = ref_model(**batch).logits[:, 0].numpy()

    m = loaded(kind)
    head = rank_head(m.path, m.tokenizer)
    assert head is CROSS_ENCODER
    pairs = [head.encode(m.tokenizer, QUERY, doc) for doc in DOCUMENTS]
    assert [ids for ids, _ in pairs] == [list(row[row != tokenizer.pad_token_id]) for row in batch["input_ids"].numpy()]
    if kind == "bert-reranker":
        assert any(1 in types for _, types in pairs), "BERT pairs carry segment B's token type"
    else:
        assert m.model.config.model_type == "xlm-roberta" and "dense" in m.model.head
    scores = embed(m.model, EmbeddingJob(prompts=[p for p, _ in pairs], pooling="rank", max_batch_tokens=512,
                                         token_types=[t for _, t in pairs]))
    ours = np.array([float(s.ravel()[0]) for s in scores])
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    assert list(np.argsort(-ours)) == list(np.argsort(-expected))
    assert len(set(np.round(ours, 3))) == len(ours), "distinct scores: the order means something"


def test_embedder_has_no_rank_head(loaded) -> None:
    m = loaded("bert")
    assert rank_head(m.path, m.tokenizer) is None
    with pytest.raises(ValueError, match="no sequence-classification head"):
        import mlx.core as mx

        m.model.classify(m.model(mx.array([[2, 3]])))
