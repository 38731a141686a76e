"""``/infill``: llama-server's fill-in-the-middle prompt, token for token, then a native completion.

The expected prompts are built here from llama-server's rules (``format_prompt_infill`` in
b11312's ``server-common.cpp``), written out case by case with the numbers of these servers
(``-b 64 -c 512``, ``-n`` left at -1): the prefix keeps its last 3 x (64 / 4) = 48 tokens, the
suffix its first 64 / 4 - 2 - len(prompt) tokens, the extra context its last 512 - 64 + 2 = 450.

Side by side with the real llama-server (b11312, ``~/.cache/llama-peer``), on the factory's FIM
GGUF, for every request of :data:`CASES` with and without ``--spm-infill``:
:func:`test_prompts_equal_the_real_llama_server` (skipped where the binary is absent, as in CI).
Run on 2026-12-02: the ``prompt`` text and ``tokens_evaluated`` of all 2 x 5 requests were equal,
and so was the 400 for a bad ``input_extra`` (status and body). By hand the same day: llama-server
on the tiny llama GGUF (no FIM tokens) answered the 501 body :func:`test_model_without_fim_tokens_gets_501`
expects, word for word; a ``null`` filename and an out-of-vocabulary id gave the same 400s as here;
a missing ``input_prefix`` and a numeric one gave 500s (``[json.exception.out_of_range.403] key
'input_prefix' not found``, ``[json.exception.type_error.302] ...``), where this server answers 400.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import parse_sse
from tests.conftest import LLAMA_SERVER, start_llama_server, tiny_model
from mlxcel_compat.testing.tokenizer import fim_token_id

PRE, MID, SUF, PAD, REP, SEP = (fim_token_id(t) for t in (
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"))
ARGS = ["-np", "1", "-c", "512", "-b", "64"]

PREFIX = "def total(items):\n    result = 0\n    for item in items:\n" + "".join(f"    # step {i}: add the value\n" for i in range(12))
SUFFIX = "\n    return result\n\n\nprint(total([1, 2, 3]))\n" + "".join(f"# trailing note {i}\n" for i in range(8))


@pytest.fixture(scope="module")
def coder_dir() -> Path:
    return tiny_model("qwen2_coder")


@pytest.fixture(scope="module")
def coder_gguf() -> Path:
    return tiny_model("qwen2_coder:f32")


@pytest.fixture(scope="module")
def fim_server(server_factory, coder_dir):
    return server_factory(["-m", str(coder_dir), *ARGS])


@pytest.fixture(scope="module")
def spm_server(server_factory, coder_gguf):
    return server_factory(["-m", str(coder_gguf), *ARGS, "--spm-infill"])


@pytest.fixture(scope="module")
def http(fim_server):
    with httpx.Client(base_url=fim_server.base_url, timeout=60) as client:
        yield client


def plain(http: httpx.Client, text: str) -> list[int]:
    """Text as llama-server tokenizes the FIM pieces: no BOS, special-token text left as text.
    The factory vocabulary has no special token inside these texts, so /tokenize agrees."""
    assert "<|" not in text
    return http.post("/tokenize", json={"content": text}).json()["tokens"]


def infill(http: httpx.Client, **body) -> dict:
    response = http.post("/infill", json={"n_predict": 1, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def detok(http: httpx.Client, tokens: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": tokens}).json()["content"]


def assert_prompt(http: httpx.Client, result: dict, expected: list[int]) -> None:
    assert result["tokens_evaluated"] == len(expected)
    assert result["prompt"] == detok(http, expected)


def test_repo_level_layout_with_extra_chunks_and_truncation(http):
    prefix, suffix = plain(http, PREFIX), plain(http, SUFFIX)
    assert len(prefix) > 48 and len(suffix) > 16  # both are cut
    prompt = plain(http, " result")
    extra = [{"filename": "util.py", "text": "def helper():\n    pass\n"}, {"text": "CONSTANT = 3\n"}]
    result = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=extra, prompt=" result")
    expected = (
        [REP, *plain(http, "myproject\n")]
        + [SEP, *plain(http, "util.py\n"), *plain(http, extra[0]["text"])]
        + [SEP, *plain(http, "tmp\n"), *plain(http, extra[1]["text"])]  # no filename: "tmp"
        + [SEP, *plain(http, "filename\n")]
        + [PRE, *prefix[-48:], *prompt]  # the prompt follows the prefix, before the suffix token
        + [SUF, *suffix[: 16 - 2 - len(prompt)]]
        + [MID]
    )
    assert_prompt(http, result, expected)


def test_without_extra_the_repo_lines_still_frame_the_file(http):
    result = infill(http, input_prefix="x = ", input_suffix="\n")
    expected = [REP, *plain(http, "myproject\n"), SEP, *plain(http, "filename\n"), PRE, *plain(http, "x = "), SUF, *plain(http, "\n"), MID]
    assert_prompt(http, result, expected)


def test_extra_context_keeps_its_last_tokens(http):
    chunks = [{"filename": f"f{i}.py", "text": "".join(f"value_{i}_{j} = {j}\n" for j in range(20))} for i in range(6)]
    extra = [REP, *plain(http, "myproject\n")]
    for c in chunks:
        extra += [SEP, *plain(http, c["filename"] + "\n"), *plain(http, c["text"])]
    extra += [SEP, *plain(http, "filename\n")]
    assert len(extra) > 450
    result = infill(http, input_prefix="a", input_suffix="b", input_extra=chunks, n_predict=1)
    expected = [*extra[-450:], PRE, *plain(http, "a"), SUF, *plain(http, "b"), MID]
    assert_prompt(http, result, expected)


def test_prefix_and_suffix_may_mix_text_and_token_ids(http):
    ids = plain(http, " value")
    result = infill(http, input_prefix=["x =", *ids], input_suffix=[*ids, "\n"])
    expected = [REP, *plain(http, "myproject\n"), SEP, *plain(http, "filename\n"),
                PRE, *plain(http, "x ="), *ids, SUF, *ids, *plain(http, "\n"), MID]
    assert_prompt(http, result, expected)


def test_special_token_text_in_the_code_is_not_a_control_token(http, coder_dir):
    """The prefix is tokenized with special parsing off (the quoted text is ordinary tokens), the
    ``prompt`` with it on (its ``<|fim_pad|>`` is the control token)."""
    from tokenizers import Tokenizer

    spelled = Tokenizer.from_file(str(coder_dir / "tokenizer.json"))
    spelled.encode_special_tokens = True
    code = "s = '<|fim_middle|>'"
    result = infill(http, input_prefix=code, input_suffix="", prompt="<|fim_pad|>")
    expected = [REP, *plain(http, "myproject\n"), SEP, *plain(http, "filename\n"),
                PRE, *spelled.encode(code, add_special_tokens=False).ids, PAD, SUF, MID]
    assert MID not in expected[:-1]
    assert_prompt(http, result, expected)


def test_spm_order_puts_the_suffix_first(spm_server):
    with httpx.Client(base_url=spm_server.base_url, timeout=60) as http:
        prompt = plain(http, " result")
        suffix = plain(http, SUFFIX)
        result = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, prompt=" result")
        expected = [REP, *plain(http, "myproject\n"), SEP, *plain(http, "filename\n"),
                    SUF, *suffix[: 16 - 2 - len(prompt)], PRE, *plain(http, PREFIX)[-48:], *prompt, MID]
        assert_prompt(http, result, expected)


def test_second_keystroke_in_the_same_file_hits_the_prompt_cache(http):
    body = {"input_prefix": PREFIX[:120], "input_suffix": SUFFIX[:40], "input_extra": [{"filename": "u.py", "text": "import os\n" * 20}],
            "cache_prompt": True, "n_predict": 4}
    first = infill(http, **body)
    second = infill(http, **{**body, "input_prefix": PREFIX[:121]})
    assert second["tokens_cached"] > 0
    assert second["tokens_cached"] >= first["tokens_evaluated"] - 30  # the extra context and most of the prefix


def test_streaming_infill_sends_native_events(http):
    response = http.post("/infill", json={"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 3, "stream": True, "temperature": 0})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    streamed = "".join(e["content"] for e in events[:-1])
    whole = infill(http, input_prefix="x = ", input_suffix="\n", n_predict=3)
    assert streamed == whole["content"] or whole["content"].startswith(streamed)


def test_editor_sampler_chain_with_infill_and_several_completions(http, server_factory, coder_dir):
    """llama.vscode's samplers (top_k, top_p, infill); n_cmpl > 1 answers an array, as /completion
    (this server has one slot, so the array is asked of a two-slot one)."""
    body = {"input_prefix": "x = ", "input_suffix": "\n", "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "n_predict": 4}
    result = infill(http, **body, temperature=0.7, seed=3)
    assert result["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
    assert 1 <= result["tokens_predicted"] <= 4
    two = server_factory(["-m", str(coder_dir), "-np", "2", "-c", "1024", "-b", "64"])
    both = httpx.post(two.base_url + "/infill", json={**body, "n_cmpl": 2}, timeout=60).json()
    assert [r["index"] for r in both] == [0, 1]
    assert both[0]["tokens_evaluated"] == both[1]["tokens_evaluated"] == result["tokens_evaluated"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_suffix": ""}, "\"input_prefix\" is required"),
        ({"input_prefix": ""}, "\"input_suffix\" is required"),
        ({"input_prefix": 3, "input_suffix": ""}, "\"input_prefix\" must be a string or an array of strings and token ids"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "extra_context chunk must contain a \"text\" field with a string value"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 1}]}, "extra_context chunk's \"filename\" field must be a string"),
        ({"input_prefix": [99999], "input_suffix": ""}, "Prompt contains invalid tokens"),
    ],
)
def test_bad_fields_get_400(http, body, message):
    response = http.post("/infill", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message


def test_a_non_string_prompt_is_ignored(http):
    assert infill(http, input_prefix="a", input_suffix="b", prompt=5)["tokens_evaluated"] == infill(http, input_prefix="a", input_suffix="b")["tokens_evaluated"]


def test_model_without_fim_tokens_gets_501(server):
    response = httpx.post(server.base_url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert response.status_code == 501
    assert response.json()["error"] == {
        "code": 501,
        "message": "Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token is missing. ",
        "type": "not_supported_error",
    }


# ---------------------------------------------------------------------- side by side with llama-server

CASES = [
    {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": " result",
     "input_extra": [{"filename": "util.py", "text": "def helper():\n    pass\n"}, {"text": "CONSTANT = 3\n"}]},
    {"input_prefix": "x = ", "input_suffix": "\n"},
    {"input_prefix": "a", "input_suffix": "b",
     "input_extra": [{"filename": f"f{i}.py", "text": "".join(f"value_{i}_{j} = {j}\n" for j in range(20))} for i in range(6)]},
    {"input_prefix": "s = '<|fim_middle|>'", "input_suffix": "", "prompt": "<|fim_pad|>"},
    {"input_prefix": ["x =", 1000, 2000], "input_suffix": [3000, "\n"]},
]



@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="the llama-server binary (b11312) is not built on this machine")
@pytest.mark.parametrize("spm", [False, True])
def test_prompts_equal_the_real_llama_server(request, server_factory, coder_gguf, spm):
    flags = ["--spm-infill"] if spm else []
    # With --spm-infill, ours is the module's spm_server (the same file and flags).
    ours = request.getfixturevalue("spm_server") if spm else server_factory(["-m", str(coder_gguf), *ARGS])
    proc, theirs = start_llama_server(["-m", str(coder_gguf), *ARGS, "-t", "1", *flags])
    try:
        for body in CASES:
            body = {**body, "n_predict": 1, "temperature": 0}
            a = httpx.post(ours.base_url + "/infill", json=body, timeout=60).json()
            b = httpx.post(theirs + "/infill", json=body, timeout=60).json()
            assert (a["prompt"], a["tokens_evaluated"]) == (b["prompt"], b["tokens_evaluated"]), body
        bad = {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}
        a, b = (httpx.post(u + "/infill", json=bad, timeout=60) for u in (ours.base_url, theirs))
        assert (a.status_code, a.json()) == (b.status_code, b.json())
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------------- finding the FIM tokens


def test_factory_gguf_states_the_fim_ids_and_the_directory_is_found_by_text(coder_dir, coder_gguf):
    from mlx_lm.tokenizer_utils import load

    from mlxcel_compat.tokenizer.fim import FimTokens, model_fim_tokens
    from mlxcel_compat.gguf.reader import open_gguf
    from mlxcel_compat.gguf.tokenizer import special_tokens

    expected = FimTokens(pre=PRE, suf=SUF, mid=MID, pad=PAD, rep=REP, sep=SEP)
    md = open_gguf(coder_gguf).metadata
    assert (md["tokenizer.ggml.fim_pre_token_id"], md["tokenizer.ggml.fim_sep_token_id"]) == (PRE, SEP)
    specials = special_tokens(open_gguf(coder_gguf))
    assert FimTokens(**specials.fim) == expected
    assert {PAD, REP, SEP} <= set(specials.eog)  # llama.cpp ends generation at them
    assert model_fim_tokens(load(coder_dir), 8198) == expected


def test_stated_ids_win_unless_out_of_range_and_old_keys_fill_in():
    from mlxcel_compat.tokenizer.fim import find_fim_tokens, stated_ids

    vocab = {"<PRE>": 5, "▁<PRE>": 3, "<SUF>": 6, "<MID>": 7, "<|fim_pad|>": 8}
    found = find_fim_tokens(vocab, 10)
    assert (found.pre, found.suf, found.mid, found.pad, found.rep, found.sep) == (3, 6, 7, 8, None, None)
    stated = stated_ids({"tokenizer.ggml.fim_pre_token_id": 1, "tokenizer.ggml.prefix_token_id": 2,
                         "tokenizer.ggml.fim_suf_token_id": 99, "tokenizer.ggml.middle_token_id": 4})
    assert stated == {"pre": 2, "suf": 99, "mid": 4}  # the deprecated key is read last, as llama.cpp reads it
    found = find_fim_tokens(vocab, 10, stated)
    assert (found.pre, found.suf, found.mid) == (2, 6, 4)  # 99 is outside the vocabulary: found by text
    assert find_fim_tokens({}, 10).missing() == "prefix token is missing. suffix token is missing. middle token is missing. "


def test_without_a_file_separator_chunks_are_joined_with_snippet_lines(coder_dir):
    """CodeLlama's kind of vocabulary: prefix, suffix and middle only, and a BOS."""
    from tokenizers import Tokenizer

    from mlxcel_compat.tokenizer.fim import FimTokens
    from mlxcel_compat.server.infill import InfillBudget, infill_prompt, parse_infill

    tok = Tokenizer.from_file(str(coder_dir / "tokenizer.json"))
    tok.encode_special_tokens = True

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    fim = FimTokens(pre=PRE, suf=SUF, mid=MID)
    body = {"input_prefix": "a = 1", "input_suffix": "b = 2", "input_extra": [{"filename": "x.py", "text": "c = 3"}, {"text": "d = 4"}]}
    budget = InfillBudget(n_batch=64, n_predict=-1, n_ctx=512, spm=False, bos_id=7)
    snippet = enc("\n\n--- snippet ---\n\n")
    expected = [*snippet, *enc("c = 3"), *snippet, *enc("d = 4"), 7, PRE, *enc("a = 1"), SUF, *enc("b = 2"), MID]
    assert infill_prompt(fim, parse_infill(body), budget, enc, enc) == expected
    # The extra context is cut from the front; the BOS stays after it.
    small = InfillBudget(n_batch=64, n_predict=200, n_ctx=470, spm=True, bos_id=7)  # 470 - 64 - 400 = 6 tokens
    extra = [*snippet, *enc("c = 3"), *snippet, *enc("d = 4")]
    assert infill_prompt(fim, parse_infill(body), small, enc, enc) == [*extra[-6:], 7, SUF, *enc("b = 2"), PRE, *enc("a = 1"), MID]
