"""The prompt cache on a real engine and real tiny models (llama and qwen3).

Exactness, as the spec states it: a hit whose adopted prefix ends on a prefill-chunk boundary
that the cold run also uses reproduces the cold run exactly (same greedy tokens, bit-identical
log-probabilities). Elsewhere the split changes the summation order: first-token log-probabilities
must agree within LOGPROB_TOL.

The engine stores dense KV as shared blocks of BLOCK positions here (16, not the default 256,
so that these short prompts span several and every test runs through multi-block tables):
sessions that share a system prompt store it once, the stats count it once, a hit on shared
blocks equals a cold run, and a reset leaves no referenced block (the pool's own bookkeeping:
tests/cache/test_block_pool.py).
"""

from __future__ import annotations

import queue
import random
from dataclasses import replace

import numpy as np
import pytest

from mlxcel_compat.cache import kv
from mlxcel_compat.cache.block_pool import BlockTable
from mlxcel_compat.engine.request import ErrorEvent
from mlxcel_compat.engine.sequence import Sequence
from mlxcel_compat.runtime import decode_kv
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness, collect

CHUNK = 16
LOGPROB_TOL = 1e-4
N_PROBS = 8
# Long enough that the tiny models' logits (vocabulary 8192: 32 KiB) cost less than
# FINAL_LOGITS_MAX_SHARE of the entry's KV (the tiny llama's: 512 bytes a token).
LONG_PROMPT = 1100
BLOCK = 16  # positions per shared KV block
SYSTEM = 4 * BLOCK  # a system prompt of four whole blocks (and four prefill chunks)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama:q4_0"])
def harness(request: pytest.FixtureRequest):
    h = EngineHarness(tiny_model(request.param), batch_size=CHUNK, kv_block_tokens=BLOCK)
    yield h
    h.close()


@pytest.fixture(autouse=True)
def _empty_cache(harness: EngineHarness) -> None:
    harness.reset()


def test_aligned_hit_is_exact(harness: EngineHarness) -> None:
    shared = random_tokens(2 * CHUNK, seed=1)
    first = shared + random_tokens(9, seed=2)
    second = shared + random_tokens(27, seed=3)
    harness.run(first, n_predict=4)  # donates first + its generated tokens
    warm = harness.run(second, n_predict=12, n_probs=N_PROBS)
    assert warm.finish.n_cached == 2 * CHUNK  # adopted exactly up to the shared chunk boundary
    cold = harness.run(second, n_predict=12, n_probs=N_PROBS, cache=False)
    assert cold.finish.n_cached == 0
    assert warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs  # bit-identical, not just close


def test_unaligned_hit_is_within_tolerance(harness: EngineHarness) -> None:
    shared = random_tokens(2 * CHUNK + 5, seed=4)
    harness.run(shared + random_tokens(6, seed=5), n_predict=2)
    second = shared + random_tokens(20, seed=6)
    warm = harness.run(second, n_predict=1, n_probs=N_PROBS)
    cold = harness.run(second, n_predict=1, n_probs=N_PROBS, cache=False)
    assert warm.finish.n_cached == len(shared)
    common = set(warm.logprobs[0]) & set(cold.logprobs[0])
    assert len(common) >= N_PROBS - 1
    for token in common:
        assert abs(warm.logprobs[0][token] - cold.logprobs[0][token]) < LOGPROB_TOL


def test_exact_repeat_reprefills_one_token(harness: EngineHarness) -> None:
    """A short prompt's entry keeps no logits (they would cost more than FINAL_LOGITS_MAX_SHARE
    of its KV): sent again, its last token is computed again."""
    prompt = random_tokens(50, seed=7)
    cold = harness.run(prompt, n_predict=6)
    warm = harness.run(prompt, n_predict=6)
    assert warm.finish.n_cached == len(prompt) - 1
    assert warm.tokens == cold.tokens


