"""The llama-server compatibility manifest agrees with the settings table and the API reference."""

from __future__ import annotations

import pytest

from mlxcel_compat.compat import (
    MANIFEST_PATH,
    MANIFEST_STATUSES,
    dump_manifest,
    load_manifest,
    manifest_flags,
    manifest_request_fields,
    manifest_routes,
    with_generated_sections,
)
from mlxcel_compat.settings import SETTINGS, settings_by_name


@pytest.fixture(scope="module")
def manifest() -> dict:
    return load_manifest()


def test_manifest_file_is_up_to_date(manifest) -> None:
    text = MANIFEST_PATH.read_text(encoding="utf-8")
    assert text == dump_manifest(with_generated_sections(manifest)), "run python scripts/gen_docs.py"


def test_every_manifest_flag_matches_its_setting(manifest) -> None:
    for entry in manifest["flags"]:
        s = settings_by_name[entry["setting"]]
        assert entry["flags"] == list(s.flags), s.name
        assert entry["negative_flags"] == list(s.negative_flags), s.name
        assert entry["env"] == list(s.env), s.name
        assert entry["negative_env"] == list(s.negative_env), s.name
        assert entry["mlxcel_env"] == s.mlxcel_env, s.name
        assert entry["status"] == s.status, s.name
        assert entry["takes_value"] == s.takes_value, s.name
        assert entry["origin"] == ("llama-server" if s.upstream else "mlxcel"), s.name


def test_every_setting_is_in_the_manifest(manifest) -> None:
    spellings = {f for e in manifest["flags"] for f in e["flags"] + e["negative_flags"]}
    for s in SETTINGS:
        for flag in s.flags + s.negative_flags:
            assert flag in spellings, flag
    env_only = {e["setting"]: e for e in manifest["env_only"]}
    for s in SETTINGS:
        if not (s.flags or s.negative_flags):
            assert env_only[s.name]["mlxcel_env"] == s.mlxcel_env
    assert {"disable_boundary_snapshot", "disable_cache_warmup", "apc_trace"} <= set(env_only)


def test_manifest_flag_statuses_and_notes(manifest) -> None:
    for entry in manifest["flags"]:
        assert entry["status"] in ("supported", "noop", "refused")
        if entry["status"] != "supported":
            assert entry["note"], entry["setting"]
    names = {e["setting"] for e in manifest_flags(status="refused", manifest=manifest)}
    assert {"model_url", "tools_runtime"} <= names
    supported = {e["setting"] for e in manifest_flags(status="supported", manifest=manifest)}
    assert {"lora", "lora_scaled", "lora_init_without_apply"} <= supported  # issue 30
    assert {"embeddings", "rerank", "pooling", "embd_normalize"} <= supported  # issue 32
    noop = {e["setting"] for e in manifest_flags(status="noop", manifest=manifest)}
    assert {"n_gpu_layers", "flash_attn", "yarn_ext_factor"} <= noop
    assert {"threads", "threads_batch", "cache_ram", "ssl_key_file", "ssl_cert_file", "rope_scaling", "rope_scale",
            "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx", "yarn_beta_slow", "yarn_beta_fast", "override_kv",
            "mlock", "mmap", "log_file", "log_timestamps", "log_prefix", "log_colors", "reuse_port",
            "static_path"} <= supported  # issue 55
    assert {"cache_type_k", "cache_type_v"} <= supported  # issue 54


