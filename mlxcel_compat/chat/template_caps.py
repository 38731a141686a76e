"""What a chat template can do (llama.cpp's ``chat_template_caps``), learned by rendering it.

Each probe renders a small conversation containing placeholder strings through the template and
looks for them in the output; a probe that raises counts as "not supported". The conversations
here are what the template is rendered with to learn its capabilities; the rendering itself is
the template's (``ChatTemplate`` passes its probe render in), so nothing here knows Jinja.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

__all__ = ["Probe", "detect_caps"]

# Placeholders for capability probes: distinctive strings looked for in the rendered output.
_PH_SYSTEM = "<<probe-system-5b2f>>"
_PH_TOOL_NAME = "probe_tool_9d41"
_PH_CALL_NAME = "probe_call_3e87"
_PH_ARG = "<<probe-arg-a1>>"
_PH_ARG2 = "<<probe-arg-b2>>"
_PH_TEXT = "<<probe-text-c6d0>>"
_PH_REASONING = "<<probe-reasoning-e4a9>>"


class Probe(Protocol):
    """Renders a probe conversation as-is, with a generation prompt; ``None`` when the template raises."""

    def __call__(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str | None: ...


def detect_caps(probe: Probe, *, reads_reasoning_effort: bool) -> dict[str, bool]:
    """The capabilities of the template ``probe`` renders with, keys sorted as llama.cpp reports them.

    Args:
        probe: the template's probe render.
        reads_reasoning_effort: the template reads a ``reasoning_effort`` variable
            (``supports_reasoning_effort`` is that fact, not a probe).
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
    out = probe(_reasoning_conversation(), preserve_reasoning=True)
    caps["supports_preserve_reasoning"] = out is not None and _PH_REASONING in out

    caps["supports_reasoning_effort"] = reads_reasoning_effort
    return dict(sorted(caps.items()))


def _detect_content_caps(probe: Probe) -> dict[str, bool]:
    out = probe([{"role": "user", "content": _PH_TEXT}])
    string_ok = out is not None and _PH_TEXT in out

    typed = [{"type": "text", "text": _PH_TEXT}]
    out = probe([{"role": "user", "content": typed}])
    # A template that prints the list as a Python repr does not really take typed content.
    typed_ok = out is not None and _PH_TEXT in out and "'type'" not in out
    return {"supports_string_content": string_ok, "supports_typed_content": typed_ok}


def _detect_tool_call_caps(probe: Probe) -> dict[str, bool]:
    """Object arguments first (printed as JSON, not a Python repr), then string arguments."""
    args: list[Any] = [{"arg": _PH_ARG}, {"arg": _PH_ARG2}]
    out = probe(_tool_call_conversation(args[:1]), tools=_probe_tools())
    object_ok = out is not None and _PH_ARG in out and "'arg'" not in out
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
