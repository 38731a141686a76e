"""Two argument encodings other than JSON, as their templates render them.

- Python keyword arguments, ``(city='Paris', days=3)``: LFM2 and Llama 3.1's built-in tools;
- Gemma 4's object, ``{city:<|"|>Paris<|"|>,days:3}``: bare keys, strings between ``<|"|>``.

The analysis (``chat/syntax_learn.py``) recognises them by decoding a rendered call with these
functions; the reply parser (``chat/call_reader.py``) decodes a generated call with them.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import regex

__all__ = ["bracket_end", "gemma_arguments", "python_arguments"]


def bracket_end(buf: str, start: int, open_: str, close: str) -> int | None:
    """The end of the bracketed text at ``start`` (quotes and Gemma's ``<|"|>`` respected)."""
    depth, i, n = 0, start, len(buf)
    quote = None
    while i < n:
        ch = buf[i]
        if quote is not None:
            if quote == '<|"|>':
                if buf.startswith(quote, i):
                    quote, i = None, i + len('<|"|>')
                    continue
            elif ch == "\\":
                i += 2
                continue
            elif ch == quote:
                quote = None
            i += 1
            continue
        if buf.startswith('<|"|>', i):
            quote, i = '<|"|>', i + len('<|"|>')
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1 if ch == close else None
        i += 1
    return None


def python_arguments(text: str) -> dict[str, Any] | None:
    """``(city='Paris', days=3)`` as a dict (Python literals only)."""
    try:
        node = ast.parse("f" + text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError):
            return None
    return arguments


_GEMMA_STRING = regex.compile(r'<\|"\|>(.*?)<\|"\|>', regex.DOTALL)
_GEMMA_KEY = regex.compile(r'([{,]\s*)([A-Za-z_][\w\-.]*)(\s*:)')


def gemma_arguments(text: str) -> dict[str, Any] | None:
    """Gemma 4's ``{city:<|"|>Paris<|"|>,days:3}`` as a dict."""
    strings: list[str] = []

    def stash(m: regex.Match[str]) -> str:
        strings.append(m.group(1))
        return f"\x00{len(strings) - 1}\x00"

    body = _GEMMA_STRING.sub(stash, text)
    body = _GEMMA_KEY.sub(lambda m: m.group(1) + json.dumps(m.group(2)) + m.group(3), body)
    body = regex.sub(r"\x00(\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))], ensure_ascii=False), body)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
