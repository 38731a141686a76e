"""What a text GGUF's server does not import (issue 51's Gemma 3 RSS budget): the vision room
with Pillow (``model/loader.py`` asks whether a path is a vision-language directory only for a
directory) and the Prometheus client (``server/metrics.py`` imports it at the first scrape;
``tests/e2e/test_metrics.py`` scrapes). Checked in a fresh interpreter, since other tests in
this process import both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_model

PROBE = """
import json, sys
from mlxcel_compat.runtime.backend import load_optimized_blas
load_optimized_blas()  # before MLX is imported, as the server does
import mlxcel_compat.server.app, mlxcel_compat.server.instance, mlxcel_compat.server.metrics
from mlxcel_compat.model.loader import load_model
loaded = load_model(sys.argv[1], [])
print(json.dumps({"decoder": loaded.decoder is not None, "n_vocab": len(loaded.tokenizer),
                  "added": len(loaded.tokenizer.added_tokens_decoder),
                  "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("PIL", "prometheus_client")
                                    or m.startswith("mlxcel_compat.vision.model"))}))
"""


def test_a_text_gguf_loads_without_the_vision_room_or_the_prometheus_client() -> None:
    path = tiny_model("qwen3:q8_0")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["decoder"] and seen["n_vocab"] > 0 and seen["added"] > 0  # loaded for serving; added tokens read when asked
    assert seen["modules"] == []
