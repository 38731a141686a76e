"""The sandboxed Jinja environment every chat template compiles in, and ``TemplateError``.

Chat templates ship with model repositories and are untrusted code, so they run in Jinja's
``SandboxedEnvironment``. The environment offers what transformers' ``apply_chat_template``
offers (``raise_exception``, an HF-flavoured ``tojson``, ``strftime_now``, a no-op
``{% generation %}`` tag, ``loopcontrols``), because templates are written against that runtime,
plus what llama.cpp's own Jinja engine does differently where real templates depend on it
(llama-server renders them that way, and this server must render what it renders):

- ``+`` with a missing or null operand next to a string counts as ``""``;
- lists and dicts may be changed in place (Kimi K2 queues tool-call ids with ``.append`` and
  ``.pop``); everything a template is given is a copy made for that render, so nothing it
  changes outlives the render;
- ``safe`` gives the plain string back: autoescaping is off, and a ``Markup`` would escape what is
  added to it (Functionary v3.1 writes ``"..."|safe + name``);
- ``tojson`` takes the lazy sequences filters return (``map``, ``select``) as lists.

One environment (:data:`ENVIRONMENT`) is shared by every template (``chat/template.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import SandboxedEnvironment

__all__ = ["ENVIRONMENT", "TemplateError"]


class TemplateError(Exception):
    """A chat template failed to compile or render.

    Raised for Jinja syntax and runtime errors, sandbox violations and the template's own
    ``raise_exception(...)``. The routes answer it with HTTP 400 and ``message``.
    """

    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _raise_exception(message: Any) -> NoReturn:
    # Templates call this to refuse a conversation ("roles must alternate ...").
    raise TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``: plain ``json.dumps`` that keeps non-ASCII text and key order.

    Jinja's own filter HTML-escapes ``<``, ``>`` and ``&`` and sorts keys, which would change
    the prompt the model was trained on.
    """
    if separators is not None:
        separators = tuple(separators)
    return json.dumps(
        _listed(value),
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _listed(value: Any) -> Any:
    """``value`` with the lazy sequences in it (generators, ``map`` objects) made lists, at any depth."""
    if isinstance(value, dict):
        return {k: _listed(v) for k, v in value.items()}
    if isinstance(value, list):  # list.__iter__: a list subclass's own iteration is not called
        return [_listed(v) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return [_listed(v) for v in tuple.__iter__(value)]
    if isinstance(value, Iterator):
        return [_listed(v) for v in value]
    return value


def _safe(value: Any) -> str:
    """llama.cpp's ``safe``: the value as a plain string (no ``Markup``, which escapes what it is added to)."""
    return str.__str__(value) if isinstance(value, str) else str(value)


def _is_string(value: Any) -> bool:
    """Jinja's ``string`` test, telling a watched value that it was asked (``template_caps``
    learns from it whether a template takes content as a string or a list)."""
    noted = getattr(type(value), "string_tested", None)
    if callable(noted):
        noted()
    return isinstance(value, str)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """Stands in for the ``dict`` global: builds dicts, exposes nothing of the ``dict`` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names, so no internals can be reached."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as Jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace: {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body unchanged.

    transformers uses the tag to build assistant-token masks for training; serving only needs
    templates that contain it to compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _is_nothing(value: Any) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


class _ChatEnvironment(SandboxedEnvironment):
    """The sandbox, plus llama.cpp's Jinja rule for ``+``: a missing or null operand next to a
    string counts as ``""``.

    Templates written for llama-server rely on it: Firefunction v2 builds its system prompt as
    ``suffix + "\\n" + functions`` and renders with ``functions`` undefined there. Jinja itself
    raises (an undefined operand) or Python does (``str + None``). ``~`` keeps Jinja's meaning.
    """

    intercepted_binops = frozenset({"+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            if isinstance(left, str) and _is_nothing(right):
                return left
            if isinstance(right, str) and _is_nothing(left):
                return right
        return super().call_binop(context, operator, left, right)


def _make_environment() -> SandboxedEnvironment:
    env = _ChatEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols, jinja2.ext.do],
    )
    env.filters["tojson"] = _tojson
    env.filters["safe"] = _safe
    env.tests["string"] = _is_string
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# Shared by every template: templates compile once, in ``ChatTemplate``'s constructor.
ENVIRONMENT = _make_environment()
