#!/usr/bin/env python
"""Regenerate the files derived from the settings table.

- docs/configuration.md (all of it), from ``settings.render_markdown()``;
- the ``flags`` and ``env_only`` sections of docs/compat/llama-server.json (routes and request
  fields in that file are maintained by hand and kept as they are).

Usage: ``python scripts/gen_docs.py`` writes the files; ``--check`` writes nothing and exits 1
when a file is stale, so CI can catch a table change without regenerated docs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxcel_compat.compat import MANIFEST_PATH, dump_manifest, load_manifest, with_generated_sections  # noqa: E402
from mlxcel_compat.settings import render_markdown  # noqa: E402

CONFIGURATION_MD = ROOT / "docs" / "configuration.md"


def expected_files() -> dict[Path, str]:
    """Each generated file and the text it should have."""
    return {
        CONFIGURATION_MD: render_markdown(),
        MANIFEST_PATH: dump_manifest(with_generated_sections(load_manifest())),
    }


def _display(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def stale_files() -> list[Path]:
    stale = []
    for path, text in expected_files().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            stale.append(path)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {_display(path)} (run python scripts/gen_docs.py)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {_display(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
