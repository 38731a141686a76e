"""The tokenizer and chat templates of a GGUF (gguf/tokenizer.py) against HF directories.

- SentencePiece vocabularies (``tokenizer.ggml.model = llama``): a small SentencePiece-style BPE
  built offline with the ``tokenizers`` library (``testing/spm_tokenizer.py``), written as an HF
  directory in the legacy Llama 2 layout and as a GGUF the way llama.cpp's converter writes one
  (scores, token types, byte tokens). Token ids, text, streaming detokenization, special tokens
  and the chat template must be the directory's, including around special tokens and leading
  spaces, where llama.cpp's space prefix differs from transformers' default.
- The converted-tokenizer cache: reused without converting (no child process), keyed by the
  header, rebuilt when damaged, pruned, and optional.
- Named chat templates (``tokenizer.chat_template.NAME``) as llama-server uses them: the
  default for plain requests, ``tool_use`` for requests with tools.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_hf_tokenizer

from mlxcel_compat.chat.render import render_chat
from mlxcel_compat.chat.request import parse_chat_request
from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.engine.textstream import TextStream
from mlxcel_compat.gguf import tokenizer as gguf_tokenizer
from mlxcel_compat.tokenizer import cache as tokenizer_cache
from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.gguf.tokenizer import cache_key, load_tokenizer
from mlxcel_compat.tokenizer.served import ServedTokenizer
from mlxcel_compat.testing.gguf_writer import ensure_gguf, write_gguf, write_spm_tokenizer_gguf
from mlxcel_compat.testing.corpus import generate_corpus
from mlxcel_compat.testing.spm_tokenizer import write_spm_tokenizer_dir
from tests.conftest import MODEL_CACHE, tiny_model

SPM_TEXTS = [
    "Hello world, the quick fox.",
    "  two leading spaces and  inner  ones ",
    " ",
    "",
    "café 你好 🚀 ŵ ☃ 𝔘 \u00a0non-breaking",  # characters outside the pieces: byte fallback
    "<s>[INST] hi [/INST]",  # text right after a special token gets the space prefix too
    "a</s>b<unk>c",
    "line\nnext\n\n\ttab\r\n",
    "def f(x: int) -> str:\n    return 'x' * 3",
]


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spm")
    directory = write_spm_tokenizer_dir(root / "hf")
    return directory, write_spm_tokenizer_gguf(root / "spm.gguf", directory)


def _stream(tokenizer, ids: list[int]) -> list[str]:
    """The text the server streams for these tokens, one piece per token (engine/textstream.py)."""
    stream = TextStream(tokenizer, eog_token_ids=[])
    return [stream.push(token).text for token in ids] + [stream.finish()]


def test_sentencepiece_gguf_tokenizes_like_the_directory(spm: tuple[Path, Path], tmp_path: Path) -> None:
    directory, path = spm
    file = open_gguf(path)
    assert file.metadata["tokenizer.ggml.model"] == "llama"
    ours, specials = load_tokenizer(file, cache_dir=tmp_path)
    theirs = load_hf_tokenizer(directory)
    assert isinstance(ours, ServedTokenizer)  # no transformers object in the serving process
    assert specials.add_bos and specials.bos == 1 and specials.eos == 2 and specials.eog == [2]
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")

    paragraphs = generate_corpus().split("\n\n")[:150]
    for text in SPM_TEXTS + paragraphs:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special), text
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
        assert _stream(ours, ids) == _stream(theirs, ids), text
    fallback = ours.encode("☃", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(fallback) == ["\u2581", "<0xE2>", "<0x98>", "<0x83>"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = ChatTemplate.from_tokenizer(ours).render(messages, add_generation_prompt=True)
    assert rendered == ChatTemplate.from_tokenizer(theirs).render(messages, add_generation_prompt=True)
    # The template writes "<s>"; the tokenizer adds it itself, so the text leaves it out (llama-server).
    assert rendered.startswith("<<SYS>>\nBe brief.")
    assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(rendered, add_special_tokens=False)


def test_sentencepiece_without_space_prefix(spm: tuple[Path, Path], tmp_path: Path) -> None:
    """``tokenizer.ggml.add_space_prefix = false``: no "▁" is prepended (llama.cpp's rule)."""
    directory, _ = spm
    plain = tmp_path / "hf-no-prefix"
    shutil.copytree(directory, plain)
    spec = json.loads((plain / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    spec["decoder"]["decoders"] = spec["decoder"]["decoders"][:-1]  # no Strip of the prefix
    (plain / "tokenizer.json").write_text(json.dumps(spec))
    path = write_spm_tokenizer_gguf(tmp_path / "no-prefix.gguf", directory, add_space_prefix=False)
    ours, _ = load_tokenizer(open_gguf(path), cache_dir=tmp_path / "cache")
    theirs = load_hf_tokenizer(plain)
    for text in SPM_TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text)), text
    assert not ours.convert_ids_to_tokens(ours.encode("hello", add_special_tokens=False))[0].startswith("\u2581")


# ------------------------------------------------------------------------------ the conversion cache


def test_converted_tokenizer_is_cached_and_reused_without_converting(tmp_path: Path, monkeypatch, caplog) -> None:
    path = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    file = open_gguf(path)
    with caplog.at_level("INFO", logger="mlxcel_compat.gguf.tokenizer"):
        first, _ = load_tokenizer(file, cache_dir=tmp_path)
    # The first start says what it is doing while it converts (seconds on a large vocabulary).
    assert any("converting the GGUF's tokenizer" in r.getMessage() for r in caplog.records)
    entry = tmp_path / cache_key(file)
    assert (entry / "tokenizer.json").is_file() and [p.name for p in tmp_path.iterdir()] == [entry.name]

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds this tokenizer")

    monkeypatch.setattr(tokenizer_cache, "convert_in_child", no_conversion)
    second, specials = load_tokenizer(file, cache_dir=tmp_path)
    text = "<|im_start|>user\nhello café 你好<|im_end|>"
    assert second.encode(text) == first.encode(text) and second.eos_token_ids == first.eos_token_ids
    assert second.chat_template == first.chat_template and specials.eog == sorted(first.eos_token_ids)

    # Another quantization of the same model holds the same vocabulary: the same entry.
    same_vocabulary = open_gguf(ensure_gguf("qwen3", "tiny", "f32", cache_dir=MODEL_CACHE))
    assert same_vocabulary.header_bytes != file.header_bytes or same_vocabulary.file_type != file.file_type
    assert load_tokenizer(same_vocabulary, cache_dir=tmp_path)[0].encode(text) == first.encode(text)

    # Another vocabulary (another family's template) is another entry, and converting it is needed.
    other = open_gguf(ensure_gguf("llama", "tiny", "f32", cache_dir=MODEL_CACHE))
    assert cache_key(other) != cache_key(file)
    with pytest.raises(AssertionError, match="converted again"):
        load_tokenizer(other, cache_dir=tmp_path)


def test_damaged_cache_entry_is_rebuilt(tmp_path: Path, caplog) -> None:
    file = open_gguf(ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE))
    good, _ = load_tokenizer(file, cache_dir=tmp_path)
    (tmp_path / cache_key(file) / "tokenizer.json").write_text("{ not json")
    again, _ = load_tokenizer(file, cache_dir=tmp_path)
    assert "does not load" in caplog.text and "converting again" in caplog.text
    assert again.encode("hello world") == good.encode("hello world")
    json.loads((tmp_path / cache_key(file) / "tokenizer.json").read_text())  # valid again


