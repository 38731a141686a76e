"""Embeddings on the engine side (``engine/embedding.py``), the pooling a model declares
(``encoders/pooling.py``) and llama.cpp's normalisations (``server/api_embeddings.py``).

The reference is Hugging Face transformers (PyTorch, CPU) on the same factory weights: its
``last_hidden_state`` is the final-norm output llama.cpp reads as a decoder's embedding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mlxcel_compat.engine.embedding import EmbeddingJob, embed, length_groups, pooled_from
from mlxcel_compat.encoders.pooling import model_pooling
from mlxcel_compat.server.api_embeddings import normalize
from mlxcel_compat.vision.inputs import MediaAudio, MediaImage, MediaInput
from tests.conftest import tiny_model

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog near the river bank.", "a",
         "Embeddings back retrieval pipelines; rerankers sort what they find."]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded(family):
    from mlxcel_compat.model.loader import load_model

    return load_model(str(tiny_model(family)), [])


@pytest.fixture(scope="module")
def reference(family):
    """Per-token hidden states from transformers for a token list."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModel.from_pretrained(str(tiny_model(family)), dtype=torch.float32)
    model.eval()

    def hidden(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]))
        return out.last_hidden_state[0].numpy()

    return hidden


def _pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    return {"none": hidden, "mean": hidden.mean(axis=0, keepdims=True), "cls": hidden[:1], "last": hidden[-1:]}[pooling]


@pytest.mark.parametrize("pooling", ["none", "mean", "cls", "last"])
def test_batched_embeddings_equal_transformers(loaded, reference, pooling) -> None:
    prompts = [list(loaded.tokenizer.encode(t)) for t in TEXTS]
    got = embed(loaded.model, EmbeddingJob(prompts, pooling, 512))
    assert len(got) == len(prompts)
    for tokens, vec in zip(prompts, got):
        want = _pool(reference(tokens), pooling)
        assert vec.shape == want.shape
        for row, ref in zip(vec, want):
            assert cosine(row, ref) > 1 - 1e-4
        np.testing.assert_allclose(vec, want, atol=1e-3)


def test_chunked_long_input_equals_one_pass(loaded) -> None:
    """An input longer than one pass goes through a KV cache in chunks: same vectors."""
    tokens = list(loaded.tokenizer.encode(" ".join(TEXTS)))
    one = embed(loaded.model, EmbeddingJob([tokens], "none", 512))[0]
    chunked = embed(loaded.model, EmbeddingJob([tokens], "none", 7))[0]
    assert len(tokens) > 7 and one.shape == chunked.shape
    np.testing.assert_allclose(chunked, one, atol=1e-4)


def test_a_prompt_with_media_pools_from_after_its_last_medium() -> None:
    """llama-server pools its last batch, which starts after the prompt's last image or clip."""
    image = MediaImage(np.zeros((1, 3, 4, 4), np.float32), (1, 1, 1), (3, 7))
    clip = MediaAudio(np.zeros((1, 2, 2), np.float32), np.ones((1, 2), bool), (9, 12))
    assert pooled_from(None) == 0 and pooled_from(MediaInput()) == 0
    assert pooled_from(MediaInput(images=[image])) == 7
    assert pooled_from(MediaInput(images=[image], audio=[clip])) == 12


def test_groups_bound_the_padded_tokens_of_a_pass() -> None:
    lengths = [5, 1, 9, 3, 9, 2]
    groups = length_groups(lengths, 18)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 18
    assert length_groups([30, 40], 10) == [[0], [1]]  # too long alone: one group each (run in chunks)


@pytest.mark.parametrize("mode", [-1, 0, 1, 2, 3, 5])
def test_normalize_is_llama_cpp_common_embd_normalize(mode: int) -> None:
    v = np.array([3.0, -4.0, 0.5, 0.0, 1e-3], dtype=np.float32)
    x = v.astype(np.float64)
    total = {-1: 1.0, 0: np.abs(x).max() / 32760.0, 2: np.sqrt((x * x).sum())}.get(mode)
    if total is None:
        total = (np.abs(x) ** mode).sum() ** (1.0 / mode)
    np.testing.assert_allclose(normalize(v, mode), v / total, rtol=1e-6)
    assert normalize(v, mode).dtype == np.float32
    assert not normalize(np.zeros(4, np.float32), mode).any()  # a zero norm leaves zeros


