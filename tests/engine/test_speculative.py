"""Speculative decoding (engine/speculative.py): drafts, the acceptance rule, and output equal to
plain decoding, on the engine and through a real server."""

from __future__ import annotations

import math
import queue
import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST
from mlxcel_compat.engine.metrics import EngineMetrics
from mlxcel_compat.engine.request import CacheContext, GenerationRequest
from mlxcel_compat.engine.sampling.chain import SamplerChain
from mlxcel_compat.engine.sampling.params import SamplingParams
from mlxcel_compat.engine.speculative import (NgramModState, NgramModTable, SpecConfig, SpecError, Speculator, ngram_mod_draft,
                                              ngram_simple_draft, parse_types, resolve, verify_draft)
from mlxcel_compat.settings import SettingsError, resolve_settings
from mlxcel_compat.testing.draft_pair import ensure_pair
from mlxcel_compat.testing.gguf_writer import ensure_gguf

from tests.conftest import MODEL_CACHE
from tests.engine.harness import EngineHarness, collect


# ---------------------------------------------------------------------- drafts and settings


def test_ngram_simple_drafts_what_followed_the_latest_earlier_match() -> None:
    # pattern = the last size_n - 1 tokens + the sampled one; the latest earlier occurrence wins
    tokens = [9, 1, 2, 3, 40, 41, 42, 43, 1, 2, 3, 50, 51, 52, 53, 54, 7, 1, 2]
    assert ngram_simple_draft(tokens, 3, size_n=3, size_m=4) == [50, 51, 52, 53]
    assert ngram_simple_draft(tokens, 3, size_n=3, size_m=2) == []  # a draft shorter than size_n is none
    assert ngram_simple_draft(tokens, 8, size_n=3, size_m=4) == []  # no match
    assert ngram_simple_draft(tokens[:6], 3, size_n=3, size_m=4) == []  # too short a history
    # a match at position 0 is never used (llama.cpp's search stops before it)
    assert ngram_simple_draft([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2], 3, size_n=3, size_m=4) == []


def test_ngram_mod_chains_lookups_in_a_table_every_sequence_shares() -> None:
    table = NgramModTable(3, size=4096)
    first = NgramModState()
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7, 8, 9]
    # the window (8, 9, 10) maps to 11, then (9, 10, 11) -> 12, ... until a window never seen
    assert ngram_mod_draft(table, first, tokens, 10, n_min=0, n_max=6) == [11, 12, 13, 5, 6, 7]
    assert ngram_mod_draft(table, first, tokens, 10, n_min=0, n_max=2) == [11, 12]
    assert ngram_mod_draft(table, first, tokens, 99, n_min=0, n_max=6) == []  # (8, 9, 99): not in the table
    # another sequence (another request) drafts from what the first one put in the table
    spec = Speculator(resolve(("ngram-mod",), None, mod_n_match=3, mod_n_min=2, mod_n_max=4), None, table)
    assert spec.propose([1, 2, 3, 11, 12], 13, n_max=8) == [5, 6, 7, 8]
    assert spec.propose([1, 2, 3, 11, 12], 13, n_max=8) == [5, 6, 7, 8]
    # a chain shorter than n_min is no draft
    short = Speculator(resolve(("ngram-mod",), None, mod_n_match=3, mod_n_min=5, mod_n_max=8), None, NgramModTable(3, 4096))
    assert short.propose([1, 2, 3, 4, 1, 2], 3, n_max=8) == []


def test_types_parse_as_llama_server_names_them() -> None:
    assert parse_types("none") == ("none",)
    assert parse_types("ngram-simple,draft-simple") == ("ngram-simple", "draft-simple")
    with pytest.raises(SpecError, match="unknown speculative decoding type 'ngram'"):
        parse_types("ngram")
    assert parse_types("ngram-cache,ngram-simple") == ("ngram-cache", "ngram-simple")
    with pytest.raises(SpecError, match="'ngram-map-k' is not supported by this server"):
        parse_types("ngram-map-k")
    # a draft model alone drafts with it; draft-simple needs one
    assert resolve(("none",), "draft.gguf").types == ("draft-simple",)
    with pytest.raises(SpecError, match="needs a draft model"):
        resolve(("draft-simple",), None)
    assert not resolve(("none",), None).enabled


