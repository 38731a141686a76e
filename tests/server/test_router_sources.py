"""The router's model sources: a models directory, an INI preset, and the arguments each model gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel_compat.server.router_sources import SourceError, collect_sources, model_argv, scan_models_dir
from mlxcel_compat.settings import resolve_settings


def touch(path: Path, data: bytes = b"GGUF") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_models_dir_layout(tmp_path: Path) -> None:
    """llama-server's layout: files, subdirectories with split parts and companions; plus model
    directories and split parts at the top, this server's additions."""
    touch(tmp_path / "Qwen3-8B-Q4_K_M.gguf")
    touch(tmp_path / "mmproj-F16.gguf")  # companion files are never models
    touch(tmp_path / "mtp-draft.gguf")
    touch(tmp_path / "gemma" / "gemma-3-4b-it-Q8_0.gguf")
    touch(tmp_path / "gemma" / "mmproj-F16.gguf")
    touch(tmp_path / "kimi" / "Kimi-00002-of-00002.gguf")
    touch(tmp_path / "kimi" / "Kimi-00001-of-00002.gguf")
    touch(tmp_path / "big-00001-of-00002.gguf")
    touch(tmp_path / "big-00002-of-00002.gguf")
    touch(tmp_path / "smol" / "config.json", b"{}")
    (tmp_path / "empty").mkdir()
    found = {m.name: Path(m.model).relative_to(tmp_path).as_posix() for m in scan_models_dir(str(tmp_path))}
    assert found == {
        "Qwen3-8B-Q4_K_M": "Qwen3-8B-Q4_K_M.gguf",
        "gemma": "gemma/gemma-3-4b-it-Q8_0.gguf",
        "kimi": "kimi/Kimi-00001-of-00002.gguf",
        "big": "big-00001-of-00002.gguf",
        "smol": "smol",
    }
    with pytest.raises(SourceError, match="does not exist"):
        scan_models_dir(str(tmp_path / "missing"))


def test_preset_sections_defaults_and_precedence(tmp_path: Path) -> None:
    touch(tmp_path / "models" / "a.gguf")
    preset = tmp_path / "models.ini"
    preset.write_text(
        "version = 1\n[*]\nc = 8192\nnp = 2\n\n"
        "[a]\n; a comment\nctx-size = 4096\njinja = false\npin = true\nalias = first,premier\n\n"
        f"[custom]\nmodel = {tmp_path / 'b.gguf'}\nLLAMA_ARG_N_PARALLEL = 3\nload-on-startup = true\nno-cont-batching = true\n"
    )
    models = {m.name: m for m in collect_sources(str(tmp_path / "models"), str(preset))}
    assert sorted(models) == ["a", "custom"]
    a, custom = models["a"], models["custom"]
    assert a.pin and not a.load_on_startup and a.aliases == ["first", "premier"] and a.source == "models_dir"
    assert custom.load_on_startup and not custom.pin and custom.source == "preset"
    # [*], then the section, then the router's command line: the last value of a flag wins.
    settings = resolve_settings(model_argv(a, ["--models-dir", "x", "-np", "4", "--port", "9"]), {})
    assert (settings.ctx_size, settings.n_parallel, settings.jinja) == (4096, 4, False)
    assert settings.model == a.model and list(settings.alias) == ["a"] and settings.models_dir is None
    settings = resolve_settings(model_argv(custom, []), {})
    assert (settings.ctx_size, settings.n_parallel, settings.cont_batching) == (8192, 3, False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[nowhere]\nc = 1\n", "names no model"),
        ("[x]\nmodel = /m.gguf\nno-such-option = 1\n", "unknown key 'no-such-option'"),
        ("[x]\nmodel = /m.gguf\npin = maybe\n", "is not a boolean"),
        ("[x]\nmodel = /m.gguf\nalias = y\n[y]\nmodel = /n.gguf\n", "conflicts"),
        ("[x\n", "cannot read"),
    ],
)
def test_bad_presets_are_refused(tmp_path: Path, text: str, message: str) -> None:
    preset = tmp_path / "models.ini"
    preset.write_text(text)
    with pytest.raises(SourceError, match=message):
        for source in collect_sources(None, str(preset)):
            model_argv(source, [])


def test_hub_cache_models_are_named_as_llama_server_names_them(tmp_path: Path) -> None:
    from tests.model.test_hub import populate_cache

    populate_cache(tmp_path, "acme/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF", "tiny-q4_k_m.gguf": b"GGUF",
                                                 "mmproj-tiny-F16.gguf": b"GGUF", "README.md": b"x"})
    populate_cache(tmp_path, "acme/big-GGUF", {"Q2_K/big-Q2_K-00001-of-00002.gguf": b"GGUF",
                                                "Q2_K/big-Q2_K-00002-of-00002.gguf": b"GGUF", "notag.gguf": b"GGUF"})
    found = {m.name: Path(m.model).name for m in collect_sources(None, None, str(tmp_path))}
    assert found == {"acme/tiny-GGUF:Q8_0": "tiny-Q8_0.gguf", "acme/tiny-GGUF:Q4_K_M": "tiny-q4_k_m.gguf",
                     "acme/big-GGUF:Q2_K": "big-Q2_K-00001-of-00002.gguf"}
    assert all(m.source == "cache" for m in collect_sources(None, None, str(tmp_path)))


def test_dedup_cache_models_hides_the_cache_entries_a_preset_stands_for(tmp_path: Path) -> None:
    """``dedup-cache-models`` (in a section or in ``[*]``): the cache entries of the preset's
    ``hf-repo`` and ``spec-draft-hf`` leave the list; other cache entries stay."""
    from tests.model.test_hub import populate_cache

    cache = tmp_path / "cache"
    populate_cache(cache, "acme/main-GGUF", {"main-F32.gguf": b"GGUF1"})
    populate_cache(cache, "acme/draft-GGUF", {"draft-F32.gguf": b"GGUF2"})
    populate_cache(cache, "acme/other-GGUF", {"other-Q8_0.gguf": b"GGUF3"})
    section = "[dedup]\nhf-repo = acme/main-GGUF\nspec-draft-hf = acme/draft-GGUF\n"

    def hidden(text: str) -> set[str]:
        preset = tmp_path / "models.ini"
        preset.write_text(text)
        return {m.name for m in collect_sources(None, str(preset), str(cache)) if m.hidden}

    assert hidden(section + "dedup-cache-models = 1\n") == {"acme/main-GGUF:F32", "acme/draft-GGUF:F32"}
    assert hidden("[*]\ndedup-cache-models = true\n" + section) == {"acme/main-GGUF:F32", "acme/draft-GGUF:F32"}
    assert hidden(section) == set()
    assert hidden("[dedup]\nhf-repo = acme/main-GGUF:Q8_0\ndedup-cache-models = 1\n") == set()  # another tag
