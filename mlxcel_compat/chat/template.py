"""Sandboxed Jinja chat templates, rendered the way HF transformers renders them.

Chat templates ship with model repositories and are untrusted code, so they run in Jinja's
``ImmutableSandboxedEnvironment``. The environment offers what transformers'
``apply_chat_template`` offers (``raise_exception``, an HF-flavoured ``tojson``, ``strftime_now``,
a no-op ``{% generation %}`` tag, ``loopcontrols``), because templates are written against that
runtime. On top of that this module adds the llama-server behaviour the chat routes need:
capability detection for ``/props`` (``chat_template_caps``), the content and tool-call argument
shapes a template wants, the ``preserve_reasoning`` switch, and ``--chat-template NAME`` (llama.cpp's
built-in formats live in ``builtin_templates.py``).

Rendered text contains whatever special tokens the template writes (for example ``bos_token``).
Tokenize it without adding special tokens again, as transformers does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxcel_compat.chat.builtin_templates import BUILTIN_TEMPLATE_NAMES, BuiltinTemplate

__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatTemplate",
    "TemplateError",
]


class TemplateError(Exception):
    """A chat template failed to compile or render.

    Raised for Jinja syntax and runtime errors, sandbox violations and the template's own
    ``raise_exception(...)``. The routes answer it with HTTP 400 and ``message``.
    """

    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --- Jinja environment (shared by every template) ---------------------------------------------


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
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


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


class _ChatEnvironment(ImmutableSandboxedEnvironment):
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


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _ChatEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols, jinja2.ext.do],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_environment()


# --- the ChatML template (written for this project; renders what llama.cpp's ChatML renders) ---

_CHATML = """\
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' -}}
{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# The Jinja templates llama.cpp itself uses: ChatML, for a model without a template and for
# ``--chat-template chatml``. The other names are llama.cpp's C++ formats (chat/builtin_templates.py).
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
}

# Names the render arguments own; kwargs with these names are ignored instead of clobbering them.
_RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# Marks the end of the final message when continuing it; the rendered text is cut there.
_CONTINUE_MARKER = "<<mlxcel-continue-final-message-7c1e>>"

# Placeholders for capability probes: distinctive strings looked for in the rendered output.
_PH_SYSTEM = "<<probe-system-5b2f>>"
_PH_TOOL_NAME = "probe_tool_9d41"
_PH_CALL_NAME = "probe_call_3e87"
_PH_ARG = "<<probe-arg-a1>>"
_PH_ARG2 = "<<probe-arg-b2>>"
_PH_TEXT = "<<probe-text-c6d0>>"
_PH_REASONING = "<<probe-reasoning-e4a9>>"


