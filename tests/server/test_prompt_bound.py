"""The characters-per-token bound that lets a prompt be refused before it is tokenized.

Built on real ``tokenizers`` objects (the library Hugging Face fast tokenizers wrap): the bound
exists only where no character can vanish or merge before the model sees the text, and it
really is a bound: no text of the test corpus tokenizes to fewer tokens than it promises.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlxcel_compat.server.errors import ContextExceeded
from mlxcel_compat.server.prompts import PromptBound, max_chars_per_token

CORPUS = ["the quick brown fox jumps over the lazy dog " * 20, "añadir café à la crème, naïve Ærø ", "数据 和 模型 " * 10, "x" * 500]


def trained(model, pre_tokenizer=None, normalizer=None, trainer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS, trainer=trainer or trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_level_bpe_has_a_bound_that_holds() -> None:
    tok = byte_level()
    bound = max_chars_per_token(tok)
    longest = max(len(t) for t in tok.backend_tokenizer.get_vocab())
    assert bound == longest
    for text in CORPUS + ["".join(CORPUS)]:
        assert len(tok.encode(text, add_special_tokens=False)) >= -(-len(text) // bound)


@pytest.mark.parametrize(
    ("normalizer", "factor"),
    [(None, 1), (normalizers.NFD(), 1), (normalizers.NFC(), 4), (normalizers.Sequence([normalizers.Lowercase(), normalizers.NFKC()]), 4),
     (normalizers.Strip(), None), (normalizers.StripAccents(), None), (normalizers.Replace("  ", " "), None), (normalizers.Replace(" ", "_"), 1)],
)
def test_normalizers_that_can_shorten_text_weaken_or_remove_the_bound(normalizer, factor) -> None:
    tok = trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), normalizer)
    bound = max_chars_per_token(tok)
    if factor is None:
        assert bound is None
    else:
        assert bound == factor * max(len(t) for t in tok.backend_tokenizer.get_vocab())


@pytest.mark.parametrize("pre_tokenizer", [pre_tokenizers.Whitespace(), pre_tokenizers.WhitespaceSplit(), pre_tokenizers.BertPreTokenizer()])
def test_pre_tokenizers_that_drop_characters_have_no_bound(pre_tokenizer) -> None:
    assert max_chars_per_token(trained(models.BPE(), pre_tokenizer)) is None


def test_models_that_fuse_unknown_characters_have_no_bound() -> None:
    unigram = trained(models.Unigram(), pre_tokenizers.Metaspace(), trainer=trainers.UnigramTrainer(vocab_size=100, unk_token="<unk>"))
    assert max_chars_per_token(unigram) is None
    fused = trained(models.BPE(unk_token="<unk>", fuse_unk=True), pre_tokenizers.Metaspace(),
                    trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    assert max_chars_per_token(fused) is None
    assert max_chars_per_token(trained(models.BPE(), pre_tokenizers.Metaspace())) is not None


def test_the_check_refuses_only_what_cannot_fit() -> None:
    bound = PromptBound(n_ctx=100, chars_per_token=4)
    bound.check(396)  # at least 99 tokens: may fit
    with pytest.raises(ContextExceeded) as exc:
        bound.check(397)  # at least 100 tokens
    assert exc.value.extra == {"n_prompt_tokens": 100, "n_ctx": 100} and "at least 100 tokens" in exc.value.message
    with pytest.raises(ContextExceeded):
        bound.check(0, 100)  # 100 token ids
    PromptBound(n_ctx=100, chars_per_token=None).check(10**9)  # no proof: never refused here
