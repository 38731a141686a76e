"""The served tokenizer (tokenizer/served.py) against transformers' on the same files.

The server used to wrap every tokenizer in transformers' ``PreTrainedTokenizerFast`` (inside
mlx-lm's ``TokenizerWrapper``); it now reads the files itself and keeps transformers out of the
serving process. These tests load each vocabulary both ways and require the same ids, text,
pieces, streamed text and special-token facts, on a text set with what tokenizers get wrong:
non-Latin scripts, emoji whose bytes span several tokens, special tokens written in the text,
leading and repeated spaces, control characters. Vocabularies: every family the factory makes
(byte-level BPE; as a directory and as a GGUF), its SentencePiece-style vocabulary (directory
and GGUF, with byte fallback), its BERT and XLM-R encoders (WordPiece, Unigram; pairs too), and
the real SmolLM2 GGUF. For a GGUF the reference is what the server loaded before: transformers'
converter output as a ``PreTrainedTokenizerFast``, in this process.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from mlxcel_compat.engine.textstream import TextStream, token_bytes
from mlxcel_compat.gguf import tokenizer as gguf_tokenizer
from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.tokenizer.cache import load_directory
from mlxcel_compat.tokenizer.served import ServedTokenizer, from_files
from mlxcel_compat.testing.corpus import generate_corpus
from mlxcel_compat.testing.gguf_tensors import GGUF_FAMILIES
from mlxcel_compat.testing.gguf_writer import write_spm_tokenizer_gguf
from mlxcel_compat.testing.families import FAMILIES, FIM_FAMILIES
from mlxcel_compat.testing.spm_tokenizer import write_spm_tokenizer_dir
from tests.conftest import REPO_ROOT, slow_but, tiny_encoder, tiny_model

TEXTS = [
    "Hello world, the quick brown fox.",
    " leading space",
    "   three leading spaces and  inner  ones ",
    " ",
    "",
    "trailing spaces   ",
    "café naïve façade über ŵ ☃ 𝔘",
    "你好，世界。日本語のテキスト",
    "emoji 🚀🎉👩‍👩‍👧 flags 🇫🇷 skin 👍🏽",
    "mixed😀text😀without spaces",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] hi [/INST] a</s>b<unk>c",
    "<think>reasoning</think> answer <|endoftext|> after",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "line\nnext\n\n\ttab\r\nwindows",
    "def f(x: int) -> str:\n    return 'x' * 3  # comment",
    "numbers 1234567890 3.14159 -42 1e-9",
    "don't won't it's we're they've I'm . , ! ?",
    "\u00a0non-breaking\u200bzero-width\ufeffbom",
    "\x00\x01 control \x7f",
]

# Ids that decode to partial characters on their own: the streaming test feeds them one by one.
STREAM_TEXTS = [t for t in TEXTS if any(ord(c) > 127 for c in t)] + ["plain ascii text"]


def _hf(directory: Path) -> Any:
    return AutoTokenizer.from_pretrained(directory)


def _streamed(tokenizer: Any, ids: list[int], special: bool) -> list[str]:
    stream = TextStream(tokenizer, special=special, eog_token_ids=[])
    return [stream.push(t).text for t in ids] + [stream.finish()]


def _check_same(ours: ServedTokenizer, theirs: Any, texts: list[str] = TEXTS) -> None:
    """Every fact the server reads from a tokenizer, ours against transformers'."""
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    ids = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    assert ours.special_tokens_map == {k: str(v) for k, v in theirs.special_tokens_map.items()}
    assert ({i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()}
            == {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()})
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.chat_template == theirs.chat_template
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert [token_bytes(ours, i) for i in ids] == [token_bytes(theirs, i) for i in ids]
    for text in texts:
        for special in (True, False):
            expected = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        encoded = theirs.encode(text)
        for skip in (False, True):
            assert ours.decode(encoded, skip_special_tokens=skip) == theirs.decode(encoded, skip_special_tokens=skip), text
    for text in STREAM_TEXTS:
        encoded = theirs.encode(text, add_special_tokens=False)
        for special in (False, True):
            assert _streamed(ours, encoded, special) == _streamed(theirs, encoded, special), text


def _gguf_reference(path: Path) -> Any:
    """What the server loaded before: the converter's tokenizer, saved and loaded by transformers."""
    file = open_gguf(path)
    return gguf_tokenizer.hf_tokenizer(file)


