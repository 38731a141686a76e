"""End to end: router mode (several models behind one server), as llama-server's router serves them.

One router serves, from a ``--models-dir`` and a ``--models-preset``: a tiny llama model directory
(pinned by the preset), a qwen3 GGUF file, a BERT embedder (``embeddings = true`` in its section),
a second name for the llama directory with its own context (a preset-only section) and a corrupt
GGUF file, with ``--models-max 2``. The tests bring the models they need into the state they need
through the router's own routes, so they do not depend on one another's order.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, tiny_encoder, tiny_model
from tests.fake_hub import FakeHub
from tests.e2e.test_webui import browser  # noqa: F401  (the chat page's test uses the same headless browser)

PRESET = """\
version = 1
; defaults for every model
[*]
c = 2048
np = 2

[bert]
embeddings = true

[llama]
pin = true

[llama-256]
model = {llama}
LLAMA_ARG_CTX_SIZE = 512
"""


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("router-models")
    (root / "llama").symlink_to(tiny_model("llama"))
    (root / "qwen3.gguf").symlink_to(tiny_model("qwen3:f32"))
    (root / "bert").symlink_to(tiny_encoder("bert"))
    (root / "llama-q8.gguf").symlink_to(tiny_model("llama:q8_0"))  # weights kept in the file's mapped blocks
    (root / "broken.gguf").write_bytes(b"GGUF" + bytes(60))  # a header no reader takes
    (root / "mmproj-qwen3.gguf").write_bytes(b"GGUF")  # a companion file, never a model
    return root


@pytest.fixture(scope="module")
def hub(models_dir: Path) -> Iterator[FakeHub]:
    """The hub ``POST /models`` downloads from: a GGUF repository, and a slow one (64 KiB chunks
    50 ms apart) whose download a test cancels while it runs."""
    fake = FakeHub()
    fake.add("acme/fresh-GGUF", {"README.md": b"# fresh\n", "fresh-F32.gguf": (models_dir / "qwen3.gguf").resolve()})
    fake.add("acme/slow-GGUF", {"slow-F32.gguf": (models_dir / "qwen3.gguf").resolve()}, seconds_per_chunk=0.05)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def preset_file(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    preset = tmp_path_factory.mktemp("router-preset") / "models.ini"
    preset.write_text(PRESET.format(llama=models_dir / "llama"))
    return preset


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model.test_hub import populate_cache

    cache = tmp_path_factory.mktemp("router-llama-cache")  # as -hf acme/tiny-GGUF:F32 would have filled it
    populate_cache(cache, "acme/tiny-GGUF", {"tiny-F32.gguf": tiny_model("qwen3:f32")})
    return cache


@pytest.fixture(scope="module")
def router(server_factory, models_dir: Path, preset_file: Path, llama_cache: Path, hub: FakeHub) -> ServerProcess:
    return server_factory(["--models-dir", str(models_dir), "--models-preset", str(preset_file), "--models-max", "2"],
                          env={"LLAMA_CACHE": str(llama_cache), "HF_ENDPOINT": hub.url})


@pytest.fixture()
def http(router: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=60) as client:
        yield client


@pytest.fixture()
def client(router: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=router.base_url + "/v1", api_key="sk-no-key-required", max_retries=0, timeout=60) as c:
        yield c


def statuses(http: httpx.Client) -> dict[str, dict[str, Any]]:
    response = http.get("/models")
    assert response.status_code == 200
    return {m["id"]: m["status"] for m in response.json()["data"]}


def stream_in_background(router: ServerProcess, model: str, n_predict: int) -> tuple[threading.Thread, list[float]]:
    """A streamed /completion on a thread of its own, the arrival time of each event appended as it
    comes; returns once the first event has arrived."""
    arrivals: list[float] = []

    def stream() -> None:
        body = {"model": model, "prompt": "a", "n_predict": n_predict, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=router.base_url, timeout=60) as c, c.stream("POST", "/completion", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())

    streaming = threading.Thread(target=stream)
    streaming.start()
    while not arrivals:
        time.sleep(0.005)
    return streaming, arrivals


def wait_for(http: httpx.Client, name: str, value: str, timeout: float = 60.0, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if statuses(http)[name]["value"] == value:
            return
        time.sleep(poll)
    raise AssertionError(f"{name} never became {value}: {statuses(http)[name]}")


def unload_all(http: httpx.Client) -> None:
    for name, status in statuses(http).items():
        if status["value"] == "loaded":
            assert http.post("/models/unload", json={"model": name}).json() == {"success": True}
    for name in statuses(http):
        wait_for(http, name, "unloaded")


def chat(http: httpx.Client, model: str, content: str = "hello", **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return http.post("/v1/chat/completions", json=body)


def loaded(http: httpx.Client) -> set[str]:
    return {name for name, status in statuses(http).items() if status["value"] == "loaded"}


def test_props_and_model_list(http: httpx.Client) -> None:
    props = http.get("/props").json()
    assert props["role"] == "router"
    assert props["max_instances"] == 2 and props["models_autoload"] is True
    assert http.get("/tools").status_code == 403  # the chat page's tool list: the router has none of its own
    data = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert sorted(data) == ["acme/tiny-GGUF:F32", "bert", "broken", "llama", "llama-256", "llama-q8", "qwen3"]  # no mmproj
    assert data["acme/tiny-GGUF:F32"]["source"] == "cache" and data["qwen3"]["source"] == "models_dir"
    assert data["bert"]["status"]["args"][:4] == ["mlxcel-server", "-c=2048", "-np=2", "--embedding=true"]
    assert "-c=512" in data["llama-256"]["status"]["args"]  # LLAMA_ARG_CTX_SIZE, after [*]'s -c=2048
    assert data["llama"]["pinned"] is True and data["qwen3"]["pinned"] is False
    assert all(m["object"] == "model" and m["owned_by"] == "llamacpp" for m in data.values())


def test_openai_sdk_routes_by_model(http: httpx.Client, client: openai.OpenAI) -> None:
    """Each model answers under its own name, with its own settings (context, embeddings)."""
    unload_all(http)
    answer = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert answer.model == "llama" and answer.usage.completion_tokens == 3
    text = client.completions.create(model="qwen3", prompt="once upon", max_tokens=3, temperature=0)
    assert text.model == "qwen3" and text.usage.completion_tokens == 3
    assert loaded(http) == {"llama", "qwen3"}
    cached = client.completions.create(model="acme/tiny-GGUF:F32", prompt="once upon", max_tokens=3, temperature=0)
    assert cached.model == "acme/tiny-GGUF:F32" and cached.choices[0].text == text.choices[0].text  # the same file
    embedding = client.embeddings.create(model="bert", input="hello")
    assert len(embedding.data[0].embedding) > 0
    ids = {m.id for m in client.models.list()}
    assert {"llama", "qwen3", "bert"} <= ids
    # GET routes route by ?model=: each model's own props (a slot's context: -c over -np slots).
    assert http.get("/props", params={"model": "llama-256"}).json()["default_generation_settings"]["n_ctx"] == 256
    assert http.get("/props", params={"model": "llama"}).json()["default_generation_settings"]["n_ctx"] == 1024


def test_lru_unload_at_models_max_and_pinning(http: httpx.Client) -> None:
    unload_all(http)
    assert chat(http, "llama").status_code == 200  # pinned, and the least recently used from now on
    assert chat(http, "qwen3").status_code == 200
    assert http.post("/v1/embeddings", json={"model": "bert", "input": "hi"}).status_code == 200
    assert loaded(http) == {"llama", "bert"}  # qwen3 went: llama is older but pinned
    assert http.post("/models/unload", json={"model": "llama"}).json() == {"success": True}  # a pin yields to this
    wait_for(http, "llama", "unloaded")
    assert chat(http, "qwen3").status_code == 200
    assert loaded(http) == {"bert", "qwen3"}
    assert chat(http, "llama-256").status_code == 200  # a third model: the least recently used goes
    assert loaded(http) == {"qwen3", "llama-256"}


def test_failed_load_beside_healthy_models(http: httpx.Client) -> None:
    response = chat(http, "broken")
    assert response.status_code == 500
    assert "model name=broken failed to load" in response.json()["error"]["message"]
    status = statuses(http)["broken"]
    assert status["value"] == "unloaded" and status["failed"] is True and "GGUF version" in status["error"]
    assert chat(http, "llama").status_code == 200
    assert http.get("/health").status_code == 200


def test_llama_server_errors(http: httpx.Client) -> None:
    def error(response: httpx.Response) -> tuple[int, str]:
        return response.status_code, response.json()["error"]["message"]

    assert error(http.post("/v1/chat/completions", json={"messages": []})) == (400, "model name is missing from the request")
    assert error(chat(http, "no-such-model")) == (400, "model 'no-such-model' not found")
    assert error(http.get("/slots")) == (400, "model name is missing from the request")
    assert error(http.post("/models/load", json={"model": "no-such-model"})) == (404, "model is not found")
    assert error(http.post("/models/unload", json={"model": "no-such-model"})) == (400, "model is not found")
    unload_all(http)
    assert error(http.post("/models/unload", json={"model": "qwen3"})) == (400, "model is not running")
    not_loaded = http.post("/v1/chat/completions?autoload=false", json={"model": "qwen3", "messages": [{"role": "user", "content": "x"}]})
    assert error(not_loaded) == (400, "model is not loaded")
    assert http.post("/models/load", json={"model": "qwen3"}).json() == {"success": True}
    wait_for(http, "qwen3", "loaded")
    assert error(http.post("/models/load", json={"model": "qwen3"})) == (400, "model is already running")


def test_prompt_cache_survives_unload(http: httpx.Client) -> None:
    """The model's prompt-cache entries outlive its unload: after a reload the same prompt is a hit."""
    prompt = "the router keeps this prompt's KV while the model is away " * 6
    first = chat(http, "qwen3", prompt, temperature=0).json()
    assert first["timings"]["cache_n"] == 0 or first["usage"]["prompt_tokens"] > first["timings"]["cache_n"]
    assert http.post("/models/unload", json={"model": "qwen3"}).json() == {"success": True}
    wait_for(http, "qwen3", "unloaded")
    again = chat(http, "qwen3", prompt, temperature=0).json()
    assert again["timings"]["cache_n"] > 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["timings"]["cache_n"]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_unload_gives_the_memory_back(http: httpx.Client, router: ServerProcess) -> None:
    """An unloaded model's objects are freed at once: its memory-mapped GGUF leaves the process
    (it stayed mapped while a reference cycle, or the HTTP server's copy of the request scope,
    held the model until the collector's next pass)."""
    path = str(Path(tiny_model("llama:q8_0")).resolve())

    def mapped() -> bool:
        return any(path in line for line in Path(f"/proc/{router.proc.pid}/maps").read_text().splitlines())

    assert not mapped()
    assert chat(http, "llama-q8").status_code == 200
    assert mapped()
    assert http.post("/models/unload", json={"model": "llama-q8"}).json() == {"success": True}
    wait_for(http, "llama-q8", "unloaded")
    assert not mapped()


