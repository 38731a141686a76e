"""Fixtures only the end-to-end tests use: servers of other shapes than the shared default.

The server machinery (``ServerProcess``, ``server_factory``, the default ``server`` and ``http``)
stays in ``tests/conftest.py``: a few modules of other rooms start servers too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ServerProcess, tiny_model


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def small_server(server_factory, llama_dir: Path) -> ServerProcess:
    """A one-slot server with a 128-token context and the optional endpoints off.

    Its environment asks for 512 tokens and 3 slots: the command line must win.
    """
    return server_factory(
        ["-m", str(llama_dir), "-c", "128", "-np", "1", "--no-slots"],
        env={"LLAMA_ARG_CTX_SIZE": "512", "LLAMA_ARG_N_PARALLEL": "3"},
        keep=True,
    )
