"""Tests for the settings table and its resolution (CLI > MLXCEL_* > llama.cpp env > default)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from mlxcel_compat.settings import (
    SETTINGS,
    FALSE_WORDS,
    TRUE_WORDS,
    SettingsError,
    build_parser,
    default_template_kwargs,
    make_settings,
    parse_argv,
    render_markdown,
    require_model,
    resolve_settings,
    settings_by_name,
)
from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT


def resolve(argv: list[str] | None = None, **environ: str):
    return resolve_settings(argv or [], environ)


# --------------------------------------------------------------------------- defaults and table


def test_defaults_come_from_the_table() -> None:
    s = resolve()
    for setting in SETTINGS:
        assert getattr(s, setting.name) == setting.default, setting.name
        assert s.sources[setting.name] == "default"
        assert not s.is_set(setting.name)
    assert s.ignored == []
    assert (s.host, s.port, s.ctx_size, s.n_parallel, s.batch_size) == ("127.0.0.1", 8080, 0, -1, 2048)
    assert (s.jinja, s.slots, s.metrics, s.cache_prompt, s.prompt_cache_enabled) == (True, True, False, True, True)
    assert s.reasoning_format == "deepseek" and s.chat_template_kwargs == {}


REQUIRED_SUPPORTED = """
model hf_repo alias host port ctx_size n_parallel n_predict batch_size chat_template chat_template_file
chat_template_kwargs jinja metrics slots props api_key api_key_file timeout cors_origins cors_methods
cors_headers cors_credentials api_prefix sse_ping_interval temp top_k top_p min_p typical_p top_n_sigma
xtc_probability xtc_threshold repeat_last_n repeat_penalty presence_penalty frequency_penalty dry_multiplier
dry_base dry_allowed_length dry_penalty_last_n dry_sequence_breaker dynatemp_range dynatemp_exp samplers
sampling_seq seed ignore_eos min_keep n_probs n_keep reverse_prompt special verbose log_verbosity log_disable
offline cache_prompt cont_batching reasoning_format reasoning prompt_cache_enabled prompt_cache_capacity_bytes
prompt_cache_max_entries prompt_cache_ttl prompt_cache_min_prefix apc_enabled apc_block_size apc_num_blocks
apc_hash prompt_cache_snapshot_capacity_bytes prompt_cache_snapshot_max_entries prompt_cache_snapshot_ttl
disable_boundary_snapshot disable_cache_warmup apc_trace
""".split()


def test_required_settings_exist_and_are_supported() -> None:
    for name in REQUIRED_SUPPORTED:
        assert settings_by_name[name].status == "supported", name
    assert settings_by_name["n_parallel"].default == -1
    assert settings_by_name["apc_hash"].choices == ("sha256", "blake3")


def test_every_setting_has_a_derived_mlxcel_variable() -> None:
    for s in SETTINGS:
        if not s.cli_only:
            assert s.mlxcel_env == "MLXCEL_" + s.name.upper()
            assert s.env_lookup[0] == s.mlxcel_env
    assert settings_by_name["disable_cache_warmup"].mlxcel_env == "MLXCEL_DISABLE_CACHE_WARMUP"


# Flags a llama-server deployment may pass (llama-server-api.md §11.2 plus the brief's list).
LLAMA_SERVER_FLAGS = """
-m --model -hf -hfr --hf-repo -hff --hf-file -hft --hf-token -mu --model-url --offline --host --port --api-prefix
-c --ctx-size -np --parallel -n --predict --n-predict -b --batch-size -ub --ubatch-size --keep --cache-prompt
--no-cache-prompt --cache-reuse -cram --cache-ram --cache-idle-slots --no-cache-idle-slots -kvu --kv-unified
-no-kvu --no-kv-unified --context-shift --no-context-shift -sps --slot-prompt-similarity --slot-save-path
--metrics --slots --no-slots --props --api-key --api-key-file --ssl-key-file --ssl-cert-file -a --alias --tags
--jinja --no-jinja --chat-template --chat-template-file --chat-template-kwargs --reasoning-format -rea
--reasoning --reasoning-budget --prefill-assistant --no-prefill-assistant --embedding --embeddings --rerank
--reranking --pooling -t --threads -tb --threads-batch --threads-http -ngl --gpu-layers --n-gpu-layers -fa
--flash-attn -cb --cont-batching -nocb --no-cont-batching --lora --lora-scaled --lora-init-without-apply -to
--timeout --sse-ping-interval --sleep-idle-seconds --ui --webui --no-ui --no-webui --path --cors-origins
--cors-methods --cors-headers --cors-credentials --temp --seed -s --top-k --top-p --min-p --repeat-penalty -r
--reverse-prompt -sp --special --media-path --mmproj --mmproj-url --no-mmproj --log-disable --log-file
--log-colors -v --verbose --log-verbose -lv --verbosity --log-verbosity --log-prefix --no-log-prefix
--log-timestamps --no-log-timestamps --log-prompts-dir -ctk -ctv -bs --backend-sampling --spec-type -md
--model-draft --spec-draft-n-max --spec-draft-n-min -fit --mlock --no-mmap --mmap --numa -dev --device -sm
--split-mode -ts -mg --rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx
--yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast --draft-max --draft-min --mirostat
--mirostat-lr --mirostat-ent --grammar --grammar-file --json-schema -j --json-schema-file --no-warmup
--check-tensors -e --escape --no-escape -h --help --version
""".split()


def test_llama_server_flags_are_all_in_the_table() -> None:
    spellings = {f for s in SETTINGS for f in s.flags + s.negative_flags}
    missing = [f for f in LLAMA_SERVER_FLAGS if f not in spellings]
    assert missing == []


def test_llama_env_names_match_llama_cpp() -> None:
    expected = {
        "ctx_size": ("LLAMA_ARG_CTX_SIZE",), "batch_size": ("LLAMA_ARG_BATCH",), "api_key": ("LLAMA_API_KEY",),
        "metrics": ("LLAMA_ARG_ENDPOINT_METRICS",), "slots": ("LLAMA_ARG_ENDPOINT_SLOTS",),
        "props": ("LLAMA_ARG_ENDPOINT_PROPS",), "reasoning_format": ("LLAMA_ARG_THINK",),
        "top_k": ("LLAMA_ARG_TOP_K",), "n_parallel": ("LLAMA_ARG_N_PARALLEL",), "hf_token": ("HF_TOKEN",),
        "ui": ("LLAMA_ARG_UI",), "static_path": ("LLAMA_ARG_STATIC_PATH",), "temp": (),
        "apc_block_size": ("APC_BLOCK_SIZE",), "n_gpu_layers": ("LLAMA_ARG_N_GPU_LAYERS",),
    }
    for name, env in expected.items():
        assert settings_by_name[name].env == env, name
    assert settings_by_name["ui"].negative_env == ("LLAMA_ARG_NO_UI",)
    assert settings_by_name["metrics"].negative_env == ()


# --------------------------------------------------------------------------- precedence


@pytest.mark.parametrize(
    ("name", "flag", "alias", "cli", "mlx", "llama", "expected"),
    [
        ("ctx_size", "-c", "LLAMA_ARG_CTX_SIZE", "4096", "2048", "1024", (4096, 2048, 1024)),
        ("host", "--host", "LLAMA_ARG_HOST", "0.0.0.0", "10.0.0.1", "10.0.0.2", ("0.0.0.0", "10.0.0.1", "10.0.0.2")),
        ("jinja", "--no-jinja", "LLAMA_ARG_JINJA", None, "false", "true", (False, False, True)),
        ("temp", "--temp", None, "0.1", "0.2", None, (0.1, 0.2, 0.8)),
        ("alias", "-a", "LLAMA_ARG_ALIAS", "x,y", "m", "l1,l2", (("x", "y"), ("m",), ("l1", "l2"))),
        ("reasoning_format", "--reasoning-format", "LLAMA_ARG_THINK", "none", "deepseek-legacy", "auto",
         ("none", "deepseek-legacy", "auto")),
        ("chat_template_kwargs", "--chat-template-kwargs", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", '{"a": 1}', '{"b": 2}',
         '{"c": 3}', ({"a": 1}, {"b": 2}, {"c": 3})),
    ],
)
def test_precedence_cli_then_mlxcel_then_llama_then_default(name, flag, alias, cli, mlx, llama, expected) -> None:
    setting = settings_by_name[name]
    argv = [flag] if cli is None else [flag, cli]
    env = {setting.mlxcel_env: mlx}
    if alias:
        env[alias] = llama
    everything = resolve_settings(argv, env)
    assert getattr(everything, name) == expected[0] and everything.sources[name] == "cli"
    envs_only = resolve_settings([], env)
    assert getattr(envs_only, name) == expected[1] and envs_only.sources[name] == f"env:{setting.mlxcel_env}"
    if alias:
        llama_only = resolve_settings([], {alias: llama})
        assert getattr(llama_only, name) == expected[2] and llama_only.sources[name] == f"env:{alias}"
        assert llama_only.is_set(name)
    assert resolve().sources[name] == "default"


def test_repeated_scalar_flag_keeps_the_last_value() -> None:
    assert resolve(["-c", "100", "--ctx-size", "200"]).ctx_size == 200


def test_values_starting_with_a_dash_are_taken_verbatim() -> None:
    s = resolve(["-r", "-User:", "-n", "-1", "--api-prefix", "-x"])
    assert s.reverse_prompt == ("-User:",) and s.n_predict == -1 and s.api_prefix == "-x"


def test_inline_values_and_underscore_spellings() -> None:
    s = resolve(["--ctx_size=512", "--chat_template_kwargs", '{"a_b": "c_d"}', "--n_gpu_layers", "9", "--port=9"])
    assert s.ctx_size == 512 and s.port == 9
    assert s.chat_template_kwargs == {"a_b": "c_d"}  # only the flag name is normalised, never the value
    assert ("--n-gpu-layers", settings_by_name["n_gpu_layers"].reason) in s.ignored


# --------------------------------------------------------------------------- booleans


@pytest.mark.parametrize("word", [w for base in TRUE_WORDS for w in (base, base.upper(), base.capitalize())])
def test_true_words_in_env(word: str) -> None:
    s = resolve(LLAMA_ARG_ENDPOINT_METRICS=word, LLAMA_ARG_JINJA=word.swapcase())
    assert s.metrics is True and s.jinja is True


@pytest.mark.parametrize("word", [w for base in FALSE_WORDS for w in (base, base.upper(), base.capitalize())])
def test_false_words_in_env(word: str) -> None:
    s = resolve(LLAMA_ARG_ENDPOINT_SLOTS=word, MLXCEL_CONT_BATCHING=word)
    assert s.slots is False and s.cont_batching is False


def test_llama_arg_no_variable_turns_a_negatable_option_off() -> None:
    s = resolve(LLAMA_ARG_NO_JINJA="", LLAMA_ARG_JINJA="true", LLAMA_ARG_NO_ENDPOINT_SLOTS="whatever")
    assert s.jinja is False and s.sources["jinja"] == "env:LLAMA_ARG_NO_JINJA"
    assert s.slots is False
    # the CLI and MLXCEL_* still win over it
    assert resolve(["--jinja"], LLAMA_ARG_NO_JINJA="1").jinja is True
    assert resolve(MLXCEL_JINJA="on", LLAMA_ARG_NO_JINJA="1").jinja is True
    # options without a negative form have no NO_ variable
    assert resolve(LLAMA_ARG_NO_ENDPOINT_METRICS="1").metrics is False
    assert resolve(LLAMA_ARG_NO_ENDPOINT_METRICS="1").sources["metrics"] == "default"


def test_bool_flags_accept_inline_values_and_negative_forms() -> None:
    s = resolve(["--jinja=off", "--metrics=YES", "-nocb", "--no-cors-credentials"])
    assert (s.jinja, s.metrics, s.cont_batching, s.cors_credentials) == (False, True, False, False)
    with pytest.raises(SettingsError, match="--no-jinja does not take a value"):
        resolve(["--no-jinja=1"])


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        ([], {"LLAMA_ARG_ENDPOINT_METRICS": "maybe"}, ["LLAMA_ARG_ENDPOINT_METRICS", "enabled", "disabled"]),
        ([], {"MLXCEL_JINJA": "2"}, ["MLXCEL_JINJA", "true", "false"]),
        (["--jinja=maybe"], {}, ["--jinja", "yes", "no"]),
        ([], {"LLAMA_ARG_CTX_SIZE": "abc"}, ["LLAMA_ARG_CTX_SIZE", "integer"]),
        ([], {"LLAMA_ARG_THINK": "bogus"}, ["LLAMA_ARG_THINK", "deepseek-legacy"]),
        (["--temp", "hot"], {}, ["--temp", "number"]),
        (["--chat-template-kwargs", "{bad"], {}, ["--chat-template-kwargs", "JSON object"]),
        ([], {"LLAMA_ARG_CHAT_TEMPLATE_KWARGS": "[1, 2]"}, ["LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "JSON object"]),
        (["--apc-hash", "md5"], {}, ["--apc-hash", "sha256", "blake3"]),
        ([], {"LLAMA_ARG_REASONING": "maybe"}, ["LLAMA_ARG_REASONING", "auto"]),
        (["-ctk", "q5_1"], {}, ["-ctk", "f32, f16, bf16", "not implemented"]),
        ([], {"LLAMA_ARG_CACHE_TYPE_V": "f8"}, ["LLAMA_ARG_CACHE_TYPE_V", "f32, f16, bf16"]),
    ],
)
def test_malformed_values_name_the_variable_and_the_accepted_values(argv, env, names) -> None:
    with pytest.raises(SettingsError) as info:
        resolve_settings(argv, env)
    assert isinstance(info.value, ValueError)
    for name in names:
        assert name in str(info.value)


def test_kv_cache_types_from_flags_and_llama_variables() -> None:
    settings = resolve_settings(["-ctk", "bf16"], {"LLAMA_ARG_CACHE_TYPE_V": "bf16"})
    assert (settings.cache_type_k, settings.cache_type_v) == ("bf16", "bf16")
    assert (resolve_settings([], {}).cache_type_k, resolve_settings([], {}).cache_type_v) == ("f16", "f16")  # llama-server's
    settings = resolve_settings(["-ctk", "f16"], {"LLAMA_ARG_CACHE_TYPE_V": "bf16"})  # K and V may differ
    assert (settings.cache_type_k, settings.cache_type_v) == ("f16", "bf16")
    settings = resolve_settings(["-ctk", "q8_0", "-ctv", "q8_0"], {})  # ggml's blocks (kv_blocks.py)
    assert (settings.cache_type_k, settings.cache_type_v) == ("q8_0", "q8_0")
    settings = resolve_settings(["-ctk", "q8_0", "-ctv", "f16", "-fa", "off"], {})  # quantized K only: no FA needed
    assert (settings.cache_type_k, settings.cache_type_v) == ("q8_0", "f16")
    # as llama-server: a quantized V cache requires flash attention (llama-context.cpp)
    with pytest.raises(SettingsError, match="-ctv q4_0: quantized V cache requires flash_attn to be enabled"):
        resolve_settings(["-ctk", "f16", "-ctv", "q4_0", "-fa", "off"], {})
    assert resolve_settings(["-ctv", "q4_0", "-fa", "auto"], {}).cache_type_v == "q4_0"


# --------------------------------------------------------------------------- JSON, lists, escapes


def test_chat_template_kwargs_and_reasoning_give_template_defaults() -> None:
    s = resolve(["--chat-template-kwargs", '{"enable_thinking": true, "x": [1]}', "-rea", "off"])
    assert s.chat_template_kwargs == {"enable_thinking": True, "x": [1]}
    assert default_template_kwargs(s) == {"enable_thinking": False, "x": [1]}
    assert resolve(["--reasoning", "enabled"]).reasoning == "on"
    assert default_template_kwargs(resolve()) == {}
    # preserve_reasoning is on by default (chat/render.py); the flag, when given, wins over the kwargs.
    kwargs = '{"preserve_reasoning": true}'
    assert default_template_kwargs(resolve(["--no-reasoning-preserve"])) == {"preserve_reasoning": False}
    assert default_template_kwargs(resolve(["--chat-template-kwargs", kwargs])) == {"preserve_reasoning": True}
    assert default_template_kwargs(resolve(["--chat-template-kwargs", kwargs, "--no-reasoning-preserve"])) == {"preserve_reasoning": False}
    assert default_template_kwargs(resolve(LLAMA_ARG_REASONING_PRESERVE="0")) == {"preserve_reasoning": False}


def test_default_json_is_not_shared_between_instances() -> None:
    first = resolve()
    first.chat_template_kwargs["leak"] = 1
    assert resolve().chat_template_kwargs == {}


def test_list_settings_split_and_accumulate() -> None:
    s = resolve(["--api-key", "a,b", "--api-key", "c", "-a", " m1 , m2 ,"], LLAMA_API_KEY="ignored")
    assert s.api_key == ("a", "b", "c") and s.alias == ("m1", "m2")
    assert resolve(LLAMA_API_KEY="x, y,,").api_key == ("x", "y")
    assert resolve(["-r", "a,b", "-r", "c"]).reverse_prompt == ("a,b", "c")


def test_dry_sequence_breakers_none_and_escapes() -> None:
    assert resolve().dry_sequence_breaker == ("\n", ":", '"', "*")
    assert resolve(["--dry-sequence-breaker", "x", "--dry-sequence-breaker", "none"]).dry_sequence_breaker == ()
    s = resolve(["--dry-sequence-breaker", "none", "--dry-sequence-breaker", r"\n\x41"])
    assert s.dry_sequence_breaker == ("\nA",)
    assert resolve(["-r", r"\nUser:", "--no-escape"]).reverse_prompt == (r"\nUser:",)
    assert resolve(["-r", r"a\tb\\"]).reverse_prompt == ("a\tb\\",)


# --------------------------------------------------------------------------- argv errors, help


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "invalid argument: --bogus"),
        (["model.gguf"], "invalid argument: model.gguf"),
        (["-c4096"], "invalid argument: -c4096"),
        (["--ctx"], "invalid argument: --ctx"),  # never abbreviated
        (["-c"], "expected value for argument: -c"),
        (["--control-vector-layer-range", "1"], "expects two values"),
        (["--mlock=1", "--metrics=1", "--host=x", "--port=y"], "--port"),
    ],
)
def test_argv_errors_are_settings_errors(argv, message) -> None:
    with pytest.raises(SettingsError, match=message):
        resolve(argv)


def test_help_prints_the_table_and_exits_zero(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        resolve(["-m", "x", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--ctx-size", "LLAMA_ARG_CTX_SIZE", "MLXCEL_PROMPT_CACHE_ENABLED", "--no-cache-prompt", "-ngl"):
        assert text in out


def test_version_exits_zero(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        resolve(["--version"])
    assert info.value.code == 0 and "mlxcel_compat" in capsys.readouterr().out


def test_build_parser_is_generated_from_the_table() -> None:
    ns = build_parser().parse_args(["-c", "4096", "--no-jinja", "--api-key", "a", "-fa", "-m", "x"])
    assert (ns.ctx_size, ns.jinja, ns.api_key, ns.flash_attn, ns.model) == ("4096", False, ["a"], True, "x")
    with pytest.raises(SettingsError):
        build_parser().parse_args(["--bogus"])


# --------------------------------------------------------------------------- noop and refused


def test_noop_flags_with_and_without_values_are_ignored_and_listed() -> None:
    argv = ["-ngl", "99", "-fa", "-m", "model", "--check-tensors", "--prio", "2", "--control-vector-layer-range", "0",
            "3", "--flash-attn", "on", "--no-direct-io", "--spec-draft-threads", "4", "-c", "64"]
    s = resolve(argv, LLAMA_ARG_DEFRAG_THOLD="0.1")
    assert s.model == "model" and s.ctx_size == 64  # parsing continued correctly after every noop
    ignored = dict(s.ignored)
    assert set(ignored) == {"-ngl", "--flash-attn", "--check-tensors", "--prio", "--control-vector-layer-range",
                            "--no-direct-io", "--spec-draft-threads", "LLAMA_ARG_DEFRAG_THOLD"}
    assert all(reason for reason in ignored.values())
    assert s.flash_attn == "on" and s.n_gpu_layers == "99" and s.control_vector_layer_range == ("0", "3")
    assert s.direct_io is False and s.is_set("check_tensors")


def test_optional_value_flag_does_not_eat_the_next_flag() -> None:
    assert resolve(["-fa", "-m", "x"]).flash_attn is True
    assert resolve(["-fa", "-1"]).flash_attn == "-1"
    assert resolve(["--log-colors"]).log_colors == "on"


@pytest.mark.parametrize(
    ("argv", "env", "spelling"),
    [
        (["--model-url", "http://h/m.gguf"], {}, "--model-url"),
        (["--fim-qwen-7b-default"], {}, "--fim-qwen-7b-default"),
        ([], {"LLAMA_ARG_TOOLS_RUNTIME": "docker:img"}, "LLAMA_ARG_TOOLS_RUNTIME"),
    ],
)
def test_refused_options_stop_start_up_with_a_reason(argv, env, spelling) -> None:
    with pytest.raises(SettingsError) as info:
        resolve_settings(argv, env)
    message = str(info.value)
    assert message.startswith(spelling) and "not supported" in message
    assert settings_by_name[_setting_for(spelling)].reason in message


def _setting_for(spelling: str) -> str:
    for s in SETTINGS:
        if spelling in s.flags + s.negative_flags or spelling in s.env_lookup:
            return s.name
    raise KeyError(spelling)


def test_slot_save_path_is_a_directory_or_a_path_for_one(tmp_path) -> None:
    assert resolve(["--slot-save-path", str(tmp_path)]).slot_save_path == str(tmp_path)
    assert resolve([], MLXCEL_SLOT_SAVE_PATH=str(tmp_path)).slot_save_path == str(tmp_path)
    assert resolve([]).slot_save_path is None
    # A missing directory is accepted (the server creates it at start-up); a file is not.
    assert resolve(["--slot-save-path", str(tmp_path / "new")]).slot_save_path == str(tmp_path / "new")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SettingsError, match="--slot-save-path.*a directory"):
        resolve_settings(["--slot-save-path", str(tmp_path / "file")], {})


def test_disk_tier_settings() -> None:
    s = resolve(["--prompt-cache-dir", "/var/cache/x", "--prompt-cache-disk-capacity-bytes", "1000"])
    assert (s.prompt_cache_dir, s.prompt_cache_disk_capacity_bytes) == ("/var/cache/x", 1000)
    s = resolve([], MLXCEL_PROMPT_CACHE_DIR="/d", MLXCEL_PROMPT_CACHE_DISK_CAPACITY_BYTES="5")
    assert (s.prompt_cache_dir, s.prompt_cache_disk_capacity_bytes) == ("/d", 5)
    assert resolve([]).prompt_cache_dir is None  # off by default
    with pytest.raises(SettingsError, match="--prompt-cache-disk-capacity-bytes"):
        resolve_settings(["--prompt-cache-disk-capacity-bytes", "-1"], {})


def test_refused_options_in_their_off_state_are_fine() -> None:
    s = resolve(["--no-agent", "--no-ui-mcp-proxy"], LLAMA_ARG_EMBEDDINGS="0", LLAMA_ARG_SSL_CERT_FILE="")
    assert s.agent is False and s.embeddings is False and s.ssl_cert_file == ""


# --------------------------------------------------------------------------- prompt cache switch


@pytest.mark.parametrize(("raw", "enabled"), [("0", False), ("256", True), ("true", True), ("OFF", False), ("1", True)])
def test_llama_arg_cache_reuse_switches_the_prompt_cache(raw: str, enabled: bool) -> None:
    s = resolve(LLAMA_ARG_CACHE_REUSE=raw)
    assert s.prompt_cache_enabled is enabled
    assert s.sources["prompt_cache_enabled"] == "env:LLAMA_ARG_CACHE_REUSE"


@pytest.mark.parametrize("raw", ["abc", "-5", "2.5"])
def test_malformed_llama_arg_cache_reuse_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match="LLAMA_ARG_CACHE_REUSE"):
        resolve(LLAMA_ARG_CACHE_REUSE=raw)


def test_llama_arg_cache_reuse_is_not_read_when_the_switch_is_set() -> None:
    s = resolve(MLXCEL_PROMPT_CACHE_ENABLED="1", LLAMA_ARG_CACHE_REUSE="0")
    assert s.prompt_cache_enabled is True and s.sources["prompt_cache_enabled"] == "env:MLXCEL_PROMPT_CACHE_ENABLED"
    assert resolve(MLXCEL_PROMPT_CACHE_ENABLED="no", LLAMA_ARG_CACHE_REUSE="abc").prompt_cache_enabled is False
    s = resolve(["--prompt-cache-enabled=false"], LLAMA_ARG_CACHE_REUSE="256")
    assert s.prompt_cache_enabled is False and s.cache_reuse == 0
    assert resolve(["--prompt-cache-enabled"], LLAMA_ARG_CACHE_REUSE="garbage").prompt_cache_enabled is True


def test_prompt_cache_enabled_flag_forms() -> None:
    assert resolve(["--prompt-cache-enabled", "-c", "8"]).prompt_cache_enabled is True
    assert resolve(["--prompt-cache-enabled", "false"]).prompt_cache_enabled is False
    assert resolve(["--prompt-cache-enabled=0"]).prompt_cache_enabled is False
    assert resolve(["--apc-enabled=no"], APC_ENABLED="1").apc_enabled is False
    assert resolve(APC_ENABLED="0").apc_enabled is False


def test_no_cache_prompt_turns_the_prompt_cache_off() -> None:
    s = resolve(["--no-cache-prompt"])
    assert s.cache_prompt is False and s.prompt_cache_enabled is False
    assert s.sources["prompt_cache_enabled"] == "cli"
    assert resolve(LLAMA_ARG_NO_CACHE_PROMPT="").prompt_cache_enabled is False
    assert resolve(["--no-cache-prompt"], MLXCEL_PROMPT_CACHE_ENABLED="1").prompt_cache_enabled is False
    assert resolve(["--no-cache-prompt", "--cache-reuse", "256"]).prompt_cache_enabled is False
    # only the explicit flag overrides it
    s = resolve(["--no-cache-prompt", "--prompt-cache-enabled"])
    assert s.cache_prompt is False and s.prompt_cache_enabled is True


def test_cache_reuse_flag_beats_the_mlxcel_variable() -> None:
    assert resolve(["--cache-reuse", "0"]).prompt_cache_enabled is False
    assert resolve(["--cache-reuse", "256"], MLXCEL_PROMPT_CACHE_ENABLED="0").prompt_cache_enabled is True


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("argv", "env", "where"),
    [
        (["-np", "0"], {}, "-np"),
        ([], {"LLAMA_ARG_N_PARALLEL": "0"}, "LLAMA_ARG_N_PARALLEL"),
        (["--parallel", "-2"], {}, "--parallel"),
        (["--port", "70000"], {}, "--port"),
        (["-c", "-1"], {}, "-c"),
        (["-b", "0"], {}, "-b"),
        ([], {"APC_BLOCK_SIZE": "0"}, "APC_BLOCK_SIZE"),
        (["--repeat-penalty", "0"], {}, "--repeat-penalty"),
        (["--seed", str(2**32)], {}, "--seed"),
        (["--repeat-last-n", "-1"], {}, "--repeat-last-n"),
    ],
)
def test_out_of_range_values_are_rejected(argv, env, where) -> None:
    with pytest.raises(SettingsError, match=f"invalid value for {where}"):
        resolve_settings(argv, env)


def test_in_range_edge_values_are_accepted() -> None:
    s = resolve(["-np", "1", "--port", "0", "--seed", "-1", "-n", "-1", "--apc-block-size", "1"])
    assert (s.n_parallel, s.port, s.seed, s.n_predict, s.apc_block_size) == (1, 0, -1, -1, 1)


# --------------------------------------------------------------------------- the Settings object


def test_settings_are_frozen_and_hide_secrets() -> None:
    s = resolve(["--api-key", "sekrit", "-hft", "hf_tok"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ctx_size = 1  # type: ignore[misc]
    assert "sekrit" not in repr(s) and "hf_tok" not in repr(s)
    with pytest.raises(KeyError):
        s.is_set("no_such_setting")


def test_make_settings_and_require_model() -> None:
    s = make_settings(model="m", ctx_size=128)
    assert s.ctx_size == 128 and s.is_set("ctx_size") and not s.is_set("port")
    require_model(s)
    with pytest.raises(SettingsError, match="router mode"):
        require_model(make_settings())
    with pytest.raises(SettingsError, match="unknown settings"):
        make_settings(bogus=1)


def test_parse_argv_groups_occurrences_by_setting() -> None:
    found = parse_argv(["-c", "1", "--ctx-size", "2", "--no-jinja"])
    assert [o.spelling for o in found["ctx_size"]] == ["-c", "--ctx-size"]
    assert found["jinja"][0].value is False


# --------------------------------------------------------------------------- generated docs


def test_configuration_md_is_up_to_date() -> None:
    path = ROOT / "docs" / "configuration.md"
    assert path.read_text(encoding="utf-8") == render_markdown(), "run python scripts/gen_docs.py"


def test_gen_docs_check_passes_and_detects_staleness(tmp_path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    assert gen_docs.main(["--check"]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text("old", encoding="utf-8")
    monkeypatch.setattr(gen_docs, "CONFIGURATION_MD", stale)
    assert gen_docs.main(["--check"]) == 1
    assert stale.read_text(encoding="utf-8") == "old"  # --check never writes


def test_markdown_lists_every_setting_with_its_variables() -> None:
    text = render_markdown()
    for s in SETTINGS:
        for name in s.flags[:1] + ((s.mlxcel_env,) if s.mlxcel_env else ()):
            assert f"`{name}`" in text, s.name
    assert "`LLAMA_ARG_NO_CACHE_PROMPT`" in text and "| refused |" in text and "| noop |" in text


def test_lora_flags_keep_llama_servers_order_and_format() -> None:
    """--lora and --lora-scaled append to one list (ids in command-line order), comma lists and
    repeated flags both add; FNAME:SCALE splits on its one ':'; no LLAMA_ARG_* name exists."""
    from mlxcel_compat.lora.adapters import AdapterSpec, adapter_specs

    s = resolve_settings(["--lora-scaled", "b.gguf:0.5", "--lora", "a.gguf,c", "--lora-scaled", "d:2",
                          "--lora-init-without-apply"], {})
    assert adapter_specs(s) == [AdapterSpec("b.gguf", 0.5), AdapterSpec("a.gguf", 1.0), AdapterSpec("c", 1.0),
                                AdapterSpec("d", 2.0)]
    assert s.lora_init_without_apply is True
    s = resolve_settings([], {"MLXCEL_LORA": "x", "MLXCEL_LORA_SCALED": "z:3", "LLAMA_ARG_LORA": "ignored"})
    assert adapter_specs(s) == [AdapterSpec("x", 1.0), AdapterSpec("z", 3.0)]
    for bad in ("b.gguf", "a:b:1", "b.gguf:x"):
        with pytest.raises(SettingsError, match="invalid value for --lora-scaled"):
            resolve_settings(["--lora-scaled", bad], {})


def test_ui_config_and_its_file_must_hold_json_objects(tmp_path) -> None:
    good = tmp_path / "ui.json"
    good.write_text('{"systemMessage": "Be brief.", "temperature": 0.5}', encoding="utf-8")
    s = resolve(["--webui-config-file", str(good)], LLAMA_ARG_UI_CONFIG='{"temperature": 0.1}')
    assert s.ui_config_file == str(good) and s.ui_config == {"temperature": 0.1}
    listed = tmp_path / "list.json"
    listed.write_text("[1]", encoding="utf-8")
    for argv in (["--ui-config", "[1]"], ["--ui-config-file", str(listed)], ["--ui-config-file", str(tmp_path / "missing.json")]):
        with pytest.raises(SettingsError, match=f"invalid value for {argv[0]}"):
            resolve(argv)


def test_agent_tools_and_their_cors_default() -> None:
    from mlxcel_compat.settings import cors_origins, mcp_proxy_enabled, server_tools

    off = resolve_settings(["-m", "x"], environ={})
    assert server_tools(off) == () and not mcp_proxy_enabled(off) and cors_origins(off) == "*"
    agent = resolve_settings(["-m", "x", "--agent"], environ={})
    assert server_tools(agent) == ("all",) and mcp_proxy_enabled(agent) and cors_origins(agent) == "localhost"
    some = resolve_settings(["-m", "x"], environ={"LLAMA_ARG_TOOLS": "read_file,get_info"})
    assert server_tools(some) == ("read_file", "get_info") and not mcp_proxy_enabled(some)
    explicit = resolve_settings(["-m", "x", "--tools", "all", "--cors-origins", "*"], environ={})
    assert cors_origins(explicit) == "*"
    proxy_only = resolve_settings(["-m", "x", "--ui-mcp-proxy"], environ={})
    assert mcp_proxy_enabled(proxy_only) and cors_origins(proxy_only) == "*"  # llama-server: only tools and MCP servers
    with pytest.raises(SettingsError, match='unknown tool "shell". available tools: read_file'):
        resolve_settings(["-m", "x", "--tools", "shell"], environ={})
    with pytest.raises(SettingsError, match="--tools-runtime is not supported by mlxcel_compat: the built-in tools run on the host only"):
        resolve_settings(["-m", "x", "--tools-runtime", "ssh:box"], environ={})


# --------------------------------------------------------------------------- embeddings (issue 32)


def test_embedding_options_parse_as_llama_server_spells_them() -> None:
    s = resolve(["--embedding", "--pooling", "mean", "--embd-normalize", "-1"])
    assert (s.embeddings, s.rerank, s.pooling, s.embd_normalize) == (True, False, "mean", -1)
    s = resolve([], LLAMA_ARG_RERANKING="1", LLAMA_ARG_POOLING="last")
    assert (s.rerank, s.pooling, s.embd_normalize) == (True, "last", 2)
    with pytest.raises(SettingsError, match="--pooling"):
        resolve(["--pooling", "max"])
