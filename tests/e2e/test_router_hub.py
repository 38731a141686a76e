"""End to end: a router started from a preset kept in a hub repository, a download cancelled while
it runs, and resumable streams (``/v1/stream``) behind the router.

One server, started as llama-server's ``test_router_remote_preset`` starts it: ``-hf`` naming a
repository that holds a ``preset.ini`` and no ``-m``. The hub is ``tests/fake_hub.py`` on
loopback (``HF_ENDPOINT``); its second repository is slow (64 KiB chunks 50 ms apart), so a
download can be cancelled while it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess, tiny_model
from tests.e2e.test_router import EventListener, statuses, wait_for
from tests.fake_hub import FakeHub

pytestmark = pytest.mark.e2e

PRESET = """\
version = 1
[*]
c = 1024
np = 2

[tiny]
model = {llama}

[qwen]
model = {qwen}
"""
SLOW = "acme/slow-GGUF:F32"


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    preset = PRESET.format(llama=tiny_model("llama:q8_0"), qwen=tiny_model("qwen3:f32"))
    fake.add("acme/router-preset", {"preset.ini": preset.encode(), "README.md": b"# a preset\n"})
    fake.add("acme/slow-GGUF", {"slow-F32.gguf": tiny_model("qwen3:f32")}, seconds_per_chunk=0.05)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-hub-cache")


@pytest.fixture(scope="module")
def router(server_factory, hub: FakeHub, llama_cache: Path) -> ServerProcess:
    return server_factory(["-hf", "acme/router-preset"], env={"LLAMA_CACHE": str(llama_cache), "HF_ENDPOINT": hub.url})


@pytest.fixture()
def http(router: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=60) as client:
        yield client


def test_a_hub_preset_starts_a_router_over_its_models(http: httpx.Client, llama_cache: Path) -> None:
    props = http.get("/props").json()
    assert props["role"] == "router"
    assert {"tiny", "qwen"} <= set(statuses(http))
    # the preset came through the hub into $LLAMA_CACHE, as -hf downloads
    assert list(llama_cache.glob("models--acme--router-preset/snapshots/*/preset.ini"))
    answer = http.post("/completion", json={"model": "tiny", "prompt": "a", "n_predict": 4})
    assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 4
    assert "acme/router-preset" not in statuses(http)["tiny"]["args"]  # -hf is the router's, not its models'


def _start_slow_download(http: httpx.Client, router: ServerProcess) -> EventListener:
    listener = EventListener(router)
    assert http.post("/models", json={"model": SLOW}).json() == {"success": True}
    listener.wait("download_progress", SLOW)
    return listener


def test_a_download_under_way_is_cancelled(http: httpx.Client, router: ServerProcess, hub: FakeHub,
                                           llama_cache: Path) -> None:
    repo_dir = llama_cache / "models--acme--slow-GGUF"
    # DELETE /models stops it: download_failed, then model_remove; nothing is left in the cache
    listener = _start_slow_download(http, router)
    deleted = http.delete("/models", params={"model": SLOW})
    assert deleted.status_code == 200 and deleted.json() == {"success": True}
    listener.wait("model_remove", SLOW)
    listener.stop.set()
    events = [e["event"] for e in listener.events if e["model"] == SLOW]
    assert "download_finished" not in events
    assert events.index("download_failed") < events.index("model_remove")
    failed = next(e for e in listener.events if e["event"] == "download_failed")
    assert failed["data"]["error"] == "cancelled"
    assert not repo_dir.exists() or not list(repo_dir.rglob("*.gguf")) and not list(repo_dir.rglob("*.incomplete"))
    assert SLOW not in statuses(http)
    # POST /models/unload naming a download under way cancels it too, as llama-server's does
    listener = _start_slow_download(http, router)
    assert http.post("/models/unload", json={"model": SLOW}).json() == {"success": True}
    listener.wait("download_failed", SLOW)
    listener.stop.set()
    assert not repo_dir.exists() or not list(repo_dir.rglob("*.incomplete"))
    # a name nothing downloads is refused as before, and the router still serves
    assert http.delete("/models", params={"model": SLOW}).status_code == 400
    assert http.get("/health").json() == {"status": "ok"}


def _stream(http: httpx.Client, model: str, conversation: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}) as r:
        assert r.status_code == 200
        return r.read()


def test_resumable_streams_find_their_model(http: httpx.Client) -> None:
    first = _stream(http, "tiny", "conv-tiny")
    second = _stream(http, "qwen", "conv-qwen")
    assert first.rstrip().endswith(b"data: [DONE]") and second.rstrip().endswith(b"data: [DONE]")
    # the replay comes from the model that ran the stream, byte for byte
    replay = http.get("/v1/stream", params={"conv_id": "conv-tiny"})
    assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
    assert replay.content == first
    assert http.get("/v1/stream", params={"conv_id": "conv-qwen", "from": 0}).content == second
    # the lookup asks each owner for its own ids; ids no model owns are left out
    found = http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-tiny", "conv-qwen", "nobody's"]})
    assert found.status_code == 200
    assert sorted((s["conversation_id"], s["is_done"]) for s in found.json()) == [("conv-qwen", True), ("conv-tiny", True)]
    # llama-server's errors: no id, an id no model owns
    missing = http.get("/v1/stream")
    assert missing.status_code == 400 and missing.json()["error"]["message"] == "Missing conversation id in path"
    unknown = http.get("/v1/stream", params={"conv_id": "nobody's"})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "Stream not found or expired"
    # DELETE goes to the owner and forgets the conversation (204 also for one nobody owns)
    assert http.delete("/v1/stream", params={"conv_id": "conv-tiny"}).status_code == 204
    assert http.get("/v1/stream", params={"conv_id": "conv-tiny"}).status_code == 404
    assert http.delete("/v1/stream", params={"conv_id": "nobody's"}).status_code == 204
    # the owner unloaded: its streams went with it
    assert http.post("/models/unload", json={"model": "qwen"}).json() == {"success": True}
    wait_for(http, "qwen", "unloaded")
    assert http.get("/v1/stream", params={"conv_id": "conv-qwen"}).status_code == 404
    assert json.loads(http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-qwen"]}).content) == []
