"""The chat page's files as shipped: vendored libraries unmodified, size budget, no inline script,
and every module import resolving to a served file. No server, no browser."""

from __future__ import annotations

import hashlib
import re

from mlxcel_compat.server.api_web import UI_DIR, ui_files

VENDOR = UI_DIR / "ui" / "vendor"


def test_vendored_files_match_their_recorded_digests() -> None:
    notes = (VENDOR / "README.md").read_text(encoding="utf-8")
    recorded = dict(re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", notes, flags=re.M))
    shipped = {p.name for p in VENDOR.iterdir() if p.name != "README.md"}
    assert set(recorded) == shipped
    for name, digest in recorded.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
    assert "marked v18.2.1" in (VENDOR / "marked.esm.js").read_text(encoding="utf-8")[:200]
    assert "DOMPurify 3.5.0" in (VENDOR / "purify.es.mjs").read_text(encoding="utf-8")[:200]


def test_the_page_weighs_under_300_kb() -> None:
    files = ui_files()
    page = [name for name in files if name.endswith((".html", ".js", ".mjs", ".css", ".svg"))]
    assert {"index.html", "ui/main.js", "ui/vendor/marked.esm.js", "ui/vendor/purify.es.mjs"} <= set(page)
    assert sum(len(files[name].body) for name in page) < 300_000


def test_index_has_no_inline_script_or_style() -> None:
    html = ui_files()["index.html"].body.decode()
    scripts = re.findall(r"<script\b[^>]*>", html)
    assert scripts and all(" src=" in tag for tag in scripts)
    assert not re.search(r"<script\b[^>]*>\s*[^<\s]", html), "inline script"
    assert not re.search(r"\son[a-z]+\s*=", html, flags=re.I), "inline event handler"
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"(src|href)=\"(https?:)?//", html), "the page loads nothing from elsewhere"


def test_module_imports_resolve_to_served_files() -> None:
    files = ui_files()
    for name, file in files.items():
        if not name.endswith(".js") or name.startswith("ui/vendor/"):
            continue
        for target in re.findall(r"^import .* from \"(\./[^\"]+)\";$", file.body.decode(), flags=re.M):
            resolved = "ui/" + target[2:]
            assert resolved in files, f"{name} imports {target}"
    for path in re.findall(r"(?:src|href)=\"([^\"]+)\"", files["index.html"].body.decode()):
        assert path in files, path
