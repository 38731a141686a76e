"""Several listen addresses: ``--host`` as a comma list, as llama-server parses and binds it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxcel_compat.listen import parse_hosts, url_of
from tests.conftest import free_port

pytestmark = pytest.mark.e2e


def _second_loopback() -> str:
    """``::1`` where this machine has IPv6 loopback, else another IPv4 loopback address."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return "::1"
    except OSError:
        return "127.0.0.2"


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "MLXCEL_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "mlxcel_compat", *args], capture_output=True, text=True, env=full_env, timeout=120)


def test_host_list_is_parsed_as_llama_cpp_parses_it() -> None:
    assert parse_hosts("127.0.0.1") == ["127.0.0.1"]
    assert parse_hosts(" 127.0.0.1 , ::1 ,, ") == ["127.0.0.1", "::1"]
    assert parse_hosts('"/tmp/a,b.sock",0.0.0.0') == ["/tmp/a,b.sock", "0.0.0.0"]
    with pytest.raises(ValueError, match="at least one address"):
        parse_hosts(" , ")
    assert url_of("::1", 8080) == "http://[::1]:8080"
    assert url_of("/run/x.sock", 8080) == "unix:///run/x.sock"


def test_every_address_serves_and_the_flag_replaces_the_env(server_factory, llama_dir: Path, tmp_path: Path) -> None:
    second = _second_loopback()
    sock_path = tmp_path / "llama.sock"
    server = server_factory(
        ["-m", str(llama_dir), "-np", "1", "-c", "512", "--host", f"127.0.0.1,{second},{sock_path}"],
        env={"LLAMA_ARG_HOST": "127.0.0.3"},
    )
    port = server.port
    second_url = f"http://[{second}]:{port}" if ":" in second else f"http://{second}:{port}"
    for base in (f"http://127.0.0.1:{port}", second_url):
        with httpx.Client(base_url=base, timeout=30) as client:
            assert client.get("/health").json() == {"status": "ok"}
            assert client.post("/completion", json={"prompt": "Hi", "n_predict": 2}).json()["tokens_predicted"] == 2
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock_path)), base_url="http://llama", timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError):  # LLAMA_ARG_HOST was replaced, not added
        httpx.get(f"http://127.0.0.3:{port}/health", timeout=5)
    log = server.log()
    assert f"listening on http://127.0.0.1:{port}" in log and f"listening on unix://{sock_path}" in log


def test_bad_host_lists_stop_start_up(llama_dir: Path) -> None:
    model = ["-m", str(llama_dir), "-np", "1"]
    empty = _cli([*model, "--host", " , "])
    assert empty.returncode == 2 and "--host" in empty.stderr
    port0 = _cli([*model, "--host", f"127.0.0.1,{_second_loopback()}", "--port", "0"])
    assert port0.returncode == 1 and "--port 0 is not supported with multiple TCP addresses" in port0.stderr
    port = free_port()
    unbindable = _cli([*model, "--host", "127.0.0.1,192.0.2.1", "--port", str(port)])  # TEST-NET-1: not ours
    assert unbindable.returncode == 1
    assert f"couldn't bind HTTP server socket, hostname: 192.0.2.1, port: {port}" in unbindable.stderr