def test_a_prompt_sent_again_samples_from_the_entrys_logits(harness: EngineHarness) -> None:
    """A long prompt's entry keeps the logits its donor computed at the prompt's last position
    (with that position's KV, which the entry holds anyway). The same prompt sent again adopts
    all of it and samples its first token from them: no forward pass before the first token,
    nothing counted as prompt processing, and the answer and its log-probabilities bit-identical
    to the cold run's. A prompt that is only a prefix of the entry, or extends the donor's prompt,
    computes its last token as before."""
    prompt = random_tokens(LONG_PROMPT, seed=30)
    decoder = harness.engine.loaded.decoder
    cold = harness.run(prompt, n_predict=6, n_probs=N_PROBS)
    steps, fed = decoder.steps, decoder.prefilled
    (entry,) = harness.on_engine(lambda: harness.engine.prefix_cache.store.entries())
    assert entry.final_logits is not None and entry.final_logits[0] == len(prompt)
    assert entry.nbytes == entry.payload_nbytes + entry.final_logits[2]
    hits = harness.stats()["hits"]
    warm = harness.run(prompt, n_predict=6, n_probs=N_PROBS)
    assert warm.finish.n_cached == len(prompt) and warm.finish.n_prompt == len(prompt)
    assert decoder.steps - steps == 5 and decoder.prefilled == fed  # only the 5 tokens fed back
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    assert harness.stats()["hits"] == hits + 1  # one lookup, one hit (the store's, one token short)
    again = harness.run(prompt, n_predict=6, n_probs=N_PROBS)  # from the entry the warm run donated
    assert again.finish.n_cached == len(prompt) and again.tokens == cold.tokens
    for other in (prompt[:-1], prompt + cold.tokens[:1]):
        run = harness.run(other, n_predict=3)
        assert run.finish.n_cached == len(other) - 1


def _entry_arrays(harness: EngineHarness, entry_id: int) -> list[np.ndarray]:
    def grab() -> list[np.ndarray]:
        entry = harness.engine.prefix_cache.store.get(entry_id)
        return [np.array(a) for layer in kv.materialize(entry.payload) for a in (layer.keys, layer.values)]

    return harness.on_engine(grab)


def test_adoption_never_mutates_the_stored_entry(harness: EngineHarness) -> None:
    base = random_tokens(40, seed=8)
    harness.run(base, n_predict=3)
    (entry_id,) = harness.on_engine(lambda: [e.id for e in harness.engine.prefix_cache.store.entries()])
    before = _entry_arrays(harness, entry_id)
    # Two continuations adopt the same stored prefix and write their own KV after it.
    first = base[: 2 * CHUNK] + random_tokens(10, seed=9)
    second = base[: 2 * CHUNK] + random_tokens(10, seed=12)
    warm_runs = [harness.run(p, n_predict=6, session="other") for p in (first, second)]
    for prompt, warm in zip((first, second), warm_runs):
        assert warm.finish.n_cached == 2 * CHUNK
        assert warm.tokens == harness.run(prompt, n_predict=6, cache=False).tokens
    for x, y in zip(before, _entry_arrays(harness, entry_id)):
        np.testing.assert_array_equal(x, y)


def test_cache_prompt_false_neither_reads_nor_writes(harness: EngineHarness) -> None:
    prompt = random_tokens(48, seed=10)
    harness.run(prompt, n_predict=2)
    stats_before = harness.stats()
    run = harness.run(prompt, n_predict=2, cache=False)
    stats_after = harness.stats()
    assert run.finish.n_cached == 0
    for key in ("lookups", "hits", "misses", "inserts", "entries", "bytes"):
        assert stats_after[key] == stats_before[key], key


def test_donated_entry_holds_exactly_its_tokens(harness: EngineHarness) -> None:
    prompt = random_tokens(37, seed=11)
    run = harness.run(prompt, n_predict=5)
    assert run.finish.stop_type == "limit"

    def inspect() -> tuple[tuple[int, ...], list[int], int, int]:
        (entry,) = harness.engine.prefix_cache.store.entries()
        layers = kv.materialize(entry.payload)  # a block table's blocks gathered
        return entry.tokens, [kv.layer_tokens(layer) for layer in layers], entry.nbytes, kv.nbytes(layers)

    tokens, held, nbytes, measured = harness.on_engine(inspect)
    # prompt + generated tokens that were fed back (the last sampled token never is).
    assert list(tokens) == prompt + run.tokens[:-1]
    assert held == [len(tokens)] * len(held)
    assert nbytes == measured  # logical bytes, no preallocated slack
    assert nbytes % len(tokens) == 0  # dense KV: the same bytes for every token held


