"""The prompt cache's disk tier (``--prompt-cache-dir``) through real servers: restarts, ``kill -9``,
damaged and foreign files, several processes on one directory, reset by tier, stats and metrics.

Cache hits are compared with cold runs (``cache_prompt: false``) of the same request; on the tiny
models greedy outputs agree (see test_e2e_prompt_cache.py), and an entry read from disk holds
bit-identical arrays (test_disk_payloads.py).
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxcel_compat.cache import kv_io
from mlxcel_compat.cache.disk_directory import TEMP_PREFIX, entry_name
from mlxcel_compat.cache.disk_format import read_header
from tests.cache.fakes import rewrite_record
from tests.conftest import ServerProcess, tiny_model
from tests.e2e.helpers import assert_serving

pytestmark = pytest.mark.e2e

WORDS = "harbour lantern gull tide anchor rope sail compass storm island keeper beacon reef current".split()
# 256 KV bytes a token on the tiny llama at the default f16 (-ctk/-ctv): RAM keeps one 90-word
# (~240-token) entry, and every new one pushes the previous one to disk.
SMALL_RAM = "75000"


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def start(server_factory, directory: Path, *extra: str, model: Path | None = None) -> ServerProcess:
    return server_factory([
        "-m", str(model or tiny_model("llama")), "-np", "2", "-c", "4096", "-b", "64", "--metrics",
        "--prompt-cache-dir", str(directory), "--prompt-cache-min-prefix", "16", *extra,
    ])


def complete(c: httpx.Client, prompt: str, **extra: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, "temperature": 0, "n_predict": 6, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def disk_stats(c: httpx.Client) -> dict[str, Any]:
    return c.get("/v1/cache/stats").json()["tiers"]["disk"]


def settle(c: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the writer has nothing queued."""
    deadline = time.monotonic() + timeout
    while True:
        d = disk_stats(c)
        if d["write_queue_entries"] == 0 or time.monotonic() > deadline:
            return d
        time.sleep(0.05)


def entry_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.safetensors"))


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.startswith(TEMP_PREFIX)]


def tokenize(c: httpx.Client, prompt: str) -> tuple[int, ...]:
    """The token ids ``/completion`` sees for a prompt."""
    return tuple(c.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"])


def check_file(path: Path) -> None:
    """Read a file completely, as a load would: header, checksums, rebuilt state."""
    header, _ = read_header(path)
    kv_io.decode(header.layout, kv_io.load_arrays(path, header))


def test_a_restart_keeps_a_chat_session_warm(server_factory, tmp_path) -> None:
    first = start(server_factory, tmp_path, model=tiny_model("qwen3"))
    oai = openai.OpenAI(base_url=first.base_url + "/v1", api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(60, seed=1)}]

    def turn(client: openai.OpenAI, content: str, **extra: Any) -> Any:
        return client.chat.completions.create(model="x", messages=messages + [{"role": "user", "content": content}], max_tokens=6,
                                              temperature=0, extra_body={"prompt_cache_key": "sailor", **extra})

    for i, question in enumerate(["Where is the lighthouse?", "Who keeps the lantern lit?"]):
        reply = turn(oai, question)
        if i:
            assert reply.usage.prompt_tokens_details.cached_tokens > 0
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply.choices[0].message.content}]
    cold = turn(oai, "When does the tide turn?", cache_prompt=False)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    first.stop()  # SIGTERM: a clean shutdown writes RAM to the disk tier
    assert "entries written at shutdown" in first.log()

    second = start(server_factory, tmp_path, model=tiny_model("qwen3"))
    oai = openai.OpenAI(base_url=second.base_url + "/v1", api_key="x", max_retries=0)
    with httpx.Client(base_url=second.base_url, timeout=60) as c:
        assert disk_stats(c)["startup"]["indexed"] >= 1
        warm = turn(oai, "When does the tide turn?")
        assert warm.usage.prompt_tokens_details.cached_tokens > 0
        assert warm.choices[0].message.content == cold.choices[0].message.content
        d = disk_stats(c)
        assert d["hits"] == 1 and d["load_ms_total"] > 0 and d["tokens_loaded_total"] == warm.usage.prompt_tokens_details.cached_tokens


