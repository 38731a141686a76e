"""ggml's repacked weights (runtime/ggml_repack.py, ggml_repack.c): the same products as the file's
blocks, rows that never depend on how many share a decode call, and a repacked model that
answers as before."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from mlxcel_compat.runtime import backend
from mlxcel_compat.runtime import block_weight
from mlxcel_compat.runtime import ggml_cpu
from mlxcel_compat.runtime import ggml_repack
from tests.gguf.test_quants import random_blocks

backend.load_optimized_blas()
LIB = block_weight.library()
REPACK = ggml_repack.library()
pytestmark = pytest.mark.skipif(isinstance(LIB, str) or isinstance(REPACK, str),
                                reason=f"no ggml kernels or repacking here: {LIB if isinstance(LIB, str) else REPACK}")


def _weight(ggml_type: int, n: int, k: int, seed: int = 0, rows: np.ndarray | None = None):
    """An (n, k) weight of ``ggml_type``: ggml's quantization of random values, or for MXFP4 and
    the i-quants random valid blocks (some of their quantizers take 5-25 s to set up)."""
    if ggml_type in (T.MXFP4, *ggml_cpu.I_QUANTS):
        blocks = random_blocks(ggml_type, n * k // GGML_QUANT_SIZES[ggml_type][0], seed=seed).reshape(n, -1)
    else:
        values = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
        blocks = ggml_cpu.kernels().quantize(ggml_type, values)
    return blocks, block_weight.BlockWeight(blocks, ggml_type, n, k, LIB, rows=rows)


def _product(repacked, x: np.ndarray, n: int, per_row: bool, out: np.ndarray | None = None, beta: float = 0.0,
             ldx: int | None = None) -> np.ndarray:
    m = x.shape[0]
    out = np.empty((m, n), dtype=np.float32) if out is None else out
    repacked.matmul_into(m, x.ctypes.data, ldx or x.shape[1], out.ctypes.data, out.shape[1], beta, per_row)
    return out


@pytest.mark.parametrize("ggml_type", sorted(ggml_repack.REPACKED_TYPES))
@pytest.mark.parametrize("n,k", [(64, 256), (2048, 768), (776, 512)])
def test_repacked_products_equal_the_blocks_within_rounding(ggml_type: int, n: int, k: int) -> None:
    """Both compute llama.cpp's products (8-bit activations, the same blocks): they differ only in
    float32 summation order. Tolerance: 1e-5 relative to the product's scale."""
    blocks, weight = _weight(ggml_type, n, k)
    repacked = ggml_repack.repack(blocks, ggml_type, n, k)
    assert repacked is not None and repacked.nbytes >= blocks.nbytes
    x = np.random.default_rng(1).standard_normal((13, k), dtype=np.float32)
    reference = weight.matmul(x, tiles=False)
    scale = float(np.abs(reference).max())
    for per_row in (True, False):
        got = _product(repacked, x, n, per_row)
        assert np.abs(got - reference).max() <= 1e-5 * scale, per_row


@pytest.mark.parametrize("ggml_type", sorted(ggml_repack.REPACKED_TYPES))
def test_per_row_products_do_not_depend_on_the_rows_sharing_the_call(ggml_type: int) -> None:
    """Decode steps: a sequence's logits must be the same alone or in a batch, so each row of a
    per-row product is bit-identical to that row multiplied on its own, for every row count."""
    n, k = 1024, 512
    blocks, _ = _weight(ggml_type, n, k, seed=2)
    repacked = ggml_repack.repack(blocks, ggml_type, n, k)
    x = np.random.default_rng(3).standard_normal((16, k), dtype=np.float32)
    alone = np.concatenate([_product(repacked, x[i:i + 1], n, True) for i in range(16)])
    for m in (1, 2, 3, 4, 5, 8, 13, 16):
        assert np.array_equal(_product(repacked, x[:m], n, True), alone[:m]), m


def test_row_order_strides_and_accumulation() -> None:
    """Permuted rows (llama.cpp's Q/K order) are repacked in the model's order; activations and
    outputs with leading dimensions wider than a row, and beta = 1, as the decode runtime uses them."""
    n, k = 512, 256
    perm = np.random.default_rng(4).permutation(n).astype(np.int32)
    blocks, weight = _weight(T.Q4_K, n, k, seed=5, rows=perm)
    repacked = ggml_repack.repack(blocks, T.Q4_K, n, k, rows=perm)
    wide_x = np.random.default_rng(6).standard_normal((5, k + 32), dtype=np.float32)
    x = np.ascontiguousarray(wide_x[:, :k])
    out = np.random.default_rng(7).standard_normal((5, n + 16), dtype=np.float32)
    before = out.copy()
    for per_row in (True, False):
        got = out.copy()
        _product(repacked, wide_x, n, per_row, out=got, beta=1.0, ldx=k + 32)
        expected = before[:, :n] + weight.matmul(x, tiles=False)
        assert np.abs(got[:, :n] - expected).max() <= 1e-4
        assert np.array_equal(got[:, n:], before[:, n:])  # past the product's columns: untouched