def test_settings_take_llama_server_flags_and_refuse_bad_types(monkeypatch: pytest.MonkeyPatch) -> None:
    s = resolve_settings(["--spec-type", "ngram-simple", "--spec-draft-n-max", "8", "--spec-ngram-simple-size-n", "4"])
    config = SpecConfig.from_settings(s)
    assert (config.types, config.draft_n_max, config.ngram_size_n, config.ngram_size_m) == (("ngram-simple",), 8, 4, 48)
    monkeypatch.setenv("LLAMA_ARG_SPEC_DRAFT_MODEL", "/models/draft.gguf")
    monkeypatch.setenv("LLAMA_ARG_SPEC_DRAFT_P_MIN", "0.75")
    s = resolve_settings([])
    config = SpecConfig.from_settings(s)
    assert (config.types, config.draft_model, config.draft_p_min) == (("draft-simple",), "/models/draft.gguf", 0.75)
    with pytest.raises(SettingsError, match="spec-type"):
        resolve_settings(["--spec-type", "ngram-map-k4v"])
    monkeypatch.delenv("LLAMA_ARG_SPEC_DRAFT_MODEL")
    lookup = SpecConfig.from_settings(resolve_settings(["--spec-type", "ngram-cache", "-lcs", "s.bin",
                                                        "--lookup-cache-dynamic", "d.bin"]))
    assert (lookup.types, lookup.lookup_cache_static, lookup.lookup_cache_dynamic) == (("ngram-cache",), "s.bin", "d.bin")
    spec_default = SpecConfig.from_settings(resolve_settings(["--spec-default"]))  # llama-server's default config
    assert (spec_default.types, spec_default.mod_n_match, spec_default.mod_n_min, spec_default.mod_n_max) == (
        ("ngram-mod",), 24, 48, 64)
    with pytest.raises(SettingsError):
        resolve_settings(["--spec-draft-p-min", "1.5"])


def test_metrics_count_drafts_per_position() -> None:
    m = EngineMetrics()
    m.add_drafts(10, 6, 3, (3, 2, 1))
    m.add_drafts(4, 4, 1, (1, 1, 1, 1))
    assert (m.n_draft_tokens, m.n_draft_accepted, m.n_draft_rounds) == (14, 10, 4)
    assert m.accepted_per_pos == (4, 3, 2, 1)


# ---------------------------------------------------------------------- the acceptance rule


def _chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty approximation of the chi-square law)."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_accepted_tokens_are_distributed_as_the_models_own_samples() -> None:
    """Draws through the acceptance rule, with a real sampler chain at temperature 1: the first
    token's frequencies match the model's distribution at position 0, the draft is accepted as
    often as the model gives it probability, and the token after an accepted draft follows the
    distribution at position 1 (chi-square tests at significance 0.001, 3000 draws)."""
    import mlx.core as mx

    rng = np.random.default_rng(7)
    rows = rng.standard_normal((2, 12)).astype(np.float32) * 1.5
    p = np.exp(rows - rows.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    draft = [int(np.argmax(p[0]))]  # a deterministic draft, as a draft model's top token is
    chain = SamplerChain(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99), vocab_size=12)
    first, second = np.zeros(12), np.zeros(12)
    n = 3000
    for _ in range(n):
        def sample_at(i: int) -> tuple[int, int]:
            value = int(chain.sample(mx.array(rows[i])).token.item())
            return value, value

        kept, pending = verify_draft(draft, sample_at, lambda value, sampled: True)
        if kept == 0:
            first[pending] += 1
        else:
            first[draft[0]] += 1
            second[pending] += 1
    assert _chi_square_p(first, n * p[0]) > 1e-3
    accepted = first[draft[0]]
    assert abs(accepted / n - p[0][draft[0]]) < 4 * math.sqrt(p[0][draft[0]] * (1 - p[0][draft[0]]) / n)
    assert _chi_square_p(second, accepted * p[1]) > 1e-3


def test_the_rule_stops_where_generation_ends() -> None:
    calls = []

    def sample_at(i: int) -> tuple[int, str]:
        calls.append(i)
        return [5, 6, 7, 8][i], f"s{i}"

    assert verify_draft([5, 6, 9], sample_at, lambda v, s: True) == (2, "s2")  # 7 != 9: s2 is next
    assert verify_draft([5, 6, 7], sample_at, lambda v, s: True) == (3, "s3")  # all kept: the bonus draw
    calls.clear()
    assert verify_draft([5, 6, 7], sample_at, lambda v, s: v != 6) == (2, None)  # generation ended at 6
    assert calls == [0, 1]  # no draw after the end


# ---------------------------------------------------------------------- on the engine



@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return ensure_pair("llama", "tiny", draft_layers=1, cache_dir=MODEL_CACHE)


