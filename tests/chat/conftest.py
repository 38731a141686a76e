"""Fixtures of the chat room's tests: llama.cpp's real chat templates.

``scripts/setup.sh`` keeps the llama-cpp-python 0.3.36 sdist (llama.cpp b11312) in
``.venv/sdist``; its ``vendor/llama.cpp/models/templates`` holds the 70 templates (and a README) llama.cpp tests
its chat formats with. They are read from the archive at test time, never committed.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

SDIST = Path(os.environ.get("MLXCEL_VENV", REPO_ROOT / ".venv")) / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
TEMPLATES_IN_SDIST = "vendor/llama.cpp/models/templates/"


def read_llama_cpp_templates(sdist: Path = SDIST) -> dict[str, str]:
    """Template file stem -> Jinja source, for every ``*.jinja`` llama.cpp ships."""
    if not sdist.is_file():
        raise FileNotFoundError(f"{sdist} is missing: scripts/setup.sh downloads it (the chat tests read "
                                "llama.cpp's templates from it)")
    templates = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name.startswith(TEMPLATES_IN_SDIST) and name.endswith(".jinja"):
                stem = Path(name).stem
                templates[stem] = archive.extractfile(member).read().decode("utf-8")
    return dict(sorted(templates.items()))


@pytest.fixture(scope="session")
def llama_cpp_templates() -> dict[str, str]:
    templates = read_llama_cpp_templates()
    assert len(templates) == 70, f"expected llama.cpp b11312's 70 templates, found {len(templates)}"
    return templates
