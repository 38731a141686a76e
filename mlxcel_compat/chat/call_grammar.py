"""Lark rules for tool calls written in a template's own syntax (``chat/syntax.py``).

A learned :class:`ToolSyntax` says how a template renders a call: literal markers and the fields
between them. The rules here write exactly that, so a forced call is the text the template would
render for it, and a call sent back as history re-renders to the tokens that were generated:

- literal parts (:class:`Lit`, the section's start, end and separator) are the template's text,
  whitespace included, through ``spell`` (special tokens as llguidance token references,
  ``<[id]>``: they are reachable no other way); the marker that opens a reply's calls is written
  as the tokens the tokenizer makes of it (``mark``), so a generated call starts with the same
  tokens as its re-rendering. Only that one: llguidance reads a token reference and text that
  starts with the same token as two exclusive paths, so a marker where the grammar branches
  (an optional argument or the call's end) must stay text;
- the name is one of the allowed functions, each with its own arguments rule;
- JSON (arguments, a whole-call object, JSON argument values) has the separators the template's
  ``tojson`` writes (:class:`JsonStyle`: ``", "`` and ``": "`` for most) and no other whitespace;
  a template that indents its JSON gets llama.cpp's bounded whitespace instead; an object that
  lists its properties takes no others unless it says so, as in llama.cpp (:func:`closed_objects`);
- tagged arguments (``<parameter=KEY>VALUE</parameter>``) follow the schema's property order,
  required ones always, optional ones maybe; a string value is any text up to the value's closing
  marker (the closing marker ends it, as in the parser); where the template nests objects and
  lists in elements (MiniMax M3), their listed properties and items are written that way;
- Python keyword arguments (LFM2) and Gemma 4's argument objects in their own notations.

Nothing here compiles or imports llguidance: :class:`RuleWriter` only collects the rule texts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxcel_compat.chat.syntax import (
    CallId,
    CallIndex,
    GemmaArgs,
    JsonArgs,
    JsonCall,
    KeySuffix,
    Lit,
    Name,
    Part,
    PythonArgs,
    TaggedArgs,
    ToolSyntax,
)
from mlxcel_compat.engine.grammar import JSON_WHITESPACE, lark_string

__all__ = ["JsonStyle", "RuleWriter", "call_rule", "lstrip_call"]

Spell = Callable[[str], str]

# A call id the model writes (Mistral's [CALL_ID], Solar's <|tool_call:begin|>): 9 letters or
# digits, the one shape every template takes back (Mistral's refuse any other).
CALL_ID = r"/[a-zA-Z0-9]{9}/"
CALL_INDEX = r"/[0-9]{1,3}/"
# A Python string literal as repr() writes it (LFM2's ``city='Paris'``).
PY_STRING = r"""/'(?:[^'\\\n]|\\.)*'/"""
GEMMA_QUOTE = '<|"|>'
NUMBER = r"/-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?/"


@dataclass(frozen=True)
class JsonStyle:
    """How a template writes JSON (``tojson``): its separators, or indentation (``indented``)."""

    item_separator: str = ", "
    key_separator: str = ": "
    indented: bool = False

    def options(self) -> dict[str, Any]:
        """llguidance's ``x-guidance`` options for this style."""
        if self.indented:
            return {"whitespace_pattern": JSON_WHITESPACE}
        return {"item_separator": self.item_separator, "key_separator": self.key_separator, "whitespace_flexible": False}


