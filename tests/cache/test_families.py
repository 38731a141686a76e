"""Recognising recurrent and hybrid families from config.json (APC auto-off)."""

from __future__ import annotations

import pytest

from mlxcel_compat.cache.families import RECURRENT_MODEL_TYPES, recurrent_family

SPEC_LIST = (
    "jamba mamba mamba2 nemotron_h gated_delta kimi_linear kimi_k3 qwen3_next falcon_mamba "
    "longcat_flash longcat_flash_ngram rwkv7 recurrent_gemma baichuan_m1"
).split()


def test_the_list_is_the_specs() -> None:
    assert sorted(RECURRENT_MODEL_TYPES) == sorted(SPEC_LIST)


@pytest.mark.parametrize("model_type", SPEC_LIST)
def test_every_listed_model_type_matches_at_top_level(model_type: str) -> None:
    match = recurrent_family({"model_type": model_type})
    assert match is not None and (match.family, match.field) == (model_type, "model_type")


def test_model_type_is_case_insensitive_and_exact() -> None:
    assert recurrent_family({"model_type": "Qwen3_Next"}).family == "qwen3_next"  # type: ignore[union-attr]
    # Exact on model_type: a dense family whose name merely contains a listed one does not match.
    assert recurrent_family({"model_type": "mamba_like_dense"}) is None


def test_text_config_model_type() -> None:
    config = {"model_type": "some_vlm_wrapper", "text_config": {"model_type": "jamba"}}
    match = recurrent_family(config)
    assert match is not None and (match.family, match.field, match.value) == ("jamba", "text_config.model_type", "jamba")


@pytest.mark.parametrize(
    "arch, family",
    [
        ("Qwen3NextForCausalLM", "qwen3_next"),
        ("FalconMambaForCausalLM", "falcon_mamba"),  # longest name wins over "mamba"
        ("Mamba2ForCausalLM", "mamba2"),
        ("NemotronHForCausalLM", "nemotron_h"),
        ("RecurrentGemmaForCausalLM", "recurrent_gemma"),
        ("KimiLinearForCausalLM", "kimi_linear"),
        ("LongcatFlashNgramForCausalLM", "longcat_flash_ngram"),
        ("BaichuanM1ForCausalLM", "baichuan_m1"),
        ("Rwkv7ForCausalLM", "rwkv7"),
    ],
)
def test_architectures_match_class_names(arch: str, family: str) -> None:
    match = recurrent_family({"model_type": "custom", "architectures": ["Unrelated", arch]})
    assert match is not None and (match.family, match.field, match.value) == (family, "architectures", arch)


def test_model_type_is_checked_before_architectures() -> None:
    match = recurrent_family({"model_type": "rwkv7", "architectures": ["JambaForCausalLM"]})
    assert match is not None and match.field == "model_type" and match.family == "rwkv7"
    assert "rwkv7" in match.describe()


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]},  # sliding, not recurrent
        {"model_type": "llava", "text_config": {"model_type": "mistral"}, "architectures": ["LlavaForConditionalGeneration"]},
        {},
        {"model_type": None, "text_config": "not a mapping", "architectures": "not a list"},
        {"architectures": [None, 3]},
    ],
)
def test_dense_and_malformed_configs_do_not_match(config: dict[str, object]) -> None:
    assert recurrent_family(config) is None
