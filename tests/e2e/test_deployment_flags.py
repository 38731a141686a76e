"""llama-server's deployment flags, each proven on a real server (issue 55).

Three servers for the module: ``deployed``, a Q8_0 GGUF behind most flags at once (TLS, a port
others may share, a static directory, llama.cpp's log format into a file, a 1 MiB prompt cache,
metadata overrides, the weights read into memory and locked); ``overridden``, the tiny llama
directory with RoPE flags and one thread; ``configured``, a copy of that directory whose
config.json makes the same RoPE change, with two threads (slow: its config.json is new, so its
tokenizer is built afresh, 10-30 s on a busy machine). The session's default ``server`` (the
same directory, no flags) is the baseline of the default run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import LLAMA_SERVER, MODEL_CACHE, SLOW, ServerProcess, start_llama_server

ROPE_FLAGS = ["--rope-freq-base", "5000", "--rope-scale", "2"]
ROPE_CONFIG = {"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl, made for the test)."""
    root = tmp_path_factory.mktemp("tls")
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def static_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("public")
    (root / "index.html").write_text("<h1>static index</h1>")
    (root / "hello.txt").write_text("hello from --path")
    (root / "docs").mkdir()
    (root / "docs" / "index.html").write_text("<p>docs index</p>")
    (root / "props").write_text("a file named like a route")
    return root


@pytest.fixture(scope="module")
def deployed(server_factory, tls_files, static_dir, tmp_path_factory) -> tuple[ServerProcess, str, Path, Path]:
    """(server, https base URL, certificate, log file)."""
    from mlxcel_compat.testing.gguf_writer import ensure_gguf

    model = ensure_gguf("llama", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    key, cert = tls_files
    log_file = tmp_path_factory.mktemp("logs") / "server.log"
    server = server_factory(
        ["-m", str(model), "-np", "1", "-c", "256", "--ssl-key-file", str(key), "--ssl-cert-file", str(cert),
         "--reuse-port", "--path", str(static_dir), "--log-file", str(log_file), "--log-prefix",
         "--log-timestamps", "--log-colors", "on", "-cram", "1", "--override-kv",
         f"tokenizer.ggml.eos_token_id=int:{EOS_OVERRIDE},tokenizer.ggml.add_bos_token=bool:false",
         "--no-mmap", "--mlock"],
        wait=False,
    )
    url = f"https://127.0.0.1:{server.port}"
    deadline = time.monotonic() + 120
    while True:
        assert server.proc.poll() is None, server.log()
        try:
            if httpx.get(url + "/health", verify=str(cert), timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    return server, url, cert, log_file


EOS_OVERRIDE = 300  # an ordinary token of the factory's vocabulary, made the end of generation


@pytest.fixture(scope="module")
def configured(server_factory, llama_dir: Path, tmp_path_factory) -> ServerProcess:
    """The tiny llama whose config.json carries the RoPE change, on two threads."""
    copy = tmp_path_factory.mktemp("rope") / "llama"
    shutil.copytree(llama_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **ROPE_CONFIG}))
    return server_factory(["-m", str(copy), "-np", "1", "-c", "256", "-t", "2", "-tb", "2"])


@pytest.fixture(scope="module")
def overridden(server_factory, llama_dir: Path) -> ServerProcess:
    """The tiny llama as it is, changed by the RoPE flags, on one thread."""
    return server_factory(["-m", str(llama_dir), "-np", "1", "-c", "256", "-t", "1", "-tb", "1", *ROPE_FLAGS])


def first_token_probs(base_url: str, **client: object) -> list:
    body = {"prompt": PROMPT, "n_predict": 1, "n_probs": 8, "temperature": 0, "cache_prompt": False}
    reply = httpx.post(base_url + "/completion", json=body, timeout=60, **client).json()
    return reply["completion_probabilities"][0]["top_logprobs"]


def test_rope_flags_change_the_logits(overridden, server) -> None:
    assert first_token_probs(server.base_url) != first_token_probs(overridden.base_url)
    assert "RoPE overrides: scale=2.0, freq_base=5000.0" in overridden.log()


