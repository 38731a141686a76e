"""mlx-lm imported without transformers (zoo.py), and still the whole package when asked.

Each case runs in a fresh interpreter: whether transformers is imported is a property of the
process, and this one imported it long ago (the tests' references use it).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, REPO_ROOT, tiny_model

ROOT = REPO_ROOT


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch'))"


def test_models_caches_and_the_weight_loader_import_no_transformers() -> None:
    out = _run(f"""
        import sys
        import mlxcel_compat
        from mlx_lm.models.cache import make_prompt_cache
        import mlx_lm
        from mlxcel_compat import zoo
        model, config = zoo.load_model({str(tiny_model('qwen3'))!r})
        cls, args = zoo.model_classes(config)
        by_name, _ = zoo.module_classes("qwen3")
        print(type(model).__module__, cls.__module__, mlx_lm.__version__ != "", by_name is cls)
        print({HEAVY})
    """)
    assert out[0] == "mlx_lm.models.qwen3 mlx_lm.models.qwen3 True True"
    assert out[1] == "[]"


def test_the_package_is_whole_once_something_else_is_asked_of_it() -> None:
    """``mlx_lm.load``, ``from mlx_lm import generate`` and mlx-lm's own tokenizer loading work
    after the lazy start (they import transformers then, as they always did)."""
    out = _run(f"""
        import sys
        import mlxcel_compat
        from mlxcel_compat import zoo
        utils = zoo.utils()
        from mlx_lm import generate, load
        import mlx_lm.tokenizer_utils as real
        wrapper = utils.load_tokenizer(__import__("pathlib").Path({str(tiny_model('llama'))!r}))
        print(callable(load), callable(generate), type(wrapper) is real.TokenizerWrapper)
        print(wrapper.encode("Hello world", add_special_tokens=False) != [])
    """)
    assert out == ["True True True", "True"]


def test_a_gguf_server_imports_neither_the_hub_client_nor_httpx_nor_llguidance() -> None:
    """The server's app and a GGUF load leave out ``huggingface_hub`` (mlx-lm's ``utils`` imports
    it: ~20 MiB with httpx2 and trio), ``httpx`` (only the CORS proxy uses it: ~11 MiB with
    rich and click where installed) and ``llguidance`` (the first grammar imports it: ~6 MiB):
    fixed memory that counts against llama-server's."""
    path = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    out = _run(f"""
        import sys
        import mlxcel_compat.server.app
        from mlxcel_compat.gguf.load import load_gguf
        model, *_ = load_gguf({str(path)!r}, on_cpu=True)
        print(type(model).__module__)
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('huggingface_hub', 'httpx', 'transformers', 'llguidance')))
    """)
    assert out == ["mlx_lm.models.qwen3", "[]"]
