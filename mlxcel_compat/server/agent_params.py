"""How a built-in agent tool is called: its JSON parameters, read as llama-server reads them.

A tool (``agent_tools.py``) is called with the ``params`` object of ``POST /tools`` and, when it
streams, a :data:`Chunk` sink. Its parameters follow llama-server's JSON library:

- a missing or mistyped required parameter raises ``ParamError`` (llama-server: its JSON
  library's exception, a 400 with the library's message);
- an optional parameter of the wrong type falls back to its default, as llama-server's
  ``json_value`` does.
"""

from __future__ import annotations

from typing import Any, Callable

Chunk = Callable[[str], bool]  # streaming sink: returns False when the client has gone


class ParamError(ValueError):
    """A required parameter is missing or has the wrong type (llama-server: 400)."""


_JSON_TYPE = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object",
              type(None): "null"}


def type_name(value: Any) -> str:
    """The JSON type of ``value`` as llama-server's JSON library names it in its messages."""
    return _JSON_TYPE.get(type(value), "object")


def required(params: dict[str, Any], key: str, kind: type) -> Any:
    """``params[key]`` of JSON type ``kind``; worded as llama-server's JSON library words it."""
    if key not in params:
        raise ParamError(f"[json.exception.out_of_range.403] key '{key}' not found")
    value = params[key]
    if not _is_kind(value, kind):
        raise ParamError(f"[json.exception.type_error.302] type must be {_JSON_TYPE[kind]}, but is {type_name(value)}")
    return int(value) if kind is int else value


def optional(params: dict[str, Any], key: str, default: Any) -> Any:
    """``params[key]`` when present and of the default's type, else the default."""
    value = params.get(key)
    kind = type(default)
    if value is None or not _is_kind(value, kind):
        return default
    return int(value) if kind is int else value


def _is_kind(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, kind)
