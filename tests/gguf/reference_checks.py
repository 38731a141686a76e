"""Checks the architecture tests share: a GGUF's tokenizer and chat template against the
Hugging Face directory the factory wrote for the same family."""

from __future__ import annotations

from typing import Any, Sequence

from mlxcel_compat.chat.template import ChatTemplate


def assert_tokenizer_and_template_match(tokenizer: Any, hf_tok: Any, texts: Sequence[str]) -> None:
    """The GGUF's tokenizer encodes ``texts`` as the directory's does, with and without special
    tokens, and its chat template renders a short conversation to the same prompt."""
    for text in texts:
        for special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=special) == hf_tok.encode(text, add_special_tokens=special)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ours, theirs = ChatTemplate.from_tokenizer(tokenizer), ChatTemplate.from_tokenizer(hf_tok)
    assert ours.render(messages, add_generation_prompt=True) == theirs.render(messages, add_generation_prompt=True)