def test_load_does_not_stall_other_streams(http: httpx.Client, router: ServerProcess) -> None:
    """A model loading beside a stream: the stream's tokens keep coming while it loads."""
    unload_all(http)
    assert chat(http, "llama").status_code == 200
    streaming, arrivals = stream_in_background(router, "llama", 500)
    started = time.monotonic()
    assert http.post("/models/load", json={"model": "qwen3"}).json() == {"success": True}
    wait_for(http, "qwen3", "loaded")
    done = time.monotonic()
    streaming.join(60)
    assert len(arrivals) >= 500
    assert arrivals[-1] > done, "the stream ended before the load did: nothing was measured"
    during = [t for t in arrivals if started <= t <= done]
    gaps = [b - a for a, b in zip([started, *during], [*during, done])]
    assert max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s while the model loaded ({done - started:.2f} s)"


@pytest.mark.slow  # a browser of its own: ~5 s (tests/e2e/test_webui.py covers the page itself by default)
def test_chat_page_picks_a_model(http: httpx.Client, router: ServerProcess, browser: Any) -> None:  # noqa: F811
    """The chat page behind the router lists the models with their status, and the one picked
    answers (the request names it; the pick survives a reload)."""
    from selenium.webdriver.support.ui import Select

    from tests.e2e.test_webui import by_css, open_page, send, until, wait_answer

    unload_all(http)
    driver = browser
    open_page(driver, router.base_url, settings={"max_tokens": 4})
    until(driver, lambda d: by_css(d, "#model-pick option"), message="the picker never listed the models")
    pick = Select(by_css(driver, "#model-pick")[0])
    labels = [option.text for option in pick.options]
    assert "qwen3 (unloaded)" in labels and "llama-256 (unloaded)" in labels and len(labels) == 7
    pick.select_by_value("qwen3")
    send(driver, "hello")
    wait_answer(driver, 1)
    assert loaded(http) == {"qwen3"}
    until(driver, lambda d: "qwen3" in [o.text for o in Select(by_css(d, "#model-pick")[0]).options],
          message="the picker never showed qwen3 loaded")
    driver.refresh()
    until(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    assert Select(by_css(driver, "#model-pick")[0]).first_selected_option.get_attribute("value") == "qwen3"


class EventListener:
    """A ``/models/sse`` client on a thread: the events it hears, in order."""

    def __init__(self, router: ServerProcess) -> None:
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.content_type = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, args=(router.base_url,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "the /models/sse stream did not open"
        assert self.content_type.startswith("text/event-stream")

    def _listen(self, base_url: str) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=None) as client, client.stream("GET", "/models/sse") as response:
                self.content_type = response.headers["content-type"]
                self.ready.set()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[len("data: "):]))
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:  # the server stopped at the module's end, with this stream still open
            pass

    def wait(self, event: str, model: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e["event"] == event and e["model"] == model:
                    return e
            time.sleep(0.02)
        raise AssertionError(f"no {event} event for {model}; heard {self.events}")

    def statuses(self, model: str) -> list[str]:
        return [e["data"]["status"] for e in self.events if e["event"] == "status_change" and e["model"] == model]


def test_models_sse_reports_status_changes(http: httpx.Client, router: ServerProcess) -> None:
    listener = EventListener(router)
    unload_all(http)
    listener.events.clear()
    assert http.post("/models/load", json={"model": "qwen3"}).json() == {"success": True}
    wait_for(http, "qwen3", "loaded")
    assert http.post("/models/unload", json={"model": "qwen3"}).json() == {"success": True}
    wait_for(http, "qwen3", "unloaded")
    listener.wait("status_change", "qwen3")
    deadline = time.monotonic() + 10
    while len(listener.statuses("qwen3")) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    listener.stop.set()
    assert listener.statuses("qwen3") == ["loading", "loaded", "unloading", "unloaded"]
    unloaded = [e for e in listener.events if e["model"] == "qwen3" and e["data"]["status"] == "unloaded"]
    assert unloaded[0]["data"]["exit_code"] == 0
    # a failed load ends unloaded with a non-zero exit code, as a crashed child does there
    listener = EventListener(router)
    http.post("/models/load", json={"model": "broken"})
    wait_for(http, "broken", "unloaded")
    deadline = time.monotonic() + 10
    while "unloaded" not in listener.statuses("broken") and time.monotonic() < deadline:
        time.sleep(0.02)
    listener.stop.set()
    assert [e["data"].get("exit_code") for e in listener.events if e["model"] == "broken"][-1] == 1


def test_download_and_delete_a_cache_model(http: httpx.Client, router: ServerProcess, hub: FakeHub,
                                           llama_cache: Path) -> None:
    name = "acme/fresh-GGUF:F32"
    listener = EventListener(router)
    assert http.post("/models", json={"model": name}).json() == {"success": True}
    listener.wait("download_finished", name)
    listener.stop.set()
    progress = [e["data"]["progress"] for e in listener.events if e["event"] == "download_progress"]
    assert progress, "no download_progress events"
    done = progress[-1]["acme/fresh-GGUF/fresh-F32.gguf"]
    assert done["done"] == done["total"] > 0
    assert hub.downloads("acme/fresh-GGUF") == ["fresh-F32.gguf"]
    listed = {m["id"]: m for m in http.get("/models").json()["data"]}
    assert listed[name]["can_remove"] is True and listed[name]["status"]["value"] == "unloaded"
    assert listed[name]["source"] == "cache" and listed["qwen3"]["can_remove"] is False
    # it serves like any cached model
    tokens = http.post("/tokenize", json={"model": name, "content": "hello world"})
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    # adding it again, or a name that is no repository, is refused
    again = http.post("/models", json={"model": name})
    assert again.status_code == 400 and "already exists" in again.json()["error"]["message"]
    assert http.post("/models", json={}).status_code == 400
    assert http.post("/models", json={"model": "not-a-repo"}).status_code == 400
    # a missing repository: the download fails, reported on the stream, and nothing is listed
    listener = EventListener(router)
    assert http.post("/models", json={"model": "acme/missing-GGUF:F32"}).status_code == 200
    listener.wait("download_failed", "acme/missing-GGUF:F32")
    listener.stop.set()
    assert "acme/missing-GGUF:F32" not in statuses(http)
    # delete: the model stops, leaves the list and the cache
    listener = EventListener(router)
    deleted = http.delete("/models", params={"model": name})
    assert deleted.status_code == 200 and deleted.json() == {"success": True}
    listener.wait("model_remove", name)
    listener.stop.set()
    assert name not in statuses(http)
    assert not (llama_cache / "models--acme--fresh-GGUF").exists()
    assert (llama_cache / "models--acme--tiny-GGUF").exists()
    assert http.delete("/models", params={"model": name}).status_code == 400
    not_removable = http.delete("/models", params={"model": "qwen3"})
    assert not_removable.status_code == 400 and "not removable" in not_removable.json()["error"]["message"]
    assert http.get("/health").json() == {"status": "ok"}


def test_a_download_under_way_is_cancelled(http: httpx.Client, router: ServerProcess, llama_cache: Path) -> None:
    """As llama-server cancels one: ``DELETE /models`` (then ``model_remove``) or ``/models/unload``
    naming it; ``download_failed`` says so, and nothing of it is left in the cache."""
    name, repo_dir = "acme/slow-GGUF:F32", llama_cache / "models--acme--slow-GGUF"

    def start() -> EventListener:
        listener = EventListener(router)
        assert http.post("/models", json={"model": name}).json() == {"success": True}
        listener.wait("download_progress", name)
        listed = {m["id"]: m for m in http.get("/models").json()["data"]}[name]  # listed while it runs
        assert listed["status"]["value"] == "downloading" and listed["can_remove"] is True
        return listener

    listener = start()
    deleted = http.delete("/models", params={"model": name})
    assert deleted.status_code == 200 and deleted.json() == {"success": True}
    listener.wait("model_remove", name)
    listener.stop.set()
    events = [e for e in listener.events if e["model"] == name]
    kinds = [e["event"] for e in events]
    assert "download_finished" not in kinds and kinds.index("download_failed") < kinds.index("model_remove")
    assert next(e for e in events if e["event"] == "download_failed")["data"]["error"] == "cancelled"
    assert not repo_dir.exists()  # its unfinished blob, and the folder that held nothing else
    assert name not in statuses(http)
    listener = start()
    assert http.post("/models/unload", json={"model": name}).json() == {"success": True}
    listener.wait("download_failed", name)
    listener.stop.set()
    assert not repo_dir.exists() and name not in statuses(http)
    assert http.delete("/models", params={"model": name}).status_code == 400  # nothing downloads it now


def test_resumable_streams_find_their_model(http: httpx.Client) -> None:
    """``/v1/stream`` and ``/v1/streams/lookup`` name a conversation, not a model: the router
    remembers which model ran each one (llama-server's ``conv_models``) and asks that model."""
    def stream(model: str, conversation: str) -> bytes:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}) as r:
            assert r.status_code == 200
            return r.read()

    first, second = stream("llama", "conv-llama"), stream("qwen3", "conv-qwen3")
    assert first.rstrip().endswith(b"data: [DONE]") and second.rstrip().endswith(b"data: [DONE]")
    replay = http.get("/v1/stream", params={"conv_id": "conv-llama"})  # from the model that ran it, byte for byte
    assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
    assert replay.content == first
    assert http.get("/v1/stream", params={"conv_id": "conv-qwen3", "from": 0}).content == second
    found = http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-llama", "conv-qwen3", "nobody"]})
    assert sorted((s["conversation_id"], s["is_done"]) for s in found.json()) == [("conv-llama", True), ("conv-qwen3", True)]
    missing = http.get("/v1/stream")
    assert missing.status_code == 400 and missing.json()["error"]["message"] == "Missing conversation id in path"
    unknown = http.get("/v1/stream", params={"conv_id": "nobody"})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "Stream not found or expired"
    assert http.delete("/v1/stream", params={"conv_id": "conv-llama"}).status_code == 204  # to its owner; forgotten
    assert http.get("/v1/stream", params={"conv_id": "conv-llama"}).status_code == 404
    assert http.delete("/v1/stream", params={"conv_id": "nobody"}).status_code == 204  # llama-server's, all the same
    assert http.post("/models/unload", json={"model": "qwen3"}).json() == {"success": True}
    wait_for(http, "qwen3", "unloaded")  # its streams went with it
    assert http.get("/v1/stream", params={"conv_id": "conv-qwen3"}).status_code == 404
    assert http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-qwen3"]}).json() == []
    # a stop while the conversation's model loads cancels the request waiting for it
    waiting: list[httpx.Response] = []
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    late = threading.Thread(target=lambda: waiting.append(httpx.post(
        http.base_url.join("/v1/chat/completions"), json=body, headers={"X-Conversation-Id": "conv-late"}, timeout=60)))
    late.start()
    wait_for(http, "qwen3", "loading", poll=0.002)
    assert http.delete("/v1/stream", params={"conv_id": "conv-late"}).status_code == 204
    late.join(60)
    assert waiting[0].status_code == 400
    assert waiting[0].json()["error"]["message"] == "request cancelled by a stop while the model was loading"


