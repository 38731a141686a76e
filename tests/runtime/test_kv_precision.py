"""KV storage types (runtime/kv_precision.py) on mlx-lm's cache objects themselves: a stamped
layer stores what it is given in its type from the first write on, and keeps it through growth,
copies, a merged batch and a context shift; an unstamped float32 layer is left as it was."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlxcel_compat.cache import kv
from mlxcel_compat.runtime import kv_precision
from mlxcel_compat.runtime.kv_precision import KvTypes

H, D = 2, 8


def rows(n: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))


@pytest.fixture(autouse=True)
def _patched() -> None:
    kv_precision.patch_caches()


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_a_stamped_layer_stores_and_returns_its_type_through_growth(name: str) -> None:
    dtype = kv_precision.DTYPES[name]
    layer = kv_precision.stamp([KVCache()], KvTypes(name, name))[0]
    k, v = rows(200, 1)
    keys, values = layer.update_and_fetch(k, v)
    assert keys.dtype == values.dtype == layer.keys.dtype == dtype
    assert mx.array_equal(keys, k.astype(dtype)).item()  # what attention reads is what is stored
    k2, v2 = rows(100, 2)  # past mlx-lm's 256-position step: the buffer grows
    keys, values = layer.update_and_fetch(k2, v2)
    assert keys.shape[2] == 300 and keys.dtype == values.dtype == dtype
    assert mx.array_equal(keys[:, :, 200:], k2.astype(dtype)).item()


def test_copies_batches_and_shifts_keep_the_type() -> None:
    types = KvTypes("f16", "f16")
    empty_copy = kv.copy_cache(kv_precision.stamp([KVCache()], types))[0]
    empty_copy.update_and_fetch(*rows(3, 3))
    assert empty_copy.keys.dtype == mx.float16

    a, b = kv_precision.stamp([KVCache(), KVCache()], types)
    a.update_and_fetch(*rows(5, 4))
    b.update_and_fetch(*rows(9, 5))
    batch = BatchKVCache.merge([a, b])
    keys, values = batch.update_and_fetch(*(mx.concatenate([x, x]) for x in rows(1, 6)))
    assert keys.dtype == values.dtype == mx.float16
    assert batch.extract(0).keys.dtype == mx.float16

    def rotate(_: int, keys: mx.array, shift: int) -> mx.array:
        return keys.astype(mx.float32) * 2  # a rotation computed in float32

    kv.shift([a], 1, 2, rotate)
    assert a.keys.dtype == a.values.dtype == mx.float16 and a.offset == 3


def test_rings_store_the_type_and_unstamped_float32_layers_are_untouched() -> None:
    ring = kv_precision.stamp([RotatingKVCache(max_size=4)], KvTypes("bf16", "bf16"))[0]
    keys, _ = ring.update_and_fetch(*rows(6, 7))
    assert keys.dtype == mx.bfloat16
    plain = KVCache()
    k, v = rows(4, 8)
    keys, values = plain.update_and_fetch(k, v)
    assert keys.dtype == mx.float32 and mx.array_equal(keys, k).item()


def test_install_stamps_the_models_caches_and_f32_leaves_the_model_alone() -> None:
    class Model:
        layers = [object(), object()]

    model = Model()
    kv_precision.install(model, KvTypes())
    assert kv_precision.of_model(model) == KvTypes() and not hasattr(model, "make_cache")
    kv_precision.install(model, KvTypes("f16", "f16"))
    made = model.make_cache()
    assert len(made) == 2 and all(layer.__dict__[kv_precision.STAMP] == (mx.float16, mx.float16) for layer in made)
    assert kv_precision.of_model(model).tag == "f16/f16"
    assert KvTypes("f16", "f16").bytes_per_value() == (2, 2) and not KvTypes("f16", "f16").exact
