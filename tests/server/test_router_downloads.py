"""``DELETE /models``' file removal from the hub cache: links, shared blobs, the repository folder."""

from __future__ import annotations

from pathlib import Path

from mlxcel_compat.server.router_downloads import remove_cached
from mlxcel_compat.server.router_registry import RouterModel
from mlxcel_compat.server.router_sources import collect_sources


def cached(cache: Path) -> dict[str, RouterModel]:
    return {s.name: RouterModel(s, [], None) for s in collect_sources(None, None, str(cache))}


def test_remove_cached_keeps_what_other_models_use(tmp_path: Path) -> None:
    from tests.model.test_hub import populate_cache

    populate_cache(tmp_path, "acme/tiny-GGUF", {"big-Q2_K-00001-of-00002.gguf": b"GGUF-a",
                                                 "big-Q2_K-00002-of-00002.gguf": b"GGUF-b",
                                                 "tiny-Q8_0.gguf": b"GGUF-a"})  # the same bytes: one blob
    repo = tmp_path / "models--acme--tiny-GGUF"
    remove_cached(cached(tmp_path)["acme/tiny-GGUF:Q2_K"])
    assert set(cached(tmp_path)) == {"acme/tiny-GGUF:Q8_0"}
    assert (next((repo / "snapshots").rglob("tiny-Q8_0.gguf"))).read_bytes() == b"GGUF-a"  # its blob stayed
    assert len(list((repo / "blobs").iterdir())) == 1  # part 2's blob went
    remove_cached(cached(tmp_path)["acme/tiny-GGUF:Q8_0"])
    assert not repo.exists() and cached(tmp_path) == {}
