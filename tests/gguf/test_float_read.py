"""Float GGUF tensors read straight into MLX (``gguf.read_float_tensor``, the loader's fast path).

The reference is gguf-py's reader on the same file: an independent parser of the header and the
tensor bytes. The file mixes F32, F16 and BF16 tensors of several ranks with a quantized tensor
between them, so a wrong offset or a mis-sized tensor cannot go unnoticed. The MLX-side undoing
of the converter's changes (``load_float_tensor``) must equal the NumPy path (``decode_tensor``)
bit for bit.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlxcel_compat.gguf import architectures as gguf_arch
from mlxcel_compat.gguf import precision
from mlxcel_compat.gguf.reader import GGUFError, SafetensorsView, open_gguf, read_float_tensor, read_tensor
from mlxcel_compat.gguf.load import decode_tensor, load_float_tensor

SHAPES = {"a": (7,), "b": (6, 64), "c": (2, 3, 32)}


def _encode(values: np.ndarray, qtype: T) -> np.ndarray:
    return gguf.quants.quantize(values, qtype) if qtype != T.F32 else values


@pytest.fixture(scope="module")
def float_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("gguf-float") / "floats.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    stored: dict[str, np.ndarray] = {}
    for qtype in (T.F32, T.F16, T.BF16):
        for key, shape in SHAPES.items():
            name = f"{qtype.name}.{key}"
            values = rng.standard_normal(shape).astype(np.float32) * 3
            writer.add_tensor(name, _encode(values, qtype), raw_dtype=qtype)
            stored[name] = values
        q8 = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(f"{qtype.name}.q8", gguf.quants.quantize(q8, T.Q8_0), raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, stored


def test_float_tensors_equal_gguf_py(float_file: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = float_file
    file = open_gguf(path)
    reference = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    dtypes = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}
    checked = 0
    for name, info in file.tensors.items():
        if info.ggml_type == T.Q8_0:
            with pytest.raises(GGUFError, match="not a float type"):
                read_float_tensor(info)
            continue
        array = read_float_tensor(info)
        assert array.dtype == dtypes[info.ggml_type] and tuple(array.shape) == SHAPES[name.split(".")[1]]
        expected = gguf.quants.dequantize(np.asarray(reference[name].data), T(info.ggml_type))
        np.testing.assert_array_equal(np.array(array.astype(mx.float32)), expected.reshape(array.shape))
        checked += 1
    assert checked == 9


@pytest.mark.parametrize("dtype", [precision.FLOAT32, precision.FLOAT16, precision.BFLOAT16])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_mlx_path_equals_the_numpy_path(float_file: tuple[Path, dict[str, np.ndarray]], qtype: T, dtype: str) -> None:
    path, _ = float_file
    file = open_gguf(path)
    info = file.tensors[f"{qtype.name}.b"]
    config = {"num_attention_heads": 1, "num_key_value_heads": 1}
    llama, gemma = gguf_arch.ARCHITECTURES["llama"], gguf_arch.ARCHITECTURES["gemma3"]
    cases = [
        (llama, "model.layers.0.self_attn.q_proj.weight", (6, 64)),  # rows un-permuted (one head of 3 pairs)
        (gemma, "model.layers.0.input_layernorm.weight", (6, 64)),  # norm shifted by 1
        (llama, "model.layers.0.mlp.up_proj.weight", (6, 64, 1)),  # reshaped
    ]
    for spec, mlx_name, target in cases:
        fast = load_float_tensor(info, mlx_name, spec, config, dtype, target)
        slow = decode_tensor(info, read_tensor(info), mlx_name, spec, config, dtype, target)
        assert fast.dtype == slow.dtype and fast.shape == slow.shape, mlx_name
        assert mx.array_equal(fast, slow).item(), mlx_name
    permuted = load_float_tensor(info, cases[0][1], llama, config, precision.FLOAT32, (6, 64))
    assert not mx.array_equal(permuted, read_float_tensor(info).astype(mx.float32)).item()


def test_a_truncated_float_tensor_is_an_error(float_file: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, _ = float_file
    info = open_gguf(path).tensors["BF16.c"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:info.offset + info.n_bytes - 10])
    with pytest.raises(Exception, match="ends inside tensor 'BF16.c'"):
        read_float_tensor(open_gguf(cut).tensors["BF16.c"])


def test_mlx_has_let_go_of_the_reader_when_a_read_returns(float_file: tuple[Path, dict[str, np.ndarray]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX's I/O worker drops its reference to the file object after handing the read back, and
    takes the GIL to do it. Left pending when the interpreter exits, that drop aborts the process
    ("terminate called without an active exception"), so no reader may outlive a read.

    The worker loses that race when it is preempted between the two, so two threads keep the
    cores busy meanwhile (NumPy products, the GIL released): without the wait, 15-35 % of these
    reads returned with their reader still held."""
    path, _ = float_file
    file = open_gguf(path)
    made: list[weakref.ref] = []
    init = SafetensorsView.__init__

    def recorded(self: SafetensorsView, *args: object) -> None:
        init(self, *args)
        made.append(weakref.ref(self))

    monkeypatch.setattr(SafetensorsView, "__init__", recorded)
    done = threading.Event()

    def busy() -> None:
        square = np.random.default_rng(0).random((300, 300))
        while not done.is_set():
            square @ square

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        floats = [info for info in file.tensors.values() if info.ggml_type != T.Q8_0]
        for _ in range(60):
            for info in floats:
                read_float_tensor(info)
                assert made[-1]() is None, info.name
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert len(made) == 60 * 9
