"""What a chat template can do (llama.cpp's ``chat_template_caps``), learned by rendering it.

Each probe renders a small conversation containing placeholder strings through the template and
looks for them in the output; a probe that raises counts as "not supported". The conversations
here are what the template is rendered with to learn its capabilities; the rendering itself is
the template's (``ChatTemplate`` passes its probe render in), so nothing here knows Jinja.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

__all__ = ["Probe", "detect_caps", "detect_thinking"]

# Placeholders for capability probes: distinctive strings looked for in the rendered output.
_PH_SYSTEM = "<<probe-system-5b2f>>"
_PH_TOOL_NAME = "probe_tool_9d41"
_PH_CALL_NAME = "probe_call_3e87"
_PH_ARG = "<<probe-arg-a1>>"
_PH_ARG2 = "<<probe-arg-b2>>"
_PH_TEXT = "<<probe-text-c6d0>>"
_PH_REASONING = "<<probe-reasoning-e4a9>>"
_PH_USER = "<<probe-user-71c3>>"
_PH_KEY = "probe_key_5c20"


class Probe(Protocol):
    """Renders a probe conversation as-is, with a generation prompt; ``None`` when the template raises."""

    def __call__(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str | None: ...


def detect_caps(probe: Probe, *, reads_reasoning_effort: bool) -> dict[str, bool]:
    """The capabilities of the template ``probe`` renders with, keys sorted as llama.cpp reports them.

    Args:
        probe: the template's probe render.
        reads_reasoning_effort: the template reads a ``reasoning_effort`` variable (or
            ``reasoning_strength``, which llama.cpp sets to the same value):
            ``supports_reasoning_effort`` is that fact, not a probe.
    """
    caps: dict[str, bool] = {}
    caps.update(_detect_content_caps(probe))

    out = probe(
        [
            {"role": "system", "content": _PH_SYSTEM},
            {"role": "user", "content": "User message"},
        ]
    )
    caps["supports_system_role"] = out is not None and _PH_SYSTEM in out

    out = probe([{"role": "user", "content": "User message"}], tools=_probe_tools())
    caps["supports_tools"] = out is not None and _PH_TOOL_NAME in out

    caps.update(_detect_tool_call_caps(probe))

    # Reasoning deeper in the history than the last assistant turn must survive when the
    # preserve switch is on (many templates keep only the latest turn's reasoning).
    out = probe(_reasoning_conversation(), preserve_reasoning=True, enable_thinking=True)
    caps["supports_preserve_reasoning"] = out is not None and _PH_REASONING in out

    caps["supports_reasoning_effort"] = reads_reasoning_effort
    return dict(sorted(caps.items()))


def detect_thinking(probe: Probe) -> bool:
    """Whether the template has reasoning: what llama-server's template analysis decides before it
    hands the template ``enable_thinking: true`` (``false`` otherwise).

    Reasoning is there when a past assistant turn's ``reasoning_content`` shows in the rendered
    text (with or without tool calls next to it), or when ``enable_thinking`` changes what follows
    the user's message: the generation prompt (Qwen3's empty think block). A template that only
    changes its system prompt with the switch (Apertus) has none, as llama-server finds.
    """
    user = {"role": "user", "content": _PH_USER}
    answer = {"role": "assistant", "content": _PH_TEXT, "reasoning_content": _PH_REASONING}
    out = probe([user, answer], enable_thinking=True)
    if out is not None and _PH_REASONING in out:
        return True
    call = {"id": "call00001", "type": "function", "function": {"name": _PH_CALL_NAME, "arguments": {"arg": _PH_ARG}}}
    calling = {"role": "assistant", "content": "", "reasoning_content": _PH_REASONING, "tool_calls": [call]}
    out = probe([user, calling], tools=_probe_tools(), enable_thinking=True)
    if out is not None and _PH_REASONING in out:
        return True
    off = probe([user], enable_thinking=False)
    on = probe([user], enable_thinking=True)
    if off is None or on is None or _PH_USER not in off or _PH_USER not in on:
        return False
    return off[off.rindex(_PH_USER):] != on[on.rindex(_PH_USER):]


def _detect_content_caps(probe: Probe) -> dict[str, bool]:
    """llama.cpp's rule: typed content is taken when the template uses a message's content as a
    list (iterates it, indexes it, ``selectattr``), string content when a string renders (and,
    for a template that uses content as a list, shows up). A template that tests whether the
    content ``is string`` is also given an empty list, to see whether it walks it then."""
    used = _ListUse()
    out = probe([{"role": "user", "content": used.string(_PH_TEXT)}])
    typed_ok = used.as_list
    if not typed_ok and used.string_tested:
        empty = _ListUse()
        typed_ok = probe([{"role": "user", "content": empty.list()}]) is not None and empty.as_list
    string_ok = out is not None and not (typed_ok and _PH_TEXT not in out)
    return {"supports_string_content": string_ok, "supports_typed_content": typed_ok}


class _ListUse:
    """Watches a content value for being used as a list.

    ``string()`` and ``list()`` make values whose classes note it (iteration, integer indexing);
    the probe's copy of its messages keeps them as they are.
    """

    def __init__(self) -> None:
        self.as_list = False
        self.string_tested = False

    def string(self, text: str) -> str:
        use = self

        class WatchedString(str):
            def __deepcopy__(self, memo: Any) -> Any:
                return self

            @staticmethod
            def string_tested() -> None:  # sandbox.py's ``string`` test calls it
                use.string_tested = True

            def __iter__(self):  # type: ignore[no-untyped-def]
                use.as_list = True
                return str.__iter__(self)

            def __getitem__(self, key):  # type: ignore[no-untyped-def]
                if isinstance(key, int):
                    use.as_list = True
                return str.__getitem__(self, key)

        return WatchedString(text)

    def list(self) -> list[Any]:
        use = self

        class WatchedList(list):  # type: ignore[type-arg]
            def __deepcopy__(self, memo: Any) -> Any:
                return self

            def __iter__(self):  # type: ignore[no-untyped-def]
                use.as_list = True
                return list.__iter__(self)

            def __getitem__(self, key):  # type: ignore[no-untyped-def]
                use.as_list = True
                return list.__getitem__(self, key)

        return WatchedList()


def _detect_tool_call_caps(probe: Probe) -> dict[str, bool]:
    """Object arguments first (printed as JSON, not a Python repr), then string arguments.

    The arguments' key is a name of its own, so a Python repr of the *tools* (which some templates
    print) is not taken for a repr of the arguments.
    """
    args: list[Any] = [{_PH_KEY: _PH_ARG}, {_PH_KEY: _PH_ARG2}]
    out = probe(_tool_call_conversation(args[:1]), tools=_probe_tools())
    object_ok = out is not None and _PH_ARG in out and f"'{_PH_KEY}'" not in out
    calls_ok = object_ok
    if not object_ok:
        args = [json.dumps(a) for a in args]
        out = probe(_tool_call_conversation(args[:1]), tools=_probe_tools())
        calls_ok = out is not None and (_PH_ARG in out or _PH_CALL_NAME in out)

    parallel_ok = False
    if calls_ok:
        out = probe(_tool_call_conversation(args), tools=_probe_tools())
        parallel_ok = out is not None and _PH_ARG in out and _PH_ARG2 in out
    return {
        "supports_object_arguments": object_ok,
        "supports_tool_calls": calls_ok,
        "supports_parallel_tool_calls": parallel_ok,
    }


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