@dataclass
class RuleWriter:
    """Collects named Lark rules; ``spell`` writes a literal (special tokens as ``<[id]>``)."""

    spell: Spell = lark_string
    mark: Spell = lark_string  # writes a marker (as the tokenizer's tokens, see GrammarCompiler.lark_marker)
    style: JsonStyle = field(default_factory=JsonStyle)
    before_call: str = ""  # whitespace the template writes before a call (chat/call_layout.py)
    after_name: str = ""  # and between a name and its tagged arguments
    python_values: bool = False  # tagged values other than strings and numbers written as Python literals
    index_key: str = ""  # a JSON call's first key, holding the call's position as a string
    python_bools: bool = False  # tagged booleans written as True/False
    element_marker: str | None = None  # tagged objects and lists written as nested elements after this marker
    rules: list[str] = field(default_factory=list)
    _count: int = 0
    named: dict[str, str] = field(default_factory=dict)  # shared rules: their key -> name

    def add(self, body: str, prefix: str = "r", attributes: str = "") -> str:
        """A new rule ``body``; its name."""
        self._count += 1
        name = f"{prefix}_{self._count}"
        self.rules.append(f"{name}{attributes}: {body}")
        return name

    def lit(self, text: str) -> str:
        """``text`` as a Lark expression (nothing when empty)."""
        return self.spell(text) if text else ""

    def marker(self, text: str) -> str:
        """A marker of the syntax as a Lark expression (nothing when empty)."""
        return self.mark(text) if text else ""

    def json(self, schema: Any) -> str:
        """A rule for a JSON value valid against ``schema``, in the template's JSON style."""
        if schema is True or schema is None or schema == {}:
            schema = {}
        if not isinstance(schema, dict):
            schema = {}
        options = {**self.style.options(), **(schema.get("x-guidance") or {})}
        text = json.dumps({**closed_objects(schema), "x-guidance": options}, ensure_ascii=False, sort_keys=False)
        if text not in self.named:
            self.named[text] = self.add("%json " + text, "json")
        return self.named[text]

    def text_until(self, closing: str, schema: Any = None) -> str:
        """Free text (a string value) that ends at ``closing``, the closing included; the length
        bounds of a string ``schema`` apply (characters, as JSON Schema counts them).

        A lazy lexeme ends at the first ``closing``, as the parser reads it; a closing that holds
        a special token ends the text where the model writes that token.
        """
        bounds = schema if isinstance(schema, dict) else {}
        low, high = bounds.get("minLength"), bounds.get("maxLength")
        low = low if isinstance(low, int) and not isinstance(low, bool) and low >= 0 else 0
        high = high if isinstance(high, int) and not isinstance(high, bool) and high >= low else None
        text = f"/(?s:.{{{low},{high}}})/" if high is not None else f"/(?s:.{{{low},}})/" if low else "/(?s:.*)/"
        spelled = self.lit(closing)
        if "<[" in spelled or not closing:
            return f"{text} {spelled}".strip()
        return self.add(f"{text} {lark_string(closing)}", "text", "[lazy]")

    def lines(self) -> list[str]:
        return list(self.rules)


def closed_objects(schema: Any) -> Any:
    """``schema`` with llama.cpp's reading of objects: one that lists ``properties`` and says
    nothing of ``additionalProperties`` takes no others (``common/json-schema.cpp``; JSON Schema
    would take any). A tool with ``"properties": {}`` is called with ``{}``, not with whatever keys
    a model makes up until ``max_tokens`` cuts the call."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples", "x-guidance") else closed_objects(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: closed_objects(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def seq(*items: str) -> str:
    """Lark elements in sequence (empty ones dropped); ``""`` when nothing is left."""
    kept = [i for i in items if i]
    return " ".join(kept) if kept else '""'


def call_rule(w: RuleWriter, syntax: ToolSyntax, tool: dict[str, Any], opening: bool = False) -> str:
    """The rule of one call to ``tool`` in ``syntax``: its parts in order. ``opening``: the call's
    first literal opens the reply's calls, and is written as a marker (its tokens)."""
    function = tool["function"]
    name, parameters = function["name"], function.get("parameters") or {"type": "object"}
    items = []
    for i, part in enumerate(syntax.call):
        if i == 0 and opening and isinstance(part, Lit):
            items.append(w.marker(part.text))
            continue
        items.append(_part(w, part, name, parameters))
        if isinstance(part, Name) and isinstance(syntax.call[i + 1:i + 2] and syntax.call[i + 1], TaggedArgs):
            items.append(w.lit(w.after_name))
    return w.add(seq(w.lit(w.before_call), *items), "call")


def lstrip_call(syntax: ToolSyntax) -> ToolSyntax:
    """``syntax`` whose first literal (section start, else the call's first marker) starts at its
    first visible character: where a lazy grammar's trigger hands over to it."""
    if syntax.section_start:
        return dataclasses.replace(syntax, section_start=syntax.section_start.lstrip())
    if syntax.call and isinstance(syntax.call[0], Lit):
        return dataclasses.replace(syntax, call=(Lit(syntax.call[0].text.lstrip()), *syntax.call[1:]))
    return syntax


