"""The child process that builds a directory's tokenizer with transformers and saves it.

Run as ``python -m mlxcel_compat.tokenizer.convert DIR OUT`` by ``tokenizer/cache.py:
load_directory`` (through ``convert_in_child``): the serving process never imports transformers,
this program does, once per directory, and the cache keeps what it wrote. (A GGUF vocabulary's
conversion is ``python -m mlxcel_compat.gguf.tokenizer``.)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """``AutoTokenizer.from_pretrained(DIR).save_pretrained(OUT)``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m mlxcel_compat.tokenizer.convert DIR OUT", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(args[0]).save_pretrained(args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
