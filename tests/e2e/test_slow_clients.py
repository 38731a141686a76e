"""End to end: idle and slow clients cannot take the server away from the others.

``--timeout`` is llama-server's read/write timeout: a client that stops sending its body, or
stops reading its response, for that long loses its connection (and its generation); an idle
keep-alive connection closes after at most 5 s. Meanwhile /health and real requests are served.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.e2e.helpers import assert_serving, wait_idle

pytestmark = pytest.mark.e2e

TIMEOUT = 2


@pytest.fixture(scope="module")
def timeout_server(server_factory, llama_dir) -> str:
    server = server_factory(["-m", str(llama_dir), "-np", "2", "-c", "32768", "--timeout", str(TIMEOUT)])
    return server.base_url


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True once the server closed the connection (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_idle_connections_and_a_slow_body_do_not_stop_other_requests(timeout_server: str) -> None:
    idle = [connect(timeout_server) for _ in range(100)]  # connected, nothing sent
    kept_alive = []
    for _ in range(100):  # one request answered, then idle on a kept-alive connection
        sock = connect(timeout_server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        kept_alive.append(sock)
    slowloris = connect(timeout_server)
    slowloris.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    with httpx.Client(base_url=timeout_server, timeout=30) as client:
        for _ in range(5):
            slowloris.sendall(b" ")  # a byte now and then, well within the read timeout
            assert client.get("/health").status_code == 200
            assert_serving(client)
        # Once silent for --timeout seconds, the slow body's connection is dropped ...
        assert closed_by_server(slowloris, TIMEOUT + 3)
        # ... and the idle connections are closed too (keep-alive timeout, at most --timeout here).
        assert all(closed_by_server(sock, TIMEOUT + 3) for sock in idle[:10] + kept_alive[:10])
    with httpx.Client(base_url=timeout_server, timeout=30) as client:  # its pooled connection timed out too
        assert_serving(client)
    for sock in idle + kept_alive + [slowloris]:
        sock.close()


def test_a_client_that_stops_reading_loses_its_stream(timeout_server: str) -> None:
    """A stream whose client reads nothing fills the socket buffers; after --timeout seconds of a
    blocked write the server drops the connection and the slot is free again."""
    sock = connect(timeout_server)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = b'{"prompt": "Keep going", "n_predict": 100000, "ignore_eos": true, "stream": true, "n_probs": 50}'
    sock.sendall(
        b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    with httpx.Client(base_url=timeout_server, timeout=30) as client:
        deadline = time.monotonic() + 10
        while not any(slot["is_processing"] for slot in client.get("/slots").json()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Never read: the generation stops once a write has been blocked for --timeout seconds.
        wait_idle(client, timeout=60)
        assert_serving(client)
    sock.close()
