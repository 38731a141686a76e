"""The cache bookkeeping never imports MLX; only the adapters (cache/kv.py, cache/kv_io.py) do."""

from __future__ import annotations

import subprocess
import sys


def test_bookkeeping_modules_do_not_import_mlx() -> None:
    modules = ["key", "radix", "store", "block_hash", "snapshot", "families", "disk"]
    code = (
        "import sys\n"
        + "".join(f"import mlxcel_compat.cache.{m}\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
