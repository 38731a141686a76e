"""End to end: ``-hf`` naming a hub repository that holds a ``preset.ini`` (and no ``-m``) starts a
router over that preset, as llama-server's remote presets do (``test_router_remote_preset``).

The hub is ``tests/fake_hub.py`` on loopback (``HF_ENDPOINT``). Loading one of the preset's models
through such a router is what ``scripts/check_llama_router_tests.py`` runs (llama.cpp's test);
here the router's start and its model list, which cost no model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ServerProcess, tiny_model
from tests.fake_hub import FakeHub

pytestmark = pytest.mark.e2e

PRESET = """\
version = 1
[*]
c = 1024

[tiny]
model = {llama}

[qwen]
model = {qwen}
np = 3
"""


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    preset = PRESET.format(llama=tiny_model("llama:q8_0"), qwen=tiny_model("qwen3:f32"))
    fake.add("acme/router-preset", {"preset.ini": preset.encode(), "README.md": b"# a preset\n"})
    fake.start()
    yield fake
    fake.stop()


def test_a_hub_preset_starts_a_router_over_its_models(server_factory, hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "llama-cache"
    router: ServerProcess = server_factory(["-hf", "acme/router-preset"],
                                           env={"LLAMA_CACHE": str(cache), "HF_ENDPOINT": hub.url})
    import httpx

    with httpx.Client(base_url=router.base_url, timeout=60) as http:
        assert http.get("/props").json()["role"] == "router"
        models = {m["id"]: m for m in http.get("/models").json()["data"]}
    assert {"tiny", "qwen"} <= set(models)
    assert models["qwen"]["source"] == "preset" and models["qwen"]["status"]["value"] == "unloaded"
    args = models["qwen"]["status"]["args"]
    assert "-c=1024" in args and "-np=3" in args  # [*] and its own section
    assert not any("acme/router-preset" in a for a in args)  # -hf is the router's, not passed on to its models
    # the preset came through the hub into $LLAMA_CACHE, as -hf downloads; only that file
    assert [p.name for p in cache.glob("models--acme--router-preset/snapshots/*/*")] == ["preset.ini"]
    assert hub.downloads("acme/router-preset") == ["preset.ini"]
