"""Chat templates, rendered the way HF transformers renders them: the ``ChatTemplate`` class.

Chat templates ship with model repositories and are untrusted code, so they compile in the
sandboxed Jinja environment of ``chat/sandbox.py``, which offers what transformers'
``apply_chat_template`` offers. On top of that this module adds the llama-server behaviour the
chat routes need: capability detection for ``/props`` (``chat_template_caps``, probed in
``chat/template_caps.py``), the content and tool-call argument shapes a template wants and the
``preserve_reasoning`` switch (``chat/template_inputs.py``), the model's templates read from its
tokenizer with ChatML as the fallback, and ``--chat-template NAME`` (llama.cpp's built-in formats
live in ``builtin_templates.py``).

Rendered text contains whatever special tokens the template writes (for example ``bos_token``).
Tokenize it without adding special tokens again, as transformers does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta

from mlxcel_compat.chat.builtin_templates import BUILTIN_TEMPLATE_NAMES, BuiltinTemplate
from mlxcel_compat.chat.message_fixes import fix_messages, fix_rendered, trims_content
from mlxcel_compat.chat.sandbox import ENVIRONMENT, TemplateError
from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.syntax_formats import template_syntax
from mlxcel_compat.chat.template_caps import detect_caps, detect_thinking
from mlxcel_compat.chat.template_inputs import (
    adapt_messages,
    cut_final_message,
    expand_switches,
    mark_final_message,
    prepare_messages,
)
from mlxcel_compat.tokenizer.served import unwrap_tokenizer

__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatTemplate",
]


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
        add_bos: bool = False,
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
            add_bos: the tokenizer adds ``bos_token`` itself: a rendered text that starts with it
                loses it, as llama-server's does (the prompt is tokenized with the BOS added).

        Raises:
            TemplateError: the source does not compile.
        """
        self._source = source
        self._name = name
        self._tool_use_source = tool_use_source
        self._tool_use: ChatTemplate | None = None
        self._add_bos = add_bos
        if tool_use_source is not None and tool_use_source != source:
            self._tool_use = ChatTemplate(tool_use_source, bos_token=bos_token, eos_token=eos_token,
                                          special_tokens=special_tokens, name="tool_use", add_bos=add_bos)
        self._globals: dict[str, Any] = dict(special_tokens or {})
        self._globals["bos_token"] = bos_token
        self._globals["eos_token"] = eos_token
        try:
            ast = ENVIRONMENT.parse(source)
            self._compiled = ENVIRONMENT.from_string(ast)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"invalid chat template: {exc}") from exc
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self._caps: dict[str, bool] | None = None
        self._thinking: bool | None = None
        self._syntax: ChatSyntax | None = None

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, override: str | None = None) -> ChatTemplate:
        """Build the template for a loaded tokenizer.

        Args:
            tokenizer: the served ``tokenizer.served.ServedTokenizer``, an HF tokenizer or an
                mlx-lm ``TokenizerWrapper``.
            override: the ``--chat-template`` value or ``--chat-template-file`` content. One of
                llama.cpp's built-in names (``chat/builtin_templates.py``; those render as
                llama.cpp's C++ does) or the name of one of the model's named templates selects
                it; anything else is Jinja source.

        Without an override the model's ``default`` template is used (``tool_use`` when that is
        the only one); a model without any template falls back to ChatML, as llama.cpp does.
        """
        hf = unwrap_tokenizer(tokenizer, "chat_template")
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
            add_bos=_adds_bos(hf),
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
        caps = self.caps()
        prepared = adapt_messages(prepare_messages(messages, trim=trims_content(self._source)), caps)
        prepared = fix_messages(prepared, self._source, caps)
        text = self._render_prepared(
            prepared,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            kwargs=kwargs,
        )
        bos = self._globals["bos_token"]
        if self._add_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return fix_rendered(text, self._source, add_generation_prompt)

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
            effort = self.supports_kwarg("reasoning_effort") or self.supports_kwarg("reasoning_strength")
            self._caps = detect_caps(self._probe, reads_reasoning_effort=effort)
        return dict(self._caps)

    def supports_thinking(self) -> bool:
        """Whether llama-server would turn thinking on for this template by default (cached).

        llama-server hands templates ``enable_thinking: true`` only when its analysis of the
        template finds reasoning in it (``chat_template_caps`` do not say); otherwise ``false``.
        Only a template that reads ``enable_thinking`` can tell the two apart, so the others are
        not probed (``template_caps.detect_thinking`` says what is looked at).
        """
        if self._thinking is None:
            self._thinking = not self.supports_kwarg("enable_thinking") or detect_thinking(self._probe)
        return self._thinking

    def syntax(self) -> ChatSyntax:
        """The syntax of this template's replies: reasoning, content and tool calls (learned from
        renders of the template once, then cached; ``chat/syntax_formats.py``)."""
        if self._syntax is None:
            self._syntax = template_syntax(self._source, self.render, self.caps())
        return self._syntax

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
            mark_final_message(messages, field)

        # As llama-server's: what is absent stays undefined (a template's ``tools is defined``
        # and ``add_generation_prompt is defined`` see that), and every value is a copy the
        # template may change.
        context = copy.deepcopy(self._globals)
        context.update(copy.deepcopy(expand_switches(kwargs)))
        for reserved in _RESERVED_NAMES:
            context.pop(reserved, None)
        context["messages"] = messages
        if tools is not None:
            context["tools"] = copy.deepcopy(list(tools))
        if documents:
            context["documents"] = copy.deepcopy(list(documents))
        if add_generation_prompt:
            context["add_generation_prompt"] = True

        try:
            text = self._compiled.render(context)
        except TemplateError:
            raise
        except Exception as exc:
            # Templates are untrusted programs: any failure inside one (Jinja errors, sandbox
            # refusals, Python type errors on bad data) is a bad template or a bad request.
            raise TemplateError(str(exc) or type(exc).__name__) from exc

        if field:
            text = cut_final_message(text, field)
        return text

    def _probe(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | None:
        """Render a probe conversation as-is (llama.cpp's probes give ``tools`` as an empty list
        when they have none); ``None`` when the template raises."""
        try:
            return self._render_prepared(
                prepare_messages(messages),
                tools=tools if tools is not None else [],
                documents=None,
                add_generation_prompt=True,
                continue_final_message=False,
                kwargs=kwargs,
            )
        except TemplateError:
            return None


# --- helpers: the model's templates and special tokens, read from its tokenizer ----------------


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


def _adds_bos(hf: Any) -> bool:
    """The tokenizer puts a BOS before the text it encodes (``add_bos_token``)."""
    try:
        plain = list(hf.encode("a", add_special_tokens=False))
        special = list(hf.encode("a", add_special_tokens=True))
    except Exception:  # a tokenizer that cannot say: keep whatever the template renders
        return False
    return len(special) > len(plain) and special[:1] != plain[:1]


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