def test_types_and_shapes_without_a_worthwhile_layout_are_not_repacked() -> None:
    blocks, _ = _weight(T.Q6_K, 64, 256)
    assert ggml_repack.repack(blocks, T.Q6_K, 64, 256) is None  # no x86 layout
    blocks, _ = _weight(T.Q2_K, 64, 256)
    assert ggml_repack.repack(blocks, T.Q2_K, 64, 256) is None  # its GEMM is slower than our tiles
    blocks, _ = _weight(T.Q4_K, 60, 256)
    assert ggml_repack.repack(blocks, T.Q4_K, 60, 256) is None  # rows come in groups of 8


def test_released_pages_leave_the_process_and_read_back_unchanged(tmp_path) -> None:
    """Dropping a repacked tensor's pages takes them out of the process's RSS (they stay in the
    page cache) and leaves the file's bytes readable; pages only partly inside the range stay."""
    from mlxcel_compat.gguf.reader import map_file

    size = 8 << 20
    data = np.random.default_rng(8).integers(0, 255, size=size, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    mapped = map_file(path)  # populated: all 8 MiB resident
    before = _rss_file()
    ggml_repack.release_pages(mapped, 100, size // 2)
    assert before - _rss_file() >= size // 2 - 2 * mmap.PAGESIZE - (256 << 10)  # (the rest: noise)
    assert np.array_equal(mapped, data)


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_a_repacked_q4_0_model_serves_decode_and_prompts_from_the_copy() -> None:
    """Loading a Q4_0 GGUF repacks its linear layers (decode steps too) and releases their
    pages; the token embedding keeps its blocks; greedy decoding matches the float32 expansion
    of the same file wherever its top two logits are apart."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.gguf.load import load_gguf
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from tests.conftest import MODEL_CACHE

    path = ensure_gguf("llama", "tiny", "q4_0", cache_dir=MODEL_CACHE)
    model, tokenizer, _, summary = load_gguf(str(path), on_cpu=True)
    from mlxcel_compat.runtime import block_layers

    linears = [m for _, m in model.named_modules() if isinstance(m, block_layers.BlockLinear) and m.block.ggml_type == T.Q4_0]
    assert summary.repacked["blocks q4_0"] == len(linears) > 0
    assert all(m.block.repacked is not None for m in linears)
    proj = model.layers[0].self_attn.q_proj.block
    assert proj.repacked is not None
    assert model.model.embed_tokens.block.repacked is None  # looked up by rows: the file's blocks
    reference, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    caches = make_prompt_cache(model), make_prompt_cache(reference)
    ours, theirs = model(mx.array([ids]), cache=caches[0]), reference(mx.array([ids]), cache=caches[1])
    for _ in range(6):
        a, b = np.array(ours[0, -1]), np.array(theirs[0, -1])
        assert np.abs(a - b).max() <= 0.25  # 8-bit activations against float32 math (test_gguf_models)
        top = np.sort(b)[-2:]
        if top[1] - top[0] > 0.5:
            assert int(a.argmax()) == int(b.argmax())
        token = int(b.argmax())
        ours, theirs = model(mx.array([[token]]), cache=caches[0]), reference(mx.array([[token]]), cache=caches[1])


def test_no_repack_keeps_the_file_blocks_only() -> None:
    """llama-server's --no-repack / LLAMA_ARG_NO_REPACK reach the loader: no repacked copies."""
    from mlxcel_compat.gguf.load import load_gguf
    from mlxcel_compat.settings import resolve_settings
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from tests.conftest import MODEL_CACHE

    assert resolve_settings(["-m", "x.gguf"], environ={}).repack is True
    assert resolve_settings(["-m", "x.gguf", "--no-repack"], environ={}).repack is False
    assert resolve_settings(["-m", "x.gguf"], environ={"LLAMA_ARG_NO_REPACK": "1"}).repack is False
    path = ensure_gguf("llama", "tiny", "q4_0", cache_dir=MODEL_CACHE)
    model, _, _, summary = load_gguf(str(path), on_cpu=True, repack=False)
    assert summary.repacked == {}
    assert model.layers[0].self_attn.q_proj.block.repacked is None


@pytest.mark.parametrize("ggml_type", sorted(ggml_repack.REPACKED_TYPES))
def test_prompt_rows_do_not_depend_on_the_rows_sharing_the_call(ggml_type: int) -> None:
    """Prompt chunks: a token's product is bit-identical whatever the chunk's length and where
    the token sits in it (ggml's GEMM for every row: calls are padded to a multiple of 4 rows),
    so chunking, batched padding and cache-hit splits never change a token's KV."""
    n, k = 512, 512
    blocks, _ = _weight(ggml_type, n, k, seed=9)
    repacked = ggml_repack.repack(blocks, ggml_type, n, k)
    x = np.random.default_rng(10).standard_normal((23, k), dtype=np.float32)
    whole = _product(repacked, x, n, False)
    for start, stop in ((0, 2), (1, 4), (3, 10), (5, 6), (7, 23), (0, 23)):
        assert np.array_equal(_product(repacked, np.ascontiguousarray(x[start:stop]), n, False), whole[start:stop])


PROMPT = pytest.mark.skipif(not ggml_repack.takes_prompt_products(T.Q4_K),
                            reason=f"ggml {ggml_cpu.kernels().version if not isinstance(LIB, str) else '?'} has no tiled "
                                   "K-quant kernels (scripts/setup.sh builds 0.25)")


def _prompt(ggml_type: int, n: int, k: int, seed: int = 0, rows: np.ndarray | None = None):
    """A weight whose prompt chunks take ggml's mul_mat, or for Q8_0 where the shim's lanes take
    its prompts (``BlockLibrary.lane_prompts``), those: what a served model's prompts run,
    checked the same way."""
    blocks, weight = _weight(ggml_type, n, k, seed=seed, rows=rows)
    assert ggml_repack.prompt_product(weight) != (ggml_type in LIB.lane_prompts)
    return blocks, weight


@PROMPT
@pytest.mark.parametrize("ggml_type", sorted(ggml_repack.PROMPT_TYPES))
@pytest.mark.parametrize("n,k", [(2048, 768), (64, 512)])
def test_prompt_products_equal_the_dequantized_weights_within_the_activations_rounding(ggml_type: int, n: int,
                                                                                      k: int) -> None:
    """A prompt chunk through ggml's mul_mat (its tiled kernels) against float64 math on gguf-py's
    dequantization of the same blocks. ggml rounds the activations to 8 bits per 256 values (Q8_K:
    each value within max|x| / 254 of its block), so output j may be off by at most
    sum_i |w_ji| * max|x_block(i)| / 254; float32 rounding adds 1e-5 of the product's scale."""
    from gguf.quants import dequantize

    blocks, weight = _prompt(ggml_type, n, k, seed=11)
    x = np.random.default_rng(12).standard_normal((37, k), dtype=np.float32)
    got = weight.matmul(x, tiles=True)
    w = dequantize(blocks, ggml_type).reshape(n, k).astype(np.float64)
    reference = x.astype(np.float64) @ w.T
    step = np.repeat(np.abs(x).reshape(37, k // 256, 256).max(axis=2), 256, axis=1) / 254  # (rows, k)
    bound = step @ np.abs(w).T
    assert np.all(np.abs(got - reference) <= bound * 1.001 + 1e-5 * np.abs(reference).max())
    assert np.abs(got - reference).max() > 0  # int8 activations: not the float32 tiles' result


@PROMPT
def test_prompt_products_from_several_threads_and_a_forked_child_equal_one_caller() -> None:
    """Prompt graphs run on one ggml threadpool kept for the process: a second caller meanwhile
    computes with a threadpool of its own, and a forked child (where the pool's threads do not
    exist) makes a new one; every result is bit-identical to one caller's."""
    import os
    import signal
    import threading
    import time

    _, weight = _prompt(T.Q4_K, 1024, 768, seed=17)
    xs = [np.random.default_rng(18 + i).standard_normal((40, 768), dtype=np.float32) for i in range(4)]
    alone = [weight.matmul(x, tiles=True) for x in xs]
    got: list[list[np.ndarray]] = [[] for _ in xs]

    def run(i: int) -> None:
        for _ in range(20):
            got[i].append(weight.matmul(xs[i], tiles=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, alone[i]) for i in range(len(xs)) for g in got[i])
    pid = os.fork()
    if pid == 0:
        os._exit(0 if np.array_equal(weight.matmul(xs[0], tiles=True), alone[0]) else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # a child waiting on threads the fork did not copy
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and done[1] == 0


@PROMPT
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0])
def test_prompt_product_rows_do_not_depend_on_the_chunk(ggml_type: int) -> None:
    """ggml picks its kernel by the row count (tiled from 8 rows, vec_dot below; llamafile's GEMM
    for Q8_0 blocks its tiles by it): fewer rows are padded, so a token's product is
    bit-identical whatever the chunk's length and its place in it; wider leading dimensions and
    beta = 1 (the decode runtime's accumulation) too."""
    n, k = 512, 768
    _, weight = _prompt(ggml_type, n, k, seed=13)
    x = np.random.default_rng(14).standard_normal((300, k), dtype=np.float32)
    whole = weight.matmul(x, tiles=True)
    for start, stop in ((0, 1), (4, 7), (8, 16), (9, 18), (100, 117), (13, 300)):
        assert np.array_equal(weight.matmul(np.ascontiguousarray(x[start:stop]), tiles=True), whole[start:stop])
    wide = np.random.default_rng(15).standard_normal((20, k + 16), dtype=np.float32)
    out = np.random.default_rng(16).standard_normal((20, n + 8), dtype=np.float32)
    before = out.copy()
    weight.matmul_into(20, wide.ctypes.data, k + 16, out.ctypes.data, n + 8, 1.0, tiles=True)
    alone = weight.matmul(np.ascontiguousarray(wide[:, :k]), tiles=True)
    assert np.array_equal(out[:, :n], before[:, :n] + alone) and np.array_equal(out[:, n:], before[:, n:])


@PROMPT
def test_permuted_rows_are_stored_in_order_for_prompt_products() -> None:
    """llama.cpp's permuted Q/K rows: the weight is copied into the model's order (ggml's mul_mat
    reads rows as stored), and every path still gives output r from stored row rows[r]."""
    n, k = 256, 512
    perm = np.random.default_rng(17).permutation(n).astype(np.int32)
    blocks, weight = _prompt(T.Q6_K, n, k, seed=18, rows=perm)
    assert weight.rows is None and np.array_equal(weight.data, blocks[perm])
    _, plain = _weight(T.Q6_K, n, k, seed=18, rows=perm)
    x = np.random.default_rng(19).standard_normal((24, k), dtype=np.float32)
    assert np.array_equal(weight.matmul(x, tiles=False), plain.matmul(x, tiles=False))
    assert np.array_equal(weight.take([3, 200]), plain.take([3, 200]))
    ordered = block_weight.BlockWeight(np.ascontiguousarray(blocks[perm]), T.Q6_K, n, k, LIB)
    assert ggml_repack.prompt_product(ordered)
    assert np.array_equal(weight.matmul(x, tiles=True), ordered.matmul(x, tiles=True))


@PROMPT
def test_a_k_quant_model_takes_prompt_products_instead_of_repacking() -> None:
    """A Q4_K_M file: its Q4_K and Q6_K linear layers are not repacked, with --no-repack too: they
    are grouped for the shim's lanes where it has them (test_grouped_rows.py), else take ggml's
    mul_mat for prompts (its tiled kernels beat the repacked GEMM; llama.cpp runs them either
    way); the embedding keeps its blocks."""
    from mlxcel_compat.runtime import block_layers
    from mlxcel_compat.gguf.load import load_gguf
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from tests.conftest import MODEL_CACHE

    path = ensure_gguf("llama", "small", "q4_k_m", cache_dir=MODEL_CACHE)  # rows of 768: whole K-quant blocks
    for repack in (True, False):
        model, _, _, summary = load_gguf(str(path), on_cpu=True, repack=repack)
        linears = [m.block for _, m in model.named_modules() if isinstance(m, block_layers.BlockLinear)]
        k_quants = [b for b in linears if b.ggml_type in ggml_repack.PROMPT_TYPES]
        assert k_quants and summary.repacked == {} and all(b.repacked is None for b in k_quants)
        grouped = [b for b in k_quants if b.grouped]
        assert all(b.prompt is None for b in grouped) and all(b.prompt is not None for b in k_quants if not b.grouped)
        assert {int(b.ggml_type) for b in grouped} == {int(b.ggml_type) for b in k_quants} & set(LIB.grouped_kinds)
        assert sum(summary.grouped.values()) == len(grouped)
        assert sum(summary.prompt_products.values()) == len(k_quants) - len(grouped)
        assert model.model.embed_tokens.block.prompt is None