def test_l2_normalized_vectors_have_unit_length() -> None:
    v = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    assert abs(float(np.linalg.norm(normalize(v, 2))) - 1.0) < 1e-6
    assert abs(float(np.abs(normalize(v, 0)).max()) - 32760.0) < 1e-2


def _with_pooling_config(tmp: Path, config: dict, path: str = "1_Pooling") -> Path:
    out = tmp / "st-model"
    shutil.copytree(tiny_model("qwen3"), out)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": path, "type": "sentence_transformers.models.Pooling"},
    ]))
    (out / path).mkdir()
    (out / path / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("config", "expected"), [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "last"),
    ({"pooling_mode": "lasttoken"}, "last"),
    ({"pooling_mode_max_tokens": True}, "none"),  # no llama.cpp equivalent
])
def test_directory_pooling_comes_from_the_sentence_transformers_config(tmp_path, config, expected) -> None:
    assert model_pooling(_with_pooling_config(tmp_path, config, "2_Pool")) == expected


def test_a_model_that_declares_nothing_pools_none(tmp_path) -> None:
    assert model_pooling(tiny_model("qwen3")) == "none"
    assert model_pooling(tiny_model("qwen3:f32")) == "none"


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "rank", "none"])
def test_gguf_pooling_comes_from_its_metadata(tmp_path, pooling) -> None:
    from mlxcel_compat.testing.gguf_writer import write_gguf

    out = tmp_path / f"qwen3-{pooling}.gguf"
    write_gguf("qwen3", "tiny", out, "f32", model_dir=tiny_model("qwen3"), pooling=pooling)
    assert model_pooling(out) == pooling


# --------------------------------------------------------------------------- decoder rerankers


def test_a_qwen3_reranker_directory_is_recognised_as_llama_cpp_does(tmp_path) -> None:
    from mlxcel_compat.encoders.rerank import is_reranker_directory

    base = tiny_model("qwen3")
    assert not is_reranker_directory(base)
    named = tmp_path / "Qwen3-Reranker-tiny"
    shutil.copytree(base, named)
    assert is_reranker_directory(named) and model_pooling(named) == "rank"
    titled = tmp_path / "plain"
    shutil.copytree(base, titled)
    (titled / "README.md").write_text("# Qwen3-Reranker-0.6B\n")
    assert is_reranker_directory(titled)


def test_a_directory_reranker_scores_with_its_label_tokens_rows(loaded, family) -> None:
    """With the label tokens' rows of the output head (a directory reranker), the scores equal a
    GGUF-style head holding the same rows."""
    import mlx.core as mx

    from mlxcel_compat.engine.embedding import rank_scores
    from mlxcel_compat.encoders.rerank import QWEN3_RERANK_TEMPLATE, RankHead

    ids = (88, 2146)
    tokens = RankHead(QWEN3_RERANK_TEMPLATE, token_ids=ids).prompt(loaded.tokenizer, "q", "a document")
    assert tokens[0] == loaded.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]  # specials parsed
    hidden = embed(loaded.model, EmbeddingJob([tokens], "last", 512))[0]
    model = loaded.model
    weight = model.lm_head.weight if hasattr(model, "lm_head") else model.model.embed_tokens.weight
    rows = np.array(weight.astype(mx.float32))[list(ids)]
    by_tokens = rank_scores(model, hidden, RankHead(QWEN3_RERANK_TEMPLATE, token_ids=ids))
    by_matrix = rank_scores(model, hidden, RankHead(QWEN3_RERANK_TEMPLATE, matrix=rows))
    np.testing.assert_allclose(by_tokens, by_matrix, atol=1e-5)
    assert abs(float(by_tokens.sum()) - 1.0) < 1e-6
