"""Tests for the deterministic tiny-model factory (mlxcel_compat.testing)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import jinja2
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import load

from mlxcel_compat.testing import chatml
from mlxcel_compat.testing import corpus as factory_corpus
from mlxcel_compat.testing import families, model_directory, models
from mlxcel_compat.testing import tokenizer as tok

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the tool",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "sunny, 21 C"},
]


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: model_directory.build_model(family, "tiny", root / family) for family in families.FAMILIES}


@pytest.fixture(scope="module")
def loaded(built: dict[str, Path]) -> dict[str, tuple]:
    return {family: load(str(path)) for family, path in built.items()}


def _render_plain(template: str, **kwargs: object) -> str:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**kwargs)


# --- models ---------------------------------------------------------------


@pytest.mark.parametrize("family", families.FAMILIES)
def test_tiny_model_prefills_and_decodes(family: str, loaded: dict[str, tuple]) -> None:
    model, tokenizer = loaded[family]
    vocab = families.model_config(family, "tiny")["vocab_size"]
    assert vocab == len(tokenizer) == tok.VOCAB_SIZE
    cache = make_prompt_cache(model)
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    logits = model(mx.array([prompt]), cache=cache)
    assert logits.shape == (1, len(prompt), vocab)
    assert mx.all(mx.isfinite(logits)).item()
    # Unit-gain init: logits spread around 1, not collapsed to near-ties.
    assert 0.3 < logits[0, -1].std().item() < 3.0
    token = mx.argmax(logits[0, -1]).reshape(1, 1)
    for _ in range(3):
        step = model(token, cache=cache)
        assert step.shape == (1, 1, vocab)
        assert mx.all(mx.isfinite(step)).item()
        token = mx.argmax(step[0, -1]).reshape(1, 1)
    kv = [c for c in cache if hasattr(c, "offset")]  # hybrids (lfm2) may end on a recurrent layer
    assert kv[-1].offset == len(prompt) + 3


def test_gemma3_text_has_small_rotating_window(loaded: dict[str, tuple]) -> None:
    model, _ = loaded["gemma3_text"]
    cache = make_prompt_cache(model)
    rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
    assert rotating and any(type(c) is KVCache for c in cache)
    assert {c.max_size for c in rotating} == {64}
    model(mx.array([list(range(100, 200))]), cache=cache)  # 100 tokens > window
    for t in range(5):
        out = model(mx.array([[300 + t]]), cache=cache)
    mx.eval(out)
    assert mx.all(mx.isfinite(out)).item()
    for c in rotating:
        assert c.offset == 105 and c.keys.shape[2] <= c.max_size  # wrapped, not grown


def test_qwen3_next_is_a_recurrent_hybrid(loaded: dict[str, tuple]) -> None:
    model, _ = loaded["qwen3_next"]
    cache = make_prompt_cache(model)
    assert [type(c).__name__ for c in cache] == ["ArraysCache"] * 3 + ["KVCache"]
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
    states = [c for c in cache if isinstance(c, ArraysCache)]
    assert all(s[0] is not None and s[1] is not None for s in states)


def test_describe_matches_the_loaded_model(loaded: dict[str, tuple]) -> None:
    for family, (model, _) in loaded.items():
        info = models.describe(family, "tiny")
        loaded_count = sum(v.size for _, v in tree_flatten(model.parameters()))
        assert info["num_parameters"] == loaded_count
        assert info["cache_types"] == [type(c).__name__ for c in make_prompt_cache(model)]


def test_small_sizes_are_benchmark_sized() -> None:
    for family in families.FAMILIES:
        count = models.describe(family, "small")["num_parameters"]
        assert 88_000_000 <= count <= 100_000_000, (family, count)
    llama = families.model_config("llama", "small")
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["num_attention_heads"],
            llama["num_key_value_heads"], llama["intermediate_size"], llama["vocab_size"]) == (
        768, 12, 12, 4, 2048, 8192)
    for family in families.FAMILIES:
        for size in families.SIZES:
            assert families.model_config(family, size)["max_position_embeddings"] >= 8192


def test_builds_are_byte_identical(built: dict[str, Path], tmp_path: Path) -> None:
    tok.trained_tokenizer_json.cache_clear()  # retrain the tokenizer too
    for family, first in built.items():
        second = model_directory.build_model(family, "tiny", tmp_path / family)
        digests = _digests(second)
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "generation_config.json"} <= set(digests)
        assert digests == _digests(first), family


def test_unknown_family_and_size_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model family 'gpt9'"):
        model_directory.build_model("gpt9", "tiny", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown model size"):
        model_directory.ensure_model("llama", "huge", tmp_path)
    assert not (tmp_path / "x").exists()


def test_build_replaces_a_previous_build_but_not_foreign_files(tmp_path: Path) -> None:
    out = model_directory.build_model("qwen3", "tiny", tmp_path / "m")
    before = _digests(out)
    assert model_directory.build_model("qwen3", "tiny", out) == out
    assert _digests(out) == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        model_directory.build_model("qwen3", "tiny", foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "m"]  # no temp leftovers


def test_ensure_model_builds_once_and_survives_a_race(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker() -> None:
        try:
            barrier.wait()
            results.append(model_directory.ensure_model("gemma3_text", "tiny", tmp_path))
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    expected = tmp_path / f"gemma3_text-tiny-v{model_directory.FORMAT_VERSION}"
    assert results == [expected, expected]
    assert model_directory.is_complete(expected)
    assert [p.name for p in tmp_path.iterdir()] == [expected.name]  # losers cleaned up

    mtime = (expected / "model.safetensors").stat().st_mtime_ns
    assert model_directory.ensure_model("gemma3_text", "tiny", tmp_path) == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt

    (expected / "tokenizer.json").unlink()  # damaged: rebuilt on next use
    assert not model_directory.is_complete(expected)
    assert model_directory.is_complete(model_directory.ensure_model("gemma3_text", "tiny", tmp_path))

    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    assert model_directory.ensure_model("gemma3_text", "tiny") == expected


# --- tokenizer ------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "Hello, world! 123 + 4.56 = 127.56\n\ttabs and  double  spaces ",
    "emoji 🙂🚀👩‍👩‍👧‍👦 flags 🇫🇷 skin 👍🏽",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "combining e\u0301 vs é, zero\u200bwidth, rtl שלום مرحبا",
    "def f(x):\n    return {'a': [1, 2]}  # code\r\n",
    "\x00\x01 control \x7f and lone spaces    ",
    "special text <|im_start|> <think> inline",
]


def test_tokenizer_round_trips_any_text(loaded: dict[str, tuple]) -> None:
    texts = list(ROUND_TRIP_TEXTS)
    # Arbitrary code points from a fixed LCG (no surrogates).
    state, chars = 12345, []
    for _ in range(400):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        cp = (state >> 33) % 0x30000
        chars.append(chr(cp if not 0xD800 <= cp < 0xE000 else 0x20))
    texts.append("".join(chars))
    for family in ("llama", "qwen3"):
        tokenizer = loaded[family][1]
        for text in texts:
            ids = tokenizer.encode(text)
            assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace(
                "<|im_start|>", "")
            assert tokenizer.decode(ids) == (tok.BEGIN_OF_TEXT if family == "llama" else "") + text


def test_special_tokens_and_bos(loaded: dict[str, tuple]) -> None:
    for family, (_, tokenizer) in loaded.items():
        for spec in tok.ADDED_TOKENS:
            ids = tokenizer.encode(spec.content, add_special_tokens=False)
            assert ids == [tok.token_id(spec.content)], spec.content
        assert tokenizer.eos_token == tok.IM_END
        assert tokenizer.eos_token_ids == {tok.token_id(tok.IM_END), tok.token_id(tok.ENDOFTEXT)}
        plain = tokenizer.encode("hello there", add_special_tokens=False)
        with_bos = tokenizer.encode("hello there")
        if families.FAMILY_SPECS[family].add_bos:  # llama, mistral
            assert with_bos == [tok.token_id(tok.BEGIN_OF_TEXT)] + plain
        else:
            assert with_bos == plain
    # Think / tool-call markers survive skip_special_tokens; ChatML markers do not.
    qwen = loaded["qwen3"][1]
    text = "<|im_start|><think>a</think><tool_call>{}</tool_call><|im_end|>"
    assert qwen.decode(qwen.encode(text), skip_special_tokens=True) == (
        "<think>a</think><tool_call>{}</tool_call>")


def test_corpus_is_varied_and_fixed() -> None:
    corpus = factory_corpus.generate_corpus()
    assert len(corpus) >= 100_000
    for needle in ("def ", "{", "| name |", "$ ", "User:", "你好", "🚀"):
        assert needle in corpus
    assert hashlib.sha256(corpus.encode()).hexdigest() == hashlib.sha256(
        factory_corpus.generate_corpus.__wrapped__().encode()).hexdigest()


# --- chat template ----------------------------------------------------------


def test_chat_template_renders_tools_and_calls_with_transformers(loaded: dict[str, tuple]) -> None:
    hf = loaded["qwen3"][1]._tokenizer
    text = hf.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ("<|im_start|>assistant\n<think>\nI need the tool\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text
    assert text.endswith("<|im_start|>assistant\n")
    # Reasoning of turns before the last user message is dropped by default...
    assert "old thoughts" not in text
    # ...and kept with preserve_thinking.
    kept = hf.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=False, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold thoughts\n</think>\n\nHello.<|im_end|>" in kept


def test_chat_template_enable_thinking(loaded: dict[str, tuple]) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    hf = loaded["qwen3_next"][1]._tokenizer
    off = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                 enable_thinking=False)
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                enable_thinking=True)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_renders_with_plain_jinja2() -> None:
    template = chatml.chat_template(thinking=True)
    text = _render_plain(template, messages=CONVERSATION, tools=TOOLS,
                         add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in text
    with pytest.raises(jinja2.TemplateError, match="Unknown message role: robot"):
        _render_plain(template, messages=[{"role": "robot", "content": "beep"}])
    with pytest.raises(jinja2.TemplateError, match="first message"):
        _render_plain(template, messages=[{"role": "user", "content": "a"},
                                          {"role": "system", "content": "b"}])


def test_non_thinking_families_and_bos_in_template(loaded: dict[str, tuple]) -> None:
    llama = loaded["llama"][1]
    assert "think" not in llama.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = llama.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                     enable_thinking=False)
    assert text == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = llama.apply_chat_template(messages, add_generation_prompt=True)
    assert ids.count(tok.token_id(tok.BEGIN_OF_TEXT)) == 1 and ids[:2] == [
        tok.token_id(tok.BEGIN_OF_TEXT), tok.token_id(tok.IM_START)]
    # mlx-lm recognises the tool-call format from the template.
    assert llama.tool_call_start == "<tool_call>" and llama.tool_parser is not None


# --- command line ------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxcel_compat.testing.models", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_list_and_unknown_family(tmp_path: Path) -> None:
    listed = _cli("--list")
    assert listed.returncode == 0
    assert listed.stdout.splitlines() == [*families.FAMILIES, *families.FIM_FAMILIES, *families.ARCHITECTURE_FAMILIES]
    bad = _cli("--family", "gpt9", "--size", "tiny", "--out", str(tmp_path / "x"))
    assert bad.returncode != 0
    assert "unknown model family 'gpt9'" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_cli_build_matches_in_process_build(built: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cli-llama"
    done = _cli("--family", "llama", "--size", "tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == out
    # Another process, another tokenizer training, the same bytes.
    assert _digests(out) == _digests(built["llama"])


def test_large_tokenizer_grows_a_valid_bpe_deterministically() -> None:
    from tokenizers import Tokenizer, pre_tokenizers

    from mlxcel_compat.tokenizer.byte_level import byte_level_bytes

    text = tok.large_tokenizer_json(12_000)
    assert text == tok.large_tokenizer_json(12_000)
    tokenizer = Tokenizer.from_str(text)
    assert tokenizer.get_vocab_size() == 12_000
    assert tokenizer.token_to_id(tok.IM_END) == 12_000 - len(tok.ADDED_TOKENS) + 2  # added tokens last, in order
    sample = "Grown vocabularies still round-trip text: ünïcode, code() and 123."
    assert tokenizer.decode(tokenizer.encode(sample).ids) == sample
    grown = [tokenizer.id_to_token(i) for i in range(tok.VOCAB_SIZE - len(tok.ADDED_TOKENS), 12_000 - len(tok.ADDED_TOKENS))]
    assert all(2 <= len(piece) <= 12 for piece in grown)
    # Only what BPE could learn from text: whole UTF-8 characters, one pre-token each (no "é" cut
    # in half before an "a", no word glued to a quote), as in a real vocabulary.
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str
    texts = [byte_level_bytes(piece).decode("utf-8") for piece in grown]  # raises on a broken character
    assert all([p for p, _ in split(t)] == [piece] for t, piece in zip(texts, grown))


# --- random-block GGUF files (write_random_gguf) ----------------------------------------------

RANDOM_DIMS = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=512)


@pytest.mark.parametrize(("gguf_type", "dims"), [
    ("q4_k_m", RANDOM_DIMS),
    # intermediate 320: ffn_down's rows are not whole 256-value blocks (Q4_K -> Q5_0, Q6_K -> Q8_0)
    ("q4_k_m", {**RANDOM_DIMS, "intermediate_size": 320}),
    ("q8_0", RANDOM_DIMS),
    ("q4_1", RANDOM_DIMS),
    # gpt-oss's experts' type (its exponent a power of two: d rounded) and two i-quants (IQ1_M's d
    # split over its scale words)
    ("mxfp4", RANDOM_DIMS),
    ("iq2_xxs", RANDOM_DIMS),
    ("iq1_m", RANDOM_DIMS),
])
def test_random_gguf_has_the_mix_and_loads(gguf_type: str, dims: dict, tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from mlxcel_compat.runtime import block_weight
    from mlxcel_compat.gguf.reader import open_gguf, read_tensor
    from mlxcel_compat.gguf.load import load_gguf
    from mlxcel_compat.gguf.quants import type_name
    from mlxcel_compat.testing import gguf_random, gguf_tensors

    from tests.conftest import tiny_model

    source = tiny_model("llama")
    path = gguf_random.write_random_gguf(tmp_path / "r.gguf", "llama", dims, gguf_type, seed=7, model_dir=source)
    again = gguf_random.write_random_gguf(tmp_path / "again.gguf", "llama", dims, gguf_type, seed=7, model_dir=source)
    assert path.read_bytes() == again.read_bytes()  # the bytes depend only on the arguments
    file = open_gguf(path)
    n_layers = dims["num_hidden_layers"]
    assert file.arch_value("embedding_length") == dims["hidden_size"]
    assert file.arch_value("feed_forward_length") == dims["intermediate_size"]
    assert file.arch_value("block_count") == n_layers
    assert len(file.metadata["tokenizer.ggml.tokens"]) == tok.VOCAB_SIZE
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{t}.weight" for i in range(n_layers)
        for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")}
    assert set(file.tensors) == expected
    for name, info in file.tensors.items():
        kind = type_name(info.ggml_type).lower()
        if name.endswith("norm.weight"):
            assert kind == "f32"
            continue
        want = gguf_tensors.tensor_type(name, gguf_type, n_layers)
        if info.shape[-1] % 256 and want in ("q4_k", "q6_k"):
            want = {"q4_k": "q5_0", "q6_k": "q8_0"}[want]
        assert kind == want, name
        assert kind == gguf_tensors.stored_type(name, info.shape, gguf_type, n_layers)
        values = quants.dequantize(read_tensor(info), GGMLQuantizationType(info.ggml_type))
        assert values.size == info.n_values and np.all(np.isfinite(values)), name
        # scaled like the factory's weights: mean about 0, std 1/sqrt(fan_in)
        std = 1 / np.sqrt(info.shape[-1])
        assert abs(values.mean()) < 0.1 * std and 0.8 * std < values.std() < 1.25 * std, name
    if gguf_type == "q4_k_m":
        kinds = {n: type_name(i.ggml_type).lower() for n, i in file.tensors.items()}
        assert kinds["output.weight"] == "q6_k" and kinds["token_embd.weight"] == "q4_k"
        more = [i for i in range(n_layers) if gguf_tensors.use_more_bits(i, n_layers)]
        assert 0 < len(more) < n_layers

    model, tokenizer, config, summary = load_gguf(str(path), on_cpu=True)
    if not isinstance(block_weight.library(), str):  # served from the file's blocks, every matrix
        assert sum(n for label, n in summary.precision.items() if label.startswith("blocks")) == len(expected) - (
            2 * n_layers + 1)
    assert config["hidden_size"] == dims["hidden_size"] and config["num_hidden_layers"] == n_layers
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    logits = model(mx.array([ids]), cache=make_prompt_cache(model))
    assert logits.shape == (1, len(ids), tok.VOCAB_SIZE)
    assert mx.all(mx.isfinite(logits)).item()
    assert 0.1 < logits[0, -1].std().item() < 10.0


def test_random_gguf_rejects_unknown_types(tmp_path: Path) -> None:
    from mlxcel_compat.testing import gguf_random

    with pytest.raises(ValueError, match="unknown GGUF type"):
        gguf_random.write_random_gguf(tmp_path / "x.gguf", "llama", RANDOM_DIMS, "q7_k")
    with pytest.raises(ValueError, match="no GGUF writer"):
        gguf_random.write_random_gguf(tmp_path / "x.gguf", "qwen3_next", RANDOM_DIMS, "q8_0")


@pytest.mark.parametrize(("family", "gguf_type", "expert_type"), [("qwen3_moe", "q4_k_m", None),
                                                                  ("gpt_oss", "q8_0", "mxfp4")])
def test_random_moe_gguf_keeps_its_experts_in_blocks(family: str, gguf_type: str, expert_type: str | None,
                                                     tmp_path: Path) -> None:
    """The MoE-shaped benchmark files (``scripts/bench_quantized.py``: Qwen3-30B-A3B's and
    gpt-oss-20b's layers) at small sizes: the experts' own type, served from their blocks, and
    logits within the 8-bit-activation bound of the file's float32 expansion."""
    from mlxcel_compat.gguf.architectures import is_expert_stack
    from mlxcel_compat.gguf.load import load_gguf
    from mlxcel_compat.gguf.quants import type_name
    from mlxcel_compat.gguf.reader import open_gguf
    from mlxcel_compat.runtime import block_weight
    from mlxcel_compat.testing import gguf_random

    from tests.conftest import tiny_model

    dims = gguf_random.moe_dims(family, 2) | dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=64, intermediate_size=256)
    dims |= {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
             "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16)}[family]
    path = gguf_random.write_random_gguf(tmp_path / "moe.gguf", family, dims, gguf_type, seed=3,
                                         model_dir=tiny_model(family), expert_type=expert_type)
    file = open_gguf(path)
    stacks = {n: type_name(i.ggml_type).lower() for n, i in file.tensors.items() if is_expert_stack(n)}
    assert len(stacks) == 6
    if expert_type:
        assert set(stacks.values()) == {expert_type} and type_name(file.tensors["blk.0.attn_q.weight"].ggml_type) == "Q8_0"
    else:
        assert set(stacks.values()) <= {"q4_k", "q6_k"}
    if isinstance(block_weight.library(), str):
        pytest.skip("no ggml kernels here")
    model, tokenizer, _, summary = load_gguf(str(path), on_cpu=True)
    assert sum(n for label, n in summary.precision.items() if label.startswith("experts in blocks")) == 6
    expanded, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    ids = mx.array([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    logits = model(ids)
    assert mx.all(mx.isfinite(logits)).item() and 0.1 < logits[0, -1].std().item() < 10.0
    # Each layer's experts on the same inputs and choices (random routers sit near ties, so the
    # whole model's logits move wherever an 8-bit activation moves a choice): within 8-bit products
    # (two of them in a row; measured 0.01-0.025).
    from mlx_lm.models.switch_layers import SwitchGLU

    ours = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    reference = [m for _, m in expanded.named_modules() if isinstance(m, SwitchGLU)]
    assert len(ours) == len(reference) == 2
    x = mx.random.normal((1, 5, dims["hidden_size"]), key=mx.random.key(0))
    chosen = mx.random.randint(0, 4, (1, 5, 2), key=mx.random.key(1))
    for layer, float_layer in zip(ours, reference):
        got, want = layer(x, chosen), float_layer(x, chosen)
        assert (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want ** 2).sum())).item() < 0.05
