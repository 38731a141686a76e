"""llama-server's slot persistence (``POST /slots/{id}?action=save|restore|erase``) on real servers.

Outputs after a restore are compared with the uncut run's: the restored state holds the prompt's
KV exactly as the first run computed it, and the next request adopts all but the last prompt token,
which it feeds exactly as the first run did, so greedy outputs are identical.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cache.fakes import rewrite_record
from tests.conftest import ServerProcess
from tests.e2e.helpers import assert_serving, parse_sse, wait_idle

pytestmark = pytest.mark.e2e

STORY = (
    "The lighthouse keeper wrote every evening in a leather notebook: the colour of the sea, the ships "
    "that passed, the birds on the rocks and the weather that came from the west over the long grey water."
)
GREEDY = {"temperature": 0, "n_predict": 16, "ignore_eos": True}
SAVE_KEYS = ["id_slot", "filename", "n_saved", "n_written", "timings"]
RESTORE_KEYS = ["id_slot", "filename", "n_restored", "n_read", "timings"]


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def slot_server(server_factory, llama_dir, slot_dir) -> ServerProcess:
    return server_factory(["-m", str(llama_dir), "-np", "2", "-c", "2048", "-b", "64", "--slot-save-path", str(slot_dir)])


@pytest.fixture()
def client(slot_server: ServerProcess):
    with httpx.Client(base_url=slot_server.base_url, timeout=120) as c:
        yield c


def complete(c: httpx.Client, prompt: str, id_slot: int, **extra: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, "id_slot": id_slot, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def action(c: httpx.Client, id_slot: int | str, name: str, filename: str | None = None) -> httpx.Response:
    body = {"filename": filename} if filename is not None else None
    return c.post(f"/slots/{id_slot}", params={"action": name}, json=body)


def test_without_slot_save_path_every_action_is_501(http) -> None:
    for name in ("save", "restore", "erase"):
        r = http.post("/slots/0", params={"action": name}, json={"filename": "x.bin"})
        assert r.status_code == 501
        assert r.json() == {"error": {
            "code": 501,
            "message": "This server does not support slots action. Start it with `--slot-save-path`",
            "type": "not_supported_error",
        }}


def test_save_erase_restore_round_trip_gives_the_uncut_output(client, slot_dir) -> None:
    prompt = STORY + " Tonight he wrote:"
    first = complete(client, prompt, id_slot=0)
    n_prompt = first["tokens_evaluated"]

    r = action(client, 0, "save", "story.bin")
    assert r.status_code == 200, r.text
    saved = r.json()
    assert list(saved) == SAVE_KEYS and list(saved["timings"]) == ["save_ms"]
    assert saved["id_slot"] == 0 and saved["filename"] == "story.bin"
    assert saved["n_saved"] == first["tokens_cached"] == n_prompt + GREEDY["n_predict"] - 1
    assert saved["n_written"] == (slot_dir / "story.bin").stat().st_size > 0
    assert not [p for p in slot_dir.iterdir() if p.name.startswith(".tmp-")]

    assert action(client, 0, "erase").json() == {"id_slot": 0, "n_erased": saved["n_saved"]}
    assert action(client, 0, "erase").json() == {"id_slot": 0, "n_erased": 0}
    client.post("/v1/cache/reset").raise_for_status()  # nothing but the file can help now

    r = action(client, 0, "restore", "story.bin")
    assert r.status_code == 200, r.text
    restored = r.json()
    assert list(restored) == RESTORE_KEYS and list(restored["timings"]) == ["restore_ms"]
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]

    again = complete(client, prompt, id_slot=0)
    assert again["timings"]["cache_n"] == n_prompt - 1 and again["timings"]["prompt_n"] == 1
    assert again["content"] == first["content"]
    # The restored state also went into the prompt cache: another slot adopts it too.
    client.post("/v1/cache/reset", json={"tier": "ram"}).raise_for_status()
    action(client, 0, "restore", "story.bin").raise_for_status()
    other = complete(client, prompt, id_slot=1)
    assert other["timings"]["cache_n"] == n_prompt - 1 and other["content"] == first["content"]


def test_ids_wrap_and_are_echoed_as_given(client) -> None:
    complete(client, "A short one.", id_slot=1)
    r = action(client, 7, "save", "wrapped.bin")  # 7 % 2 == 1
    assert r.status_code == 200 and r.json()["id_slot"] == 7
    assert action(client, " 3", "erase").json()["id_slot"] == 3  # std::stoi skips spaces
    assert action(client, "1abc", "erase").json()["id_slot"] == 1  # ... and stops at the first non-digit


@pytest.mark.parametrize(
    ("id_slot", "name", "body", "message"),
    [
        ("x", "save", {"filename": "a.bin"}, "Invalid slot ID"),
        ("-1", "save", {"filename": "a.bin"}, "Invalid slot ID"),
        ("99999999999", "erase", None, "Invalid slot ID"),
        ("0", "load", {"filename": "a.bin"}, "Invalid action"),
        ("0", "", None, "Invalid action"),
        ("0", "save", {"filename": "../a.bin"}, "Invalid filename"),
        ("0", "save", {"filename": "sub/a.bin"}, "Invalid filename"),
        ("0", "save", {"filename": "sub\\a.bin"}, "Invalid filename"),
        ("0", "restore", {"filename": ".."}, "Invalid filename"),
        ("0", "restore", {"filename": "a..b"}, "Invalid filename"),
        ("0", "save", {"filename": ""}, "Invalid filename"),
        ("0", "save", {"filename": "trailing."}, "Invalid filename"),
        ("0", "save", {"filename": " lead"}, "Invalid filename"),
        ("0", "save", {"filename": "a:b"}, "Invalid filename"),
        ("0", "save", {"filename": "nl\nx"}, "Invalid filename"),
        ("0", "save", {}, '"filename" is required and must be a string'),
        ("0", "restore", {"filename": 5}, '"filename" is required and must be a string'),
    ],
)
def test_bad_requests_are_400_with_llama_server_messages(client, id_slot, name, body, message) -> None:
    r = client.post(f"/slots/{id_slot}", params={"action": name}, json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


def test_files_that_cannot_be_restored_are_400_with_the_reason(client, slot_dir) -> None:
    complete(client, STORY, id_slot=0)
    action(client, 0, "save", "good.bin").raise_for_status()
    good = (slot_dir / "good.bin").read_bytes()
    cases = {
        "missing.bin": (None, "not found"),
        "garbage.bin": (b"\x00\x01garbage" * 50, "not a slot save file"),
        "cut.bin": (good[: len(good) // 2], "truncated"),
        "flipped.bin": (good[:-9] + bytes([good[-9] ^ 0x40]) + good[-8:], "corrupted"),
    }
    for name, (data, _) in cases.items():
        if data is not None:
            (slot_dir / name).write_bytes(data)
    for name, changes in {"other-model.bin": {"model": "0" * 64}, "other-version.bin": {"runtime": "mlx 0.1; mlx-lm 0.1; cpu; float32"},
                          "other-format.bin": {"format_version": 2}}.items():
        (slot_dir / name).write_bytes(good)
        rewrite_record(slot_dir / name, **changes)
    cases.update({
        "other-model.bin": (None, "saved from another model"),
        "other-version.bin": (None, "written by an incompatible version"),
        "other-format.bin": (None, "written by an incompatible version"),
    })
    for name, (_, reason) in cases.items():
        r = action(client, 0, "restore", name)
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("Unable to restore slot: ") and reason in error["message"], (name, error)
    assert_serving(client)


def test_a_busy_slot_saves_when_its_task_is_done(client) -> None:
    done: dict[str, Any] = {}

    def stream() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=120) as c:
            r = c.post("/completion", json={"prompt": STORY, "id_slot": 0, "stream": True, "temperature": 0, "n_predict": 120, "ignore_eos": True})
            done["events"] = parse_sse(r.text)
            done["t"] = time.monotonic()

    worker = threading.Thread(target=stream)
    worker.start()
    deadline = time.monotonic() + 30
    while not any(s.get("is_processing") for s in client.get("/slots").json()) and time.monotonic() < deadline:
        time.sleep(0.01)
    r = action(client, 0, "save", "busy.bin")
    t_saved = time.monotonic()
    worker.join(60)
    assert r.status_code == 200, r.text
    final = done["events"][-1]
    assert final["stop"] is True
    assert r.json()["n_saved"] == final["tokens_cached"]  # the whole finished task, not a half-done one
    assert t_saved >= done["t"] - 0.5
    wait_idle(client)


def test_another_process_restores_with_the_prompt_cache_off(server_factory, llama_dir, client, slot_dir) -> None:
    """A second server (same model, another chat template, prompt cache off) restores a raw-prompt
    slot file and reuses it on the slot; a chat slot file is refused because of the template; a
    state longer than its context is refused; a file of another model is refused by a third."""
    prompt = STORY + " At dawn the keeper"
    first = complete(client, prompt, id_slot=1)
    action(client, 1, "save", "raw.bin").raise_for_status()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": STORY}], "max_tokens": 4, "id_slot": 0})
    assert r.status_code == 200, r.text
    action(client, 0, "save", "chat.bin").raise_for_status()
    complete(client, (STORY + " ") * 4, id_slot=1, n_predict=2)
    action(client, 1, "save", "long.bin").raise_for_status()

    other = server_factory([
        "-m", str(llama_dir), "-np", "2", "-c", "256", "-b", "64", "--slot-save-path", str(slot_dir),
        "--chat-template", "chatml", "--prompt-cache-enabled=false",
    ])
    with httpx.Client(base_url=other.base_url, timeout=120) as c:
        cold = complete(c, prompt, id_slot=0)
        assert cold["timings"]["cache_n"] == 0
        r = action(c, 0, "restore", "raw.bin")
        assert r.status_code == 200, r.text
        again = complete(c, prompt, id_slot=0)
        assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
        assert again["content"] == first["content"] == cold["content"]
        r = action(c, 1, "restore", "chat.bin")
        assert r.status_code == 400 and "another chat template" in r.json()["error"]["message"]
        r = action(c, 1, "restore", "long.bin")
        assert r.status_code == 400 and "does not fit in the slot context" in r.json()["error"]["message"]
        assert c.get("/v1/cache/stats").json()["enabled"] is False

    from tests.conftest import tiny_model

    foreign = server_factory(["-m", str(tiny_model("qwen3")), "-np", "1", "-c", "2048", "--slot-save-path", str(slot_dir)])
    with httpx.Client(base_url=foreign.base_url, timeout=60) as c:
        r = action(c, 0, "restore", "raw.bin")
        assert r.status_code == 400 and "saved from another model" in r.json()["error"]["message"]
        assert_serving(c)


def test_slot_files_round_trip_at_f16_and_another_kv_type_is_refused(server_factory, llama_dir, client, slot_dir) -> None:
    """The default -ctk f16 -ctv f16: the slot file holds 16-bit KV (about half the bytes of a
    file saved in the exactness mode, -ctk f32 -ctv f32), comes back as it was (the same greedy
    output), and a file of another KV type is a 400 naming the types, both ways; stats and
    /metrics report the bytes a token takes in each type."""
    prompt = STORY + " In the morning"
    exact = server_factory(["-m", str(llama_dir), "-np", "1", "-c", "2048", "-b", "64", "--slot-save-path",
                            str(slot_dir), "-ctk", "f32", "-ctv", "f32", "--metrics"])
    with httpx.Client(base_url=exact.base_url, timeout=120) as f:
        complete(f, prompt, id_slot=0)
        f32_saved = action(f, 0, "save", "f32.bin").json()
    first = complete(client, prompt, id_slot=0)
    saved = action(client, 0, "save", "f16.bin").json()
    assert saved["n_saved"] == f32_saved["n_saved"]
    assert saved["n_written"] < 0.6 * f32_saved["n_written"]
    action(client, 0, "erase").raise_for_status()
    client.post("/v1/cache/reset").raise_for_status()
    r = action(client, 0, "restore", "f16.bin")
    assert r.status_code == 200, r.text
    again = complete(client, prompt, id_slot=0)
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert again["content"] == first["content"]
    r = action(client, 0, "restore", "f32.bin")
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("Unable to restore slot: ") and "KV cache type" in message and "f32/f32" in message
    stats = client.get("/v1/cache/stats").json()
    assert (stats["kv_cache_type_k"], stats["kv_cache_type_v"]) == ("f16", "f16")
    assert_serving(client)
    with httpx.Client(base_url=exact.base_url, timeout=120) as f:
        r = action(f, 0, "restore", "f16.bin")
        assert r.status_code == 400 and "f16/f16" in r.json()["error"]["message"]
        exact_stats = f.get("/v1/cache/stats").json()
        assert exact_stats["kv_bytes_per_token"] == 2 * stats["kv_bytes_per_token"]
        assert "mlxcel_prompt_cache_kv_bytes_per_token " + str(float(exact_stats["kv_bytes_per_token"])) in f.get("/metrics").text
