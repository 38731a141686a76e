"""``/infill``'s pieces tokenized with special-token parsing off (``server/infill.py:
plain_tokenizer``) through the served tokenizer itself: the same ids as a tokenizer with
``encode_special_tokens`` set, and no second tokenizer built unless a text spells a special token
(a copy of Gemma 3's is ~95 MiB)."""

from __future__ import annotations

from tokenizers import Tokenizer

from mlxcel_compat.engine.textstream import derived_values
from mlxcel_compat.server.infill import plain_tokenizer
from mlxcel_compat.tokenizer.cache import load_directory
from tests.conftest import tiny_model


def test_plain_tokens_equal_the_switched_tokenizer_and_the_copy_waits_for_special_text() -> None:
    tokenizer = load_directory(tiny_model("qwen2_coder"))
    hf = tokenizer
    switched = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    switched.encode_special_tokens = True
    specials = [t.content for t in hf.backend_tokenizer.get_added_tokens_decoder().values() if t.special]
    assert "<|im_end|>" in specials
    encode = plain_tokenizer(tokenizer)
    ordinary = ["def add(a, b):\n    return a + b\n", " result", "x = 1  # <not special>", "", "\n\n"]
    for text in ordinary:
        assert encode(text) == switched.encode(text, add_special_tokens=False).ids
    assert "plain-text tokenizer" not in derived_values[hf]  # no copy so far
    spelled = 'print("<|im_end|>")\n<|fim_prefix|>x'
    got = encode(spelled)
    assert got == switched.encode(spelled, add_special_tokens=False).ids
    assert got != hf.backend_tokenizer.encode(spelled, add_special_tokens=False).ids  # the switch mattered
    assert "plain-text tokenizer" in derived_values[hf]
