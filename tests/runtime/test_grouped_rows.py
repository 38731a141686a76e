"""Weights whose rows ``group_rows`` grouped at load (16 rows' blocks side by side, a vector lane a
row): Q4_K and Q6_K (``rows_q4_K_grouped``, ``rows_q6_K_grouped`` in k_quant_rows.c), Q8_0
(quant_rows.c), Q4_1, Q5_0, Q5_1 (``rows_q4_1_grouped`` ... in split_rows.c) and MXFP4
(``rows_mxfp4_grouped`` in mxfp4_rows.c), the last four against their rows split at load.

A grouped weight takes the lanes for every product, decode rows and prompt chunks alike, so what
must hold is: each activation row gets the very bits it gets from the same weight stored apart
(the lanes' and the two-row path's arithmetic: greedy output and cache-hit-equals-cold do not
move), alone or beside any other rows, in whole groups and in the rows after the last whole group;
the bytes come back unchanged (``ungrouped_rows``, ``take``); and the loader groups a GGUF's Q4_K
and Q6_K linear weights and expert stacks, which then serve the same tokens as before.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlxcel_compat.runtime.block_weight import (SPLIT_FIELDS, BlockWeight, group_rows, grouped_copy, library, split_rows,
                                                ungrouped_rows)
from tests.runtime.test_block_weight import raw_weight, reference

LIB = library()
GROUPED = set() if isinstance(LIB, str) else set(LIB.grouped_kinds)
pytestmark = pytest.mark.skipif(not GROUPED, reason="no grouped kernels on this CPU (AVX-512 VNNI)")


# (type, n, k): whole groups only, a shorter last one (53: 5 rows stored as they were), super-blocks
# of one, two and three (Q6_K's 16 x 210 bytes start mid-line every other one) and ten; the
# 32-value types (Q8_0's 16 x 34 and Q5_0's 16 x 22 bytes start mid-line every other block; Q4_1,
# Q5_0 and Q5_1 grouped in whole groups only, against their rows split at load) in blocks of
# three, one group's 16 and more; MXFP4 likewise (16 x 17 bytes: its blocks start at every 16th
# byte of a line), over gpt-oss's 90 blocks too
@pytest.mark.parametrize("qtype,n,k", [(T.Q4_K, 64, 256), (T.Q4_K, 53, 768), (T.Q4_K, 40, 2560), (T.Q6_K, 64, 256),
                                       (T.Q6_K, 53, 512), (T.Q6_K, 48, 768), (T.Q6_K, 40, 2560),
                                       (T.Q8_0, 64, 96), (T.Q8_0, 53, 640), (T.Q8_0, 48, 2048), (T.Q4_1, 64, 96),
                                       (T.Q4_1, 48, 640), (T.Q5_0, 32, 96), (T.Q5_0, 64, 640), (T.Q5_0, 48, 1024),
                                       (T.Q5_1, 48, 512), (T.Q5_1, 32, 96), (T.MXFP4, 32, 96), (T.MXFP4, 48, 640),
                                       (T.MXFP4, 32, 2880)], ids=str)
def test_grouped_rows_give_each_row_the_bits_of_the_rows_stored_apart(qtype: T, n: int, k: int) -> None:
    if int(qtype) not in GROUPED:
        pytest.skip(f"no grouped {qtype.name} kernel on this CPU")
    raw = raw_weight(qtype, n, k, seed=n + k)
    apart = BlockWeight(raw.copy(), qtype, n, k, LIB)
    if int(qtype) in SPLIT_FIELDS:
        assert split_rows(apart)  # the split rows' lanes: the same arithmetic
    grouped = BlockWeight(raw.copy(), qtype, n, k, LIB)
    assert group_rows(grouped) and grouped.grouped
    assert not np.array_equal(grouped.data, raw)  # really rearranged (53: the last 5 rows stay as stored)
    assert grouped.data.ctypes.data % 64 == 0
    np.testing.assert_array_equal(ungrouped_rows(grouped.data, qtype, np.arange(n)), raw)
    np.testing.assert_array_equal(grouped_copy(raw, qtype), grouped.data)  # the loader's C loop and NumPy agree
    np.testing.assert_array_equal(grouped.take([n - 1, 0, 17]), reference(qtype, raw)[[n - 1, 0, 17]])
    x = np.random.default_rng(k).standard_normal((40, k)).astype(np.float32)
    alone = np.stack([apart.matmul(x[i:i + 1], tiles=False)[0] for i in range(40)])
    for m in (1, 2, 3, 5, 8, 9, 16, 17, 40):
        rows = (np.arange(m) + 3 * m) % 40
        np.testing.assert_array_equal(grouped.matmul(x[rows], tiles=False), alone[rows], err_msg=f"{m} rows")
        np.testing.assert_array_equal(apart.matmul(x[rows], tiles=False), alone[rows], err_msg=f"{m} rows apart")
    # a prompt chunk's path (tiles) takes the lanes too: grouped rows have no row of their own to expand
    np.testing.assert_array_equal(grouped.matmul(x, tiles=True), alone)


def test_grouped_copy_puts_dword_t_of_row_r_at_64t_plus_4r() -> None:
    n, k = 32, 512
    raw = raw_weight(T.Q4_K, n, k, seed=3)
    out = grouped_copy(raw, T.Q4_K)
    group, block, t, r = 1, 1, 7, 5  # the second group's second super-block
    at = group * 16 * raw.shape[1] + block * 16 * 144 + 64 * t + 4 * r
    np.testing.assert_array_equal(out.reshape(-1)[at:at + 4], raw[16 * group + r, 144 * block + 4 * t:144 * block + 4 * t + 4])


def test_grouped_q6_k_puts_the_rows_d_ahead_where_a_super_block_starts_mid_line() -> None:
    """16 x 210 bytes: the first super-block starts a cache line (its rows' d after the dwords),
    the second 32 bytes into one (d ahead: its dwords then start the next line); the dwords' quads
    in the lanes' reading order (the scales, dwords 48-51, first)."""
    n, k = 16, 512
    raw = raw_weight(T.Q6_K, n, k, seed=4)
    out = grouped_copy(raw, T.Q6_K, LIB).reshape(-1)
    assert out.ctypes.data % 64 == 0
    np.testing.assert_array_equal(out[3328:3360], raw[:, 208:210].reshape(-1))  # after the first's 52 dwords
    np.testing.assert_array_equal(out[3360:3392], raw[:, 210 + 208:].reshape(-1))  # ahead of the second's
    np.testing.assert_array_equal(out[3392 + 4:3392 + 8], raw[1, 210 + 192:210 + 196])  # its dword 48 of row 1, at a line
    np.testing.assert_array_equal(out[256 + 64 + 4:256 + 64 + 8], raw[1, 4:8])  # the first's dword 1: slot 1, after 48-51


def _greedy(served, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.runtime.decode_kv import OwnedCache

    cache, owned = make_prompt_cache(served.model), OwnedCache()
    logits = np.array(served.decoder.prefill(prompt, cache, owned, logits=True)).reshape(-1)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = np.array(served.decoder.step_tokens([out[-1]], cache, owned)).reshape(-1)
    return out


def _projections(served) -> list[BlockWeight]:
    names = ("q", "k", "v", "o", "gate", "up", "down")
    return [getattr(layer, n).block for layer in served.decoder.layers for n in names if getattr(layer, n, None) is not None]


def _experts(served) -> list[BlockWeight]:
    from mlxcel_compat.runtime.block_experts import ExpertStack

    return [m.stack.weight for _, m in served.model.named_modules() if isinstance(getattr(m, "stack", None), ExpertStack)]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_gguf_serves_its_k_quant_weights_grouped_and_the_same_tokens(family: str, monkeypatch) -> None:
    """The factory's small llama and Qwen3-MoE as Q4_K_M: the loader groups their Q4_K and Q6_K
    projections and expert stacks (the embedding stays as stored), and greedy decoding from a
    40-token prompt chunk gives the tokens the weights stored apart give (prompt chunks took ggml's
    mul_mat then: another sum order)."""
    from mlxcel_compat.gguf import load as gguf_load
    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from tests.conftest import MODEL_CACHE

    path = str(ensure_gguf(family, "small", "q4_k_m", cache_dir=MODEL_CACHE))  # rows of 768: whole K-quant blocks
    served = load_model(path, [])
    k_quants = [w for w in _projections(served) + _experts(served) if int(w.ggml_type) in (int(T.Q4_K), int(T.Q6_K))]
    assert {int(w.ggml_type) for w in k_quants} == {int(T.Q4_K), int(T.Q6_K)}
    assert all(w.grouped and w.prompt is None for w in k_quants)
    # the file's Q5_0 fallbacks (rows of 128 values: not whole super-blocks) are grouped too
    fallbacks = [w for w in _projections(served) + _experts(served) if int(w.ggml_type) == int(T.Q5_0)]
    assert (family == "qwen3_moe") == bool(fallbacks) and all(w.grouped and not w.split for w in fallbacks)
    assert (family == "qwen3_moe") == any(w.grouped for w in _experts(served))
    assert not served.decoder.embed.grouped
    prompt = [(37 * i + 11) % 200 + 20 for i in range(40)]
    tokens = _greedy(served, prompt, 12)

    monkeypatch.setattr(gguf_load.block_weight, "group_rows", lambda *a, **kw: False)  # the loader as before
    apart = load_model(path, [])
    assert not any(w.grouped for w in _projections(apart) + _experts(apart))
    assert _greedy(apart, prompt, 12) == tokens


def test_grouped_rows_after_a_weight_of_rows_not_whole_groups_in_one_shared_job() -> None:
    """q, k and v (or gate and up) go through one job (``mlxcel_block_matmul_shared``), their rows
    in one run split into parts of 16: a grouped weight after one of 40 rows must still be read
    from its groups' first rows."""
    import ctypes

    from mlxcel_compat.runtime import backend

    shared = backend.matmul_shim().lib.mlxcel_block_matmul_shared
    shared.restype = None
    shared.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_float]
    k = 512
    first = BlockWeight(raw_weight(T.Q4_K, 40, k, seed=5), T.Q4_K, 40, k, LIB)  # stored apart
    raw = raw_weight(T.Q4_K, 1024, k, seed=6)  # enough rows for several parts
    grouped = BlockWeight(raw.copy(), T.Q4_K, 1024, k, LIB)
    assert group_rows(grouped)
    apart = BlockWeight(raw, T.Q4_K, 1024, k, LIB)
    x = np.random.default_rng(7).standard_normal((3, k)).astype(np.float32)
    outs = [np.empty((3, 40), np.float32), np.empty((3, 1024), np.float32)]
    weights = (ctypes.c_void_p * 2)(first.address, grouped.address)
    targets = (ctypes.c_void_p * 2)(*(o.ctypes.data for o in outs))
    ldcs = (ctypes.c_long * 2)(40, 1024)
    shared(2, weights, 3, x.ctypes.data, k, targets, ldcs, 0.0)
    np.testing.assert_array_equal(outs[0], first.matmul(x, tiles=False))
    np.testing.assert_array_equal(outs[1], apart.matmul(x, tiles=False))
