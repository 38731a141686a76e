"""The RoPE/YaRN flags as config changes (``model/load_options.py``)."""

from __future__ import annotations

import pytest

from mlxcel_compat.model.load_options import LoadOptions, RopeOverrides
from mlxcel_compat.settings import resolve_settings

PLAIN = {"rope_theta": 10000.0, "max_position_embeddings": 2048}
YARN = {**PLAIN, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                  "beta_fast": 32.0}}


def test_no_flags_leave_the_config_as_it_is() -> None:
    assert not RopeOverrides()
    assert RopeOverrides().apply(YARN) == YARN


def test_base_and_scale_become_rope_theta_and_a_linear_factor() -> None:
    out = RopeOverrides(freq_base=5000, scale=2).apply(PLAIN)
    assert out["rope_theta"] == 5000.0
    assert out["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}
    assert RopeOverrides(scale=2, freq_scale=0.25).apply(PLAIN)["rope_scaling"]["factor"] == 4.0  # freq-scale wins


def test_yarn_keeps_the_models_parameters_unless_given() -> None:
    out = RopeOverrides(scale=8, yarn_beta_slow=2).apply(YARN)["rope_scaling"]
    assert out["factor"] == 8.0 and out["original_max_position_embeddings"] == 1024
    assert out["beta_fast"] == 32.0 and out["beta_slow"] == 2.0
    fresh = RopeOverrides(scaling="yarn", scale=2).apply(PLAIN)["rope_scaling"]
    assert fresh["type"] == "yarn" and fresh["original_max_position_embeddings"] == 2048


def test_none_drops_the_scaling_and_other_kinds_are_refused() -> None:
    assert RopeOverrides(scaling="none").apply(YARN)["rope_scaling"] is None
    with pytest.raises(ValueError, match="llama3"):
        RopeOverrides(scale=2).apply({**PLAIN, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_from_settings_reads_every_flag_and_changes_the_fingerprint() -> None:
    options = LoadOptions.from_settings(resolve_settings(
        ["--rope-scaling", "yarn", "--yarn-orig-ctx", "512", "--override-kv", "a=int:1", "--no-mmap", "--mlock"], {}))
    assert options.rope == RopeOverrides(scaling="yarn", yarn_orig_ctx=512)
    assert [o.key for o in options.kv_overrides] == ["a"] and not options.use_mmap and options.mlock
    assert options.mark("f" * 64) != "f" * 64 and LoadOptions().mark("f" * 64) == "f" * 64


def test_a_malformed_override_is_refused_before_loading() -> None:
    settings = resolve_settings(["--override-kv", "tokenizer.ggml.eos_token_id=int:two"], {})
    with pytest.raises(ValueError, match="invalid int value for KV override 'tokenizer.ggml.eos_token_id=int:two'"):
        LoadOptions.from_settings(settings)