def test_cache_is_pruned_and_optional(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer_cache, "MAX_CACHED", 1)
    files = [open_gguf(ensure_gguf(f, "tiny", "f32", cache_dir=MODEL_CACHE)) for f in ("qwen3", "llama")]
    for file in files:
        load_tokenizer(file, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [cache_key(files[1])]  # the older entry went

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    tokenizer, _ = load_tokenizer(files[0], cache_dir=blocked)  # cannot cache: converts each time
    assert tokenizer.encode("hi") and blocked.read_text() == "not a directory"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_tokenizer.default_cache_dir() == tmp_path / "xdg" / "mlxcel_compat" / "gguf-tokenizers"


# ------------------------------------------------------------------------------ named chat templates

TOOL_USE = (
    "{{- '<|im_start|>tools\\n' }}{%- for tool in tools %}{{- tool.function.name + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
RAG = "{%- for message in messages %}{{- 'RAG ' + message.content + '\\n' }}{%- endfor %}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def named_template_model(tmp_path: Path) -> tuple[Path, Path]:
    """The tiny llama as a directory whose tokenizer_config.json lists named templates, and its GGUF."""
    directory = tmp_path / "named"
    shutil.copytree(tiny_model("llama"), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    default = config["chat_template"]
    config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": TOOL_USE},
                               {"name": "rag", "template": RAG}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path,) = write_gguf("llama", "tiny", tmp_path / "named.gguf", "f32", model_dir=directory)
    return directory, path


def test_named_templates_are_used_as_llama_server_uses_them(tmp_path: Path) -> None:
    directory, path = named_template_model(tmp_path)
    file = open_gguf(path)
    assert file.metadata["tokenizer.chat_template.tool_use"] == TOOL_USE
    assert file.metadata["tokenizer.chat_template.rag"] == RAG
    ours, _ = load_tokenizer(file, cache_dir=tmp_path / "cache")
    theirs = load_hf_tokenizer(directory)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for tokenizer in (ours, theirs):
        template = ChatTemplate.from_tokenizer(tokenizer)
        assert template.name == "default" and template.tool_use_source == TOOL_USE
        plain = render_chat(template, parse_chat_request({"messages": messages}))
        with_tools = render_chat(template, parse_chat_request({"messages": messages, "tools": TOOLS}))
        refused = render_chat(template, parse_chat_request({"messages": messages, "tools": TOOLS, "tool_choice": "none"}))
        assert "<|im_start|>tools" not in plain
        assert refused == with_tools  # tool_choice "none" changes what is generated, not the prompt
        assert with_tools == "<|im_start|>tools\nget_weather\n<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        rag = ChatTemplate.from_tokenizer(tokenizer, override="rag")
        assert rag.render(messages) == "RAG Weather in Paris?\n" and rag.tool_use_source is None
    assert ChatTemplate.from_tokenizer(ours).source == ChatTemplate.from_tokenizer(theirs).source