@pytest.fixture(scope="module")
def engines(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    target, draft = pair
    made = {
        "plain": EngineHarness(target, batch_size=32, n_parallel=3),
        "draft": EngineHarness(target, batch_size=32, n_parallel=3, speculative=resolve(("draft-simple",), str(draft), draft_n_max=4),
                               disk_dir=str(tmp_path_factory.mktemp("draft-disk"))),
        "ngram": EngineHarness(target, batch_size=32, n_parallel=3,
                               speculative=resolve(("ngram-simple",), None, ngram_size_n=1, ngram_size_m=6)),
        "mod": EngineHarness(target, batch_size=32, n_parallel=3,
                             speculative=resolve(("ngram-mod",), None, mod_n_match=1, mod_n_min=1, mod_n_max=6)),
        "cache": EngineHarness(target, batch_size=32, n_parallel=3, speculative=resolve(("ngram-cache",), None)),
    }
    yield made
    for harness in made.values():
        harness.close()


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        body = [rnd.randrange(10, 8000) for _ in range(24)]
        out.append(body + body[:16] + body)  # repeats, so n-grams find drafts
    return out


def _sampled(harness: EngineHarness, prompt: list[int], seed: int, n_predict: int = 24, cache: bool = False,
             penalties: bool = False) -> GenerationRequest:
    extra = dict(repeat_penalty=1.2, repeat_last_n=8, presence_penalty=0.3, dry_multiplier=0.5, dry_allowed_length=4,
                 dry_penalty_last_n=16) if penalties else {}
    return GenerationRequest(
        prompt_tokens=list(prompt),
        sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed, **extra),
        n_predict=n_predict,
        cache=CacheContext(enabled=cache, session_key="s", template_sig=RAW_PROMPT_TEMPLATE_SIG, mm_digest=TEXT_ONLY_MM_DIGEST),
    )


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["draft", "ngram", "mod", "cache"])
def test_greedy_output_equals_plain_decoding_token_for_token(engines, kind: str) -> None:
    drafted = accepted = 0
    for prompt in _prompts(6):
        plain = engines["plain"].run(prompt, n_predict=32, cache=False, ignore_eos=True)
        spec = engines[kind].run(prompt, n_predict=32, cache=False, ignore_eos=True)
        assert spec.tokens == plain.tokens
        assert spec.finish.n_decoded == 32 and spec.finish.tokens_cached == len(prompt) + 31
        drafted += spec.finish.n_draft
        accepted += spec.finish.n_draft_accepted
    assert drafted > 0 and 0 <= accepted <= drafted
    if kind not in ("mod", "cache"):  # the shared table's and the n-gram counts' guesses are rarely right on
        assert accepted > 0  # random weights, which never repeat their prompt (a real model's: test_ngram_cache.py)
    if kind == "draft":  # the derived pair agrees often: acceptance is measured, not assumed
        assert accepted / drafted > 0.5


@pytest.mark.engine
@pytest.mark.parametrize("gguf_type", ["q4_1", "q8_0"])
def test_ngram_speculation_over_block_weights_equals_plain_decoding(gguf_type: str) -> None:
    """Verify passes of up to 16 rows over Q4_1 (split rows) and Q8_0 weights go through the lane
    kernels (a vector lane per weight row, runtime/native/split_rows.c and quant_rows.c): the
    text is plain decoding's token for token, with drafts long enough to take passes of many rows."""
    model = ensure_gguf("llama", "tiny", gguf_type, cache_dir=MODEL_CACHE)
    plain = EngineHarness(model, batch_size=32, n_parallel=1)
    spec = EngineHarness(model, batch_size=32, n_parallel=1,
                         speculative=resolve(("ngram-simple",), None, ngram_size_n=1, ngram_size_m=15))
    try:
        assert spec.engine.loaded.decoder is not None  # the CPU decode runtime verifies the drafts
        drafted = 0
        for prompt in _prompts(2, seed=5):
            expected = plain.run(prompt, n_predict=40, cache=False, ignore_eos=True)
            got = spec.run(prompt, n_predict=40, cache=False, ignore_eos=True)
            assert got.tokens == expected.tokens
            drafted += got.finish.n_draft
        assert drafted > 0
    finally:
        plain.close()
        spec.close()


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["draft", "ngram", "mod"])
def test_batched_speculation_equals_plain_decoding(engines, kind: str) -> None:
    prompts = _prompts(3, seed=11)
    expected = [engines["plain"].run(p, n_predict=24, cache=False, ignore_eos=True).tokens for p in prompts]
    if kind == "mod":
        # The shared table learns the n-grams a sequence goes through (its generated ones by
        # chunks of 32): each prompt once alone first, 48 tokens, so that the batched run's drafts
        # do not depend on which tests ran on the module's engine before this one.
        for p, tokens in zip(prompts, expected):
            assert engines[kind].run(p, n_predict=48, cache=False, ignore_eos=True).tokens[:24] == tokens
    sinks = []
    for p in prompts:  # three at once: continuous batching, each row speculating on its own
        events: queue.Queue = queue.Queue()
        engines[kind].submit(p, events.put, n_predict=24, cache=False, ignore_eos=True)
        sinks.append(events)
    runs = [collect(events) for events in sinks]
    assert [r.tokens for r in runs] == expected
    assert sum(r.finish.n_draft for r in runs) > 0


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["draft", "ngram", "mod"])
@pytest.mark.parametrize("penalties", [False, True], ids=["plain-chain", "penalties-and-dry"])
def test_seeded_sampling_equals_plain_sampling(engines, kind: str, penalties: bool) -> None:
    """One draw per emitted token, from bit-identical logits, with the history each position
    has in plain decoding (penalties, DRY): a seeded sampled request gives plain decoding's
    tokens exactly (llama.cpp's own speculative test checks the same)."""
    drafted = 0
    for seed, prompt in zip((5, 6, 7), _prompts(3, seed=21)):
        outs = []
        for name in ("plain", kind):
            events: queue.Queue = queue.Queue()
            engines[name].engine.submit(_sampled(engines[name], prompt, seed, penalties=penalties), events.put)
            outs.append(collect(events))
        assert outs[1].tokens == outs[0].tokens
        assert outs[1].finish.seed == seed
        drafted += outs[1].finish.n_draft
    assert drafted > 0