def test_kill_9_in_the_middle_of_writes_never_leaves_an_adoptable_corrupt_entry(server_factory, tmp_path) -> None:
    prompts = [text(400, seed=100 + i) for i in range(24)]  # ~1000 tokens: ~0.5 MB files
    previous_temps = None
    caught = 0
    for _ in range(2):  # kill, restart, kill again, restart
        server = start(server_factory, tmp_path, "--prompt-cache-capacity-bytes", "800000")  # ~1.5 entries
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            d = disk_stats(c)
            if previous_temps is not None:
                # What the restart found is exactly what the kill left: temporary files, no bad entry.
                assert d["startup"]["stale_temp"] == previous_temps
                assert d["startup"]["rejected"] == 0
                assert d["rejections"]["stale_temp"] == previous_temps
            for p in entry_files(tmp_path):
                check_file(p)
        stop_at = time.monotonic() + 40

        def traffic(i: int) -> None:
            with httpx.Client(base_url=server.base_url, timeout=30) as c:
                while time.monotonic() < stop_at:
                    try:
                        c.post("/completion", json={"prompt": random.choice(prompts), "n_predict": 1, "temperature": 0})
                    except httpx.HTTPError:
                        return

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for i in range(2):
                pool.submit(traffic, i)
            # Let a few writes finish, then kill at the next file being written.
            done_before = len(entry_files(tmp_path))
            while time.monotonic() < stop_at and len(entry_files(tmp_path)) < done_before + 2:
                time.sleep(0.01)
            while time.monotonic() < stop_at and not temp_files(tmp_path):
                time.sleep(0.0005)
            caught += bool(temp_files(tmp_path))
            server.proc.kill()  # SIGKILL, while (most likely) a writer is mid-file
            server.proc.wait()
            stop_at = 0.0
        previous_temps = len(temp_files(tmp_path))
    assert caught >= 1, "no kill landed while a file was being written"

    final = start(server_factory, tmp_path)
    with httpx.Client(base_url=final.base_url, timeout=60) as c:
        d = disk_stats(c)
        assert d["startup"]["stale_temp"] == previous_temps and d["startup"]["rejected"] == 0
        assert d["startup"]["indexed"] == len(entry_files(tmp_path)) > 0
        assert not temp_files(tmp_path)
        # Whatever is on disk is whole, and adopting it changes nothing the model sees.
        on_disk = {read_header(p)[0].tokens for p in entry_files(tmp_path)}
        kept = [p for p in prompts if any(t[: len(toks)] == toks for toks in [tokenize(c, p)] for t in on_disk)]
        assert kept
        for prompt in kept[:3]:
            warm = complete(c, prompt)
            cold = complete(c, prompt, cache_prompt=False)
            assert warm["timings"]["cache_n"] > 0 and warm["content"] == cold["content"]
        d = disk_stats(c)
        assert d["hits"] == min(3, len(kept))
        assert {k: v for k, v in d["rejections"].items() if v} == ({"stale_temp": previous_temps} if previous_temps else {})


def test_garbage_truncated_and_foreign_files_are_rejected_and_removed(server_factory, tmp_path) -> None:
    first = start(server_factory, tmp_path, "--prompt-cache-capacity-bytes", SMALL_RAM)
    prompts = [text(90, seed=200 + i) for i in range(3)]
    with httpx.Client(base_url=first.base_url, timeout=60) as c:
        for prompt in prompts:
            complete(c, prompt)
        model_dir = Path(settle(c)["path"])
    first.stop()
    good = entry_files(tmp_path)
    assert len(good) == 3
    (model_dir / entry_name("kv", b"\x11" * 32)).write_bytes(bytes(random.Random(1).randrange(256) for _ in range(4096)))
    (model_dir / entry_name("kv", b"\x22" * 32)).write_bytes(good[0].read_bytes()[:-500])
    foreign = model_dir / entry_name("kv", b"\x33" * 32)
    foreign.write_bytes(good[1].read_bytes())
    rewrite_record(foreign, model="f" * 64)
    (model_dir / f"{TEMP_PREFIX}kv-abc-999999-dead").write_bytes(b"half a file")
    flipped = good[2]
    data = bytearray(flipped.read_bytes())
    data[-30] ^= 0x04
    flipped.write_bytes(bytes(data))

    second = start(server_factory, tmp_path)
    with httpx.Client(base_url=second.base_url, timeout=60) as c:
        d = disk_stats(c)
        assert d["startup"] == dict(files=6, indexed=3, rejected=3, stale_temp=1, removed_by_budget=0)
        assert {k: v for k, v in d["rejections"].items() if v} == {"not_a_cache_file": 1, "truncated": 1, "foreign_model": 1, "stale_temp": 1}
        assert sorted(entry_files(tmp_path)) == sorted(good) and not temp_files(tmp_path)
        metrics = c.get("/metrics").text
        assert 'mlxcel_prompt_cache_disk_rejections_total{reason="foreign_model"} 1.0' in metrics
        # The flipped payload is caught when it is read, never adopted.
        file_tokens = read_header(flipped)[0].tokens
        flipped_prompt = next(p for p in prompts if file_tokens[: len(tokenize(c, p))] == tokenize(c, p))
        warm = complete(c, flipped_prompt)
        cold = complete(c, flipped_prompt, cache_prompt=False)
        assert warm["timings"]["cache_n"] == 0 and warm["content"] == cold["content"]
        d = disk_stats(c)
        assert d["rejections"]["payload_checksum"] == 1 and d["last_reject"]["reason"] == "payload_checksum"
        assert not flipped.exists()
        for prompt in prompts:
            if prompt != flipped_prompt:
                assert complete(c, prompt)["timings"]["cache_n"] > 0
        assert_serving(c)


