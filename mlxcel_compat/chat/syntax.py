"""The syntax a model family writes its replies in: reasoning, content and tool calls, as plain data.

A :class:`ChatSyntax` is what ``chat/syntax_learn.py`` reads out of a chat template (or what
``chat/syntax_formats.py`` writes by hand for the few templates the analysis cannot read), and what
``chat/reply_parser.py`` walks to take a generated reply apart, whole or piece by piece. Nothing
here parses or renders: a syntax is a description that can be printed, compared and documented.

A tool call is a sequence of parts (:data:`Part`): literal markers and the fields between them
(the function's name, the call's id, the arguments in one of a few encodings). Literal markers are
matched with their surrounding whitespace optional, because templates pad markers with newlines
that models do not always reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

__all__ = [
    "ArgsKind",
    "CallId",
    "CallIndex",
    "ChatSyntax",
    "Dialect",
    "GemmaArgs",
    "JsonArgs",
    "JsonCall",
    "KeySuffix",
    "Lit",
    "Name",
    "Part",
    "PythonArgs",
    "ReasoningSyntax",
    "TaggedArgs",
    "ToolSyntax",
    "core",
]


def core(text: str) -> str:
    """A marker without the whitespace around it: what a model must write for the marker to count."""
    return text.strip()


@dataclass(frozen=True)
class Lit:
    """Literal text of a call (``<tool_call>``, ``[ARGS]``, ``">\\n"``); whitespace around it is optional."""

    text: str


@dataclass(frozen=True)
class Name:
    """The function's name: letters, digits, ``_`` and ``-`` (what OpenAI and Anthropic accept).

    A second ``Name`` in a call is the name written again (Muse Glimmer): it must be the same."""


@dataclass(frozen=True)
class CallId:
    """The call's id, written by the model (Mistral's ``[CALL_ID]``, Solar's ``<|tool_call:begin|>``)."""


@dataclass(frozen=True)
class CallIndex:
    """The call's position in the reply (Kimi K2's ``functions.NAME:0``); the call's id is
    ``id_template`` filled with the name and that position (an id is made up when it is empty)."""

    id_template: str = "{name}:{index}"


@dataclass(frozen=True)
class JsonArgs:
    """The arguments as one JSON object."""


@dataclass(frozen=True)
class JsonCall:
    """The whole call as one JSON object: the name, the arguments and the id at these key paths.

    ``name_is_key``: the object is ``{NAME: ARGUMENTS}`` (Apertus). ``args_as_string``: the
    template writes the arguments as a JSON string holding the object's text (Apriel; the parser
    reads either form). ``id_after_args``: the id comes after the arguments, so the call is
    announced when the object closes (its id is then known).
    """

    name_path: tuple[str, ...] = ("name",)
    args_path: tuple[str, ...] = ("arguments",)
    id_path: tuple[str, ...] | None = None
    name_is_key: bool = False
    args_as_string: bool = False
    id_after_args: bool = False


ArgsKind = Literal["string", "json", "schema"]


@dataclass(frozen=True)
class KeySuffix:
    """What follows an argument's key, and how the value after it is written.

    ``kind`` is ``"string"`` (the value is raw text: a string argument), ``"json"`` (the value is
    JSON) or ``"schema"`` (the same marker for both: the tool's schema decides, else the value is
    JSON when it parses as JSON other than a bare string).
    """

    text: str
    kind: ArgsKind = "schema"


@dataclass(frozen=True)
class TaggedArgs:
    """Arguments written one by one between markers (Qwen3-Coder, GLM, MiniMax, DeepSeek DSML).

    Each argument is ``key_prefix KEY suffix VALUE value_suffix``, arguments are separated by
    ``separator``; ``{key}`` in ``value_suffix`` stands for the argument's key (MiniMax M3 closes a
    value with a tag named after its key).
    """

    key_prefix: str
    key_suffixes: tuple[KeySuffix, ...]
    value_suffix: str
    separator: str = ""


@dataclass(frozen=True)
class PythonArgs:
    """Arguments as Python keyword arguments, ``(city='Paris', days=3)`` (LFM2)."""


@dataclass(frozen=True)
class GemmaArgs:
    """Gemma 4's argument object: bare keys, ``<|"|>``-quoted strings, ``{city:<|"|>Paris<|"|>,days:3}``."""


Part = Union[Lit, Name, CallId, CallIndex, JsonArgs, JsonCall, TaggedArgs, PythonArgs, GemmaArgs]


@dataclass(frozen=True)
class ToolSyntax:
    """Where calls sit in a reply and how one is written.

    A reply's calls form a section: ``section_start``, calls separated by ``separator``,
    ``section_end``. The section end may be missing at the end of a reply (it is often the token
    that stops the generation, as Functionary's ``<|eom_id|>``). ``id_style`` is the shape of ids
    this template accepts back in history when the model wrote none (``"call"``: ``call_`` and 24
    letters or digits; ``"alnum9"``: 9 letters or digits, which Mistral's templates demand).
    """

    call: tuple[Part, ...]
    section_start: str = ""
    section_end: str = ""
    separator: str = ""
    parallel: bool = True
    id_style: Literal["call", "alnum9"] = "call"


@dataclass(frozen=True)
class ReasoningSyntax:
    """A reasoning block: ``start`` REASONING ``end``, at the start of a reply.

    ``opener`` is what the prompt ends with when the template opened the block for the model (the
    reply then starts inside it): often ``start`` itself (``<think>``), sometimes a line of text
    (Apriel's ``Here are my reasoning steps:``). ``start`` may be empty when only the prompt opens
    the block.
    """

    start: str
    end: str
    opener: str = ""


Dialect = Literal["markers", "harmony", "functionary_v3_2"]


@dataclass(frozen=True)
class ChatSyntax:
    """The whole syntax of one template's replies.

    ``tools`` holds the call formats a reply may use, each recognised by its opening marker (most
    templates have one; Llama 3.1 adds ``<|python_tag|>`` calls to its built-in tools).
    ``dialect`` picks the parser: ``"markers"`` (the generic one, driven by the fields here),
    ``"harmony"`` (gpt-oss channels) or ``"functionary_v3_2"`` (``>>>recipient`` messages).
    ``content_start``/``content_end`` wrap the answer text in some families (Command R7B's
    ``<|START_RESPONSE|>``); they are dropped from the content. ``origin`` says how the syntax was
    obtained: ``"learned"`` from the template, or the name of the hand-written format.
    """

    format: str
    reasoning: ReasoningSyntax | None = None
    tools: tuple[ToolSyntax, ...] = ()
    content_start: str = ""
    content_end: str = ""
    dialect: Dialect = "markers"
    origin: str = "learned"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def reply_starts_in_reasoning(self, prompt: str) -> bool:
        """True when ``prompt`` ends inside an open reasoning block (the template opened it)."""
        if self.reasoning is None:
            return False
        opener = core(self.reasoning.opener or self.reasoning.start)
        if not opener:
            return False
        return prompt.rstrip().endswith(opener)
