"""RoPE scaling metadata of a GGUF becomes the mlx-lm config the same model's directory has.

The factory's tiny llama directory is copied with a ``rope_scaling`` entry added to its
``config.json`` (RoPE has no weights, so the weights stay valid) and written as a GGUF the way
llama.cpp's converter writes each kind: ``linear`` and ``yarn`` as ``rope.scaling.*`` keys, Llama
3's as the ``rope_freqs`` tensor. The GGUF must then give the directory's logits, and different
logits from the unscaled model (so the scaling is really applied, not ignored).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.testing.gguf_tensors import llama3_rope_factors
from mlxcel_compat.testing.gguf_writer import write_gguf
from tests.conftest import tiny_model

pytestmark = pytest.mark.engine

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                   "beta_fast": 16.0, "beta_slow": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}
# The directory runs mlx-lm's own RoPE from the config; the GGUF gets its llama3 frequencies from
# the file's factors (a float32 product instead of mlx-lm's division), so allow rounding there.
TOLERANCE = {"linear": 0.0, "yarn": 0.0, "yarn-betas": 0.0, "llama3": 1e-4}


def _scaled_directory(tmp_path: Path, scaling: dict) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_scaling"] = scaling
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_scaling_matches_the_directory(kind: str, tmp_path: Path) -> None:
    directory = _scaled_directory(tmp_path, SCALINGS[kind])
    (path,) = write_gguf("llama", "tiny", tmp_path / "scaled.gguf", "f32", model_dir=directory)
    file = open_gguf(path)
    if kind == "llama3":
        assert "rope_freqs.weight" in file.tensors and "llama.rope.scaling.type" not in file.metadata
    else:
        assert file.metadata["llama.rope.scaling.type"] == SCALINGS[kind]["rope_type"]

    model, tokenizer, config, _ = load_gguf(str(path), on_cpu=True)
    reference, _ = load(str(directory))
    plain, _ = load(str(tiny_model("llama")))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    got, expected = model(mx.array([ids])), reference(mx.array([ids]))
    assert mx.abs(got - expected).max().item() <= TOLERANCE[kind], kind
    assert mx.abs(got - plain(mx.array([ids]))).max().item() > 1e-3, "the scaling changed nothing"

    rope, reference_rope = model.model.layers[0].self_attn.rope, reference.model.layers[0].self_attn.rope
    assert type(rope) is type(reference_rope)
    if kind == "linear":
        assert rope.scale == reference_rope.scale == 0.25
    if kind.startswith("yarn"):
        assert config["rope_scaling"]["original_max_position_embeddings"] == SCALINGS[kind]["original_max_position_embeddings"]
        assert config["rope_scaling"].get("beta_fast", 32.0) == SCALINGS[kind].get("beta_fast", 32.0)
        assert rope.mscale == reference_rope.mscale
        np.testing.assert_array_equal(np.array(rope._freqs), np.array(reference_rope._freqs))
    if kind == "llama3":
        np.testing.assert_allclose(np.array(rope._freqs), np.array(reference_rope._freqs), rtol=1e-6)
        factors = llama3_rope_factors({**config, "rope_scaling": SCALINGS[kind]})
        assert factors.shape == (config["head_dim"] // 2,)
        # short wavelengths kept (1), long ones scaled (8) and the blend between them all occur
        assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