class ChatTemplate:
    """One compiled chat template plus the special tokens it renders with.

    Compiling happens once, in the constructor. ``caps()`` and the referenced-variable set are
    computed lazily and cached; both only depend on the source.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: Mapping[str, Any] | None = None,
        name: str | None = None,
        tool_use_source: str | None = None,
    ) -> None:
        """Compile ``source``.

        Args:
            source: Jinja template source.
            bos_token, eos_token: token strings exposed to the template.
            special_tokens: further template globals from the tokenizer's special-tokens map
                (``unk_token``, ``pad_token``, ...); bos/eos above win.
            name: built-in or named-template name, for logs and ``/props``.
            tool_use_source: the model's separate ``tool_use`` template: requests with tools
                render with it (``for_tools``) and ``/props`` reports it, as in llama-server.

        Raises:
            TemplateError: the source does not compile.
        """
        self._source = source
        self._name = name
        self._tool_use_source = tool_use_source
        self._tool_use: ChatTemplate | None = None
        if tool_use_source is not None and tool_use_source != source:
            self._tool_use = ChatTemplate(tool_use_source, bos_token=bos_token, eos_token=eos_token,
                                          special_tokens=special_tokens, name="tool_use")
        self._globals: dict[str, Any] = dict(special_tokens or {})
        self._globals["bos_token"] = bos_token
        self._globals["eos_token"] = eos_token
        try:
            ast = _ENV.parse(source)
            self._compiled = _ENV.from_string(ast)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"invalid chat template: {exc}") from exc
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self._caps: dict[str, bool] | None = None

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, override: str | None = None) -> ChatTemplate:
        """Build the template for a loaded tokenizer.

        Args:
            tokenizer: the served ``model.tokenizer.ServedTokenizer``, an HF tokenizer or an
                mlx-lm ``TokenizerWrapper``.
            override: the ``--chat-template`` value or ``--chat-template-file`` content. One of
                llama.cpp's built-in names (``chat/builtin_templates.py``; those render as
                llama.cpp's C++ does) or the name of one of the model's named templates selects
                it; anything else is Jinja source.

        Without an override the model's ``default`` template is used (``tool_use`` when that is
        the only one); a model without any template falls back to ChatML, as llama.cpp does.
        """
        hf = _unwrap_tokenizer(tokenizer)
        named = _named_templates(getattr(hf, "chat_template", None))
        special = _special_tokens(hf)
        bos = _token_text(getattr(hf, "bos_token", None))
        eos = _token_text(getattr(hf, "eos_token", None))

        tool_use: str | None = None
        if override and override in BUILTIN_TEMPLATE_NAMES and override not in BUILTIN_TEMPLATES:
            return BuiltinTemplate(override, bos_token=bos, eos_token=eos)  # type: ignore[return-value]
        if override:
            if override in BUILTIN_TEMPLATES:
                source, name = BUILTIN_TEMPLATES[override], override
            elif override in named:
                source, name = named[override], override
            else:
                source, name = override, None
        elif "default" in named:
            source, name = named["default"], "default"
            tool_use = named.get("tool_use")
        elif "tool_use" in named:
            source, name = named["tool_use"], "tool_use"
            tool_use = named["tool_use"]
        else:
            source, name = BUILTIN_TEMPLATES["chatml"], "chatml"
        return cls(
            source,
            bos_token=bos,
            eos_token=eos,
            special_tokens=special,
            name=name,
            tool_use_source=tool_use,
        )

    @classmethod
    def builtin(cls, name: str, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """A built-in template by name. Raises ``KeyError`` for an unknown name."""
        return cls(BUILTIN_TEMPLATES[name], bos_token=bos_token, eos_token=eos_token, name=name)

    # --- properties -------------------------------------------------------------------------

    @property
    def source(self) -> str:
        """The Jinja source (input to ``template_sig``; ``chat_template`` in ``/props``)."""
        return self._source

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def tool_use_source(self) -> str | None:
        """The model's ``tool_use`` template when it has one (``chat_template_tool_use``)."""
        return self._tool_use_source

    def for_tools(self, tools: Any) -> ChatTemplate:
        """The template a request renders with: llama-server switches to the model's ``tool_use``
        template (GGUF ``tokenizer.chat_template.tool_use``, or an HF directory's named template)
        when the request passes tools to the template, and uses the default one otherwise."""
        return self._tool_use if tools and self._tool_use is not None else self

    @property
    def bos_token(self) -> str:
        return self._globals["bos_token"]

    @property
    def eos_token(self) -> str:
        return self._globals["eos_token"]

    # --- rendering --------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text.

        Messages are copied and shaped for this template first: typed text parts are joined
        with ``"\\n"`` when the template only takes string content (plain strings are wrapped
        in a text part when it only takes typed content), and JSON-string tool-call arguments
        become objects when the template wants object arguments.

        Args:
            messages: OpenAI-style message dicts (as produced by ``parse_chat_request``).
            tools: OpenAI function tools; ``None`` hides tools from the template.
            documents: RAG documents for templates that take them.
            add_generation_prompt: append the header that opens an assistant turn.
            continue_final_message: ``True`` (or the field name, ``"content"`` /
                ``"reasoning_content"``) to end the text right after that field of the final
                message, so the model continues it instead of starting a new turn.
            **kwargs: extra template variables (``chat_template_kwargs``); they override the
                special tokens, never the arguments above (``messages`` is positional-only so
                a ``messages`` kwarg lands here and is ignored). A boolean ``preserve_reasoning`` also sets
                ``preserve_thinking``/``clear_thinking``/``truncate_history_thinking``/
                ``drop_thinking`` unless those are given, as llama.cpp does.

        Raises:
            TemplateError: the template failed or refused the conversation.
        """
        prepared = self._adapt_messages(_prepare_messages(messages))
        return self._render_prepared(
            prepared,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            kwargs=kwargs,
        )

    def render_history(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` as closed history, without a generation prompt.

        Used for the snapshot history boundary: the caller clips this text to its common prefix
        with the live prompt, because templates may render the last turn differently.
        """
        return self.render(
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=False,
            **kwargs,
        )

    # --- capabilities -----------------------------------------------------------------------

    def supports_kwarg(self, name: str) -> bool:
        """True when the template reads the global variable ``name`` (e.g. ``enable_thinking``).

        Based on the variables the template references without defining them, so a template
        that only tests ``preserve_thinking is defined`` counts as supporting it.
        """
        return name in self._variables

    def caps(self) -> dict[str, bool]:
        """llama.cpp-style ``chat_template_caps``, detected by probe renders (cached).

        Each probe renders a small conversation containing placeholder strings and looks for
        them in the output; a probe that raises counts as "not supported". Keys are sorted, as
        llama.cpp reports them.
        """
        if self._caps is None:
            self._caps = self._detect_caps()
        return dict(self._caps)

    # --- internals --------------------------------------------------------------------------

    def _render_prepared(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        documents: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        kwargs: Mapping[str, Any],
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise TemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        field = ""
        if continue_final_message:
            field = "content" if continue_final_message is True else str(continue_final_message)
            _mark_final_message(messages, field)

        context = dict(self._globals)
        context.update(_expand_switches(kwargs))
        for reserved in _RESERVED_NAMES:
            context.pop(reserved, None)
        context["messages"] = messages
        context["tools"] = copy.deepcopy(list(tools)) if tools else None
        context["documents"] = copy.deepcopy(list(documents)) if documents else None
        context["add_generation_prompt"] = add_generation_prompt

        try:
            text = self._compiled.render(context)
        except TemplateError:
            raise
        except Exception as exc:
            # Templates are untrusted programs: any failure inside one (Jinja errors, sandbox
            # refusals, Python type errors on bad data) is a bad template or a bad request.
            raise TemplateError(str(exc) or type(exc).__name__) from exc

        if field:
            cut = text.rfind(_CONTINUE_MARKER)
            if cut < 0:
                raise TemplateError(
                    f"continue_final_message is set but the final message's {field} does not "
                    "appear in the rendered chat"
                )
            text = text[:cut]
        return text

    def _adapt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        caps = self.caps()
        only_string = caps["supports_string_content"] and not caps["supports_typed_content"]
        only_typed = caps["supports_typed_content"] and not caps["supports_string_content"]
        for message in messages:
            content = message.get("content")
            if only_string and isinstance(content, list):
                message["content"] = _join_text_parts(content)
            elif only_typed and isinstance(content, str):
                message["content"] = [{"type": "text", "text": content}]
            if caps["supports_object_arguments"]:
                _arguments_to_objects(message)
        return messages

    def _probe(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | None:
        """Render a probe conversation as-is; ``None`` when the template raises."""
        try:
            return self._render_prepared(
                _prepare_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=True,
                continue_final_message=False,
                kwargs=kwargs,
            )
        except TemplateError:
            return None

    def _detect_caps(self) -> dict[str, bool]:
        caps: dict[str, bool] = {}
        caps.update(self._detect_content_caps())

        out = self._probe(
            [
                {"role": "system", "content": _PH_SYSTEM},
                {"role": "user", "content": "User message"},
            ]
        )
        caps["supports_system_role"] = out is not None and _PH_SYSTEM in out

        out = self._probe([{"role": "user", "content": "User message"}], tools=_probe_tools())
        caps["supports_tools"] = out is not None and _PH_TOOL_NAME in out

        caps.update(self._detect_tool_call_caps())

        # Reasoning deeper in the history than the last assistant turn must survive when the
        # preserve switch is on (many templates keep only the latest turn's reasoning).
        out = self._probe(_reasoning_conversation(), preserve_reasoning=True)
        caps["supports_preserve_reasoning"] = out is not None and _PH_REASONING in out

        caps["supports_reasoning_effort"] = self.supports_kwarg("reasoning_effort")
        return dict(sorted(caps.items()))

    def _detect_content_caps(self) -> dict[str, bool]:
        out = self._probe([{"role": "user", "content": _PH_TEXT}])
        string_ok = out is not None and _PH_TEXT in out

        typed = [{"type": "text", "text": _PH_TEXT}]
        out = self._probe([{"role": "user", "content": typed}])
        # A template that prints the list as a Python repr does not really take typed content.
        typed_ok = out is not None and _PH_TEXT in out and "'type'" not in out
        return {"supports_string_content": string_ok, "supports_typed_content": typed_ok}

    def _detect_tool_call_caps(self) -> dict[str, bool]:
        """Object arguments first (printed as JSON, not a Python repr), then string arguments."""
        args: list[Any] = [{"arg": _PH_ARG}, {"arg": _PH_ARG2}]
        out = self._probe(_tool_call_conversation(args[:1]), tools=_probe_tools())
        object_ok = out is not None and _PH_ARG in out and "'arg'" not in out
        calls_ok = object_ok
        if not object_ok:
            args = [json.dumps(a) for a in args]
            out = self._probe(_tool_call_conversation(args[:1]), tools=_probe_tools())
            calls_ok = out is not None and (_PH_ARG in out or _PH_CALL_NAME in out)

        parallel_ok = False
        if calls_ok:
            out = self._probe(_tool_call_conversation(args), tools=_probe_tools())
            parallel_ok = out is not None and _PH_ARG in out and _PH_ARG2 in out
        return {
            "supports_object_arguments": object_ok,
            "supports_tool_calls": calls_ok,
            "supports_parallel_tool_calls": parallel_ok,
        }


# --- helpers ----------------------------------------------------------------------------------


def _unwrap_tokenizer(tokenizer: Any) -> Any:
    """The HF tokenizer inside an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself).

    HF fast tokenizers also have a ``_tokenizer`` (the Rust one), which has no chat template;
    only unwrap when the inner object looks like an HF tokenizer.
    """
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is not None and hasattr(inner, "chat_template"):
        return inner
    return tokenizer


def _named_templates(raw: Any) -> dict[str, str]:
    """Normalize ``tokenizer.chat_template`` (str, dict, or HF's old list form) to a dict."""
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, Mapping):
        return {str(k): v for k, v in raw.items() if isinstance(v, str)}
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for item in raw:
            if isinstance(item, Mapping) and isinstance(item.get("template"), str):
                named[str(item.get("name", "default"))] = item["template"]
        return named
    return {}


def _token_text(token: Any) -> str:
    if token is None:
        return ""
    return str(getattr(token, "content", token))


def _special_tokens(hf: Any) -> dict[str, Any]:
    """The tokenizer's special-tokens map as plain strings (HF passes it to templates)."""
    try:
        mapping = getattr(hf, "special_tokens_map", None) or {}
    except Exception:  # some tokenizer classes compute this property and can fail
        return {}
    if not isinstance(mapping, Mapping):
        return {}
    result: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, (list, tuple)):
            result[str(key)] = [_token_text(v) for v in value]
        elif value is not None:
            result[str(key)] = _token_text(value)
    return result


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deep-copy messages (never mutate the caller's) and alias reasoning for templates.

    Templates read an assistant's reasoning as ``reasoning_content`` or, for gpt-oss, as
    ``thinking``; transformers fills both, so do we.
    """
    prepared: list[dict[str, Any]] = []
    for message in messages:
        copied = copy.deepcopy(dict(message))
        reasoning = copied.get("reasoning_content")
        if reasoning is not None and "thinking" not in copied:
            copied["thinking"] = reasoning
        prepared.append(copied)
    return prepared


def _expand_switches(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply llama.cpp's ``preserve_reasoning`` switch; explicit kwargs still win."""
    expanded = dict(kwargs)
    switch = kwargs.get("preserve_reasoning")
    if isinstance(switch, bool):
        derived = {
            "preserve_thinking": switch,
            "clear_thinking": not switch,
            "truncate_history_thinking": not switch,
            "drop_thinking": not switch,
        }
        for key, value in derived.items():
            expanded.setdefault(key, value)
    return expanded


def _join_text_parts(parts: list[Any]) -> str:
    # llama.cpp joins text parts with a newline when the template only takes strings.
    texts = [
        part.get("text", "")
        for part in parts
        if isinstance(part, Mapping) and part.get("type") == "text"
    ]
    return "\n".join(str(t) for t in texts)


def _arguments_to_objects(message: dict[str, Any]) -> None:
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                function["arguments"] = parsed


def _mark_final_message(messages: list[dict[str, Any]], field: str) -> None:
    """Append the continue marker to ``field`` of the final message (last text part for lists)."""
    if not messages:
        raise TemplateError("continue_final_message is set but there are no messages")
    final = messages[-1]
    value = final.get(field)
    if isinstance(value, str):
        final[field] = value + _CONTINUE_MARKER
        if field == "reasoning_content" and final.get("thinking") == value:
            final["thinking"] = value + _CONTINUE_MARKER
        return
    if isinstance(value, list):
        for part in reversed(value):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = part["text"] + _CONTINUE_MARKER
                return
    raise TemplateError(
        f"continue_final_message is set but the final message has no {field} to continue"
    )


def _probe_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": _PH_TOOL_NAME,
                "description": "Tool description",
                "parameters": {
                    "type": "object",
                    "properties": {"arg": {"type": "string", "description": "Arg description"}},
                    "required": ["arg"],
                },
            },
        }
    ]


def _tool_call_conversation(arguments: list[Any]) -> list[dict[str, Any]]:
    calls = [
        {
            "id": f"call0000{i + 1}",
            "type": "function",
            "function": {"name": _PH_CALL_NAME, "arguments": args},
        }
        for i, args in enumerate(arguments)
    ]
    return [
        {"role": "user", "content": "User message"},
        # Some templates expect empty content next to tool calls.
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


def _reasoning_conversation() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "Assistant message", "reasoning_content": _PH_REASONING},
        {"role": "user", "content": "User message"},
        {
            "role": "assistant",
            "content": "Assistant message",
            "reasoning_content": "Reasoning content",
        },
        {"role": "user", "content": "User message"},
    ]