@pytest.mark.engine
def test_ngram_speculation_on_a_cache_hit_matches_a_cold_run(engines) -> None:
    prompt = _prompts(1, seed=41)[0]
    cold = engines["plain"].run(prompt, n_predict=20, cache=False, ignore_eos=True)
    engines["ngram"].run(prompt, n_predict=20, ignore_eos=True)
    hit = engines["ngram"].run(prompt, n_predict=20, ignore_eos=True)
    assert hit.finish.n_cached > 0 and hit.tokens == cold.tokens


@pytest.mark.engine
def test_a_cache_hit_warms_the_draft_too_and_matches_a_cold_run(engines) -> None:
    harness = engines["draft"]
    draft = harness.engine.draft
    prompt = _prompts(1, seed=31)[0] + [77, 78, 79, 80] * 4
    cold = engines["plain"].run(prompt, n_predict=16, cache=False, ignore_eos=True)
    first = harness.run(prompt, n_predict=16, ignore_eos=True)
    fed_before = draft.n_fed
    second = harness.run(prompt, n_predict=16, ignore_eos=True)
    assert first.tokens == cold.tokens and second.tokens == cold.tokens
    assert second.finish.n_cached >= len(prompt) - 16  # the target's prefix came from the cache ...
    assert draft.n_fed - fed_before < len(prompt) // 2  # ... and the draft's with it (same entry)
    assert second.finish.n_draft > 0


@pytest.mark.engine
def test_the_disk_tier_checks_files_against_the_draft_models_fingerprint_too(engines) -> None:
    """Entries hold the draft model's layers after the model's, so a file written without the
    draft (or with another one) must not match: the disk tier checks the engine's own ``compat``,
    the one slot files use, which names both fingerprints."""
    engine = engines["draft"].engine
    assert "+draft:" in engine.compat.model and engine.draft.loaded.fingerprint in engine.compat.model
    assert engine.prefix_cache.disk.index.compat == engine.compat


@pytest.mark.engine
def test_a_draft_with_another_vocabulary_is_refused_at_load(pair: tuple[Path, Path], smollm2_gguf: Path) -> None:
    from mlxcel_compat.engine.core import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(pair[0]), speculative=resolve(("draft-simple",), str(smollm2_gguf))))
    engine.start()
    assert not engine.wait_ready(180)
    assert "draft model vocab must closely match target model" in (engine.load_error or "")
    engine.stop()


# ---------------------------------------------------------------------- through a real server


@pytest.fixture(scope="module")
def spec_server(server_factory, pair: tuple[Path, Path]):
    target, draft = pair
    return server_factory(["-m", str(target), "-md", str(draft), "--spec-draft-n-max", "4", "-np", "2",
                           "-c", "1024", "--metrics"])