def test_unaligned_rest_goes_in_one_pass_when_it_fits(harness: EngineHarness) -> None:
    """After an unaligned hit the rest of the prompt is one pass if it fits in a chunk (two
    passes split at the chunk grid bought no exactness there); aligned starts and longer rests
    keep the grid, so cold runs and aligned hits split exactly as before."""
    from mlxcel_compat.engine.factory import make_sequence

    prompt = random_tokens(3 * CHUNK + 2, seed=13)  # 50 tokens: the last one is fed alone

    def chunks_after(adopted: int) -> list[int]:
        seq = make_sequence(harness.engine, harness.request(prompt, cache=False), lambda event: None, 0)
        seq.adopt(adopted)
        sizes = []
        while len(seq.cache_tokens) < seq.n_prompt - 1:
            chunk = seq.next_chunk()
            seq.cache_tokens.extend(chunk)
            sizes.append(len(chunk))
        return sizes

    sizes = harness.on_engine(lambda: {n: chunks_after(n) for n in (0, 16, 37, 40, 20, 3)})
    assert sizes[0] == [16, 16, 16, 1]  # cold: on the grid
    assert sizes[16] == [16, 16, 1]  # aligned hit: the cold run's chunks
    assert sizes[37] == [12]  # 37..49 crosses 48: one pass instead of 11 + 1
    assert sizes[40] == [9]
    assert sizes[20] == [12, 16, 1]  # 29 tokens left: more than a chunk, back on the grid
    assert sizes[3] == [13, 16, 16, 1]


