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


def test_a_cancelled_download_leaves_nothing_but_the_other_models(tmp_path: Path) -> None:
    """What ``remove_partial`` deletes after a cancel: the parts already finished, and the
    repository's folder only when no other model of it is cached (huggingface-hub deletes the
    temporary file of the part it was writing itself)."""
    from mlxcel_compat.server.router_downloads import remove_partial
    from tests.model.test_hub import populate_cache

    populate_cache(tmp_path, "acme/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF-q8", "big-Q2_K-00001-of-00002.gguf": b"GGUF-a"})
    repo = tmp_path / "models--acme--tiny-GGUF"
    beside = repo / "blobs" / "0123abcd.5f3e9a1c.incomplete"  # another tag's download, running beside it
    beside.write_bytes(b"GGUF-b, half of it")
    finished = list((repo / "snapshots").rglob("big-Q2_K-00001-of-00002.gguf"))
    remove_partial(repo, finished)
    assert set(cached(tmp_path)) == {"acme/tiny-GGUF:Q8_0"}  # the other model, whole
    assert not list(repo.rglob("big-*")) and beside.exists()
    assert sorted(p.read_bytes() for p in (repo / "blobs").iterdir()) == [b"GGUF-b, half of it", b"GGUF-q8"]
    remove_cached(cached(tmp_path)["acme/tiny-GGUF:Q8_0"])  # the last model of the repository goes...
    remove_partial(repo, [])  # ...and a cancel afterwards finds nothing to do
    assert not repo.exists()
    remove_partial(tmp_path / "models--acme--never-GGUF", [])  # a download cancelled before it wrote anything
