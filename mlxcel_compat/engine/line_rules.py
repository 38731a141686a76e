"""llama-server's newline rules for one generation (``LineRules``): ``n_indent`` (a line shallower
than that many spaces or tabs ends it, and is cut from the reply) and ``t_max_predict_ms`` (the
time limit, checked only when a newline is sent, so lines stay whole), with what ``/slots``
shows of them (``has_new_line``)."""

from __future__ import annotations

import time


class LineRules:
    """The text sent so far (kept for ``n_indent`` only), whether a newline was sent
    (``t_max_predict_ms``, ``/slots`` ``has_new_line``) and where the last line starts."""

    def __init__(self, n_indent: int, t_max_predict_ms: float) -> None:
        self.n_indent = n_indent
        self.t_max_predict_ms = t_max_predict_ms
        self.text_sent = ""
        self.has_new_line = False
        self._last_nl_pos = 0
        self.content_cut = -1  # where the reply is cut (a shallower line), -1: nowhere

    def add_text(self, text: str) -> None:
        """Text sent to the client; only ``n_indent`` needs the text itself."""
        if self.n_indent > 0:
            self.text_sent += text

    def under_indented(self) -> bool:
        """``n_indent``: once a line has started, it must be indented by at least n_indent spaces
        or tabs; a shallower line ends generation and is cut from the reply (llama-server)."""
        n_indent = self.n_indent
        if n_indent <= 0 or not self.has_new_line:
            return False
        text = self.text_sent
        if self._last_nl_pos > 0:
            pos = self._last_nl_pos
            while pos < len(text) and text[pos] in " \t":
                pos += 1
            if pos < len(text) and pos - self._last_nl_pos < n_indent:
                self.content_cut = pos
                return True
        nl = text.find("\n", self._last_nl_pos)
        if nl >= 0:
            self._last_nl_pos = nl + 1
        return False

    def out_of_time(self, piece: str, started: float | None) -> bool:
        """``t_max_predict_ms``: checked only when a newline is sent, so lines stay whole;
        ``started``: when the first token was sampled (None: not yet)."""
        if "\n" not in piece:
            return False
        self.has_new_line = True
        limit = self.t_max_predict_ms
        return limit > 0 and started is not None and (time.perf_counter() - started) * 1000.0 > limit
