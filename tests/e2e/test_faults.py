"""End to end: an engine fault in one request is a 500 in llama.cpp's shape for that request only.

The server runs in this process (the real app on hypercorn, on a free loopback port) so that a
fault can be injected around its real model: a forward pass that carries a "poison" token id
raises. The poisoned request fails (a 500 body, or a final error event on its stream); a request
running next to it completes, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Iterator

import httpx
import pytest

from tests.conftest import free_port
from tests.e2e.helpers import assert_serving, parse_sse, wait_idle
from tests.engine.test_faults import POISON, Faulty

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def in_process(llama_dir) -> Iterator[tuple[str, object]]:
    from hypercorn.asyncio import serve

    from mlxcel_compat.cli import hypercorn_config
    from mlxcel_compat.server.instance import build_server
    from mlxcel_compat.settings import resolve_settings

    port = free_port()
    settings = resolve_settings(["-m", str(llama_dir), "--port", str(port), "-np", "2", "-c", "2048"], {})
    app = build_server(settings, str(llama_dir), [])
    stop: asyncio.Event | None = None
    loop = asyncio.new_event_loop()

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        await serve(app, hypercorn_config(settings), shutdown_trigger=stop.wait)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        threading.Event().wait(0.1)
    engine = app.state.ctx.engine
    real = engine.loaded.model
    faulty = Faulty(real, lambda inputs: any(POISON in row for row in inputs.tolist()))
    engine.call(lambda: setattr(engine.loaded, "model", faulty) or setattr(engine.scheduler.batch, "model", faulty)
                or setattr(engine.loaded, "decoder", faulty.wrap(engine.loaded.decoder))
                or setattr(engine.scheduler.batch, "decoder", engine.loaded.decoder)).result(30)
    yield base_url, engine
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


def test_a_faulty_request_gets_a_500_and_its_neighbour_completes(in_process) -> None:
    base_url, _ = in_process
    with httpx.Client(base_url=base_url, timeout=60) as client:
        results: dict[str, httpx.Response] = {}

        def neighbour() -> None:
            results["ok"] = client.post("/completion", json={"prompt": "A quiet afternoon", "n_predict": 24, "ignore_eos": True})

        thread = threading.Thread(target=neighbour)
        thread.start()
        poisoned = client.post("/completion", json={"prompt": [1, 2, 3, 4, 5, POISON], "n_predict": 8})
        thread.join(60)
        assert poisoned.status_code == 500
        error = poisoned.json()["error"]
        assert list(error)[:3] == ["code", "message", "type"]
        assert error["code"] == 500 and error["type"] == "server_error" and "injected fault" in error["message"]
        assert results["ok"].status_code == 200 and results["ok"].json()["tokens_predicted"] == 24
        wait_idle(client, timeout=10)
        assert_serving(client)


def test_a_faulty_stream_ends_with_an_error_event(in_process) -> None:
    base_url, _ = in_process
    with httpx.Client(base_url=base_url, timeout=60) as client:
        response = client.post("/v1/completions", json={"prompt": [7, 8, 9, POISON], "max_tokens": 8, "stream": True})
        assert response.status_code == 200
        events = parse_sse(response.text)
        assert events[-1]["error"]["code"] == 500 and "injected fault" in events[-1]["error"]["message"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert chat.status_code == 200
        wait_idle(client, timeout=10)
