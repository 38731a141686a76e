"""The server's log lines: llama-server's ``--log-*`` flags over Python's ``logging``.

By default a line reads ``TIME LEVEL logger: message`` on stderr. llama-server's flags change it
as they change llama.cpp's log (``common/log.cpp``):

- ``--log-prefix``: the line starts with llama.cpp's level mark instead (``I``, ``W``, ``E``,
  ``D``, then a space) and the message follows, without Python's time and logger name;
- ``--log-timestamps`` (only with ``--log-prefix``, as in llama.cpp): the time since start-up
  before the mark, ``minutes.seconds.milliseconds.microseconds`` (``0.01.234.567``);
- ``--log-colors on|off|auto``: the mark (or the level word) in llama.cpp's ANSI colours (info
  green, warning magenta, error red, debug yellow, the timestamp blue); ``auto`` colours only
  where stderr is a terminal;
- ``--log-file FNAME``: every line also goes to that file (appended; never coloured, so that it
  reads the same in any viewer).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import IO

PYTHON_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# llama.cpp's log colours (common/log.h: LOG_COL_*).
RESET = "\033[0m"
COLOURS = {"D": "\033[33m", "I": "\033[32m", "W": "\033[35m", "E": "\033[31m"}
BLUE = "\033[34m"


@dataclass(frozen=True)
class LogStyle:
    """How a line is written: llama.cpp's prefix and timestamps, colours."""

    prefix: bool = False
    timestamps: bool = False
    colours: bool = False


def level_mark(levelno: int) -> str:
    """llama.cpp's one-letter level (errors and above are ``E``, anything below info ``D``)."""
    if levelno >= logging.ERROR:
        return "E"
    if levelno >= logging.WARNING:
        return "W"
    return "I" if levelno >= logging.INFO else "D"


def elapsed_stamp(seconds: float) -> str:
    """llama.cpp's timestamp: ``M.SS.mmm.uuu`` since the log started."""
    us = int(seconds * 1_000_000)
    return f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"


class StyledFormatter(logging.Formatter):
    """One formatter per destination: the same style, coloured or not."""

    def __init__(self, style: LogStyle, started: float) -> None:
        super().__init__(None if style.prefix else PYTHON_FORMAT)
        self.style = style
        self.started = started

    def format(self, record: logging.LogRecord) -> str:
        if not self.style.prefix:
            if not self.style.colours:
                return super().format(record)
            saved = record.levelname
            record.levelname = COLOURS[level_mark(record.levelno)] + saved + RESET
            try:
                return super().format(record)
            finally:
                record.levelname = saved
        mark = level_mark(record.levelno)
        text = super().format(record)
        stamp = ""
        if self.style.timestamps:
            stamp = elapsed_stamp(record.created - self.started)
            stamp = (BLUE + stamp + RESET if self.style.colours else stamp) + " "
        if not self.style.colours:
            return f"{stamp}{mark} {text}"
        if mark == "I":  # llama.cpp resets after an info mark, and after the message of the others
            return f"{stamp}{COLOURS[mark]}{mark} {RESET}{text}"
        return f"{stamp}{COLOURS[mark]}{mark} {text}{RESET}"


def wants_colours(setting: str, stream: IO[str]) -> bool:
    """``--log-colors``: on, off, or auto (a terminal)."""
    if setting == "auto":
        return bool(getattr(stream, "isatty", lambda: False)())
    return setting == "on"


def configure(level: int, *, prefix: bool = False, timestamps: bool = False, colours: str = "auto",
              log_file: str | None = None, stream: IO[str] = sys.stderr) -> None:
    """Install the handlers on the root logger: ``stream``, and ``log_file`` when given
    (``OSError`` when it cannot be opened: the caller stops start-up)."""
    started = time.time()
    style = LogStyle(prefix=prefix, timestamps=timestamps and prefix)
    handlers: list[logging.Handler] = []
    console = logging.StreamHandler(stream)
    console.setFormatter(StyledFormatter(LogStyle(style.prefix, style.timestamps, wants_colours(colours, stream)), started))
    handlers.append(console)
    if log_file:
        file = logging.FileHandler(log_file, encoding="utf-8")
        file.setFormatter(StyledFormatter(style, started))
        handlers.append(file)
    logging.basicConfig(level=level, handlers=handlers, force=True)


__all__ = ["LogStyle", "StyledFormatter", "configure", "elapsed_stamp", "level_mark", "wants_colours"]
