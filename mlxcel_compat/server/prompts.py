"""Turn llama-server's ``prompt`` shapes into token lists.

One prompt is a string, an array of token ids, or a mixed array of ids and strings. Several
prompts are an array with no bare integer at the top level. BOS is added only when the model adds
one and the prompt is a string or starts with a string (llama-server's rule).
"""

from __future__ import annotations

from typing import Any

from mlxcel_compat.server.errors import InvalidRequest


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tokenize_text(tokenizer: Any, text: str, add_special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def tokenize_one(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return tokenize_text(tokenizer, prompt, True)
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            raise InvalidRequest("multimodal_data is not supported by this server (no multimodal projector loaded)")
        text = prompt.get("prompt_string")
        if not isinstance(text, str):
            raise InvalidRequest("prompt_string must be a string")
        return tokenize_text(tokenizer, text, True)
    if isinstance(prompt, list):
        tokens: list[int] = []
        for i, piece in enumerate(prompt):
            if _is_token(piece):
                tokens.append(piece)
            elif isinstance(piece, str):
                tokens.extend(tokenize_text(tokenizer, piece, i == 0))
            else:
                raise InvalidRequest("\"prompt\" must be a string, an array of token ids or a mixed array of strings and token ids")
        if any(t < 0 or t >= vocab_size for t in tokens):
            raise InvalidRequest("Prompt contains invalid tokens")
        return tokens
    raise InvalidRequest("\"prompt\" must be a string, an array of token ids or a mixed array of strings and token ids")


def tokenize_prompts(tokenizer: Any, prompt: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    """Return the token lists and whether the request held several prompts."""
    if prompt is None:
        raise InvalidRequest("\"prompt\" is required")
    if isinstance(prompt, list) and prompt and not any(_is_token(p) for p in prompt):
        if all(isinstance(p, str) for p in prompt) or any(isinstance(p, (list, dict)) for p in prompt):
            return [tokenize_one(tokenizer, p, vocab_size) for p in prompt], len(prompt) > 1
    return [tokenize_one(tokenizer, prompt, vocab_size)], False
