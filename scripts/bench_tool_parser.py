#!/usr/bin/env python3
"""Cost of taking a streamed reply apart: microseconds per token, at growing reply lengths.

For several families' syntaxes, learned from llama.cpp's real templates (read from the
llama-cpp-python sdist as the tests read them), a reply of N tokens is fed to the streaming parser
(``chat/stream_splitter.py: ReplyStream``) one token-sized piece (4 characters) at a time, as the
server feeds it. Replies:

* ``text``: reasoning then an answer (no call);
* ``call``: a call whose one string argument holds the whole reply (a file written by an agent);
* ``calls``: short calls, one after another (as many as fit in N tokens).

The cost per token must stay flat as N grows (the parser is linear in the reply) and be a few
microseconds at most. Each case is timed ``--reps`` times; the median is reported.

Examples::

    python scripts/bench_tool_parser.py
    python scripts/bench_tool_parser.py --tokens 1000,10000,100000 --reps 5 --json tool_parser.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mlxcel_compat.chat.stream_splitter import ReplyStream  # noqa: E402
from mlxcel_compat.chat.syntax import ChatSyntax  # noqa: E402
from mlxcel_compat.chat.template import ChatTemplate  # noqa: E402
from mlxcel_compat.chat.tool_calls import ReplyOptions  # noqa: E402
from tests.chat.conftest import read_llama_cpp_templates  # noqa: E402

FAMILIES = {
    "Hermes JSON (Qwen2.5)": "Qwen-Qwen2.5-7B-Instruct",
    "tagged (Qwen3-Coder)": "Qwen3-Coder",
    "tagged, typed (DeepSeek V3.2)": "deepseek-ai-DeepSeek-V3.2",
    "name + JSON (Kimi K2)": "moonshotai-Kimi-K2",
    "Harmony (gpt-oss)": "openai-gpt-oss-120b",
}
PIECE = 4  # characters per token-sized piece
WORDS = "the quick brown fox jumps over the lazy dog while reading a file named data.txt again and "


def filler(chars: int) -> str:
    return (WORDS * (chars // len(WORDS) + 1))[:chars]


def render_reply(template: ChatTemplate, kind: str, tokens: int) -> str:
    """A reply of about ``tokens`` token-sized pieces, written by the template itself."""
    chars = tokens * PIECE
    user = [{"role": "user", "content": "Please write the file."}]
    tools = [{"type": "function", "function": {"name": "write_file", "description": "Write a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path"]}}}]
    if kind == "text":
        message = {"role": "assistant", "content": filler(chars // 2), "reasoning_content": filler(chars // 2)}
    elif kind == "call":
        calls = [{"id": "call00001", "type": "function", "function": {
            "name": "write_file", "arguments": json.dumps({"path": "a.txt", "content": filler(chars)})}}]
        message = {"role": "assistant", "content": "", "tool_calls": calls}
    else:
        one = {"id": "call00001", "type": "function", "function": {
            "name": "write_file", "arguments": json.dumps({"path": "a.txt", "content": "short"})}}
        probe = template.render([*user, {"role": "assistant", "content": "", "tool_calls": [one]}], tools=tools,
                                add_generation_prompt=False)
        per_call = max(1, len(probe) - len(template.render(user, tools=tools, add_generation_prompt=False)))
        count = max(1, chars // per_call) if template.caps()["supports_parallel_tool_calls"] else 1
        message = {"role": "assistant", "content": "", "tool_calls": [one] * count}
    prompt = template.render(user, tools=tools, add_generation_prompt=True, enable_thinking=True)
    full = template.render([*user, message], tools=tools, add_generation_prompt=False, enable_thinking=True)
    shared = os.path.commonprefix([prompt, full])
    return full[len(shared):]


def time_stream(syntax: ChatSyntax, text: str, reps: int) -> tuple[float, int]:
    """Median CPU seconds to stream ``text`` through the parser, and the number of pieces."""
    pieces = [text[i: i + PIECE] for i in range(0, len(text), PIECE)]
    options = ReplyOptions(tools=True)
    times = []
    for _ in range(reps):
        stream = ReplyStream(syntax, options)
        start = time.process_time()  # the parser's own CPU time: the machine may be shared
        for piece in pieces:
            stream.push(piece)
        stream.finish()
        times.append(time.process_time() - start)
    return statistics.median(times), len(pieces)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1000,10000,100000", help="reply lengths, in token-sized pieces")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    templates = read_llama_cpp_templates()
    results: list[dict[str, Any]] = []
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{PIECE}-character pieces, median of {args.reps}")
    print(f"{'syntax':32} {'reply':6} " + " ".join(f"{n:>10}" for n in lengths) + "   (µs per token)")
    for label, stem in FAMILIES.items():
        template = ChatTemplate(templates[stem])
        syntax = template.syntax()
        for kind in ("text", "call", "calls"):
            row = []
            for n in lengths:
                text = render_reply(template, kind, n)
                seconds, pieces = time_stream(syntax, text, args.reps)
                per_token = seconds / pieces * 1e6
                row.append(per_token)
                results.append({"syntax": label, "template": stem, "reply": kind, "tokens": pieces,
                                "chars": len(text), "seconds": seconds, "us_per_token": per_token})
            print(f"{label:32} {kind:6} " + " ".join(f"{v:10.2f}" for v in row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
