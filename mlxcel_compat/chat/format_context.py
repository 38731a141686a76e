"""What llama.cpp's chat handlers add to the render context of some template families.

llama-server does not render every template with the same variables. ``common/chat.cpp`` picks a
handler by looking for marker strings in the template source, and some handlers add variables
the template needs (they win over ``chat_template_kwargs``, which llama.cpp merges first):

- **Llama 3.x** (the template has an ``ipython`` header, and is not a Functionary or
  Firefunction one): ``date_string`` is today's local date as ``"%d %b %Y"`` and
  ``tools_in_user_message`` is false. Without ``date_string`` the Llama 3.1 template prints its
  fixed fallback date in the "Today Date" line.
- **Firefunction v2** (the template calls ``functools[``): ``datetime`` is the local time as
  ``"%b %d %Y %H:%M:%S GMT"`` and ``functions`` is the request's tools as indented JSON (``""``
  without tools); the template itself gets no ``tools``. The template concatenates both, so it
  cannot render without them.

Only the render context is mirrored: llama.cpp's Llama 3.x built-in tools (``<|python_tag|>``
with ``wolfram_alpha`` / ``brave_search`` / ``code_interpreter``) are not detected, so
``builtin_tools`` is never set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

LLAMA_3_X = "llama-3.x"
FIREFUNCTION_V2 = "firefunction-v2"

# The markers common/chat.cpp dispatches on, in its order (the first match wins).
_FUNCTIONARY_V3_2 = ">>>all"
_FIREFUNCTION_V2 = " functools["
_HEADER = "<|start_header_id|>"
_FUNCTIONARY_V3_1 = "<function="
_LLAMA_3_X = "<|start_header_id|>ipython<|end_header_id|>"


def template_family(source: str) -> str | None:
    """The handler family of a template source whose render context llama.cpp extends, or None."""
    if _FUNCTIONARY_V3_2 in source:
        return None
    if _FIREFUNCTION_V2 in source:
        return FIREFUNCTION_V2
    if _HEADER in source and _FUNCTIONARY_V3_1 in source:
        return None
    if _LLAMA_3_X in source:
        return LLAMA_3_X
    return None


@dataclass(frozen=True)
class FormatContext:
    """The extra render variables of one template family (none for most templates)."""

    family: str | None

    @classmethod
    def of(cls, source: str) -> FormatContext:
        return cls(template_family(source))

    def apply(
        self, tools: Sequence[Mapping[str, Any]] | None, now: datetime | None = None
    ) -> tuple[Sequence[Mapping[str, Any]] | None, dict[str, Any]]:
        """``(tools the template sees, extra variables)`` for a render at ``now`` (local time)."""
        if self.family is None:
            return tools, {}
        now = now or datetime.now()
        if self.family == LLAMA_3_X:
            return tools, {"date_string": now.strftime("%d %b %Y"), "tools_in_user_message": False}
        functions = json.dumps(list(tools), indent=2, ensure_ascii=False) if tools else ""
        return None, {"datetime": now.strftime("%b %d %Y %H:%M:%S GMT"), "functions": functions}


__all__ = ["FIREFUNCTION_V2", "LLAMA_3_X", "FormatContext", "template_family"]
