"""A request's sampling fields parsed as llama.cpp parses them: the ``samplers`` list or string
(canonical names, aliases, one-character codes) and the three ``logit_bias`` formats.

The names here are llama.cpp's; ``samplers.py`` holds the stage registered under each.
"""

from __future__ import annotations

import re
from typing import Any, Callable

CANONICAL_SAMPLERS: tuple[str, ...] = (
    "dry",
    "top_k",
    "top_p",
    "top_n_sigma",
    "typ_p",
    "min_p",
    "temperature",
    "xtc",
    "infill",
    "penalties",
    "adaptive_p",
)

# llama.cpp common_sampler_type_to_chr
SAMPLER_CHARS: dict[str, str] = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "t": "temperature",
    "x": "xtc",
    "i": "infill",
    "e": "penalties",
    "a": "adaptive_p",
}


def _build_sampler_aliases() -> dict[str, str]:
    """Canonical names plus the kebab-case, no-dash and misc aliases llama.cpp accepts."""
    names = {name: name for name in CANONICAL_SAMPLERS}
    for name in CANONICAL_SAMPLERS:
        if "_" in name:
            names.setdefault(name.replace("_", "-"), name)
            names.setdefault(name.replace("_", ""), name)
    # "typical"/"typical-p" come from older llama.cpp builds; harmless to keep.
    extra = {
        "nucleus": "top_p",
        "temp": "temperature",
        "typ": "typ_p",
        "typical": "typ_p",
        "typical-p": "typ_p",
    }
    for alias, name in extra.items():
        names.setdefault(alias, name)
    return names


SAMPLER_ALIASES: dict[str, str] = _build_sampler_aliases()


def parse_samplers(value: list[str] | str, *, strict: bool = True) -> list[str]:
    """Parse the ``samplers`` request field into canonical sampler names.

    A list holds names (case-insensitive, aliases allowed); a string holds
    llama.cpp's one-character codes (e.g. ``"edskypmxt"``). llama.cpp only logs
    a warning for unknown entries and drops them; ``strict=False`` does the same,
    the default raises ``ValueError`` so a typo does not go unnoticed.
    """
    result: list[str] = []
    if isinstance(value, str):
        for ch in value:
            name = SAMPLER_CHARS.get(ch)
            if name is None:
                if strict:
                    raise ValueError(
                        f"unknown sampler character {ch!r}; valid characters are "
                        f"{''.join(SAMPLER_CHARS)!r}"
                    )
                continue
            result.append(name)
        return result
    if not isinstance(value, (list, tuple)):
        raise ValueError("samplers must be an array of names or a string of sampler characters")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"sampler names must be strings, got {item!r}")
        name = SAMPLER_ALIASES.get(item.lower())
        if name is None:
            if strict:
                raise ValueError(
                    f"unknown sampler name {item!r}; valid names are "
                    f"{', '.join(CANONICAL_SAMPLERS)}"
                )
            continue
        result.append(name)
    return result


# strtol(key, &end, 10) with *end == 0: optional whitespace and sign, then digits.
# An empty key also parses (as 0) in llama.cpp, so it is kept as a token id too.
_C_LONG_RE = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def _parse_bias_value(value: Any) -> float | None:
    """A number is a bias, ``false`` bans the token, anything else is skipped."""
    if isinstance(value, bool):
        return float("-inf") if value is False else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def parse_logit_bias(
    value: Any,
    vocab_size: int,
    tokenize: Callable[[str], list[int]],
) -> dict[int, float]:
    """Parse the three llama.cpp ``logit_bias`` formats into ``{token_id: bias}``.

    ``tokenize`` must tokenize without special tokens (no BOS, no special-token
    parsing), as llama.cpp does for string keys. llama.cpp keeps a list of
    (token, bias) entries and applies all of them, so a token named twice gets
    the sum of its biases here.
    """
    if value is None:
        return {}
    out: dict[int, float] = {}

    def add(token: int, bias: float) -> None:
        if 0 <= token < vocab_size:
            out[token] = out.get(token, 0.0) + bias

    if isinstance(value, list):
        for entry in value:
            if not isinstance(entry, list) or len(entry) != 2:
                continue
            bias = _parse_bias_value(entry[1])
            if bias is None:
                continue
            key = entry[0]
            if isinstance(key, int) and not isinstance(key, bool):
                add(key, bias)
            elif isinstance(key, str):
                for token in tokenize(key):
                    add(int(token), bias)
    elif isinstance(value, dict):
        for key, raw in value.items():
            bias = _parse_bias_value(raw)
            if bias is None:
                continue
            key = str(key)
            if key == "" or _C_LONG_RE.fullmatch(key):
                add(int(key) if key.strip() else 0, bias)
            else:
                for token in tokenize(key):
                    add(int(token), bias)
    else:
        raise ValueError("logit_bias must be an array of [token, bias] pairs or an object")
    return out
