"""Lookup decoding's n-gram caches (``engine/ngram_cache.py``, ``--spec-type ngram-cache``).

The counts are checked against a brute-force count of the whole sequence, the drafting rules
against hand-made sequences where each threshold decides, the -lcs/-lcd files against bytes laid
out as llama.cpp's ``common_ngram_cache_save`` writes them (four int32 key tokens padded with -1,
the followers' count, then token/count pairs), and the whole on a real model copying a file:
drafts accepted, the text plain decoding's.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import pytest

from mlxcel_compat.engine.ngram_cache import LookupCacheError, LookupFiles, LookupState, draft, load
from mlxcel_compat.engine.speculative import Speculator, resolve


def _all_counts(tokens: list[int]) -> dict[tuple[int, ...], Counter]:
    counts: dict[tuple[int, ...], Counter] = {}
    for i in range(1, len(tokens)):
        for n in range(1, min(4, i) + 1):
            counts.setdefault(tuple(tokens[i - n:i]), Counter())[tokens[i]] += 1
    return counts


def _write(path: Path, records: dict[tuple[int, ...], dict[int, int]]) -> Path:
    """A cache file in llama.cpp's layout, written here independently of the reader."""
    out = bytearray()
    for key, followers in records.items():
        out += struct.pack("<4i", *(list(key) + [-1] * (4 - len(key))))
        out += struct.pack("<i", len(followers))
        for token, count in followers.items():
            out += struct.pack("<2i", token, count)
    path.write_bytes(bytes(out))
    return path


def test_counts_are_every_ngram_of_the_sequence_however_it_grew() -> None:
    """Updated pass by pass (a few tokens each), the counts equal one count of the whole: the
    n-grams that straddle two updates are there (llama.cpp's own update loses them)."""
    tokens = [5, 1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 5, 1, 2, 3, 1, 1, 1, 2]
    state = LookupState()
    at = 3
    for step in (1, 4, 2, 5, 1, 3):
        state.update(tokens[:at], tokens[at])
        at += step
        if at >= len(tokens):
            break
    state.update(tokens[:-1], tokens[-1])
    got = {key: dict(part.counts) for key, part in state.cache.items()}
    assert got == {key: dict(c) for key, c in _all_counts(tokens).items()}
    part = state.cache[(1,)]
    assert (part.total, part.top, part.top_count) == (7, 2, 5)  # after 1: 2 five times, 1 twice


def test_a_context_shift_goes_on_counting_from_the_new_end() -> None:
    state = LookupState()
    state.update([1, 2, 3, 4, 5, 6], 7)
    state.update([1, 2, 6], 7)  # the middle dropped: the sequence is shorter than what was counted
    state.update([1, 2, 6, 7], 8)
    assert state.cache[(6, 7)].counts == {8: 1} and state.counted == 5


def test_a_draft_takes_the_longest_clear_ngram_and_chains() -> None:
    # After "1 2 3" came 4 once; after "3" came 7 twice and 4 once: the 3-gram decides (a 3-gram
    # needs one sample), and the drafted tokens are the context of the next lookup.
    tokens = [1, 2, 3, 4, 5, 9, 3, 7, 8, 3, 7, 8, 1, 2]
    assert draft(LookupState(), None, tokens, 3) == [4, 5, 9, 3, 7, 8, 3, 7]
    assert draft(LookupState(), None, tokens, 3, n_max=2) == [4, 5]


def test_an_unclear_ngram_falls_back_to_a_shorter_one_and_thresholds_end_a_draft() -> None:
    # "2 3" was followed by 4, 5 and 6 once each: a third each, under the 2-gram's 50 %; so the
    # 1-gram "3" decides, but it has the same three followers: no draft.
    assert draft(LookupState(), None, [2, 3, 4, 2, 3, 5, 2, 3, 6, 2], 3) == []
    # One follower seen once: a 1-gram needs two samples, a 3-gram one.
    assert draft(LookupState(), None, [8, 9], 8) == []
    assert draft(LookupState(), None, [7, 8, 9, 1, 7, 8], 9) == [1, 7, 8, 9, 1, 7, 8, 9]