def test_a_hit_with_a_short_tail_feeds_it_as_decode_rows(harness: EngineHarness) -> None:
    """A hit that leaves 2-16 prompt tokens feeds them as the rows of one decode step of the CPU
    runtime (float32 weights or blocks: such a rest would take the decode rows' kernels as a
    chunk too). The cold run feeds its own tail past the last chunk the same way, so the hit is
    bit-exact even where the adopted prefix is off the chunk grid (every row is computed as a
    single step at its position), and the stored entry is never written."""
    decoder = harness.engine.loaded.decoder
    rows = decoder is not None
    shared = random_tokens(2 * CHUNK + 5, seed=14)  # 37: off the grid
    harness.run(shared + random_tokens(6, seed=15), n_predict=2)
    (entry_id,) = harness.on_engine(lambda: [e.id for e in harness.engine.prefix_cache.store.entries()])
    before = _entry_arrays(harness, entry_id)
    second = shared + random_tokens(9, seed=16)  # 46 tokens: 9 left after the hit
    steps = decoder.steps if decoder is not None else 0
    warm = harness.run(second, n_predict=4, n_probs=N_PROBS)
    assert warm.finish.n_cached == len(shared)
    if rows:
        assert decoder.steps - steps == 9 + 3  # the tail's rows in one step, then 3 fed back
    cold = harness.run(second, n_predict=4, n_probs=N_PROBS, cache=False)
    if rows:
        assert warm.tokens == cold.tokens
        assert warm.logprobs == cold.logprobs  # bit-identical, off the grid too
    else:  # MLX's pass: the tail is a prefill chunk, within tolerance
        for token in set(warm.logprobs[0]) & set(cold.logprobs[0]):
            assert abs(warm.logprobs[0][token] - cold.logprobs[0][token]) < LOGPROB_TOL
    for x, y in zip(before, _entry_arrays(harness, entry_id)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama:q4_0"])
def test_a_hit_off_the_grid_takes_the_last_prompt_token_into_its_one_pass(family: str) -> None:
    """After a hit off the chunk grid, the rest of the prompt (more than the decode rows take)
    goes in one pass that takes the last prompt token along and samples the first token from its
    last row: no decode step runs until the first token is fed back (one read of the weights
    fewer). The answer equals the cold run's, the first token's log-probabilities within
    LOGPROB_TOL (an unaligned hit is not bit-exact whatever the split). Weights in ggml's
    blocks keep the chunk and then the step (their step quantizes its activations by vec_dot's
    rule, a chunk by another or not at all: the first token's log-probabilities would move by
    ~1e-2)."""
    harness = EngineHarness(tiny_model(family), batch_size=64)
    try:
        decoder = harness.engine.loaded.decoder
        assert decoder is not None
        shared = random_tokens(64 + 5, seed=24)  # 69: off the grid of 64
        harness.run(shared + random_tokens(4, seed=25), n_predict=2)
        second = shared + random_tokens(30, seed=26)  # 30 left after the hit: more than 16 rows, one chunk
        steps, fed = decoder.steps, decoder.prefilled
        warm = harness.run(second, n_predict=4, n_probs=N_PROBS)
        assert warm.finish.n_cached == len(shared)
        folds = ":" not in family
        # float32: only the 3 tokens fed back step, the prompt's last one was in the pass
        assert decoder.steps - steps == (3 if folds else 4)
        # float32: the rest was one prefill chunk; blocks: a chunk of all but the last token
        # (the runtime's too, as every chunk of a sequence prefilling alone), then that token's step
        assert decoder.prefilled - fed == (30 if folds else 29)
        cold_steps = decoder.steps
        cold = harness.run(second, n_predict=4, n_probs=N_PROBS, cache=False)
        assert decoder.steps - cold_steps == 4  # the cold run's last prompt token is a decode step, as before
        assert warm.tokens == cold.tokens
        for token in set(warm.logprobs[0]) & set(cold.logprobs[0]):
            assert abs(warm.logprobs[0][token] - cold.logprobs[0][token]) < LOGPROB_TOL
        assert set(warm.logprobs[0]) & set(cold.logprobs[0])
    finally:
        harness.close()


# ---------------------------------------------------------------------- shared KV blocks


def tables(h: EngineHarness) -> list[tuple[tuple[int, ...], BlockTable]]:
    return h.on_engine(lambda: [(e.tokens, e.payload) for e in h.engine.prefix_cache.store.entries()])


def test_sessions_share_their_system_prompt_once(harness: EngineHarness) -> None:
    harness.reset()
    system = random_tokens(SYSTEM, seed=1)
    runs = [harness.run(system + random_tokens(20, seed=10 + s), n_predict=3, session=f"s{s}") for s in range(3)]
    assert [r.finish.n_cached for r in runs] == [0, SYSTEM, SYSTEM]
    held = tables(harness)
    assert len(held) == 3 and all(isinstance(t, BlockTable) for _, t in held)
    shared = {t.block_ids[: SYSTEM // BLOCK] for _, t in held}
    assert len(shared) == 1  # the very same blocks, not equal copies
    tails = [set(t.block_ids[SYSTEM // BLOCK :]) for _, t in held]
    assert not (tails[0] & tails[1]) and not (tails[1] & tails[2])
    stats = harness.stats()
    per_token = stats["logical_bytes"] // stats["logical_tokens"]
    unique = SYSTEM + sum(len(toks) - SYSTEM for toks, _ in held)
    assert stats["bytes"] == unique * per_token  # shared blocks counted once
    assert stats["logical_tokens"] == sum(len(toks) for toks, _ in held)
    assert stats["sharing_ratio"] == round(stats["logical_bytes"] / stats["bytes"], 4) > 1.5
    tail_blocks = sum(-(-(len(toks) - SYSTEM) // BLOCK) for toks, _ in held)
    assert stats["kv_block_tokens"] == BLOCK and stats["kv_blocks"] == SYSTEM // BLOCK + tail_blocks


def test_a_hit_on_shared_blocks_equals_a_cold_run(harness: EngineHarness) -> None:
    harness.reset()
    system = random_tokens(SYSTEM, seed=2)
    for s in range(2):
        harness.run(system + random_tokens(9, seed=20 + s), n_predict=2, session=f"s{s}")
    prompt = system + random_tokens(23, seed=29)
    warm = harness.run(prompt, n_predict=8, n_probs=4, session="new")
    cold = harness.run(prompt, n_predict=8, n_probs=4, cache=False)
    assert warm.finish.n_cached == SYSTEM  # on a chunk boundary the cold run also uses
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs  # bit-identical


def test_adoption_copies_no_block_and_a_reset_frees_every_block(harness: EngineHarness) -> None:
    harness.reset()
    system = random_tokens(SYSTEM + 5, seed=3)
    harness.run(system + random_tokens(7, seed=30), n_predict=2, session="a")
    ((_, table),) = tables(harness)

    def adopt_by_hand() -> tuple[int, int, int]:
        pool = table.pool
        before = (len(pool), pool.nbytes)
        layers = kv.gather(table, SYSTEM + 5)
        assert (len(pool), pool.nbytes) == before  # gathering allocates no block
        return kv.layer_tokens(layers[0]), kv.nbytes(layers), pool.block(table.block_ids[0]).refs

    held, nbytes, refs = harness.on_engine(adopt_by_hand)
    assert held == SYSTEM + 5 and refs == 1  # one entry holds the block; gathering took nothing
    # A running sequence holds a lease on the full blocks it adopted, until it ends (1500 tokens to go:
    # the check below never races its end; the sequence is cancelled right after).
    events: queue.Queue = queue.Queue()
    request = harness.submit(system + random_tokens(40, seed=31), events.put, n_predict=1500, session="b", ignore_eos=True)
    first = events.get(timeout=60)
    assert first is not None

    def read_in_place() -> tuple[bool, list[str], bool, bool, int]:
        """The running sequence's layers after its prefill and first steps on the CPU decode
        runtime: still paged, each the pool's very block arrays (no copy), the runtime writing
        only the own buffer, which holds no position of the blocks."""
        seq = next(s.sequence for s in harness.engine.slots if s.sequence is not None)
        kinds = [type(layer).__name__ for layer in seq.cache]
        if set(kinds) != {"PagedKVCache"}:
            return seq.decoder is not None, kinds, False, False, 0
        blocks = [table.pool.data(i) for i in table.block_ids[: SYSTEM // BLOCK]]
        same = all(layer.n_blocked == SYSTEM and len(layer.blocks) == len(blocks) and all(
            layer.blocks[b][j] is blocks[b][i][j] for b in range(len(blocks)) for j in (0, 1))
            for i, layer in enumerate(seq.cache))
        own = max(layer.own_keys.shape[2] for layer in seq.cache)
        return seq.decoder is not None, kinds, same, seq.owned.holds(seq.cache), own - (seq.owned.reserve - SYSTEM)

    on_runtime, kinds, same, owned, slack = harness.on_engine(read_in_place)
    assert on_runtime and set(kinds) == {"PagedKVCache"}, kinds
    assert same and owned
    assert 0 <= slack < decode_kv.KV_STEP  # the own buffer: the positions past the blocks only
    leased = harness.on_engine(lambda: harness.engine.prefix_cache.blocks.leased_blocks)
    assert leased == SYSTEM // BLOCK
    running = harness.stats()  # who holds what, as /v1/cache/stats says it
    assert (running["kv_block_leases"], running["kv_blocks_leased"], running["kv_block_stray_refs"]) == (1, leased, 0)
    assert running["kv_blocks_stored"] == len(table.block_ids)
    harness.engine.cancel(request.task_id)
    collect(events)
    assert harness.on_engine(lambda: harness.engine.prefix_cache.blocks.leased_blocks) == 0
    harness.reset()
    assert harness.on_engine(lambda: len(table.pool)) == 0  # no entry, no sequence: no block left
    after = harness.stats()
    assert [after[k] for k in ("kv_blocks", "kv_blocks_stored", "kv_block_leases", "kv_blocks_leased", "kv_block_stray_refs")] == [0] * 5


def test_a_failure_right_after_a_sequence_takes_its_slot_ends_it_there(harness: EngineHarness, monkeypatch) -> None:
    """``Engine._start``: an exception after the slot took the sequence (here its first progress
    report) fails the request and frees the slot and the lease; the sequence never runs on
    behind the error, nor donates."""
    harness.reset()
    system = random_tokens(SYSTEM, seed=4)
    harness.run(system + random_tokens(9, seed=40), n_predict=2, session="a")
    calls = []
    real = Sequence.report_progress

    def fail_first(seq: Sequence) -> None:
        calls.append(seq.request.task_id)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        real(seq)

    monkeypatch.setattr(Sequence, "report_progress", fail_first)
    events: queue.Queue = queue.Queue()
    request = replace(harness.request(system + random_tokens(30, seed=41), n_predict=6, session="b"), return_progress=True)
    harness.engine.submit(request, events.put)
    assert isinstance(events.get(timeout=60), ErrorEvent)
    assert harness.on_engine(lambda: [s.sequence for s in harness.engine.slots]) == [None] * len(harness.engine.slots)
    monkeypatch.undo()
    assert harness.run(system + random_tokens(5, seed=42), n_predict=2, session="c").finish.n_cached == SYSTEM
    assert events.empty()  # nothing of the failed request ran on
    stats = harness.stats()
    assert stats["entries"] == 2 and stats["kv_block_leases"] == 0 and stats["kv_block_stray_refs"] == 0


def test_a_failure_after_the_adoption_took_its_lease_releases_it(harness: EngineHarness, monkeypatch) -> None:
    """The sequence's construction fails after ``PrefixCache.adopt`` leased the hit's blocks (here
    in ``Sequence.adopt``): the request fails, and the lease goes with it."""
    harness.reset()
    system = random_tokens(SYSTEM, seed=5)
    harness.run(system + random_tokens(9, seed=50), n_predict=2, session="a")

    def broken(seq: Sequence, *args, **kwargs) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(Sequence, "adopt", broken)
    events: queue.Queue = queue.Queue()
    harness.submit(system + random_tokens(30, seed=51), events.put, n_predict=4, session="b")
    assert isinstance(events.get(timeout=60), ErrorEvent)
    stats = harness.stats()
    assert (stats["kv_block_leases"], stats["kv_blocks_leased"], stats["kv_block_stray_refs"]) == (0, 0, 0)
    monkeypatch.undo()
    harness.reset()
    assert harness.stats()["kv_blocks"] == 0
