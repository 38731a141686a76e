"""The model fingerprint that saved prompt-cache state (disk tier, slot files) must match."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlxcel_compat.model.loader import model_fingerprint
from mlxcel_compat.testing.gguf_writer import write_gguf
from tests.conftest import tiny_model


def copy_model(tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(tiny_model("llama"), target)
    return target


def test_a_directory_fingerprint_is_stable_and_moves_with_the_content(tmp_path) -> None:
    original = tiny_model("llama")
    copy = copy_model(tmp_path)
    assert model_fingerprint(copy) == model_fingerprint(original)  # the place does not matter
    assert model_fingerprint(tiny_model("qwen3")) != model_fingerprint(original)

    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n + 100] ^= 0x01  # a fine-tune with the same shapes: one weight byte differs
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy) != model_fingerprint(original)

    other = copy_model(tmp_path, "other")
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = 1.0
    (other / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(other) != model_fingerprint(original)


def test_a_gguf_fingerprint_covers_every_part_and_the_precision(tmp_path) -> None:
    (single,) = write_gguf("llama", "tiny", tmp_path / "one.gguf", "f32")
    parts = write_gguf("llama", "tiny", tmp_path / "split.gguf", "f32", split_max_tensors=8)
    assert len(parts) > 1
    assert model_fingerprint(single) == model_fingerprint(single)
    assert model_fingerprint(parts[0]) != model_fingerprint(single)

    class Summary:
        precision = {"float32": 10}
        compute_dtype = "float32"

    kept_otherwise = Summary()
    kept_otherwise.precision = {"affine q8_0": 10}
    assert model_fingerprint(single, Summary()) != model_fingerprint(single, kept_otherwise)
    last = parts[-1]
    data = bytearray(last.read_bytes())
    data[-10] ^= 0x01
    before = model_fingerprint(parts[0])
    last.write_bytes(bytes(data))
    assert model_fingerprint(parts[0]) != before
