"""End to end: an over-limit body gets a 413 every client can read (issue 29.4).

``--max-body-bytes`` refuses a body as soon as its ``Content-Length`` (or the part read so far)
is over the limit. httpx, requests and the openai SDK write the whole body before they read a
byte of the answer, so closing the connection at once gave them a broken pipe or a reset instead
of the 413. The server now keeps reading and dropping the body, as nginx's lingering close does,
up to ``max(128 MiB, 8 x the limit)`` bytes and 10 s, with the 413 already sent; beyond that the
connection is cut as before. Here the limit is 1 MiB: bodies of 2x and 64x the limit get the
413 JSON through each client, a 256 MiB body is cut, and ``/health`` stays fast while 64 MiB
drain.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import requests

from tests.conftest import ServerProcess
from tests.e2e.helpers import assert_serving

pytestmark = pytest.mark.e2e

MIB = 1 << 20
LIMIT = MIB
SIZES = [2 * LIMIT, 64 * LIMIT]


@pytest.fixture(scope="module")
def limited(server_factory, llama_dir) -> ServerProcess:
    return server_factory(["-m", str(llama_dir), "-c", "512", "-np", "1", "--max-body-bytes", str(LIMIT)])


def body_of(size: int) -> bytes:
    """A JSON completion body of exactly ``size`` bytes."""
    head, tail = b'{"n_predict": 1, "prompt": "', b'"}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def assert_413_json(status: int, data: dict[str, Any], size: int) -> None:
    assert status == 413
    assert data == {"error": {"code": 413, "message": f"request body too large: {size} bytes; the limit is {LIMIT} bytes (--max-body-bytes)",
                              "type": "invalid_request_error"}}


@pytest.mark.parametrize("size", SIZES, ids=["2x", "64x"])
def test_httpx_reads_the_413(limited: ServerProcess, size: int) -> None:
    with httpx.Client(base_url=limited.base_url, timeout=60) as client:
        response = client.post("/completion", content=body_of(size), headers={"content-type": "application/json"})
        assert_413_json(response.status_code, response.json(), size)
        assert response.headers["connection"] == "close"
        assert_serving(client)


@pytest.mark.parametrize("size", SIZES, ids=["2x", "64x"])
def test_requests_reads_the_413(limited: ServerProcess, size: int) -> None:
    response = requests.post(limited.base_url + "/completion", data=body_of(size), headers={"content-type": "application/json"}, timeout=60)
    assert_413_json(response.status_code, response.json(), size)


@pytest.mark.parametrize("size", SIZES, ids=["2x", "64x"])
def test_openai_sdk_gets_an_api_status_error(limited: ServerProcess, size: int) -> None:
    """What a user of the SDK sees: status 413 and the server's message, not "Connection error"."""
    client = openai.OpenAI(base_url=limited.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "a" * size}])
    assert info.value.status_code == 413
    assert "request body too large" in info.value.message and "--max-body-bytes" in info.value.message
    assert info.value.body["code"] == 413 and info.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("size", SIZES, ids=["2x", "64x"])
def test_curl_reads_the_413(limited: ServerProcess, size: int, tmp_path: Path) -> None:
    path = tmp_path / "body.json"
    path.write_bytes(body_of(size))
    result = subprocess.run(
        ["curl", "-sS", "-H", "Content-Type: application/json", "--data-binary", f"@{path}", "-w", "\n%{http_code}", limited.base_url + "/completion"],
        capture_output=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    text, _, code = result.stdout.decode().rpartition("\n")
    assert_413_json(int(code), json.loads(text), size)


@pytest.mark.parametrize("size", SIZES, ids=["2x", "64x"])
def test_the_whole_body_is_taken_then_the_connection_ends_cleanly(limited: ServerProcess, size: int) -> None:
    """What the clients above rely on, at the socket: all of the body can be written, the 413 is
    there to read after it, and the server ends with a clean close (FIN), not a reset that can
    throw away the answer before the client reads it (closing with unread data sends one)."""
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as sock:
        head = f"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
        sock.sendall(head.encode() + body_of(size))
        answer = b""
        while True:
            data = sock.recv(65536)  # a reset raises ConnectionResetError here
            if not data:
                break
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert_413_json(413, json.loads(body), size)


def test_a_chunked_body_over_the_limit_is_read_to_its_end(limited: ServerProcess) -> None:
    """No Content-Length: refused once over the limit, then drained; httpx reads the 413."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(16):
            yield b"a" * MIB
        yield b'"}'

    with httpx.Client(base_url=limited.base_url, timeout=60) as client:
        response = client.post("/completion", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]
        assert_serving(client)


def test_a_body_beyond_the_drain_bound_is_cut(limited: ServerProcess) -> None:
    """256 MiB declared (the bound is 128 MiB here): the 413 goes out and the connection is closed
    at once, with almost all of the body unsent, as before the lingering close."""
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as sock:
        sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(256 * MIB).encode() + b"\r\n\r\n")
        answer = b""
        while b"--max-body-bytes" not in answer:  # the 413 comes before any of the body is sent
            data = sock.recv(65536)
            assert data, answer
            answer += data
        assert answer.startswith(b"HTTP/1.1 413")
        sent, closed = 0, False
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline and sent < 256 * MIB:
                sock.sendall(b"a" * MIB)
                sent += MIB
        except OSError:
            closed = True
        if not closed:  # the kernel may buffer a few MiB: the peer's close shows on a read
            sock.settimeout(5)
            try:
                closed = sock.recv(65536) == b""
            except OSError:
                closed = True
        assert closed and sent < 128 * MIB, sent


def test_health_stays_fast_while_64_mib_drain(limited: ServerProcess) -> None:
    """The drain only moves bytes: /health's p99 stays under 50 ms meanwhile (issue 29.4)."""
    size = 64 * MIB
    payload = body_of(size)
    done = threading.Event()
    result: dict[str, Any] = {}

    def slowly() -> Iterator[bytes]:
        for i in range(0, size, MIB):  # spread over about 2 s, so /health is polled all along
            yield payload[i : i + MIB]
            time.sleep(0.03)

    def send() -> None:
        with httpx.Client(base_url=limited.base_url, timeout=120) as client:
            headers = {"content-type": "application/json", "content-length": str(size)}
            result["response"] = client.post("/completion", content=slowly(), headers=headers)
        done.set()

    with httpx.Client(base_url=limited.base_url, timeout=30) as health:
        health.get("/health")  # connected before the drain starts
        sender = threading.Thread(target=send)
        sender.start()
        latencies = []
        while not done.is_set():
            t = time.perf_counter()
            assert health.get("/health").status_code == 200
            latencies.append((time.perf_counter() - t) * 1000.0)
            time.sleep(0.01)
        sender.join()
    assert result["response"].status_code == 413
    assert len(latencies) >= 20, latencies
    p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))]
    assert p99 < 50.0, (p99, max(latencies), len(latencies))