def test_two_servers_share_one_directory_and_one_budget(server_factory, tmp_path) -> None:
    budget = 600_000  # about 7 of the ~80 kB files these prompts make
    flags = ("--prompt-cache-capacity-bytes", SMALL_RAM, "--prompt-cache-disk-capacity-bytes", str(budget))
    servers = [start(server_factory, tmp_path, *flags) for _ in range(2)]
    prompts = [text(60, seed=300 + i) for i in range(16)]

    def traffic(server: ServerProcess, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            for _ in range(8):
                complete(c, rng.choice(prompts), n_predict=2)
            settle(c)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda a: traffic(*a), [(servers[0], 1), (servers[1], 2), (servers[0], 3), (servers[1], 4)]))
    for s in servers:
        s.stop()
    files = entry_files(tmp_path)
    assert files and sum(p.stat().st_size for p in files) <= budget
    assert not temp_files(tmp_path)
    for p in files:
        check_file(p)
    # Read before the third server starts: while it indexes, an entry that a longer one of the same
    # session supersedes is deleted (by design), so a file listed above may be gone by then.
    on_disk = {read_header(p)[0].tokens for p in files}
    third = start(server_factory, tmp_path, *flags)
    with httpx.Client(base_url=third.base_url, timeout=60) as c:
        d = disk_stats(c)
        # Every file is found and none rejected; ``indexed`` counts what the index kept, i.e. the
        # files left once those superseded by a longer one of their session were deleted.
        assert d["startup"]["files"] == len(files) and d["startup"]["rejected"] == 0
        assert d["startup"]["indexed"] == len(entry_files(tmp_path)) <= len(files)
        kept = [p for p in prompts if any(t[: len(toks)] == toks for toks in [tokenize(c, p)] for t in on_disk)]
        assert kept
        # The first request finds the file as the two servers left it. Later ones may not: each
        # hit's new entry pushes the previous one from this server's small RAM to disk, and the
        # 600 kB budget then deletes the oldest files, possibly the next prompt's.
        warm = complete(c, kept[0])
        assert warm["timings"]["cache_n"] > 0
        assert warm["content"] == complete(c, kept[0], cache_prompt=False)["content"]
        assert disk_stats(c)["hits"] == 1


