"""llama.cpp's built-in chat templates: ``--chat-template NAME`` (and ``--no-jinja``).

llama.cpp renders these in C++ (``llm_chat_apply_template`` in ``src/llama-chat.cpp``) instead of
through Jinja: each name is a fixed format over ``(role, content)`` pairs, with its own rules for
system messages (a prefix, merged into the next user turn, or dropped), trimming and the
generation prompt. This module renders every name exactly that way, written from reading that
code, and :func:`detect` picks a name from a model's Jinja source the way
``llm_chat_detect_template`` does (what llama-server uses with ``--no-jinja``).

What these formats cannot carry is left out, as in llama.cpp: tool definitions and tool calls
(only a message's text is rendered), and typed content, whose text parts are joined with a
newline first. No BOS token is written; tokenization adds the model's own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlxcel_compat.chat.syntax import ChatSyntax
from mlxcel_compat.chat.syntax_formats import with_fallbacks

__all__ = ["BUILTIN_TEMPLATE_NAMES", "BuiltinTemplate", "detect", "render"]

Message = tuple[str, str]  # (role, content)


def _trim(text: str) -> str:
    # C isspace: space, \t, \n, \v, \f, \r
    return text.strip(" \t\n\v\f\r")


def _chatml(chat: list[Message], add_ass: bool) -> str:
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in chat)
    return out + ("<|im_start|>assistant\n" if add_ass else "")


def _mistral_v7(space: str) -> Callable[[list[Message], bool], str]:
    def render_v7(chat: list[Message], add_ass: bool) -> str:
        out = []
        for role, content in chat:
            if role == "system":
                out.append(f"[SYSTEM_PROMPT]{space}{content}[/SYSTEM_PROMPT]")
            elif role == "user":
                out.append(f"[INST]{space}{content}[/INST]")
            else:
                out.append(f"{space}{content}</s>")
        return "".join(out)

    return render_v7


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> Callable[[list[Message], bool], str]:
    def render_mistral(chat: list[Message], add_ass: bool) -> str:
        out = []
        inside = False
        for role, content in chat:
            if not inside:
                out.append(f"{leading}[INST]{trailing}")
                inside = True
            if role == "system":
                out.append(content + "\n\n")
            elif role == "user":
                out.append(f"{content}{leading}[/INST]")
            else:
                out.append(f"{trailing}{_trim(content) if trim_assistant else content}</s>")
                inside = False
        return "".join(out)

    return render_mistral


def _llama2(system: bool, bos_inside: bool, strip: bool) -> Callable[[list[Message], bool], str]:
    def render_llama2(chat: list[Message], add_ass: bool) -> str:
        out = ["[INST] "]
        inside = True  # the first [INST] is written above (the BOS comes from tokenization)
        for role, content in chat:
            if strip:
                content = _trim(content)
            if not inside:
                inside = True
                out.append("<s>[INST] " if bos_inside else "[INST] ")
            if role == "system":
                out.append(f"<<SYS>>\n{content}\n<</SYS>>\n\n" if system else content + "\n")
            elif role == "user":
                out.append(content + " [/INST]")
            else:
                out.append(content + "</s>")
                inside = False
        return "".join(out)

    return render_llama2


def _per_role(fmt: str, gen: str, trim: bool = False) -> Callable[[list[Message], bool], str]:
    """Templates that write every message as ``fmt.format(role=..., content=...)``."""

    def render_per_role(chat: list[Message], add_ass: bool) -> str:
        out = "".join(fmt.format(role=role, content=_trim(content) if trim else content) for role, content in chat)
        return out + (gen if add_ass else "")

    return render_per_role


def _monarch(chat: list[Message], add_ass: bool) -> str:
    out = "".join(("" if i == 0 else "<s>") + f"{role}\n{content}</s>\n" for i, (role, content) in enumerate(chat))
    return out + ("<s>assistant\n" if add_ass else "")


def _gemma(chat: list[Message], add_ass: bool) -> str:
    out = []
    system = ""
    for role, content in chat:
        if role == "system":
            system += _trim(content)  # no system turn: merged into the next user turn
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(_trim(content) + "<end_of_turn>\n")
    return "".join(out) + ("<start_of_turn>model\n" if add_ass else "")


def _orion(chat: list[Message], add_ass: bool) -> str:
    out = []
    system = ""
    for role, content in chat:
        if role == "system":
            system += content
        elif role == "user":
            out.append("Human: ")
            if system:
                out.append(system + "\n\n")
                system = ""
            out.append(content + "\n\nAssistant: </s>")
        else:
            out.append(content + "</s>")
    return "".join(out)


def _openchat(chat: list[Message], add_ass: bool) -> str:
    out = []
    for role, content in chat:
        if role == "system":
            out.append(content + "<|end_of_turn|>")
        else:
            out.append(f"GPT4 Correct {role[:1].upper() + role[1:]}: {content}<|end_of_turn|>")
    return "".join(out) + ("GPT4 Correct Assistant:" if add_ass else "")


def _vicuna(orca: bool) -> Callable[[list[Message], bool], str]:
    def render_vicuna(chat: list[Message], add_ass: bool) -> str:
        out = []
        for role, content in chat:
            if role == "system":
                out.append(f"SYSTEM: {content}\n" if orca else content + "\n\n")
            elif role == "user":
                out.append(f"USER: {content}\n")
            elif role == "assistant":
                out.append(f"ASSISTANT: {content}</s>\n")
        return "".join(out) + ("ASSISTANT:" if add_ass else "")

    return render_vicuna


def _by_role(formats: Mapping[str, str], gen: str, trim: bool = False) -> Callable[[list[Message], bool], str]:
    """Templates with one format per role; roles without a format are left out."""

    def render_by_role(chat: list[Message], add_ass: bool) -> str:
        out = "".join(
            formats[role].format(content=_trim(content) if trim else content) for role, content in chat if role in formats
        )
        return out + (gen if add_ass else "")

    return render_by_role


def _chatglm3(chat: list[Message], add_ass: bool) -> str:
    out = "[gMASK]sop" + "".join(f"<|{role}|>\n {content}" for role, content in chat)
    return out + ("<|assistant|>" if add_ass else "")


def _chatglm4(chat: list[Message], add_ass: bool) -> str:
    out = "[gMASK]<sop>" + "".join(f"<|{role}|>\n{content}" for role, content in chat)
    return out + ("<|assistant|>\n" if add_ass else "")


def _minicpm(chat: list[Message], add_ass: bool) -> str:
    return "".join(f"<用户>{_trim(content)}<AI>" if role == "user" else _trim(content) for role, content in chat)


def _rwkv_world(chat: list[Message], add_ass: bool) -> str:
    out = []
    for i, (role, content) in enumerate(chat):
        if role == "system":
            out.append(f"System: {_trim(content)}\n\n")
        elif role == "user":
            out.append(f"User: {_trim(content)}\n\n")
            if i == len(chat) - 1:
                out.append("Assistant:")
        elif role == "assistant":
            out.append(f"Assistant: {_trim(content)}\n\n")
    return "".join(out)


def _granite(chat: list[Message], add_ass: bool) -> str:
    out = []
    for role, content in chat:
        out.append(f"<|start_of_role|>{role}<|end_of_role|>")
        if role == "assistant_tool_call":
            out.append("<|tool_call|>")
        out.append(content + "<|end_of_text|>\n")
    return "".join(out) + ("<|start_of_role|>assistant<|end_of_role|>\n" if add_ass else "")


def _gigachat(chat: list[Message], add_ass: bool) -> str:
    has_system = bool(chat) and chat[0][0] == "system"
    out = [f"<s>{chat[0][1]}<|message_sep|>" if has_system else "<s>"]
    for role, content in chat[1 if has_system else 0 :]:
        if role == "user":
            out.append(f"user<|role_sep|>{content}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>")
        elif role == "assistant":
            out.append(f"assistant<|role_sep|>{content}<|message_sep|>")
    return "".join(out) + ("assistant<|role_sep|>" if add_ass else "")


def _bailing(chat: list[Message], add_ass: bool) -> str:
    out = "".join(f"<role>{'HUMAN' if role == 'user' else role.upper()}</role>{content}" for role, content in chat)
    return out + ("<role>ASSISTANT</role>" if add_ass else "")


def _smolvlm(chat: list[Message], add_ass: bool) -> str:
    out = ["<|im_start|>"]  # SmolVLM's BOS; the turns themselves are not ChatML
    for role, content in chat:
        if role == "system":
            out.append(content + "\n\n")
        elif role == "user":
            out.append(f"User: {content}<end_of_utterance>\n")
        else:
            out.append(f"Assistant: {content}<end_of_utterance>\n")
    return "".join(out) + ("Assistant:" if add_ass else "")


def _hunyuan_moe(chat: list[Message], add_ass: bool) -> str:
    out = []
    for role, content in chat:
        if role == "system":
            out.append(f"<|startoftext|>{content}<|extra_4|>")
        elif role == "assistant":
            out.append(content + "<|eos|>")
        else:
            out.append(f"<|startoftext|>{content}<|extra_0|>")
    return "".join(out)


def _gpt_oss(chat: list[Message], add_ass: bool) -> str:
    out = "".join(
        f"<|start|>{role}<|message|>{content}" + ("<|return|>" if role == "assistant" else "<|end|>") for role, content in chat
    )
    return out + ("<|start|>assistant" if add_ass else "")


def _hunyuan_dense(chat: list[Message], add_ass: bool) -> str:
    out = []
    for i, (role, content) in enumerate(chat):
        if i == 0 and role == "system":
            out.append(content + "<｜hy_place▁holder▁no▁3｜>")
        if role == "assistant":
            out.append(f"<｜hy_Assistant｜>{content}<｜hy_place▁holder▁no▁2｜>")
        elif role == "user":
            out.append(f"<｜hy_User｜>{content}<｜hy_Assistant｜>")
    return "".join(out)


def _kimi_k2(chat: list[Message], add_ass: bool) -> str:
    heads = {
        "system": "<|im_system|>system<|im_middle|>",
        "user": "<|im_user|>user<|im_middle|>",
        "assistant": "<|im_assistant|>assistant<|im_middle|>",
        "tool": "<|im_system|>tool<|im_middle|>",
    }
    out = "".join(heads.get(role, "") + content + "<|im_end|>" for role, content in chat)
    return out + ("<|im_assistant|>assistant<|im_middle|>" if add_ass else "")


def _seed_oss(chat: list[Message], add_ass: bool) -> str:
    out = "".join(
        f"<seed:bos>{role}\n{_trim(content) if role == 'assistant' else content}<seed:eos>" for role, content in chat
    )
    return out + ("<seed:bos>assistant\n" if add_ass else "")


_DEEPSEEK3_END = "<｜end▁of▁sentence｜>"
_EXAONE = {
    "system": "[|system|]{content}[|endofturn|]\n",
    "user": "[|user|]{content}\n",
    "assistant": "[|assistant|]{content}[|endofturn|]\n",
}

_RENDERERS: dict[str, Callable[[list[Message], bool], str]] = {
    "chatml": _chatml,
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(leading=" ", trailing=" ", trim_assistant=False),
    "mistral-v3": _mistral(leading="", trailing=" ", trim_assistant=True),
    "mistral-v3-tekken": _mistral(leading="", trailing="", trim_assistant=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _per_role("<|{role}|>\n{content}<|end|>\n", "<|assistant|>\n"),
    "phi4": _per_role("<|im_start|>{role}<|im_sep|>{content}<|im_end|>", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _per_role("<|{role}|>\n{content}\n", "<|assistant|>\n"),
    "zephyr": _per_role("<|{role}|>\n{content}<|endoftext|>\n", "<|assistant|>\n"),
    "monarch": _monarch,
    "gemma": _gemma,
    "orion": _orion,
    "openchat": _openchat,
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _by_role(
        {"system": "{content}", "user": "### Instruction:\n{content}\n", "assistant": "### Response:\n{content}\n<|EOT|>\n"},
        "### Response:\n",
    ),
    "deepseek2": _by_role(
        {"system": "{content}\n\n", "user": "User: {content}\n\n", "assistant": "Assistant: {content}" + _DEEPSEEK3_END},
        "Assistant:",
    ),
    "deepseek3": _by_role(
        {"system": "{content}\n\n", "user": "<｜User｜>{content}", "assistant": "<｜Assistant｜>{content}" + _DEEPSEEK3_END},
        "<｜Assistant｜>",
    ),
    "command-r": _by_role(
        {
            "system": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
            "user": "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
            "assistant": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        },
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        trim=True,
    ),
    "llama3": _per_role(
        "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n", trim=True
    ),
    "chatglm3": _chatglm3,
    "chatglm4": _chatglm4,
    "glmedge": _per_role("<|{role}|>\n{content}", "<|assistant|>"),
    "minicpm": _minicpm,
    "exaone3": _by_role(_EXAONE, "[|assistant|]", trim=True),
    "exaone4": _by_role({**_EXAONE, "tool": "[|tool|]{content}[|endofturn|]\n"}, "[|assistant|]", trim=True),
    "rwkv-world": _rwkv_world,
    "granite": _granite,
    "gigachat": _gigachat,
    "megrez": _per_role("<|role_start|>{role}<|role_end|>{content}<|turn_end|>", "<|role_start|>assistant<|role_end|>"),
    "yandex": _by_role({"user": " Пользователь: {content}\n\n", "assistant": " Ассистент: {content}\n\n"}, " Ассистент:[SEP]"),
    "bailing": _bailing,
    "llama4": _per_role("<|header_start|>{role}<|header_end|>\n\n{content}<|eot|>", "<|header_start|>assistant<|header_end|>\n\n", trim=True),
    "smolvlm": _smolvlm,
    "hunyuan-moe": _hunyuan_moe,
    "gpt-oss": _gpt_oss,
    "hunyuan-dense": _hunyuan_dense,
    "kimi-k2": _kimi_k2,
    "seed_oss": _seed_oss,
}

BUILTIN_TEMPLATE_NAMES: tuple[str, ...] = tuple(sorted(_RENDERERS))

def _text(content: Any) -> str:
    """A message's text: strings as they are, typed parts joined with a newline (llama.cpp)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return "" if content is None else str(content)


