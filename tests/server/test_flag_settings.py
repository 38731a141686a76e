"""How the deployment flags of issue 55 resolve (``settings.py``) and how the log lines look (``logs.py``)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from mlxcel_compat.server import log_format as logs
from mlxcel_compat.runtime.backend import ThreadCounts
from mlxcel_compat.settings import CACHE_RAM_UNLIMITED, SettingsError, resolve_settings


def test_cache_ram_is_mib_minus_one_unlimited_and_zero_off() -> None:
    assert resolve_settings(["-cram", "64"], {}).prompt_cache_capacity_bytes == 64 << 20
    assert resolve_settings([], {"LLAMA_ARG_CACHE_RAM": "-1"}).prompt_cache_capacity_bytes == CACHE_RAM_UNLIMITED
    assert resolve_settings(["-cram", "0"], {}).prompt_cache_enabled is False
    assert resolve_settings(["-cram", "0", "--prompt-cache-enabled"], {}).prompt_cache_enabled is True
    both = resolve_settings(["-cram", "64", "--prompt-cache-capacity-bytes", "1000"], {})
    assert both.prompt_cache_capacity_bytes == 1000  # the finer option wins
    assert resolve_settings([], {}).prompt_cache_capacity_bytes is None  # unset: the model-aware default


def test_tls_needs_both_files(tmp_path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(SettingsError, match="needs --ssl-cert-file"):
        resolve_settings(["--ssl-key-file", str(key)], {})
    with pytest.raises(SettingsError, match="ssl-cert-file"):
        resolve_settings(["--ssl-cert-file", str(tmp_path / "missing.pem"), "--ssl-key-file", str(key)], {})


def test_path_must_be_a_directory(tmp_path) -> None:
    assert resolve_settings(["--path", str(tmp_path)], {}).static_path == str(tmp_path)
    with pytest.raises(SettingsError, match="--path"):
        resolve_settings(["--path", str(tmp_path / "nope")], {})


def test_thread_counts_follow_llama_cpp() -> None:
    assert ThreadCounts.from_flags(-1, None) == ThreadCounts(None, None)  # the defaults: nothing bound
    assert ThreadCounts.from_flags(3, None) == ThreadCounts(3, 3)  # -tb follows -t
    assert ThreadCounts.from_flags(3, 1) == ThreadCounts(3, 1)
    assert resolve_settings(["-t", "0", "-tb", "-5"], {}).threads == -1
    assert resolve_settings(["-t", "0", "-tb", "-5"], {}).threads_batch == -1
    assert resolve_settings([], {"LLAMA_ARG_THREADS": "2"}).threads == 2


def test_log_colors_words() -> None:
    assert resolve_settings(["--log-colors"], {}).log_colors == "on"
    assert resolve_settings(["--log-colors", "off"], {}).log_colors == "off"
    assert resolve_settings([], {}).log_colors == "auto"


def format_line(style: logs.LogStyle, level: int = logging.INFO) -> str:
    record = logging.LogRecord("mlxcel_compat", level, __file__, 1, "hello", (), None)
    record.created = 1000.0 + 61.002003
    return logs.StyledFormatter(style, started=1000.0).format(record)


def test_llama_cpp_prefix_timestamps_and_colours() -> None:
    assert format_line(logs.LogStyle(prefix=True)) == "I hello"
    assert format_line(logs.LogStyle(prefix=True), logging.WARNING) == "W hello"
    assert re.fullmatch(r"1\.01\.00[12]\.\d{3} I hello", format_line(logs.LogStyle(prefix=True, timestamps=True)))
    assert format_line(logs.LogStyle(prefix=True, colours=True)) == "\033[32mI \033[0mhello"
    assert format_line(logs.LogStyle(prefix=True, colours=True), logging.ERROR) == "\033[31mE hello\033[0m"
    assert "INFO mlxcel_compat: hello" in format_line(logs.LogStyle())
    assert not logs.wants_colours("auto", io.StringIO()) and logs.wants_colours("on", io.StringIO())