# Byte-level BPE (llama), Qwen-style pre-tokenization with thinking tokens (qwen3), Gemma's
# SentencePiece-shaped vocabulary and the FIM tokens by default; the other families with --slow.
@pytest.mark.parametrize("family", slow_but(FAMILIES + FIM_FAMILIES, ["llama", "qwen3", "gemma3_text", "qwen2_coder"]))
def test_factory_directory_matches_transformers(family: str) -> None:
    directory = tiny_model(family)
    ours = load_directory(directory)
    assert isinstance(ours, ServedTokenizer)
    _check_same(ours, _hf(directory))


@pytest.mark.parametrize("family", slow_but(GGUF_FAMILIES, ["llama", "gemma3_text"]))
def test_factory_gguf_matches_the_converted_tokenizer(family: str, tmp_path: Path) -> None:
    path = tiny_model(f"{family}:f32")
    ours, specials = gguf_tokenizer.load_tokenizer(open_gguf(path), cache_dir=tmp_path)
    _check_same(ours, _gguf_reference(path))
    assert ours.eos_token_ids == set(specials.eog) | {ours.eos_token_id}


def test_sentencepiece_directory_and_gguf_match_transformers(tmp_path: Path) -> None:
    directory = write_spm_tokenizer_dir(tmp_path / "hf")
    paragraphs = generate_corpus().split("\n\n")[:40]
    _check_same(load_directory(directory), _hf(directory), TEXTS + paragraphs)
    path = write_spm_tokenizer_gguf(tmp_path / "spm.gguf", directory)
    ours, _ = gguf_tokenizer.load_tokenizer(open_gguf(path), cache_dir=tmp_path / "cache")
    _check_same(ours, _gguf_reference(path), TEXTS + paragraphs)


@pytest.mark.parametrize("kind", slow_but(["bert", "xlm-roberta", "bert-reranker", "xlm-roberta-reranker"],
                                           ["bert", "xlm-roberta-reranker"]))  # WordPiece, and SentencePiece pairs
def test_encoder_vocabularies_and_pairs_match_transformers(kind: str, tmp_path: Path) -> None:
    directory = tiny_encoder(kind)
    ours, theirs = load_directory(directory), _hf(directory)
    _check_same(ours, theirs)
    for first, second in [("what is a fox?", "A fox is an animal."), ("", "x"), ("naïve 🚀", "  spaced  ")]:
        expected = theirs(first, second)
        got = ours(first, second)
        assert got["input_ids"] == expected["input_ids"]
        assert got.get("token_type_ids") == expected.get("token_type_ids")
    gguf, _ = gguf_tokenizer.load_tokenizer(open_gguf(tiny_encoder(kind, gguf=True)), cache_dir=tmp_path)
    _check_same(gguf, _gguf_reference(tiny_encoder(kind, gguf=True)))


@pytest.mark.real_model
def test_real_smollm2_gguf_matches_the_converted_tokenizer(smollm2_gguf: Path, tmp_path: Path) -> None:
    ours, _ = gguf_tokenizer.load_tokenizer(open_gguf(smollm2_gguf), cache_dir=tmp_path)
    reference = _gguf_reference(smollm2_gguf)
    _check_same(ours, reference, TEXTS + [generate_corpus()[:4000]])


def test_clean_up_spaces_applies_to_wordpiece_not_bpe(tmp_path: Path) -> None:
    """transformers' ``clean_up_tokenization_spaces`` rewrites " ." and " 's" after decoding,
    except for BPE models (it would corrupt their text); both sides must agree either way."""
    import json
    import shutil

    for source in (tiny_encoder("bert"), tiny_model("llama")):
        directory = tmp_path / source.name
        shutil.copytree(source, directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["clean_up_tokenization_spaces"] = True
        config_path.write_text(json.dumps(config), encoding="utf-8")
        ours, theirs = load_directory(directory), _hf(directory)
        ids = theirs.encode("it 's a test . really ?", add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)


def test_a_directory_without_tokenizer_json_is_built_by_transformers(tmp_path: Path) -> None:
    """Slow-tokenizer files (here GPT-2's vocab.json and merges.txt) are converted by
    transformers in the child process too; the serving process reads its tokenizer.json."""
    import json

    source = from_files(tiny_model("llama"))
    directory = tmp_path / "slow"
    directory.mkdir()
    source.backend_tokenizer.model.save(str(directory))  # vocab.json + merges.txt
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}), encoding="utf-8")
    ours = load_directory(directory, cache_dir=tmp_path / "cache")
    assert isinstance(ours, ServedTokenizer)
    _check_same(ours, _hf(directory))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_reading_tokenizer_json_directly_is_exact_where_transformers_takes_it_as_it_is(family: str) -> None:
    """The fallback when transformers cannot run: exact for PreTrainedTokenizerFast directories."""
    directory = tiny_model(family)
    _check_same(from_files(directory), _hf(directory))