def render(name: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The prompt llama.cpp's built-in template ``name`` renders (KeyError for an unknown name)."""
    chat = [(str(m.get("role", "")), _text(m.get("content"))) for m in messages]
    return _RENDERERS[name](chat, add_generation_prompt)


def _mistral_family(tmpl: str) -> str:
    if "[SYSTEM_PROMPT]" in tmpl:
        return "mistral-v7"
    if "' [INST] ' + system_message" in tmpl or "[AVAILABLE_TOOLS]" in tmpl:
        if " [INST]" in tmpl:
            return "mistral-v1"
        return "mistral-v3-tekken" if '"[INST]"' in tmpl else "mistral-v3"
    if "content.strip()" in tmpl:
        return "llama2-sys-strip"
    if "bos_token + '[INST]" in tmpl:
        return "llama2-sys-bos"
    return "llama2-sys" if "<<SYS>>" in tmpl else "llama2"


def detect(tmpl: str) -> str | None:
    """The built-in template llama.cpp would pick for a Jinja source (None: it knows none)."""
    if tmpl in _RENDERERS:
        return tmpl

    def has(*needles: str) -> bool:
        return all(n in tmpl for n in needles)

    if has("<|im_start|>"):
        return "phi4" if has("<|im_sep|>") else "smolvlm" if has("<end_of_utterance>") else "chatml"
    if tmpl.startswith("mistral") or has("[INST]"):
        return _mistral_family(tmpl)
    rules: list[tuple[bool, str]] = [
        (has("<|assistant|>", "<|end|>"), "phi3"),
        (has("[gMASK]<sop>"), "chatglm4"),
        (has("<|assistant|>", "<|user|>"), "falcon3" if has("</s>") else "glmedge"),
        (has("<|{{ item['role'] }}|>", "<|begin_of_image|>"), "glmedge"),
        (has("<|user|>", "<|endoftext|>"), "zephyr"),
        (has("bos_token + message['role']"), "monarch"),
        (has("<start_of_turn>"), "gemma"),
        (has("'\\n\\nAssistant: ' + eos_token"), "orion"),
        (has("GPT4 Correct "), "openchat"),
        (has("USER: ", "ASSISTANT: "), "vicuna-orca" if has("SYSTEM: ") else "vicuna"),
        (has("### Instruction:", "<|EOT|>"), "deepseek"),
        (has("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"), "command-r"),
        (has("<|start_header_id|>", "<|end_header_id|>"), "llama3"),
        (has("[gMASK]sop"), "chatglm3"),
        (has("<用户>"), "minicpm"),
        (has("'Assistant: ' + message['content'] + eos_token"), "deepseek2"),
        (has("<｜Assistant｜>", "<｜User｜>", _DEEPSEEK3_END), "deepseek3"),
        (has("[|system|]", "[|assistant|]", "[|endofturn|]"), "exaone4" if has("[|tool|]") else "exaone3"),
        (has("rwkv-world") or has("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}"), "rwkv-world"),
        (has("<|start_of_role|>"), "granite"),
        (has("message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]"), "gigachat"),
        (has("<|role_start|>"), "megrez"),
        (has(" Ассистент:"), "yandex"),
        (has("<role>ASSISTANT</role>", "'HUMAN'"), "bailing"),
        (has("<|header_start|>", "<|header_end|>"), "llama4"),
        (has("<|extra_0|>", "<|extra_4|>"), "hunyuan-moe"),
        (has("<|start|>", "<|channel|>"), "gpt-oss"),
        (has("<｜hy_Assistant｜>", "<｜hy_place▁holder▁no▁3｜>"), "hunyuan-dense"),
        (has("<|im_assistant|>assistant<|im_middle|>"), "kimi-k2"),
        (has("<seed:bos>"), "seed_oss"),
    ]
    return next((name for hit, name in rules if hit), None)


_CONTINUE_MARKER = "<<mlxcel-continue-final-message-2b9d>>"
_PROBE = "<<probe-system-41c7>>"


class BuiltinTemplate:
    """A built-in template behind the interface the chat routes use (``ChatTemplate``'s).

    ``source`` is the name, as llama-server reports an override in ``/props``; it also keys the
    prompt cache's template signature.
    """

    def __init__(self, name: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if name not in _RENDERERS:
            raise KeyError(name)
        self._name = name
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def source(self) -> str:
        return self._name

    @property
    def name(self) -> str:
        return self._name

    @property
    def tool_use_source(self) -> None:
        return None

    def for_tools(self, tools: Any) -> BuiltinTemplate:
        return self  # one fixed format, with or without tools

    def supports_kwarg(self, name: str) -> bool:
        return False  # no template variables: enable_thinking and friends do not apply

    def supports_thinking(self) -> bool:
        return False  # llama.cpp's C++ formats have no reasoning switch

    def caps(self) -> dict[str, bool]:
        probe = render(self._name, [{"role": "system", "content": _PROBE}, {"role": "user", "content": "u"}])
        return {
            "supports_object_arguments": False,
            "supports_parallel_tool_calls": False,
            "supports_preserve_reasoning": False,
            "supports_reasoning_effort": False,
            "supports_string_content": True,
            "supports_system_role": _PROBE in probe,
            "supports_tool_calls": False,
            "supports_tools": False,
            "supports_typed_content": False,
        }

    def syntax(self) -> ChatSyntax:
        """The syntax of replies in this format: none of them shows calls, so Hermes calls and
        ``<think>`` blocks are read (``chat/syntax_formats.py: with_fallbacks``)."""
        return with_fallbacks(ChatSyntax(format="content only", origin=f"llama.cpp built-in format {self._name}"))

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
        """Render as llama.cpp does; ``continue_final_message`` cuts right after the final text."""
        if not continue_final_message:
            return render(self._name, messages, add_generation_prompt)
        marked = [copy.deepcopy(dict(m)) for m in messages]
        if marked:
            marked[-1]["content"] = _text(marked[-1].get("content")) + _CONTINUE_MARKER
        text = render(self._name, marked, False)
        cut = text.rfind(_CONTINUE_MARKER)
        return text[:cut] if cut >= 0 else text

    def render_history(self, messages: Sequence[Mapping[str, Any]], /, **kwargs: Any) -> str:
        return render(self._name, messages, False)
