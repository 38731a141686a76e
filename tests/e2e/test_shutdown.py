"""End to end: SIGTERM / SIGINT drain the server and exit in bounded time.

After the signal, new requests get 503 (``/health`` included, so a load balancer stops routing),
running streams have ``--shutdown-grace`` seconds and then end with a final error event, and the
process exits 0. A second signal ends the running streams at once.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

pytestmark = pytest.mark.e2e

LONG_STREAM = {"prompt": "Keep going", "n_predict": 100000, "ignore_eos": True, "stream": True}


def start_stream(base_url: str) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    """Start a long stream in a thread; ``started`` is set once its first token arrived."""
    started = threading.Event()
    out: dict[str, Any] = {"events": []}

    def run() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            with client.stream("POST", "/completion", json=LONG_STREAM) as response:
                out["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(json.loads(line[len("data: ") :]))
                        started.set()
        out["closed"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out, started


@pytest.fixture()
def fresh_server(tmp_path, llama_dir):
    servers: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        server = ServerProcess(args=["-m", str(llama_dir), "-np", "2", "-c", "32768", *extra]).start(tmp_path)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_sigterm_refuses_new_requests_ends_streams_and_exits(fresh_server) -> None:
    server = fresh_server("--shutdown-grace", "2")
    thread, stream, started = start_stream(server.base_url)
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # During the grace period: new requests (health checks too) are refused with 503.
    refused = None
    while refused is None and time.monotonic() - signalled < 2:
        try:
            response = httpx.post(server.base_url + "/completion", json={"prompt": "new", "n_predict": 1}, timeout=5)
            if response.status_code == 503:
                refused = response
        except httpx.TransportError:
            break
        time.sleep(0.05)
    assert refused is not None, "no 503 while draining"
    assert refused.json()["error"] == {"code": 503, "message": "Server is shutting down", "type": "unavailable_error"}
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503
    # The running stream ends with a final event: its generation was cut after the grace.
    thread.join(30)
    assert not thread.is_alive() and stream["status"] == 200
    final = stream["events"][-1]
    assert final["error"]["code"] == 503 and final["error"]["type"] == "unavailable_error"
    assert len(stream["events"]) > 1  # tokens were streamed before it
    assert stream["closed"] - signalled >= 1.5  # it had its grace
    # ... and the process exits, 0, in bounded time.
    assert server.proc.wait(timeout=20) == 0


def test_second_signal_ends_running_streams_at_once(fresh_server) -> None:
    server = fresh_server("--shutdown-grace", "60")
    thread, stream, started = start_stream(server.base_url)
    assert started.wait(60)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGINT)
    thread.join(20)
    assert not thread.is_alive(), "the stream was not ended by the second signal"
    assert stream["events"][-1]["error"]["code"] == 503
    assert server.proc.wait(timeout=20) == 0


def test_idle_server_exits_promptly_on_sigterm(fresh_server) -> None:
    server = fresh_server()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0