def test_reload_rereads_the_preset_and_dedups_cache_models(http: httpx.Client, preset_file: Path,
                                                           models_dir: Path) -> None:
    original = preset_file.read_text()
    extra = f"\n[extra]\nmodel = {models_dir / 'qwen3.gguf'}\n\n[tiny-hub]\nhf-repo = acme/tiny-GGUF\ndedup-cache-models = 1\n"
    try:
        assert "extra" not in statuses(http)
        preset_file.write_text(original + extra)
        assert "extra" not in statuses(http)  # read again only on ?reload=1
        ids = {m["id"] for m in http.get("/models", params={"reload": "1"}).json()["data"]}
        assert {"extra", "tiny-hub", "qwen3", "llama"} <= ids
        assert "acme/tiny-GGUF:F32" not in ids  # the cache entry the preset stands for is hidden...
        tokens = http.post("/tokenize", json={"model": "acme/tiny-GGUF:F32", "content": "hi"})
        assert tokens.status_code == 200  # ...and still served
    finally:
        preset_file.write_text(original)
        ids = {m["id"] for m in http.get("/models", params={"reload": "1"}).json()["data"]}
    assert "extra" not in ids and "tiny-hub" not in ids and "acme/tiny-GGUF:F32" in ids


@pytest.mark.slow  # two loads and a 1000-token stream: ~10 s here (the rule itself: tests/server/test_router_registry.py)
def test_a_client_that_leaves_while_queued_costs_no_model_its_place(http: httpx.Client, router: ServerProcess) -> None:
    """llama.cpp's test_router_queue_client_disconnect_keeps_model, with a real stream for its
    fake timing: both places are taken (llama pinned, qwen3 streaming), a request for bert waits;
    its client gives up, so when qwen3 goes idle nothing takes its place."""
    unload_all(http)
    for name in ("llama", "qwen3"):
        http.post("/models/load", json={"model": name})
        wait_for(http, name, "loaded")
    streaming, arrivals = stream_in_background(router, "qwen3", 1000)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.base_url + "/embeddings", json={"model": "bert", "content": "hello"}, timeout=0.3)
    assert statuses(http)["qwen3"]["value"] == "loaded", "the stream ended before the client left: nothing was measured"
    streaming.join(60)
    time.sleep(0.3)  # time for a load that was still going to take qwen3's place
    assert statuses(http)["qwen3"]["value"] == "loaded"
    assert statuses(http)["bert"]["value"] == "unloaded"
    assert "failed" not in statuses(http)["bert"]