def test_without_transformers_the_directory_is_read_directly(tmp_path: Path, monkeypatch, caplog) -> None:
    import logging

    from mlxcel_compat.tokenizer import cache as tokenizer_cache

    def fail(kind: str, source: Path, out: Path) -> None:
        raise RuntimeError("building the tokenizer with transformers failed (exit 1): No module named 'transformers'")

    monkeypatch.setattr(tokenizer_cache, "convert_in_child", fail)
    with caplog.at_level(logging.WARNING, logger="mlxcel_compat.tokenizer.cache"):
        ours = load_directory(tiny_model("llama"), cache_dir=tmp_path)
    assert "reading" in caplog.text and "tokenizer.json as it is" in caplog.text
    assert ours.encode("Hello world") == _hf(tiny_model("llama")).encode("Hello world")


def test_loading_a_gguf_and_a_directory_imports_no_transformers(tmp_path: Path) -> None:
    """The serving path (model loader, chat template, tokenization) in a fresh process: neither
    transformers nor torch is imported, also when the GGUF's tokenizer is not cached yet."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from mlxcel_compat.gguf import tokenizer as gguf_tokenizer
        from mlxcel_compat.gguf.reader import open_gguf
        from mlxcel_compat.model.loader import load_model
        from mlxcel_compat.chat.template import ChatTemplate
        gguf_tokenizer.default_cache_dir = lambda: Path({str(tmp_path / 'cache')!r})  # a cold cache
        for model in ({str(tiny_model('llama:q4_0'))!r}, {str(tiny_model('qwen3'))!r}):
            loaded = load_model(model, [])
            ChatTemplate.from_tokenizer(loaded.tokenizer)
            assert loaded.tokenizer.encode("hi") and loaded.tokenizer.decode([1, 2]) is not None
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert any((tmp_path / "cache").iterdir())  # the conversion ran (in its child) and was cached


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is how a transformers import shows")
@pytest.mark.parametrize("model", ["llama:q4_0", "qwen2"])
def test_a_real_server_maps_no_torch(model: str, server_factory, tmp_path: Path) -> None:
    """``python -m mlxcel_compat -m MODEL``, started with a cold tokenizer cache (the conversion
    runs in its child) and serving: importing transformers imports torch where it is installed,
    so no torch library may be mapped into the server process."""
    import httpx

    from mlxcel_compat.runtime.native import blas_shim

    # A cold cache of tokenizers, but the run's compiled native library (the same XDG directory
    # holds both; compiling it again cost 1-2 minutes a server on this 2-core machine).
    native = blas_shim.cache_dir()
    native.mkdir(parents=True, exist_ok=True)
    (tmp_path / "mlxcel_compat").mkdir()
    (tmp_path / "mlxcel_compat" / "native").symlink_to(native, target_is_directory=True)
    server = server_factory(["-m", str(tiny_model(model)), "-c", "512"], env={"XDG_CACHE_HOME": str(tmp_path)})
    reply = httpx.post(f"{server.base_url}/tokenize", json={"content": "Hello world"}, timeout=30)
    assert reply.status_code == 200 and reply.json()["tokens"] == _hf(_reference_dir(model)).encode("Hello world", add_special_tokens=False)
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libmlx" in maps  # the right process, with its libraries mapped
    assert "torch" not in maps, [line for line in maps.splitlines() if "torch" in line][:3]
    assert "in a child process" in server.log()  # the cold cache was filled by the child


def _reference_dir(model: str) -> Path:
    """The directory whose tokenizer a factory model (directory, or ``family:type`` GGUF) has."""
    return tiny_model(model.split(":")[0])


def test_truncation_and_padding_in_tokenizer_json_do_not_apply(tmp_path: Path) -> None:
    """A tokenizer.json saved with truncation and padding on (common for encoders) encodes in
    full and unpadded, as transformers' ``encode`` does (it switches both off per call)."""
    import json
    import shutil

    directory = tmp_path / "padded"
    shutil.copytree(tiny_model("llama"), directory)
    spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (directory / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    text = "a sentence that is longer than four tokens, surely"
    for ours in (load_directory(directory, cache_dir=tmp_path / "cache"), from_files(directory)):
        assert ours.encode(text) == _hf(directory).encode(text)
        assert 4 < len(ours.encode(text)) < 64