def _part(w: RuleWriter, part: Part, name: str, parameters: dict[str, Any]) -> str:
    if isinstance(part, Lit):
        return w.lit(part.text)
    if isinstance(part, Name):
        return w.lit(name)
    if isinstance(part, CallId):
        return CALL_ID
    if isinstance(part, CallIndex):
        return CALL_INDEX
    if isinstance(part, JsonArgs):
        return w.json(parameters)
    if isinstance(part, JsonCall):
        return _json_call(w, part, name, parameters)
    if isinstance(part, TaggedArgs):
        return _tagged_args(w, part, parameters)
    if isinstance(part, PythonArgs):
        return _python_args(w, parameters)
    if isinstance(part, GemmaArgs):
        return _gemma_args(w, parameters)
    raise TypeError(f"no grammar for the call part {part!r}")


# ---------------------------------------------------------------------- a call as one JSON object


def _json_call(w: RuleWriter, part: JsonCall, name: str, parameters: dict[str, Any]) -> str:
    """``{"name": NAME, "arguments": {...}}`` with the template's key paths, in its key order
    (an id first, or last when the template writes it after the arguments)."""
    quoted_name = json.dumps(name, ensure_ascii=False)
    args = w.json(parameters)
    if part.name_is_key:
        return seq(w.lit("{" + quoted_name + w.style.key_separator), args, w.lit("}"))
    entries: list[tuple[tuple[str, ...], str]] = []
    if w.index_key:
        entries.append(((w.index_key,), f'"\\"" {CALL_INDEX} "\\""'))
    if part.id_path and not part.id_after_args:
        entries.append((part.id_path, f'"\\"" {CALL_ID} "\\""'))
    entries.append((part.name_path, w.lit(quoted_name)))
    entries.append((part.args_path, args))
    if part.id_path and part.id_after_args:
        entries.append((part.id_path, f'"\\"" {CALL_ID} "\\""'))
    return _object(w, entries)


def _object(w: RuleWriter, entries: list[tuple[tuple[str, ...], str]]) -> str:
    """A JSON object of nested key paths, keys in the order first named."""
    groups: dict[str, list[tuple[tuple[str, ...], str]]] = {}
    for path, value in entries:
        groups.setdefault(path[0], []).append((path[1:], value))
    # An indented template (Command R+ writes its call object by hand, a line per key) gets
    # llama.cpp's bounded whitespace around the object's items, as its JSON arguments do.
    space = f"(/{JSON_WHITESPACE.removeprefix('(?:').removesuffix(')?')}/)?" if w.style.indented else ""
    items = []
    for key, rest in groups.items():
        value = rest[0][1] if rest[0][0] == () else _object(w, rest)
        items.append(seq(space, w.lit(json.dumps(key, ensure_ascii=False) + w.style.key_separator), value))
    separator = w.lit(w.style.item_separator.strip() if w.style.indented else w.style.item_separator)
    body = f" {separator} ".join(items)
    return seq(w.lit("{"), body, space, w.lit("}"))


# ---------------------------------------------------------------------- tagged arguments


