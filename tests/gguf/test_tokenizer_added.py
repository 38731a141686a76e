"""Added tokens of a byte-level BPE GGUF are matched by their text, as llama.cpp matches them.

llama.cpp's converter stores a CONTROL or USER_DEFINED token as its text (SmolVLM's ``"\\n\\n"``),
while every ordinary token of a ``gpt2`` vocabulary is spelled in the byte alphabet (``"ĊĊ"``).
llama.cpp finds those tokens in the input by that text before BPE runs (``llama-vocab.cpp``:
``tokenizer_st_partition``). The conversion (``gguf/tokenizer.py``) must do the same: the factory
SmolVLM vocabulary holds ``"\\n\\n"`` as one special token, and the GGUF written from its directory
must tokenize and detokenize exactly as the directory does with Hugging Face's tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_hf_tokenizer

from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.gguf.tokenizer import CONTROL, USER_DEFINED, convert, hf_tokenizer, special_tokens
from mlxcel_compat.testing import vision
from mlxcel_compat.tokenizer.cache import from_files
from mlxcel_compat.testing.gguf_writer import write_bpe_tokenizer_gguf
from tests.conftest import MODEL_CACHE

SENTENCE_END = "<｜end▁of▁sentence｜>"
TEXTS = [
    "\n\n", "\n", "\n\n\n", "\n\n\n\n\n", "a\n\nb", " \n\n ", "\r\n\r\n", "\t\n\n\t",
    "  ", "   ", "x  y", "x   y", "    indented\n\n        more\n",
    "def f(x):\n    return x\n\n\nclass A:\n\tpass\n",
    "<image>\n\n<row_1_col_1>", "<fake_token_around_image><global-img><image>\n\n",
    "<|im_start|>user\nhi\n\nthere<|im_end|>\n<|im_start|>assistant\n",
    "emoji 🚀\n\n🙂👍🏽 café 你好", "", " ", "end<｜end▁of▁sentence｜>\n\nnext",
]


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The factory SmolVLM directory and a GGUF of its vocabulary."""
    directory = vision.ensure_vision_model(MODEL_CACHE, "smolvlm")
    return directory, write_bpe_tokenizer_gguf(tmp_path_factory.mktemp("smolvlm") / "vocab.gguf", directory)


def _same_tokenizer(ours, theirs, n_vocab: int) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special), text
        ids = theirs.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    for token_id in range(n_vocab):  # every id, alone: none lost its vocabulary entry
        assert ours.decode([token_id]) == theirs.decode([token_id]), token_id


def test_whitespace_control_token_is_one_token(smolvlm: tuple[Path, Path], tmp_path: Path) -> None:
    directory, path = smolvlm
    file = open_gguf(path)
    tokens, types = file.metadata["tokenizer.ggml.tokens"], file.metadata["tokenizer.ggml.token_type"]
    newlines = vision.vision_token_id("\n\n", "smolvlm")
    assert (tokens[newlines], types[newlines]) == ("\n\n", CONTROL)  # stored as its text, as the converter does

    convert(file, tmp_path)  # what the child process of load_tokenizer does, here (no second interpreter)
    ours = from_files(tmp_path, special_tokens(file).eog)  # the served tokenizer, read back as the server reads it
    theirs = load_hf_tokenizer(directory)
    assert ours.encode("\n\n", add_special_tokens=False) == [newlines]
    assert ours.encode("a\n\n\nb", add_special_tokens=False) == [ours.encode("a", add_special_tokens=False)[0], newlines,
                                                              *ours.encode("\nb", add_special_tokens=False)]
    _same_tokenizer(ours, theirs, len(tokens))


def test_user_defined_token_spelled_like_an_ordinary_one(smolvlm: tuple[Path, Path], tmp_path: Path) -> None:
    """A USER_DEFINED ``"  "`` whose byte spelling ``"ĠĠ"`` is also an ordinary token: both keep their ids.
    And a CONTROL token outside the byte alphabet (DeepSeek's ``<｜end▁of▁sentence｜>``) is one token."""
    from tokenizers import AddedToken, Tokenizer

    directory, _ = smolvlm
    copy = tmp_path / "hf"
    copy.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(directory / name, copy / name)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    reference.add_tokens([AddedToken("  ", special=False, normalized=False)])
    reference.add_special_tokens([AddedToken(SENTENCE_END, special=True, normalized=False)])
    reference.save(str(copy / "tokenizer.json"))
    spaces, ordinary = reference.token_to_id("  "), reference.token_to_id("ĠĠ")
    sentence_end = reference.token_to_id(SENTENCE_END)
    assert (spaces, sentence_end) == (reference.get_vocab_size() - 2, reference.get_vocab_size() - 1)
    assert ordinary is not None
    config = json.loads((copy / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"][str(spaces)] = {"content": "  ", "lstrip": False, "normalized": False,
                                                   "rstrip": False, "single_word": False, "special": False}
    config["added_tokens_decoder"][str(sentence_end)] = {"content": SENTENCE_END, "lstrip": False, "normalized": False,
                                                         "rstrip": False, "single_word": False, "special": True}
    (copy / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    file = open_gguf(write_bpe_tokenizer_gguf(tmp_path / "vocab.gguf", copy))
    assert [file.metadata["tokenizer.ggml.token_type"][i] for i in (spaces, sentence_end)] == [USER_DEFINED, CONTROL]

    ours = hf_tokenizer(file)  # the conversion itself, in this process
    theirs = load_hf_tokenizer(copy)
    assert ours.encode("  ", add_special_tokens=False) == [spaces]
    assert ours.decode([ordinary]) == "  "
    assert ours.encode(f"a{SENTENCE_END}", add_special_tokens=False) == [*ours.encode("a", add_special_tokens=False), sentence_end]
    _same_tokenizer(ours, theirs, len(file.metadata["tokenizer.ggml.tokens"]))
