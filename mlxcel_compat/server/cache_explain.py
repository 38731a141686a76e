"""``cache_explain`` in responses: the engine's record (``cache/explain.py``) with its token
windows detokenized, so a user reads the text on both sides of the first diverging position.

A request asks with ``"cache_explain": true`` in its body (native, OpenAI, Anthropic and
Responses routes) or the header ``X-Cache-Explain: 1``; the object rides at the top level of the
response body, and of the final chunk of a stream (native and OpenAI).
"""

from __future__ import annotations

from typing import Any, Sequence

from starlette.requests import Request

HEADER = "x-cache-explain"


def wanted(request: Request) -> bool:
    """The header asks for an explanation (``1`` or ``true``)."""
    return request.headers.get(HEADER, "").strip().lower() in ("1", "true")


def render(record: dict[str, Any] | None, tokenizer: Any) -> dict[str, Any] | None:
    """The record as the response shows it: each window's tokens as text too."""
    if record is None:
        return None
    out = dict(record)
    for side in ("stored_window", "request_window"):
        window = record.get(side)
        if window is not None:
            out[side] = {part: _text(tokenizer, tokens) for part, tokens in window.items()}
            out[side + "_tokens"] = window
    return out


def of_results(results: Sequence[Any], tokenizer: Any) -> dict[str, Any] | None:
    """The first result's explanation (children of one prompt share the lookup), or None."""
    finish = results[0].finish if results else None
    return render(getattr(finish, "cache_explain", None), tokenizer)


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""