@pytest.mark.e2e
def test_server_reports_speculation_like_llama_server(spec_server) -> None:
    from openai import OpenAI

    base = spec_server.base_url
    with httpx.Client(base_url=base, timeout=60) as http:
        props = http.get("/props").json()
        assert props["default_generation_settings"]["params"]["speculative.types"] == "draft-simple"
        assert all(slot["speculative"] for slot in http.get("/slots").json())
        body = {"prompt": "one two three four five six seven", "n_predict": 24, "temperature": 0, "ignore_eos": True}
        done = http.post("/completion", json=body).json()
        timings = done["timings"]
        assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
        assert done["generation_settings"]["speculative.types"] == "draft-simple"
        again = http.post("/completion", json=body).json()
        assert again["content"] == done["content"] and again["tokens_cached"] > 0
        metrics = http.get("/metrics").text

        def counter(name: str) -> float:
            return sum(float(line.split()[1]) for line in metrics.splitlines() if line.startswith(f"llamacpp:{name}"))

        # the first requests this server saw (the two warm-up-free completions above)
        both = (timings, again["timings"])
        assert counter("spec_decode_num_draft_tokens_total") == sum(t["draft_n"] for t in both)
        accepted = sum(t["draft_n_accepted"] for t in both)
        assert counter("spec_decode_num_accepted_tokens_total") == accepted > 0
        assert counter("spec_decode_num_accepted_tokens_per_pos_total") == accepted  # over every position
        assert 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics
    client = OpenAI(base_url=base + "/v1", api_key="none")
    chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.e2e
def test_an_unreadable_lookup_cache_stops_start_up(server_factory, pair: tuple[Path, Path], tmp_path: Path) -> None:
    bad = tmp_path / "static.bin"
    bad.write_bytes(b"\x01\x00\x00\x00" * 5)  # a key and a count of followers, then no followers
    proc = server_factory(["-m", str(pair[0]), "--spec-type", "ngram-cache", "-lcs", str(bad)], wait=False)
    assert proc.proc.wait(timeout=60) == 1
    assert "cannot read the lookup cache" in proc.log() and "static.bin" in proc.log()


@pytest.mark.e2e
def test_a_missing_draft_model_stops_start_up(server_factory, pair: tuple[Path, Path], tmp_path: Path) -> None:
    proc = server_factory(["-m", str(pair[0]), "-md", str(tmp_path / "nope.gguf")], wait=False)
    assert proc.proc.wait(timeout=60) == 1
    assert "nope.gguf" in proc.log()


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_logprobs_and_stop_strings_are_plain_decodings(engines, kind: str) -> None:
    """Per-token probabilities come from the same logits, and a stop string inside a verified
    draft ends the text where plain decoding ends it (the rest of the draft is given back)."""
    prompt = _prompts(1, seed=51)[0]
    plain = engines["plain"].run(prompt, n_predict=16, cache=False, ignore_eos=True, n_probs=3)
    spec = engines[kind].run(prompt, n_predict=16, cache=False, ignore_eos=True, n_probs=3)
    assert spec.tokens == plain.tokens and spec.logprobs == plain.logprobs
    tokenizer = engines["plain"].tokenizer
    text = tokenizer.decode(plain.tokens)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    outs = []
    for name in ("plain", kind):
        request = engines[name].request(prompt, n_predict=16, cache=False, ignore_eos=True)
        request.stop = [stop]
        events: queue.Queue = queue.Queue()
        engines[name].engine.submit(request, events.put)
        outs.append(collect(events))
    assert outs[0].finish.stop_type == "word" and outs[1].finish.stop_type == "word"
    assert outs[1].tokens == outs[0].tokens
    assert outs[1].finish.tokens_cached == outs[0].finish.tokens_cached


@pytest.mark.engine
@pytest.mark.parametrize("limits", [dict(draft_n_max=2, draft_n_min=3), dict(draft_n_max=4, draft_p_min=1.0)],
                         ids=["n-min-above-n-max", "p-min-1"])
def test_draft_limits_turn_drafts_off_and_leave_the_output(pair: tuple[Path, Path], engines, limits: dict) -> None:
    """--spec-draft-n-min: a shorter draft is not verified; --spec-draft-p-min 1: no draft token is
    that sure. Either way nothing is drafted, and the output is plain decoding's."""
    target, draft = pair
    harness = EngineHarness(target, batch_size=32, n_parallel=1, speculative=resolve(("draft-simple",), str(draft), **limits))
    try:
        prompt = _prompts(1, seed=61)[0]
        run = harness.run(prompt, n_predict=12, cache=False, ignore_eos=True)
        assert run.finish.n_draft == 0
        assert run.tokens == engines["plain"].run(prompt, n_predict=12, cache=False, ignore_eos=True).tokens
    finally:
        harness.close()
