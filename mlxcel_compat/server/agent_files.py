"""The built-in agent tools that read, search and write files: ``read_file``,
``file_glob_search``, ``grep_search``, ``write_file`` and ``edit_file`` (``--tools``).

Names, limits and result shapes are llama-server's (b11312, ``tools/server/server-tools.cpp``); a
tool's own failure is a result ``{"error": "..."}``, which the page hands to the model. Paths
resolve as ``agent_host.resolve`` resolves them; ``edit_file``'s replacements are
``text_edits.py``'s.
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

from mlxcel_compat.server.agent_host import list_entries, path_glob_match, resolve
from mlxcel_compat.server.agent_params import Chunk, ParamError, optional, required, type_name
from mlxcel_compat.server.text_edits import apply_edits

READ_FILE_MAX_SIZE = 16 * 1024
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100


def _lines(content: bytes) -> list[bytes]:
    """Lines as ``std::getline`` yields them: a final newline adds no empty line."""
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def read_file(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    start_line = optional(params, "start_line", 1)
    end_line = optional(params, "end_line", -1)
    append_loc = optional(params, "append_loc", False)
    full = resolve(path, params.get("cwd", ""))
    if not os.path.isfile(full):
        return {"error": "cannot stat file: " + path}
    size = os.path.getsize(full)
    if params.get("resp_type") == "base64":
        if size > READ_FILE_MAX_SIZE_BASE64:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE_BASE64})"}
        try:
            content = Path(full).read_bytes()
        except OSError:
            return {"error": "failed to open file: " + path}
        return {"base64": base64.b64encode(content).decode("ascii"), "size_bytes": len(content)}
    if size > READ_FILE_MAX_SIZE and end_line == -1:
        return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE}). "
                         "Use start_line/end_line to read a portion."}
    try:
        content = Path(full).read_bytes()
    except OSError:
        return {"error": "failed to open file: " + path}
    result = bytearray()
    for number, line in enumerate(_lines(content), start=1):
        if number < start_line:
            continue
        if end_line != -1 and number > end_line:
            break
        out_line = (f"{number}\u2192".encode() if append_loc else b"") + line + b"\n"
        if len(result) + len(out_line) > READ_FILE_MAX_SIZE:
            result += b"[output truncated]"
            break
        result += out_line
    return {"plain_text_response": result.decode("utf-8", "replace")}


def file_glob_search(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    base = resolve(path, params.get("cwd", ""))
    include = optional(params, "include", "**")
    exclude = optional(params, "exclude", "")
    kind = optional(params, "type", "file")
    max_depth = max(0, optional(params, "max_depth", 0))
    limit = optional(params, "limit", FILE_SEARCH_MAX_RESULTS)
    if limit < 1:
        return {"error": f"invalid limit: {limit} (expected 1 or more)"}
    limit = min(limit, FILE_SEARCH_MAX_RESULTS)
    if kind not in ("file", "dir", "all"):
        return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
    listing = list_entries(base, max_depth, kind)
    if listing.error:
        return {"error": f"{listing.error}: {path}"}
    matches = [(rel, is_dir) for rel, is_dir in listing.entries
               if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]
    shown = matches[:limit]
    text = "".join(rel + ("/" if is_dir else "") + "\n" for rel, is_dir in shown)
    text += f"\n---\nTotal matches: {len(matches)}\n"
    if len(matches) > len(shown):
        text += (f"[{len(shown)} results limit reached ({len(matches)} total matches). "
                 "Refine the glob pattern to narrow the search.]\n")
    if listing.truncated:
        text += "[results truncated: time budget or unreadable directory]\n"
    entries = [{"path": rel, "type": "dir" if is_dir else "file"} for rel, is_dir in shown]
    return {"plain_text_response": text, "entries": entries, "base": base}


def grep_search(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    pattern = required(params, "pattern", str)
    include = optional(params, "include", "**")
    exclude = optional(params, "exclude", "")
    show_number = optional(params, "return_line_numbers", False)
    literal = optional(params, "literal", False)
    ignore_case = optional(params, "ignore_case", False)
    context = max(0, optional(params, "context_lines", 0))
    try:
        regex = re.compile(re.escape(pattern) if literal else pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        return {"error": f"invalid regex: {exc}"}
    full = resolve(path, params.get("cwd", ""))
    files: list[tuple[str, str]] = []
    if os.path.isfile(full):
        files.append((full, path))
    elif os.path.isdir(full):
        listing = list_entries(full, 0, "file")
        if listing.error:
            return {"error": f"{listing.error}: {path}"}
        files += [(os.path.join(full, rel), rel) for rel, _ in listing.entries
                  if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]
    else:
        return {"error": "path does not exist: " + path}
    out: list[str] = []
    total = 0
    limit_reached = False
    show_number = show_number or context > 0
    for file_path, shown in files:
        if limit_reached:
            break
        try:
            lines = [line.decode("utf-8", "replace") for line in _lines(Path(file_path).read_bytes())]
        except OSError:
            continue
        for i, line in enumerate(lines):
            if total >= GREP_SEARCH_MAX_RESULTS:
                limit_reached = True
                break
            if not regex.search(line):
                continue
            first, last = (max(0, i - context), min(len(lines) - 1, i + context)) if context else (i, i)
            for j in range(first, last + 1):
                mark = ":" if j == i else "-"
                out.append(f"{shown}{mark}" + (f"{j + 1}{mark}" if show_number else "") + lines[j] + "\n")
            if context:
                out.append("--\n")
            total += 1
    text = "".join(out) + f"\n---\nTotal matches: {total}\n"
    if limit_reached:
        text += f"[{GREP_SEARCH_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n"
    return {"plain_text_response": text}


def _write(full: str, content: bytes) -> bool:
    try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        Path(full).write_bytes(content)
    except OSError:
        return False
    return True


def write_file(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    content = required(params, "content", str).encode("utf-8", "surrogatepass")
    if not _write(resolve(path, params.get("cwd", "")), content):
        return {"error": "failed to write file: " + path}
    return {"result": "file written successfully", "path": path, "bytes": len(content)}


def edit_file(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    if "edits" not in params:
        required(params, "edits", list)  # raises: the key is required
    edits_json = params["edits"]
    if not isinstance(edits_json, list) or not edits_json:
        return {"error": '"edits" must be a non-empty array'}
    edits: list[tuple[str, str]] = []
    for item in edits_json:
        if not isinstance(item, dict):
            raise ParamError(f"[json.exception.type_error.304] cannot use at() with {type_name(item)}")
        old, new = required(item, "old_text", str), required(item, "new_text", str)
        if not old:
            return {"error": f"edits[{len(edits)}].old_text must not be empty"}
        edits.append((old, new))
    full = resolve(path, params.get("cwd", ""))
    try:
        original = Path(full).read_bytes().decode("utf-8", "surrogateescape")
    except OSError:
        return {"error": "failed to open file: " + path}
    new_content, error = apply_edits(original, edits, path)
    if error:
        return {"error": error}
    if not _write(full, new_content.encode("utf-8", "surrogateescape")):
        return {"error": "failed to write file: " + path}
    return {"result": "file edited successfully", "path": path, "edits_applied": len(edits)}