def test_the_dynamic_and_static_files_draft_and_weigh(tmp_path: Path) -> None:
    # The sequence knows nothing after "10 11". -lcd's strict thresholds (a 2-gram: 3 samples,
    # 66 %) take "10 11" -> 12 and "11 12" -> 13, not "12 13" -> 14 (one sample): the draft ends.
    dynamic = load(_write(tmp_path / "d.bin", {(10, 11): {12: 3}, (11, 12): {13: 3, 5: 1}, (12, 13): {14: 1}}))
    assert draft(LookupState(), LookupFiles(dynamic=dynamic), [1, 10], 11) == [12, 13]
    # -lcs drafts by itself from the last two tokens where nothing else does (2 samples, 50 %).
    static = load(_write(tmp_path / "s.bin", {(13, 14): {15: 2, 16: 1}}))
    assert draft(LookupState(), LookupFiles(static=static), [1, 13], 14) == [15]
    # And it weighs the candidates of the others: after "1 2 3 4" came 23 twice, then 24 twice (a
    # 4-gram: one sample, 50 %). Alone, the first to get there (23) wins the tie; with a corpus
    # that knows 24 after "3 4" five times and 23 once, 2 x 500 beats 2 x 100.
    own = [1, 2, 3, 4, 23, 1, 2, 3, 4, 23, 1, 2, 3, 4, 24, 1, 2, 3, 4, 24, 1, 2, 3]
    assert draft(LookupState(), None, own, 4)[:1] == [23]
    corpus = load(_write(tmp_path / "w.bin", {(3, 4): {24: 5, 23: 1}}))
    assert draft(LookupState(), LookupFiles(static=corpus), own, 4)[:1] == [24]


def test_files_that_are_not_llama_cpp_caches_are_refused(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.bin", {(1, 2, 3, 4): {5: 7}, (9,): {1: 1, 2: 3}})
    cache = load(good)
    assert cache[(1, 2, 3, 4)].counts == {5: 7} and (cache[(9,)].top, cache[(9,)].total) == (2, 4)
    data = good.read_bytes()
    cases = {
        "cut.bin": (data[:-4], "ends inside the followers"),
        "odd.bin": (data + b"\x00", "whole number of 32-bit words"),
        "key.bin": (data[:20 + 16] + struct.pack("<5i", 1, 2, 3, 4, 0), "not an n-gram with followers"),
        "hole.bin": (struct.pack("<4i", 1, -1, 3, -1) + struct.pack("<3i", 1, 5, 1), "not an n-gram with followers"),
        "zero.bin": (struct.pack("<4i", 1, 2, -1, -1) + struct.pack("<3i", 1, 5, 0), "count at word 6 is not positive"),
        "short.bin": (struct.pack("<3i", 1, 2, 3), "ends inside a record's key"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(LookupCacheError, match=message):
            load(tmp_path / name)
    with pytest.raises(OSError):
        LookupFiles.read(str(tmp_path / "missing.bin"), None)


def test_the_speculator_tries_ngram_simple_first_and_caps_the_cache_drafts() -> None:
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]  # ngram-simple never matches position 0
    both = Speculator(resolve(("ngram-simple", "ngram-cache"), None, ngram_size_n=4, ngram_size_m=6), None)
    assert both.propose(tokens, 4, 40) == [5, 6, 7, 8, 9, 10]  # the 4-gram "1 2 3 4": ngram-simple's
    assert both._last == "ngram-simple"
    cache_only = Speculator(resolve(("ngram-cache",), None), None)
    assert cache_only.propose(tokens, 4, 40) == [5, 6, 7, 8, 9, 10, 11, 12]  # 8 at most
    cache_only.verified(8, 1)  # cut short: the cap falls to twice the accepted run
    assert cache_only.propose(tokens + [4, 5], 6, 40) == [7, 8, 9, 10]
    assert cache_only._last == "ngram-cache"
    assert Speculator(resolve(("ngram-simple",), None, ngram_size_n=4), None).lookup is None


@pytest.mark.engine
@pytest.mark.real_model
def test_on_a_real_model_copying_a_file_drafts_are_accepted_and_the_text_is_plain_decodings(smollm2_gguf: Path) -> None:
    from tests.engine.harness import EngineHarness

    text = "".join(f"def handler_{i}(event):\n    return dispatch(event, 'h{i}', retries={i % 3})\n\n"
                   for i in range(6))
    plain = EngineHarness(smollm2_gguf, batch_size=64, n_parallel=1)
    spec = EngineHarness(smollm2_gguf, batch_size=64, n_parallel=1, speculative=resolve(("ngram-cache",), None))
    try:
        # SmolLM2's ChatML turns, the answer begun with the code fence (as bench_speculative.py's edit workload)
        chat = ("<|im_start|>user\nOutput this file exactly as it is.\n\n```python\n" + text + "```<|im_end|>\n"
                "<|im_start|>assistant\n```python\n")
        prompt = plain.engine.loaded.tokenizer.encode(chat, add_special_tokens=False)
        expected = plain.run(prompt, n_predict=64, cache=False, ignore_eos=True)
        got = spec.run(prompt, n_predict=64, cache=False, ignore_eos=True)
        assert got.tokens == expected.tokens
        assert got.finish.n_draft_accepted >= 32 and got.finish.n_draft_accepted <= got.finish.n_draft
    finally:
        plain.close()
        spec.close()