@SLOW
def test_rope_flags_change_the_logits_exactly_as_the_config_change(overridden, configured) -> None:
    by_flags = first_token_probs(overridden.base_url)
    by_config = first_token_probs(configured.base_url)
    assert by_flags == by_config  # same ids, same log-probabilities to the last bit


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_threads_bound_the_runtime(overridden, server) -> None:
    for each in (overridden, server):  # a prefill and decode steps on each
        httpx.post(each.base_url + "/completion", json={"prompt": PROMPT * 6, "n_predict": 8}, timeout=60)
    assert "1 threads)" in overridden.log() and "CPU threads: 1 for decode steps (-t), 1 for prompt chunks" in overridden.log()
    if len(os.sched_getaffinity(server.proc.pid)) > 1:
        assert thread_count(overridden.proc.pid) < thread_count(server.proc.pid)


@SLOW
def test_threads_bound_the_runtime_and_leave_results_alone(overridden, configured) -> None:
    long_prompt = PROMPT * 6  # prefill in large products (OpenBLAS), then decode steps (the shim's pool)
    outputs = []
    for server in (overridden, configured):
        reply = httpx.post(server.base_url + "/completion", json={"prompt": long_prompt, "n_predict": 8,
                                                                  "temperature": 0}, timeout=60).json()
        outputs.append(reply["content"])
    assert outputs[0] == outputs[1]
    assert "1 threads)" in overridden.log() and "2 threads)" in configured.log()
    one, two = thread_count(overridden.proc.pid), thread_count(configured.proc.pid)
    assert two - one >= 1, (one, two)  # OpenBLAS's worker (and the shim pool's) exist only with -t 2


def test_openai_sdk_over_tls_with_a_self_signed_certificate(deployed) -> None:
    import openai

    server, url, cert, _ = deployed
    with httpx.Client(verify=str(cert)) as http:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", http_client=http)
        reply = client.completions.create(model="any", prompt="Hello", max_tokens=3, temperature=0)
    assert reply.choices[0].text is not None and reply.usage.completion_tokens >= 1
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no HTTP answer
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    assert f"server is listening on https://127.0.0.1:{server.port}" in server.log()


def test_reuse_port_lets_another_socket_bind_the_port(deployed, overridden) -> None:
    server = deployed[0]
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", server.port))  # shares the port: the server's socket allows it
    with socket.socket() as sock, pytest.raises(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", overridden.port))  # a server without --reuse-port does not


def test_path_serves_the_directory_ahead_of_the_routes(deployed) -> None:
    _, url, cert, _ = deployed
    with httpx.Client(base_url=url, verify=str(cert), timeout=30) as http:
        assert http.get("/").text == "<h1>static index</h1>"
        assert http.get("/index.html").text == "<h1>static index</h1>"
        hello = http.get("/hello.txt")
        assert hello.text == "hello from --path" and hello.headers["content-type"].startswith("text/plain")
        assert http.get("/docs/").text == "<p>docs index</p>"
        assert http.get("/docs", follow_redirects=False).status_code == 301  # as httplib redirects a directory
        assert http.get("/props").text == "a file named like a route"  # files first, as httplib's mount point
        assert http.get("/ui/main.js").status_code == 404  # the built-in page is not served
        assert http.get("/%2e%2e/%2e%2e/etc/hostname").status_code == 404
        assert http.get("/v1/models").json()["data"]  # other routes answer as usual


def test_log_flags_write_llama_cpp_lines_to_the_file(deployed) -> None:
    server, _, _, log_file = deployed
    lines = log_file.read_text().splitlines()
    assert lines and all("\033" not in line for line in lines)  # the file is never coloured
    assert any(re.match(r"^\d+\.\d\d\.\d{3}\.\d{3} I server is listening on https://", line) for line in lines), lines[:5]
    assert "\033[32mI \033[0m" in server.log()  # stderr: llama.cpp's green info mark


def test_cache_ram_sets_the_prompt_cache_budget(deployed) -> None:
    _, url, cert, _ = deployed
    stats = httpx.get(url + "/v1/cache/stats", verify=str(cert), timeout=30).json()
    assert stats["capacity_bytes"] == 1 << 20


def test_override_kv_eos_stops_generation_and_add_bos_changes_tokenization(deployed, server) -> None:
    _, url, cert, _ = deployed
    forced = {"prompt": "Hello", "n_predict": 6, "temperature": 0, "logit_bias": [[EOS_OVERRIDE, 100]]}
    reply = httpx.post(url + "/completion", json=forced, verify=str(cert), timeout=60).json()
    assert reply["stop_type"] == "eos" and reply["tokens_predicted"] <= 1
    plain = httpx.post(server.base_url + "/completion", json=forced, timeout=60).json()  # same vocabulary
    assert plain["stop_type"] == "limit" and plain["tokens_predicted"] == 6
    body = {"content": "Hello", "add_special": True}
    ours = httpx.post(url + "/tokenize", json=body, verify=str(cert), timeout=30).json()["tokens"]
    theirs = httpx.post(server.base_url + "/tokenize", json=body, timeout=30).json()["tokens"]
    assert theirs[1:] == ours and len(theirs) == len(ours) + 1  # the BOS is gone


def test_no_mmap_and_mlock_keep_the_weights_in_locked_process_memory(deployed) -> None:
    server, _, _, _ = deployed
    model = str(server.args[server.args.index("-m") + 1])
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert model not in maps  # --no-mmap: read into the process, nothing of the file mapped
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    locked_kb = int(re.search(r"VmLck:\s+(\d+) kB", status).group(1))
    assert locked_kb * 1024 >= os.path.getsize(model) - 4096, (locked_kb, server.log()[-2000:])


@SLOW
@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="the llama-server binary (b11312) is not built on this machine")
@pytest.mark.parametrize("flags", [ROPE_FLAGS, ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "64"]],
                         ids=["linear", "yarn"])
