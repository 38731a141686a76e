"""Tests for the llama.cpp-compatible sampler chain.

Expected distributions are computed by hand in numpy on a small fixed logit
vector; random draws are checked for determinism per seed or against expected
frequencies with a stated tolerance.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_compat.engine.sampling.candidates import Candidates
from mlxcel_compat.engine.sampling.chain import SamplerChain
from mlxcel_compat.engine.sampling.dry import dry_penalties, dry_sequence_breakers
from mlxcel_compat.engine.sampling.params import DEFAULT_SAMPLERS, DEFAULT_SEED, SamplingParams
from mlxcel_compat.engine.sampling.parsing import parse_logit_bias, parse_samplers
from mlxcel_compat.engine.sampling.results import top_logprobs, top_probs
from mlxcel_compat.engine.sampling.samplers import infill

LOGITS = np.array([3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0], dtype=np.float32)
VOCAB = len(LOGITS)
EOG = 7


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def dist_over(keep: list[int], logits: np.ndarray = LOGITS) -> np.ndarray:
    """Expected post-sampling probabilities when only ``keep`` survives."""
    out = np.zeros(len(logits))
    out[keep] = softmax(logits[keep].astype(np.float64))
    return out


def assert_probs(got: np.ndarray, expected: np.ndarray, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(got, expected, atol=atol)


def chain_probs(history=None, logits: np.ndarray = LOGITS, **kw) -> np.ndarray:
    params = SamplingParams(post_sampling_probs=True, seed=1, **kw)
    chain = SamplerChain(params, len(logits), eog_token_ids=[EOG])
    result = chain.sample(mx.array(logits), history)
    return np.array(result.probs, dtype=np.float64)


# -- parsing -------------------------------------------------------------------


def test_parse_samplers_names_aliases_and_chars():
    assert parse_samplers(["top_k", "Top-P", "nucleus", "temp", "typ", "minp", "typical"]) == [
        "top_k",
        "top_p",
        "top_p",
        "temperature",
        "typ_p",
        "min_p",
        "typ_p",
    ]
    assert parse_samplers("edskypmxt") == list(DEFAULT_SAMPLERS)
    assert parse_samplers("ia") == ["infill", "adaptive_p"]


def test_parse_samplers_unknown():
    with pytest.raises(ValueError, match="bogus"):
        parse_samplers(["top_k", "bogus"])
    with pytest.raises(ValueError, match="'z'"):
        parse_samplers("kz")
    assert parse_samplers(["top_k", "bogus"], strict=False) == ["top_k"]
    assert parse_samplers("kz", strict=False) == ["top_k"]


TOKENS = {"Hello": [3, 4], "x": [6], "abc": [1, 1]}


def fake_tokenize(text: str) -> list[int]:
    return TOKENS[text]


def test_parse_logit_bias_pairs():
    value = [
        [1, 2.0],
        ["Hello", -1.0],
        [99, 5.0],  # out of range: ignored
        [-1, 1.0],  # out of range: ignored
        [2, False],  # false bans the token
        [3, True],  # non-numeric bias: skipped
        [4, "x"],  # non-numeric bias: skipped
        [5],  # not a pair: skipped
        "bad",  # not an array: skipped
        [1.5, 1.0],  # non-integer id: skipped
        [6, None],
    ]
    assert parse_logit_bias(value, VOCAB, fake_tokenize) == {
        1: 2.0,
        3: -1.0,
        4: -1.0,
        2: float("-inf"),
    }


def test_parse_logit_bias_object_and_repeats():
    value = {"1": 2.0, "Hello": 1.5, "99": 1.0, "2": False, " 5": 0.5, "x": True, "abc": 0.25}
    assert parse_logit_bias(value, VOCAB, fake_tokenize) == {
        1: 2.0 + 0.25 + 0.25,  # "abc" tokenizes to [1, 1]: each entry applies
        3: 1.5,
        4: 1.5,
        2: float("-inf"),
        5: 0.5,
    }


def test_parse_logit_bias_wrong_type():
    assert parse_logit_bias(None, VOCAB, fake_tokenize) == {}
    with pytest.raises(ValueError):
        parse_logit_bias("abc", VOCAB, fake_tokenize)
    with pytest.raises(ValueError):
        parse_logit_bias(5, VOCAB, fake_tokenize)


def test_to_json_keys_and_seed():
    params = SamplingParams(top_k=7)
    data = params.to_json()
    assert list(data) == [
        "seed", "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p",
        "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p",
        "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
        "dry_sequence_breakers", "samplers",
    ]  # fmt: skip
    assert data["seed"] == DEFAULT_SEED and data["top_k"] == 7
    assert data["samplers"] == list(DEFAULT_SAMPLERS)
    assert data["dry_sequence_breakers"] == ["\n", ":", '"', "*"]
    assert params.to_json(seed=42)["seed"] == 42
    json.dumps(data)


# -- single samplers -------------------------------------------------------------


def test_top_k():
    assert_probs(chain_probs(samplers=["top_k"], top_k=3), dist_over([0, 1, 2]))
    assert_probs(chain_probs(samplers=["top_k"], top_k=0), softmax(LOGITS))


def test_top_p():
    p = softmax(LOGITS.astype(np.float64))  # 0.6307, 0.2320, 0.0853, 0.0518, ...
    assert p[0] + p[1] < 0.9 <= p[0] + p[1] + p[2]
    assert_probs(chain_probs(samplers=["top_p"], top_p=0.9), dist_over([0, 1, 2]))
    # the token that crosses p is kept; min_keep wins over a small p
    assert_probs(chain_probs(samplers=["top_p"], top_p=0.5), dist_over([0]))
    np.testing.assert_allclose(
        chain_probs(samplers=["top_p"], top_p=0.5, min_keep=3), dist_over([0, 1, 2]), atol=1e-6
    )


def test_min_p():
    # keep logits >= 3 + ln(0.3) = 1.796
    assert_probs(chain_probs(samplers=["min_p"], min_p=0.3), dist_over([0, 1]))
    np.testing.assert_allclose(
        chain_probs(samplers=["min_p"], min_p=0.3, min_keep=4), dist_over([0, 1, 2, 3]), atol=1e-6
    )


def test_typical_p():
    p = softmax(LOGITS.astype(np.float64))
    entropy = -(p * np.log(p)).sum()
    order = np.argsort(np.abs(-np.log(p) - entropy), kind="stable")
    cum = np.cumsum(p[order])
    cut = int(np.argmax(cum > 0.5)) + 1
    expected = sorted(order[:cut].tolist())
    assert expected == [0, 1]  # the hand computation: token 1 is most typical, then 0
    assert_probs(chain_probs(samplers=["typ_p"], typical_p=0.5), dist_over(expected))


def test_top_n_sigma():
    std = LOGITS.std()  # 1.878 (population std, as llama.cpp)
    for n, expected in [(1.0, [0, 1]), (1.5, [0, 1, 2, 3])]:
        keep = [i for i in range(VOCAB) if LOGITS[i] >= LOGITS.max() - n * std]
        assert keep == expected
        got = chain_probs(samplers=["top_n_sigma"], top_n_sigma=n)
        assert_probs(got, dist_over(keep))


def test_xtc_removes_top_choices_but_the_last():
    # p = 0.63, 0.23, 0.085...: tokens 0 and 1 pass 0.1, so only token 0 is removed
    got = chain_probs(samplers=["xtc"], xtc_probability=1.0, xtc_threshold=0.1)
    assert_probs(got, dist_over(list(range(1, VOCAB))))
    # min_keep: 8 alive - 1 removed < 8, so nothing happens
    got = chain_probs(samplers=["xtc"], xtc_probability=1.0, xtc_threshold=0.1, min_keep=8)
    assert_probs(got, softmax(LOGITS))
    # threshold > 0.5 disables it
    got = chain_probs(samplers=["xtc"], xtc_probability=1.0, xtc_threshold=0.6)
    assert_probs(got, softmax(LOGITS))


def test_temperature_and_dynatemp():
    got = chain_probs(samplers=["temperature"], temperature=2.0)
    assert_probs(got, softmax(LOGITS / 2.0))
    p = softmax(LOGITS.astype(np.float64))
    normalized = -(p * np.log(p)).sum() / math.log(VOCAB)
    dyn = 0.5 + (1.5 - 0.5) * normalized**2.0
    got = chain_probs(
        samplers=["temperature"], temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=2.0
    )
    np.testing.assert_allclose(got, softmax(LOGITS / dyn), atol=1e-5)


def test_sampler_order_matters():
    # min_p on raw logits keeps {0, 1}; after temperature 3 it keeps logits/3 >= 1 + ln(0.3)
    first = chain_probs(samplers=["min_p", "temperature"], min_p=0.3, temperature=3.0)
    assert_probs(first, dist_over([0, 1], LOGITS / 3.0))
    later = chain_probs(samplers=["temperature", "min_p"], min_p=0.3, temperature=3.0)
    assert_probs(later, dist_over([0, 1, 2, 3, 4], LOGITS / 3.0))


def test_default_chain_and_top_helpers():
    params = SamplingParams(top_k=3, post_sampling_probs=True, seed=3)
    chain = SamplerChain(params, VOCAB, [EOG])
    result = chain.sample(mx.array(LOGITS))
    assert result.token.dtype == mx.int32 and result.token.shape == ()
    # top_k 3 -> min_p 0.05 keeps all 3 (1.0 >= 3 + ln 0.05) -> top_p 0.95 keeps all 3
    probs = top_probs(result.probs, 5)
    assert [i for i, _ in probs] == [0, 1, 2]
    expected = softmax(LOGITS[:3] / 0.8)
    assert_probs([v for _, v in probs], expected)
    logprobs = top_logprobs(result.logprobs, 3)
    assert [i for i, _ in logprobs] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in logprobs], np.log(softmax(LOGITS))[:3], atol=1e-5)
    assert top_logprobs(mx.array([0.0, float("-inf")]), 2)[1][1] == float(np.finfo(np.float32).min)


# -- greedy ----------------------------------------------------------------------


def test_greedy():
    chain = SamplerChain(SamplingParams(temperature=0.0, post_sampling_probs=True), VOCAB, [EOG])
    assert chain.is_greedy
    result = chain.sample(mx.array(LOGITS))
    assert result.token.item() == 0
    assert top_probs(result.probs, 5) == [(0, 1.0)]


def test_greedy_applies_penalties_and_bias():
    chain = SamplerChain(SamplingParams(temperature=0.0, repeat_penalty=2.0), VOCAB, [EOG])
    assert chain.sample(mx.array(LOGITS), [0]).token.item() == 1  # 3 / 2 < 2
    chain = SamplerChain(SamplingParams(temperature=0.0, logit_bias={2: 5.0}), VOCAB, [EOG])
    assert chain.sample(mx.array(LOGITS)).token.item() == 2


def test_greedy_after_typical_uses_the_filtered_set():
    # typical_p can drop the top token; llama.cpp's temp <= 0 then keeps the best survivor
    params = SamplingParams(temperature=0.0, typical_p=0.2, samplers=["typ_p", "temperature"])
    chain = SamplerChain(params, VOCAB, [EOG])
    assert not chain.is_greedy
    assert chain.sample(mx.array(LOGITS)).token.item() == 1


def test_ignore_eos_and_banned_tokens():
    logits = LOGITS[::-1].copy()  # the EOG token 7 now has the highest logit
    chain = SamplerChain(SamplingParams(temperature=0.0, ignore_eos=True), VOCAB, [EOG])
    assert chain.sample(mx.array(logits)).token.item() == 6
    got = chain_probs(samplers=["temperature"], temperature=1.0, logits=logits, ignore_eos=True)
    assert got[EOG] == 0.0
    assert_probs(got, dist_over(list(range(7)), logits))
    # a banned token sorts last, so top_k=2 keeps the next two
    got = chain_probs(samplers=["top_k"], top_k=2, logit_bias={0: float("-inf")})
    assert_probs(got, dist_over([1, 2]))



@pytest.mark.parametrize("params", [
    {},
    {"ignore_eos": True},
    {"logit_bias": {2: 5.0, 3: float("-inf")}},
    {"ignore_eos": True, "logit_bias": {0: 0.5}},
])
def test_plain_argmax_with_a_bias_is_the_chains_draw(params):
    """Greedy rows with a logit bias (ignore_eos's -inf on the end tokens) take the fast argmax
    paths: NumPy's on the CPU runtime's row (argmax_of, the row left as it was, a read-only one
    too) and a batch's one argmax over biased rows. Each picks what the chain draws, ties to
    the first index as MLX does."""
    chain = SamplerChain(SamplingParams(temperature=0.0, **params), VOCAB, [EOG])
    assert chain.is_plain_argmax
    rng = np.random.default_rng(3)
    rows = [LOGITS[::-1].copy(), rng.standard_normal(VOCAB).astype(np.float32), np.full(VOCAB, 1.5, np.float32)]
    for row in rows:
        before = row.copy()
        drawn = chain.sample(mx.array(row)).token.item()
        assert chain.argmax_of(row) == drawn and np.array_equal(row, before)
        frozen = row.copy()
        frozen.flags.writeable = False
        assert chain.argmax_of(frozen) == drawn
    batch = mx.array(np.stack(rows))
    biased = batch
    for i in range(len(rows)):
        biased = chain.biased(biased, i)
    picks = mx.argmax(biased, axis=-1).tolist()
    assert picks == [chain.sample(mx.array(row)).token.item() for row in rows]
    if "ignore_eos" in params:
        assert picks[0] != EOG  # the reversed row's best token is the end token, which is banned


# -- penalties -----------------------------------------------------------------


def penalized(history_window: list[int], rep: float, freq: float, pres: float) -> np.ndarray:
    out = LOGITS.astype(np.float64).copy()
    for token in set(history_window):
        count = history_window.count(token)
        out[token] = out[token] * rep if out[token] <= 0 else out[token] / rep
        out[token] -= count * freq + pres
    return out


def test_penalties_hand_computed():
    kw = dict(
        samplers=["penalties"], repeat_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25
    )
    # repeat_last_n=4: only [0, 0, 1, 5] count; token 5 has a negative logit (multiplied)
    expected = penalized([0, 0, 1, 5], 1.5, 0.5, 0.25)
    assert math.isclose(expected[0], 3 / 1.5 - 2 * 0.5 - 0.25)
    assert math.isclose(expected[5], -1 * 1.5 - 0.5 - 0.25)
    got = chain_probs(history=[2, 0, 0, 1, 5], repeat_last_n=4, **kw)
    assert_probs(got, softmax(expected))
    got = chain_probs(history=[2, 0, 0, 1, 5], repeat_last_n=-1, **kw)
    assert_probs(got, softmax(penalized([2, 0, 0, 1, 5], 1.5, 0.5, 0.25)))
    got = chain_probs(history=[2, 0, 0, 1, 5], repeat_last_n=0, **kw)
    assert_probs(got, softmax(LOGITS))


def test_penalty_window_is_incremental():
    params = SamplingParams(
        samplers=["penalties"], repeat_penalty=1.3, frequency_penalty=0.2, repeat_last_n=3,
        post_sampling_probs=True,
    )  # fmt: skip
    chain = SamplerChain(params, VOCAB, [EOG])
    history: list = [4, 0]
    chain.sample(mx.array(LOGITS), history)
    for token in [1, 1, 2, 0]:
        history.append(mx.array(token, dtype=mx.int32))  # lazy tokens are fine
        result = chain.sample(mx.array(LOGITS), history)
    expected = softmax(penalized([1, 2, 0], 1.3, 0.2, 0.0))
    assert_probs(np.array(result.probs), expected)


# -- DRY -----------------------------------------------------------------------


def test_dry_penalties_hand_computed():
    a, b, c, y = 1, 2, 3, 4
    tokens = [a, b, c, c, b, c, y, a, b, c]
    # "a b c" repeats (len 3) and was followed by c; "b c" (len 2) was followed by y
    assert dry_penalties(tokens, {}, 1.0, 2.0, 2) == {c: 2.0, y: 1.0}
    # a single-token breaker is never penalized itself
    assert dry_penalties(tokens, {y: [()]}, 1.0, 2.0, 2) == {c: 2.0}
    # a breaker 2 tokens back limits the repetition length to 2
    assert dry_penalties(tokens, {a: [()]}, 1.0, 2.0, 2) == {c: 1.0, y: 1.0}
    assert dry_penalties(tokens[:2], {}, 1.0, 2.0, 2) == {}


def test_dry_in_chain():
    history = [1, 2, 3, 3, 2, 3, 4, 1, 2, 3]
    got = chain_probs(
        history=history,
        samplers=["dry"],
        dry_multiplier=1.0,
        dry_base=2.0,
        dry_sequence_breakers=[],
    )
    expected = LOGITS.astype(np.float64).copy()
    expected[3] -= 2.0
    expected[4] -= 1.0
    assert_probs(got, softmax(expected))


# -- randomness ------------------------------------------------------------------


def draw(chain: SamplerChain, n: int, logits: np.ndarray = LOGITS) -> list[int]:
    arr = mx.array(logits)
    return [chain.sample(arr).token.item() for _ in range(n)]


FLAT = np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], dtype=np.float32)


def test_seed_reproducibility():
    seq_a = draw(SamplerChain(SamplingParams(seed=1234), VOCAB, [EOG]), 30, FLAT)
    seq_b = draw(SamplerChain(SamplingParams(seed=1234), VOCAB, [EOG]), 30, FLAT)
    seq_c = draw(SamplerChain(SamplingParams(seed=4321), VOCAB, [EOG]), 30, FLAT)
    assert seq_a == seq_b
    assert seq_a != seq_c
    assert len(set(seq_a)) > 2


def test_random_seed_is_drawn_and_exposed():
    a = SamplerChain(SamplingParams(), VOCAB, [EOG])
    b = SamplerChain(SamplingParams(), VOCAB, [EOG])
    assert 0 <= a.seed <= 0xFFFFFFFF and a.seed != b.seed
    replay = SamplerChain(SamplingParams(seed=a.seed), VOCAB, [EOG])
    assert draw(a, 20, FLAT) == draw(replay, 20, FLAT)


def test_empirical_frequencies():
    # 3000 draws: a frequency's standard error is <= 0.0092, so 0.035 is ~4 sigma
    params = SamplingParams(seed=7, samplers=["temperature"], temperature=1.5)
    chain = SamplerChain(params, VOCAB, [EOG])
    counts = np.bincount(draw(chain, 3000), minlength=VOCAB) / 3000
    np.testing.assert_allclose(counts, softmax(LOGITS / 1.5), atol=0.035)


def test_sampling_from_another_thread():
    params = SamplingParams(seed=99)
    chain = SamplerChain(params, VOCAB, [EOG])  # built here, used on a worker thread
    out: dict = {}

    def worker() -> None:
        try:
            out["tokens"] = draw(chain, 15, FLAT)
        except Exception as exc:  # reported below
            out["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in out
    assert out["tokens"] == draw(SamplerChain(params, VOCAB, [EOG]), 15, FLAT)


def test_mirostat_and_adaptive_p_draw_valid_tokens():
    for version in (1, 2):
        params = SamplingParams(mirostat=version, seed=5, post_sampling_probs=True)
        chain = SamplerChain(params, VOCAB, [EOG])
        for _ in range(5):
            result = chain.sample(mx.array(LOGITS))
            probs = np.array(result.probs)
            assert probs[result.token.item()] > 0
            assert math.isclose(probs.sum(), 1.0, rel_tol=1e-5)
        assert chain.mirostat.mu != 2.0 * params.mirostat_tau
    params = SamplingParams(
        samplers=["top_k", "adaptive_p"],
        top_k=3,
        adaptive_target=0.3,
        seed=5,
        post_sampling_probs=True,
    )
    result = SamplerChain(params, VOCAB, [EOG]).sample(mx.array(LOGITS))
    probs = np.array(result.probs)
    assert result.token.item() in (0, 1, 2)
    assert probs[3:].sum() == 0.0 and math.isclose(probs.sum(), 1.0, rel_tol=1e-5)


def test_numpy_samplers_take_overflowed_logits_without_nan():
    """Mirostat 1 and 2 and adaptive-p compute their softmax in NumPy: a logit that overflowed to
    +inf (a temperature near 0) gets all the probability, with no inf - inf on the way."""
    import warnings

    overflowed = LOGITS.copy()
    overflowed[2] = np.inf
    mirostat = [SamplingParams(mirostat=version, seed=5, post_sampling_probs=True) for version in (1, 2)]
    adaptive = SamplingParams(samplers=["adaptive_p"], adaptive_target=0.3, seed=5, post_sampling_probs=True)
    for params in (*mirostat, adaptive):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = SamplerChain(params, VOCAB, [EOG]).sample(mx.array(overflowed))
        probs = np.array(result.probs)
        assert not np.isnan(probs).any() and math.isclose(probs.sum(), 1.0, rel_tol=1e-5)
        if params is not adaptive:  # adaptive-p steers towards its target probability, not the top
            assert result.token.item() == 2


# -- tokenizer-backed samplers (DRY breakers, infill) ----------------------------


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(["Hello world! Hello there, world."] * 20, trainer)
    path: Path = tmp_path_factory.mktemp("bpe")
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load(path)


def test_dry_breakers_from_vocab(bpe_tokenizer):
    hello = bpe_tokenizer.convert_tokens_to_ids("Hello")
    newline = bpe_tokenizer.convert_tokens_to_ids("Ċ")
    breakers = dry_sequence_breakers(bpe_tokenizer, ["\n", "lo wo"])
    assert breakers[newline] == [()]
    # "Hello" ends with "lo", a prefix of "lo wo": the rest must follow as tokens
    tail = tuple(bpe_tokenizer.encode(" wo", add_special_tokens=False))
    assert tail in breakers[hello]


def _breakers_by_loop(tokenizer, breakers):
    """llama.cpp's get_overlapping_token_sequences as a loop over every token: the reference."""
    from mlxcel_compat.engine.textstream import token_bytes

    words = [token_bytes(tokenizer, t, special=True) for t in range(len(tokenizer))]
    result: dict[int, set[tuple[int, ...]]] = {}
    for breaker in breakers:
        needle = breaker.encode("utf-8")[:40]
        if not needle:
            continue
        for token_id, word in enumerate(words):
            if needle in word:
                result.setdefault(token_id, set()).add(())
                continue
            for pos in range(len(word)):
                overlap = len(word) - pos
                if overlap < len(needle) and word[pos:] == needle[:overlap]:
                    try:
                        rest = needle[overlap:].decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    result.setdefault(token_id, set()).add(tuple(tokenizer.encode(rest, add_special_tokens=False))[:20])
    return result


BREAKER_SETS = [
    ["\n", ":", '"', "*"],  # llama.cpp's default
    ["lo wo", "Hello world! Hello there, world. Hello world! Hello there, world."],  # longer than 40 bytes
    [" the", "ing ", "é", "→ next", "\u0000", "", "<|endoftext|>", "a"],  # multi-byte, NUL, empty, special
]


@pytest.mark.parametrize("breakers", BREAKER_SETS)
def test_dry_breakers_match_a_loop_over_every_token(bpe_tokenizer, breakers):
    from mlx_lm.tokenizer_utils import load

    from tests.conftest import tiny_model

    for tokenizer in (bpe_tokenizer, load(tiny_model("llama"))):
        got = dry_sequence_breakers(tokenizer, breakers)
        assert {t: set(tails) for t, tails in got.items()} == _breakers_by_loop(tokenizer, breakers)
        assert all(len(tails) == len(set(tails)) for tails in got.values())


def test_infill_with_overflowed_logits_keeps_the_infinite_ones(bpe_tokenizer):
    """A temperature near 0 (1e-40 in float32) can turn logits into +inf before the infill
    sampler: the infinite ones then hold all the probability, with no NaN on the way."""
    import warnings

    vocab = len(bpe_tokenizer)
    hello = bpe_tokenizer.convert_tokens_to_ids("Hello")
    eos = bpe_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    logits = np.full(vocab, -np.inf, dtype=np.float32)
    logits[[hello, bpe_tokenizer.convert_tokens_to_ids("Ġworld"), eos]] = [np.inf, 1.2, -5.0]
    chain = SamplerChain(SamplingParams(samplers=["infill"], seed=2), vocab, [eos], tokenizer=bpe_tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an inf - inf in the sampler warns
        kept = infill(Candidates(mx.array(logits), None), chain.state)
    kept_ids = set(np.flatnonzero(np.array(kept.logits) > -np.inf).tolist())
    assert hello in kept_ids and bpe_tokenizer.convert_tokens_to_ids("Ġworld") not in kept_ids


def test_infill_merges_prefixes_and_keeps_confident(bpe_tokenizer):
    vocab = len(bpe_tokenizer)
    ids = {piece: bpe_tokenizer.convert_tokens_to_ids(piece) for piece in ["Hello", "Ġworld", "H"]}
    eos = bpe_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    logits = np.full(vocab, -np.inf, dtype=np.float32)
    logits[[ids["Hello"], ids["Ġworld"], ids["H"], eos]] = [1.5, 1.2, 1.0, -5.0]
    params = SamplingParams(samplers=["infill"], post_sampling_probs=True, seed=2)
    chain = SamplerChain(params, vocab, [eos], tokenizer=bpe_tokenizer)
    probs = np.array(chain.sample(mx.array(logits)).probs, dtype=np.float64)
    # "H" merges into "Hello" (p 0.68); " world" (0.32) falls under 1/3; EOG always stays
    expected = np.zeros(vocab)
    expected[[ids["Hello"], eos]] = softmax(np.array([1.5, -5.0]))
    assert_probs(probs, expected)


def _merge_pairwise(pieces: list[bytes], logits: np.ndarray, probs: np.ndarray) -> None:
    """llama.cpp's infill merge as it is written there: every ordered pair, in candidate order."""
    for i0 in range(len(pieces)):
        for i1 in range(len(pieces)):
            if logits[i0] == -np.inf:
                break
            if i0 == i1 or logits[i1] == -np.inf:
                continue
            a, b = pieces[i0], pieces[i1]
            if a and len(a) <= len(b) and b.startswith(a):
                dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
                probs[dst] += probs[src]
                logits[src] = -np.inf
                probs[src] = 0.0


@pytest.mark.parametrize("seed", range(40))
def test_infill_prefix_merge_visits_the_pairs_in_llama_cpps_order(seed):
    """The indexed merge gives what comparing every pair gives, on pieces built to overlap:
    prefixes of prefixes, equal pieces of different tokens, empty (special) pieces, equal
    probabilities (the tie keeps i0), candidates that are a shuffled part of the vocabulary (so
    candidate order is not id order) and ids of a padded vocabulary beyond the tokenizer's."""
    from mlxcel_compat.engine.sampling.infill_pieces import PieceIndex, merge_prefix_pieces

    rng = np.random.default_rng(seed)
    vocab = [bytes(rng.choice(list(b"ab\xc3"), size=int(rng.integers(0, 4))).tolist()) for _ in range(int(rng.integers(1, 80)))]
    padded = len(vocab) + 3
    ids = rng.permutation(padded)[: int(rng.integers(1, padded + 1))]
    n = len(ids)
    probs = rng.choice([0.05, 0.1, 0.2, 0.3], size=n).astype(np.float64)
    logits = np.log(probs)
    logits[rng.random(n) < 0.1] = -np.inf  # already removed by an earlier stage
    pieces = [vocab[t] if t < len(vocab) else b"" for t in ids]
    expected_logits, expected_probs = logits.copy(), probs.copy()
    _merge_pairwise(pieces, expected_logits, expected_probs)
    merge_prefix_pieces(PieceIndex.from_pieces(vocab), ids, logits, probs)
    assert np.array_equal(logits, expected_logits)
    assert np.array_equal(probs, expected_probs)


def test_infill_over_a_whole_vocabulary_keeps_the_same_candidates(bpe_tokenizer):
    """Without a top-k before it, infill sees the whole vocabulary; the result is llama.cpp's."""
    from mlxcel_compat.engine.sampling.infill_pieces import merge_prefix_pieces, piece_index
    from mlxcel_compat.engine.textstream import token_bytes

    vocab = len(bpe_tokenizer)
    rng = np.random.default_rng(3)
    ids = np.argsort(-rng.normal(size=vocab), kind="stable")  # candidate order: by probability
    probs = np.sort(softmax(rng.normal(size=vocab)))[::-1].copy()
    logits = np.log(probs)
    pieces = [token_bytes(bpe_tokenizer, int(t), special=False) for t in ids]
    expected_logits, expected_probs = logits.copy(), probs.copy()
    _merge_pairwise(pieces, expected_logits, expected_probs)
    merge_prefix_pieces(piece_index(bpe_tokenizer), ids, logits, probs)
    assert np.array_equal(logits, expected_logits) and np.array_equal(probs, expected_probs)
    assert np.isinf(logits).sum() >= 10  # merges happened: "H" into "Hello", and others


def test_infill_with_no_confident_text_collapses_to_the_end_token(bpe_tokenizer):
    """Five equally likely text tokens (0.2 - a little each after the EOG's share) and an EOG too
    unlikely to win outright: no text token reaches 0.2, so only the end token is left."""
    vocab = len(bpe_tokenizer)
    eos = bpe_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = [bpe_tokenizer.convert_tokens_to_ids(p) for p in ["Hello", "Ġworld", "Ġthere", ",", "."]]
    logits = np.full(vocab, -np.inf, dtype=np.float32)
    logits[text] = 1.0
    logits[eos] = -4.0
    chain = SamplerChain(SamplingParams(samplers=["infill"], seed=2), vocab, [eos], tokenizer=bpe_tokenizer)
    kept = np.array(infill(Candidates(mx.array(logits), None), chain.state).logits)
    assert np.flatnonzero(kept > -np.inf).tolist() == [eos]