def test_replicas_with_write_through_share_a_system_prompt_while_running(server_factory, tmp_path) -> None:
    """Two servers on one directory, as two replicas behind a router: a chat the first one served
    leaves its system prompt where the second finds it, for another session, without a restart."""
    flags = ("--prompt-cache-write-through",)
    servers = [start(server_factory, tmp_path, *flags, model=tiny_model("qwen3")) for _ in range(2)]
    system = {"role": "system", "content": text(80, seed=500)}

    def chat(server: ServerProcess, session: str, question: str, **extra: Any) -> dict[str, Any]:
        r = httpx.post(server.base_url + "/v1/chat/completions", headers={"X-Session-ID": session}, timeout=60, json={
            "messages": [system, {"role": "user", "content": question}], "max_tokens": 8, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    first = chat(servers[0], "alice", "Where is the lighthouse?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with httpx.Client(base_url=servers[0].base_url, timeout=60) as c:
        d = settle(c)
        assert d["writes"] >= 1 and c.get("/v1/cache/stats").json()["evictions"]["lru"] == 0  # nothing left RAM
    cold = chat(servers[1], "bob", "Who keeps the lantern lit?", cache_prompt=False)
    warm = chat(servers[1], "bob", "Who keeps the lantern lit?")
    shared = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    with httpx.Client(base_url=servers[1].base_url, timeout=60) as c:
        assert len(tokenize(c, system["content"])) <= shared < warm["usage"]["prompt_tokens"]  # the system prompt, at least
        d = disk_stats(c)
        assert d["picked_up"] >= 1 and d["hits"] == 1 and d["tokens_loaded_total"] == shared
        assert "mlxcel_prompt_cache_disk_picked_up_total" in c.get("/metrics").text
        assert_serving(c)


def test_reset_by_tier_and_stats_of_both_tiers(server_factory, tmp_path) -> None:
    server = start(server_factory, tmp_path, "--prompt-cache-capacity-bytes", SMALL_RAM, "--prompt-cache-disk-capacity-bytes", "50000000")
    a, b = text(90, seed=400), text(90, seed=401)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        complete(c, a)
        complete(c, b)  # a goes to disk
        d = settle(c)
        assert (d["enabled"], d["entries"], d["writes"], d["capacity_bytes"]) == (True, 1, 1, 50000000)
        r = c.post("/v1/cache/reset", json={"tier": "ram"})
        assert r.json()["tier"] == "ram" and r.json()["tiers"]["disk"] == {"cleared_entries": 0, "cleared_bytes": 0}
        stats = c.get("/v1/cache/stats").json()
        assert stats["tiers"]["ram"]["entries"] == 0 and stats["tiers"]["disk"]["entries"] == 1
        assert complete(c, a)["timings"]["cache_n"] > 0  # served from disk
        stats = c.get("/v1/cache/stats").json()
        assert stats["tiers"]["disk"]["hits"] == 1 and stats["hits"] == 1 and stats["tiers"]["ram"]["hits"] == 0
        settle(c)
        r = c.post("/v1/cache/reset", json={"tier": "disk"}).json()
        assert r["tiers"]["disk"]["cleared_entries"] >= 1 and r["tiers"]["ram"]["cleared_entries"] == 0
        assert not entry_files(tmp_path) and disk_stats(c)["entries"] == 0
        r = c.post("/v1/cache/reset").json()  # no body: every tier
        assert r["tier"] == "all" and r["tiers"]["ram"]["cleared_entries"] >= 1
        assert complete(c, a)["timings"]["cache_n"] == 0
        bad = c.post("/v1/cache/reset", json={"tier": "gpu"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        metrics = c.get("/metrics").text
        for name in ("disk_enabled 1.0", "disk_hits_total 1.0", "disk_writes_total", "disk_bytes", "disk_load_seconds_total"):
            assert f"mlxcel_prompt_cache_{name}" in metrics, name


def test_without_a_directory_the_disk_tier_is_off(http) -> None:
    stats = http.get("/v1/cache/stats").json()
    assert stats["tiers"]["disk"]["enabled"] is False and stats["tiers"]["disk"]["path"] is None
    assert set(stats["tiers"]["ram"]) == {"entries", "bytes", "capacity_bytes", "hits"}
    assert "mlxcel_prompt_cache_disk_enabled 0.0" in http.get("/metrics").text


def test_tenant_namespaces_survive_a_restart_on_disk(server_factory, tmp_path) -> None:
    """An entry written to disk keeps its tenant: after a restart, tenant B sending tenant A's exact
    prompt gets nothing from A's file (cold prefill, cold output), while A's repeat loads it."""
    keys = ("--api-key", "key-a,key-b")
    prompt = text(90, seed=7)

    def ask(server: ServerProcess, key: str, **extra: Any) -> dict[str, Any]:
        with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
            return complete(c, prompt, **extra)

    first = start(server_factory, tmp_path, *keys)
    cold = ask(first, "key-a", cache_prompt=False)
    assert ask(first, "key-a")["timings"]["cache_n"] == 0  # A's entry is made
    first.stop()  # a clean shutdown writes it to disk
    assert "entries written at shutdown" in first.log()
    namespaces = {read_header(path)[0].bucket.namespace for path in entry_files(tmp_path)}
    assert len(namespaces) == 1 and "" not in namespaces  # stored under A's namespace (a digest, not the key)
    assert not any("key-a" in path.read_bytes().decode("latin-1") for path in entry_files(tmp_path))

    second = start(server_factory, tmp_path, *keys)
    with httpx.Client(base_url=second.base_url, timeout=60, headers={"Authorization": "Bearer key-a"}) as c:
        assert disk_stats(c)["startup"]["indexed"] >= 1
    b = ask(second, "key-b")
    assert b["timings"]["cache_n"] == 0 and b["timings"]["prompt_n"] == b["tokens_evaluated"]
    assert b["content"] == cold["content"]
    a = ask(second, "key-a")
    assert a["timings"]["cache_n"] > 16 and a["content"] == cold["content"]
    with httpx.Client(base_url=second.base_url, timeout=60, headers={"Authorization": "Bearer key-a"}) as c:
        assert disk_stats(c)["hits"] == 1  # A's hit came from the file; B's lookup found nothing of its own