def test_rope_flags_mean_what_they_mean_to_llama_server(flags: list[str], server_factory) -> None:
    """The same flags on the same f32 GGUF: llama-server's first-token distribution, to float32
    rounding (the factor is not inverted, YaRN's original context is taken, ...)."""
    from mlxcel_compat.testing.gguf_writer import ensure_gguf

    model = ensure_gguf("llama", "tiny", "f32", cache_dir=MODEL_CACHE)
    args = ["-m", str(model), "-np", "1", "-c", "256", *flags]
    proc, url = start_llama_server(args)
    try:
        theirs = first_token_probs(url)
    finally:
        proc.kill()
        proc.wait()
    ours = first_token_probs(server_factory(args).base_url)
    assert [t["id"] for t in ours] == [t["id"] for t in theirs]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(ours, theirs)) < 5e-3


@SLOW
@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="the llama-server binary (b11312) is not built on this machine")
def test_override_kv_means_what_it_means_to_llama_server(server_factory) -> None:
    """The same overrides on the same GGUF: llama-server tokenizes without the BOS and stops at the
    overridden EOS where this server does."""
    from mlxcel_compat.testing.gguf_writer import ensure_gguf

    model = ensure_gguf("llama", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    args = ["-m", str(model), "-np", "1", "-c", "256", "--override-kv",
            f"tokenizer.ggml.eos_token_id=int:{EOS_OVERRIDE},tokenizer.ggml.add_bos_token=bool:false"]
    forced = {"prompt": "Hello", "n_predict": 6, "temperature": 0, "logit_bias": [[EOS_OVERRIDE, 100]]}
    tokenize = {"content": "Hello world", "add_special": True}
    proc, url = start_llama_server(args)
    try:
        theirs = (httpx.post(url + "/tokenize", json=tokenize, timeout=30).json()["tokens"],
                  httpx.post(url + "/completion", json=forced, timeout=60).json()["stop_type"])
    finally:
        proc.kill()
        proc.wait()
    base = server_factory(args).base_url
    ours = (httpx.post(base + "/tokenize", json=tokenize, timeout=30).json()["tokens"],
            httpx.post(base + "/completion", json=forced, timeout=60).json()["stop_type"])
    assert ours == theirs and theirs[1] == "eos"