SUPPORTED_ROUTES = [
    ("GET", "/health"), ("GET", "/v1/health"), ("GET", "/metrics"), ("GET", "/props"), ("POST", "/props"),
    ("GET", "/models"), ("GET", "/v1/models"), ("POST", "/completion"), ("POST", "/completions"), ("POST", "/infill"),
    ("POST", "/v1/completions"), ("POST", "/chat/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"), ("GET", "/slots"),
    ("POST", "/v1/cache/reset"), ("GET", "/v1/cache/stats"), ("GET", "/v1/cache/misses"), ("GET", "/openapi.json"), ("GET", "/"), ("GET", "/index.html"),
    ("GET", "/ui/{file}"), ("GET", "/ui/vendor/{file}"),
    ("POST", "/slots/{id_slot}"), ("GET", "/lora-adapters"), ("POST", "/lora-adapters"),
    ("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"), ("POST", "/cors-proxy"), ("POST", "/predict"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"), ("POST", "/responses"),
    ("POST", "/chat/completions/input_tokens"), ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/responses/input_tokens"), ("POST", "/v1/responses/input_tokens"),
    ("GET", "/get_load"), ("GET", "/get_server_info"), ("GET", "/get_model_info"), ("POST", "/flush_cache"),
    ("POST", "/embedding"), ("POST", "/embeddings"), ("POST", "/v1/embeddings"),
    ("POST", "/rerank"), ("POST", "/reranking"), ("POST", "/v1/rerank"), ("POST", "/v1/reranking"),
    ("POST", "/v1/chat/completions/control"), ("GET", "/v1/stream"), ("DELETE", "/v1/stream"), ("POST", "/v1/streams/lookup"),
]

# Every other route of llama-server-api.md §2 (single-model and router mode).
UPSTREAM_ROUTES = [
    ("POST", "/v1/audio/transcriptions"), ("POST", "/audio/transcriptions"),
    ("POST", "/models"), ("POST", "/models/load"), ("POST", "/models/unload"),
    ("GET", "/models/sse"), ("DELETE", "/models"),
]


def test_routes(manifest) -> None:
    routes = manifest_routes(manifest=manifest)
    assert len(routes) == len(set(routes)), "duplicate route"
    assert sorted(manifest_routes(status="supported", manifest=manifest)) == sorted(SUPPORTED_ROUTES)
    unsupported = set(manifest_routes(status="unsupported", manifest=manifest))
    assert set(UPSTREAM_ROUTES) <= unsupported
    assert set(routes) == set(SUPPORTED_ROUTES) | unsupported
    for r in manifest["routes"]:
        assert r["status"] in ("supported", "unsupported") and r["origin"] in ("llama-server", "mlxcel")
        if r["status"] == "unsupported":
            assert r["note"], r["path"]


# Every request field of llama-server-api.md §3.2 (aliases excluded).
NATIVE_FIELDS = """
stream stream_options.include_usage cache_prompt n_predict n_keep n_discard n_indent n_cmpl n_cache_reuse
t_max_predict_ms return_tokens return_progress timings_per_token post_sampling_probs n_probs min_keep
response_fields sse_ping_interval temperature dynatemp_range dynatemp_exponent top_k top_p min_p top_n_sigma
typical_p xtc_probability xtc_threshold repeat_last_n repeat_penalty presence_penalty frequency_penalty
dry_multiplier dry_base dry_allowed_length dry_penalty_last_n dry_sequence_breakers mirostat mirostat_tau
mirostat_eta adaptive_target adaptive_decay seed samplers backend_sampling json_schema grammar grammar_lazy
grammar_triggers preserved_tokens logit_bias ignore_eos stop lora id_slot verbose reasoning_format chat_format
chat_parser generation_prompt parse_tool_calls echo continue_final_message reasoning_control
reasoning_budget_tokens reasoning_budget_start_tag reasoning_budget_end_tag reasoning_budget_message
message_delimiters
""".split()

NOT_SUPPORTED = """
backend_sampling
""".split()

# Accepted-and-ignored (or refused) before issues 12 and 13; now acted on as llama-server does.
NOW_SUPPORTED = """
mirostat mirostat_tau mirostat_eta n_indent t_max_predict_ms reasoning_budget_tokens reasoning_budget_start_tag
reasoning_budget_end_tag reasoning_budget_message grammar json_schema grammar_lazy grammar_triggers preserved_tokens
adaptive_target adaptive_decay reasoning_control
""".split()


def test_request_fields(manifest) -> None:
    keys = [(f["field"], f["scope"]) for f in manifest["request_fields"]]
    assert len(set(keys)) == len(keys), "duplicate field in a scope"
    entries: dict[str, dict] = {}
    for f in manifest["request_fields"]:  # a name's first entry: the native and OpenAI scopes come first
        entries.setdefault(f["field"], f)
    for name in NATIVE_FIELDS:
        assert name in entries, name
    for f in manifest["request_fields"]:
        assert f["status"] in MANIFEST_STATUSES and f["status"] != "refused"
        assert f["scope"] in manifest["request_field_scopes"]
        if f["status"] != "supported":
            assert f["note"], f["field"]
    for name in NOT_SUPPORTED:
        assert entries[name]["status"] in ("noop", "unsupported"), name
    for name in NOW_SUPPORTED:
        assert entries[name]["status"] == "supported", name
    assert "thinking_budget_tokens" in entries["reasoning_budget_tokens"]["aliases"]
    for name in ("cache_prompt", "n_predict", "temperature", "stop", "seed", "id_slot", "n_probs"):
        assert entries[name]["status"] == "supported", name
    assert "max_tokens" in entries["n_predict"]["aliases"]
    # Fields vllm-router / sglang-router add to every chat or completions body they forward.
    for name in ("separate_reasoning", "include_reasoning", "stream_reasoning", "skip_special_tokens", "no_stop_trim",
                 "return_hidden_states", "continue_final_message", "ignore_eos", "logprobs", "echo"):
        assert name in entries, name
    assert "max_completion_tokens" in entries["n_predict"]["aliases"]
    for name in ("messages", "tools", "chat_template_kwargs", "logprobs", "response_format"):
        assert entries[name]["scope"] == "chat", name


def test_request_field_helpers_filter(manifest) -> None:
    unsupported = manifest_request_fields(status="unsupported", manifest=manifest)
    assert "previous_response_id" in unsupported and "lora" not in unsupported and "grammar" not in unsupported
    assert "stream" not in unsupported
    chat = manifest_request_fields(scope="chat", manifest=manifest)
    assert "messages" in chat and "prompt" not in chat
    assert set(manifest_request_fields(status="noop", scope="completion", manifest=manifest)) == {
        "echo", "best_of", "suffix"}


def _app_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the real application serves."""
    from mlxcel_compat.engine.core import Engine, EngineConfig
    from mlxcel_compat.server.app import build_app
    from mlxcel_compat.server.context import ServerContext
    from mlxcel_compat.settings import resolve_settings

    import os
    from unittest import mock

    settings = resolve_settings([], {})
    with mock.patch.dict(os.environ, {"AIP_MODE": "PREDICTION"}):  # /predict is served in Vertex AI mode only
        app = build_app(ServerContext(settings=settings, engine=Engine(EngineConfig(model="unused"))))
    out = set()
    for route in app.routes:
        for method in route.methods or ():
            if method != "HEAD":
                out.add((method, route.path))
    return out


def test_supported_routes_are_exactly_the_served_routes(manifest) -> None:
    served = _app_routes()
    supported = {tuple(r) for r in manifest_routes(status="supported", manifest=manifest)}
    assert supported == served


def test_every_supported_request_field_is_read_by_the_code(manifest) -> None:
    """A field the manifest calls supported must at least be named by the request-handling code."""
    from pathlib import Path

    import mlxcel_compat

    root = Path(mlxcel_compat.__file__).parent
    code = "".join(p.read_text(encoding="utf-8") for d in ("server", "chat", "cache") for p in (root / d).glob("*.py"))
    for name in manifest_request_fields(status="supported", manifest=manifest):
        leaf = name.split(".")[-1]
        assert f'"{leaf}"' in code, f"manifest says '{name}' is supported but no handler reads it"


def test_props_fields_say_which_values_are_synthetic(manifest) -> None:
    entries = manifest["props_fields"]
    assert [e["key"] for e in entries][:3] == ["default_generation_settings", "total_slots", "model_alias"]
    for e in entries:
        assert e["value"] in ("real", "synthetic") and e["note"], e["key"]
    synthetic = {e["key"] for e in entries if e["value"] == "synthetic"}
    assert {"model_ftype", "build_info", "cors_proxy_enabled"} <= synthetic
    assert "model_path" not in synthetic and "is_sleeping" not in synthetic
