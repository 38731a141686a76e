#!/usr/bin/env python
"""Write docs/tool-calls.md's round-trip table from the round trip itself.

For each of llama.cpp b11312's chat templates (read from the llama-cpp-python sdist that
``scripts/setup.sh`` keeps, as the tests do), ``tests/chat/tool_round_trip.py`` renders tool calls
and parses the model's part back, whole and streamed; the table is its rows, so it says what the
test checks (``tests/chat/test_tool_syntax.py`` fails when the table is stale).

Usage: ``python scripts/tool_calls_table.py`` rewrites the table; ``--check`` exits 1 when it is
stale. Needs ``MLXCEL_VENV`` when the venv is not ``.venv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.chat.conftest import read_llama_cpp_templates  # noqa: E402
from tests.chat.test_tool_syntax import TABLE_END, TABLE_START, TOOL_CALLS_MD  # noqa: E402
from tests.chat.tool_round_trip import round_trip, table  # noqa: E402


def expected_text() -> str:
    templates = read_llama_cpp_templates()
    rows = [round_trip(stem, source) for stem, source in templates.items()]
    text = TOOL_CALLS_MD.read_text(encoding="utf-8")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return head + TABLE_START + table(rows) + TABLE_END + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the table is stale")
    args = parser.parse_args()
    text = expected_text()
    if TOOL_CALLS_MD.read_text(encoding="utf-8") == text:
        return 0
    if args.check:
        print(f"{TOOL_CALLS_MD.relative_to(ROOT)} is stale: run python scripts/tool_calls_table.py", file=sys.stderr)
        return 1
    TOOL_CALLS_MD.write_text(text, encoding="utf-8")
    print(f"wrote {TOOL_CALLS_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
