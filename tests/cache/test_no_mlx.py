"""The cache bookkeeping never imports MLX; only the adapters (cache/kv.py, cache/kv_io.py) do."""

from __future__ import annotations

import subprocess
import sys


def test_bookkeeping_modules_do_not_import_mlx() -> None:
    modules = [
        "key", "radix", "records", "store", "prompt_store", "block_hash", "snapshot", "families",
        "disk_format", "disk_write", "disk_directory", "disk_index", "block_pool",
    ]
    code = (
        "import sys\n"
        + "".join(f"import mlxcel_compat.cache.{m}\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm.'))\n"
        + "             and m != 'mlx_lm._version'))\n"
    )
    # mlxcel_compat's import registers mlx-lm's package lazily (zoo.py: its __init__ has not
    # run and imports nothing until an attribute is read) with its version string module; any
    # other mlx-lm module, or MLX itself, would mean the bookkeeping loaded MLX code.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
