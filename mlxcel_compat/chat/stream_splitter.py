"""The streaming counterpart of reasoning and tool-call parsing: one reply, piece by piece.

A streamed reply is sent as ``content`` and ``reasoning_content`` deltas as it is generated, so
the markers that ``split_reasoning`` (``chat/reasoning.py``) and ``parse_tool_calls``
(``chat/tool_calls.py``) look for in a finished text have to be found across pieces here.
"""

from __future__ import annotations

from mlxcel_compat.chat.reasoning import THINK_END, THINK_START
from mlxcel_compat.chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = ["StreamSplitter"]


class StreamSplitter:
    """Splits streamed generated text into ``content`` and ``reasoning_content`` deltas.

    The streaming counterpart of :func:`split_reasoning` and :func:`parse_tool_calls`: text inside
    ``<think>...</think>`` (or before ``</think>`` when the prompt opened the block) goes to
    ``reasoning_content``; with tools, ``<tool_call>...</tool_call>`` blocks are withheld (the
    route sends them as ``tool_calls`` at the end). A suffix that may be the start of a marker is
    held back until the next piece decides it.
    """

    def __init__(self, *, reasoning: bool = True, in_reasoning: bool = False, tools: bool = False) -> None:
        self.mode = "reasoning_content" if reasoning and in_reasoning else "content"
        self.markers = ((THINK_START, THINK_END) if reasoning else ()) + ((TOOL_CALL_OPEN, TOOL_CALL_CLOSE) if tools else ())
        self.buffer = ""
        self.tool_text = ""  # an unfinished tool-call block, given back as content if never closed

    def push(self, text: str) -> list[tuple[str, str]]:
        """Feed generated text; return ``(field, text)`` deltas that can be sent now."""
        self.buffer += text
        out: list[tuple[str, str]] = []
        while True:
            hits = [(self.buffer.find(m), m) for m in self.markers if m in self.buffer]
            if not hits:
                keep = self._partial_marker_len()
                self._emit(out, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            index, marker = min(hits)
            self._emit(out, self.buffer[:index])
            self.buffer = self.buffer[index + len(marker) :]
            self._switch(marker)

    def flush(self) -> list[tuple[str, str]]:
        """The end of generation: release what was held back."""
        out: list[tuple[str, str]] = []
        self._emit(out, self.buffer)
        self.buffer = ""
        if self.mode == "tool":
            out.append(("content", TOOL_CALL_OPEN + self.tool_text))
            self.tool_text = ""
        return out

    def _switch(self, marker: str) -> None:
        if marker == THINK_START:
            self.mode = "reasoning_content"
        elif marker == THINK_END or marker == TOOL_CALL_CLOSE:
            self.mode = "content"
            self.tool_text = ""
        elif marker == TOOL_CALL_OPEN:
            self.mode = "tool"

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if not text:
            return
        if self.mode == "tool":
            self.tool_text += text
        elif out and out[-1][0] == self.mode:
            out[-1] = (self.mode, out[-1][1] + text)
        else:
            out.append((self.mode, text))

    def _partial_marker_len(self) -> int:
        longest = 0
        for marker in self.markers:
            for n in range(min(len(marker) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(marker[:n]):
                    longest = max(longest, n)
                    break
        return longest