def _properties(parameters: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    properties = parameters.get("properties")
    required = parameters.get("required") or []
    return (properties if isinstance(properties, dict) else {}), {r for r in required if isinstance(r, str)}


def _type_of(schema: Any) -> str | None:
    """The JSON type a property's schema names (``string`` for an enum of strings)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "string"
    if kind is None and isinstance(schema.get("const"), str):
        return "string"
    return kind if isinstance(kind, str) else None


def _suffix_for(suffixes: tuple[KeySuffix, ...], kind: str | None) -> KeySuffix:
    """The key marker a value of JSON type ``kind`` is written after (DeepSeek's
    ``string="true"``/``"false"``, Kimi K3's ``type="number"``), else the one shared marker."""
    wanted = "string" if kind == "string" else "json"
    typed = [s for s in suffixes if s.kind == wanted]
    if wanted == "json" and kind:
        names = {kind, "number"} if kind == "integer" else {kind}
        named = [s for s in typed if any(f'"{n}"' in s.text for n in names)]
        typed = named or typed
    return (typed or [s for s in suffixes if s.kind == "schema"] or list(suffixes))[0]


def _tagged_value(w: RuleWriter, schema: Any, suffix: KeySuffix, closing: str) -> str:
    """A value after its key marker, up to its closing marker: raw text for a string, else JSON."""
    kind = _type_of(schema)
    is_string = suffix.kind == "string" or (suffix.kind == "schema" and kind == "string")
    if is_string:
        options = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(options, list) and options and all(isinstance(v, str) for v in options):
            return "(" + " | ".join(seq(w.lit(v), w.lit(closing)) for v in options) + ")"
        return w.text_until(closing, schema)
    if kind in ("object", "array") and w.element_marker is not None:
        elements = _elements(w, schema, kind)
        if elements:
            return seq(elements, w.lit(closing))
    if kind == "boolean" and w.python_bools:
        return seq(_python_value(w, kind), w.lit(closing))
    if w.python_values and kind not in ("integer", "number", "boolean"):
        return seq(_python_value(w, kind), w.lit(closing))
    return seq(w.json(schema if isinstance(schema, dict) else {}), w.lit(closing))


def _elements(w: RuleWriter, schema: dict[str, Any], kind: str) -> str:
    """An object's listed properties, or a list's items, as elements nested in the argument's tags
    (MiniMax M3's ``NS<max>20NS</max>``, ``NS<item>aNS</item>``): at least one, since the template
    renders an empty object or list as nothing, which reads back as an empty string. An object
    without listed properties gives ``""`` (its value is then JSON): a context-free grammar cannot
    write a free key's closing tag."""
    marker = w.element_marker or ""
    if kind == "array":
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        item = seq(w.lit(f"{marker}<item>"), _element_value(w, items, f"{marker}</item>"))
        return f"{w.add(item, 'item')}+"
    properties, required = _properties(schema)
    fields = [(seq(w.lit(f"{marker}<{key}>"), _element_value(w, sub, f"{marker}</{key}>")), key in required)
              for key, sub in properties.items()]
    return join_fields(w, fields, "", allow_none=False) if fields else ""


def _element_value(w: RuleWriter, schema: Any, closing: str) -> str:
    """A nested element's value up to ``closing``, as MiniMax M3's ``to_xml`` writes it: elements
    again, ``true``/``false``, a number, or raw text."""
    kind = _type_of(schema)
    if kind in ("object", "array"):
        elements = _elements(w, schema, kind)
        if elements:
            return seq(elements, w.lit(closing))
    if kind in ("integer", "number", "boolean"):
        return seq(w.json(schema), w.lit(closing))
    options = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(options, list) and options and all(isinstance(v, str) for v in options):
        return "(" + " | ".join(seq(w.lit(v), w.lit(closing)) for v in options) + ")"
    if kind == "object":  # no listed properties: JSON, which the parser reads
        return seq(w.json(schema), w.lit(closing))
    return w.text_until(closing, schema)


def _python_value(w: RuleWriter, kind: str | None) -> str:
    """A Python literal (``{'max': 20}``, ``True``) of JSON type ``kind`` (any when None): how
    Seed-OSS and MiniCPM 5 render object values. Its contents are free: Python literals have no
    schema notation."""
    if "py_value" not in w.named:
        w.rules.append('py_value: PY_STRING | NUMBER | "True" | "False" | "None" | py_dict | py_list')
        w.rules.append('py_dict: "{" (py_value ": " py_value (", " py_value ": " py_value)*)? "}"')
        w.rules.append('py_list: "[" (py_value (", " py_value)*)? "]"')
        w.rules.append(f"PY_STRING: {PY_STRING}")
        w.rules.append(f"NUMBER: {NUMBER}")
        w.named["py_value"] = "py_value"
    return {"object": "py_dict", "array": "py_list", "boolean": '("True" | "False")', "null": '"None"'}.get(kind or "", "py_value")


def _tagged_args(w: RuleWriter, part: TaggedArgs, parameters: dict[str, Any]) -> str:
    properties, required = _properties(parameters)
    fields = []
    for key, schema in properties.items():
        suffix = _suffix_for(part.key_suffixes, _type_of(schema))
        closing = part.value_suffix.replace("{key}", key)
        fields.append((seq(w.lit(part.key_prefix + key + suffix.text), _tagged_value(w, schema, suffix, closing)), key in required))
    if not properties and parameters.get("additionalProperties", True) is not False:
        key = r"/[A-Za-z_][A-Za-z0-9_.-]*/"
        suffix = _suffix_for(part.key_suffixes, "string")
        closing_marker = part.value_suffix.replace("{key}", "")
        one = seq(w.lit(part.key_prefix), key, w.lit(suffix.text), w.text_until(closing_marker))
        return f"({w.add(one, 'arg')})*"
    return join_fields(w, fields, part.separator)


def join_fields(w: RuleWriter, fields: list[tuple[str, bool]], separator: str, allow_none: bool = True) -> str:
    """Fields in order (``(expression, required)``), ``separator`` only between those written:
    one alternative per field that may come first (the optional ones before the first required
    one, and that one); ``allow_none``: no field at all when every one is optional."""
    alternatives = []
    for k, (first, required) in enumerate(fields):
        rest = []
        for expression, needed in fields[k + 1:]:
            piece = seq(w.lit(separator), expression)
            rest.append(piece if needed else f"({piece})?")
        alternatives.append(seq(first, *rest))
        if required:
            break
    else:
        if allow_none:
            alternatives.append('""')  # every field optional: none at all
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


# ---------------------------------------------------------------------- other notations


def _python_args(w: RuleWriter, parameters: dict[str, Any]) -> str:
    """``(key='text', n=3, on=True)``: Python literals, as LFM2's template writes them (``repr`` of
    a string, ``str`` of the rest), except objects and numbers, which it writes as JSON (and
    whose schema then applies)."""
    properties, required = _properties(parameters)
    fields = []
    for key, schema in properties.items():
        kind = _type_of(schema)
        if kind == "string":
            options = schema.get("enum") if isinstance(schema, dict) else None
            value = ("(" + " | ".join(w.lit(repr(v)) for v in options) + ")") if isinstance(options, list) and options else _py_string(schema)
        elif kind in ("object", "integer", "number"):
            value = w.json(schema if isinstance(schema, dict) else {})
        else:
            value = _python_value(w, kind)
        fields.append((seq(w.lit(key + "="), value), key in required))
    return seq(w.lit("("), join_fields(w, fields, ", ") if fields else "", w.lit(")"))


def _py_string(schema: Any) -> str:
    """A Python string literal, at most ``maxLength`` characters (an escape counts as one)."""
    high = schema.get("maxLength") if isinstance(schema, dict) else None
    if not isinstance(high, int) or isinstance(high, bool) or high < 0:
        return PY_STRING
    return r"/'(?:[^'\\\n]|\\.){0," + str(high) + "}'/"


def _gemma_args(w: RuleWriter, parameters: dict[str, Any]) -> str:
    """Gemma 4's object: ``{city:<|"|>Paris<|"|>,days:3}``, keys sorted as its template writes them."""
    properties, required = _properties(parameters)
    value = _gemma_value_rule(w)
    quote = w.lit(GEMMA_QUOTE)
    fields = []
    for key in sorted(properties):
        kind = _type_of(properties[key])
        options = properties[key].get("enum") if isinstance(properties[key], dict) else None
        if kind == "string" and isinstance(options, list) and options and all(isinstance(v, str) for v in options):
            item = "(" + " | ".join(w.lit(GEMMA_QUOTE + v + GEMMA_QUOTE) for v in options) + ")"
        elif kind == "string":
            item = seq(quote, _gemma_text(w, properties[key]))
        elif kind in ("integer", "number", "boolean"):
            item = w.json(properties[key])  # the same text as JSON (no whitespace in Gemma's style)
        else:
            item = value
        fields.append((seq(w.lit(key + ":"), item), key in required))
    return seq(w.lit("{"), join_fields(w, fields, ",") if fields else "", w.lit("}"))


def _gemma_text(w: RuleWriter, schema: Any = None) -> str:
    return w.text_until(GEMMA_QUOTE, schema)


def _gemma_value_rule(w: RuleWriter) -> str:
    """Any value in Gemma 4's notation (nested objects and lists)."""
    if "gemma_value" not in w.named:
        quote = w.lit(GEMMA_QUOTE)
        text = _gemma_text(w)
        w.rules.append(
            "gemma_value: " + " | ".join([
                seq(quote, text), NUMBER, '"true"', '"false"', '"null"',
                '"{" (GEMMA_KEY ":" gemma_value ("," GEMMA_KEY ":" gemma_value)*)? "}"',
                '"[" (gemma_value ("," gemma_value)*)? "]"',
            ]))
        w.rules.append(r"GEMMA_KEY: /[A-Za-z_][A-Za-z0-9_]*/")
        w.named["gemma_value"] = "gemma_value"
    return "gemma_value"
