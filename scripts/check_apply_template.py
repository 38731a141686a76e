#!/usr/bin/env python
"""Side by side: ``/apply-template`` of llama-server and of this server, for llama.cpp's real templates.

For each of the 70 chat templates llama.cpp b11312 ships (``models/templates/*.jinja``, read from
the llama-cpp-python 0.3.36 sdist by ``tests/chat/conftest.py: read_llama_cpp_templates``), the
peer build of llama-server (``~/.cache/llama-peer/llama.cpp/build/bin/llama-server``) and this
server start on the same tiny factory GGUF with ``--jinja --chat-template-file T.jinja``, both get
the same ``/apply-template`` bodies (``BODIES`` of ``tests/chat/apply_template_bodies.py``), each
sent with ``add_generation_prompt`` true and false, and the prompts are compared byte for byte. A
difference is forgiven only where the template prints a date and every differing stretch of text
is a date (``dates_only``).

The bodies, grouped into the table's columns:

- ``plain``: a system prompt and a short multi-turn conversation; a system prompt and a user turn
  as typed text parts;
- ``tools``: the first with two tools, with ``tool_choice`` absent, ``"none"`` and ``"required"``;
- ``history``: a tool-call history: a user turn, an assistant turn with one call (arguments as a
  JSON object, ``content: null``), its ``tool`` result, an assistant turn with two calls (arguments
  as JSON strings, ``content: ""``), their results (one with a ``name``), the assistant's answer
  and a final user turn; the same with one call a turn (Llama 3.x refuses two); two calls
  answered out of order;
- ``reasoning``: ``reasoning_content`` on a past assistant turn, without tools and next to a call,
  with thinking turned off (``chat_template_kwargs``) and with a ``reasoning_effort``; an agent's
  loop in progress (a reasoned call and its result);
- ``prefill`` (informative: not counted in the verdict): a trailing assistant message to continue.

The ``caps`` column compares ``/props`` ``chat_template_caps`` (they decide how the messages are
shaped for the template). A cell reads ``same`` when every body of its column gave the same prompt
on both servers, and says how many both servers refused (the template raised: e.g. Llama 3.x and
two calls in one turn); ``different`` when one did not. The script exits 0 when every template is ``same`` in the five
counted columns. ``--save FILE`` keeps both servers' answers as JSON; ``--pin FILE`` writes
llama-server's prompts of the cases ``tests/chat/test_render_pins.py`` pins.

Usage::

    .venv/bin/python scripts/check_apply_template.py                   # all 70 templates, the table
    .venv/bin/python scripts/check_apply_template.py --only Qwen3 --diff  # a few, with their diffs
    .venv/bin/python scripts/check_apply_template.py --save /tmp/apply-template.json
    .venv/bin/python scripts/check_apply_template.py --pin tests/chat/apply_template_pins.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import json
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import ROOT, ServerProcess, free_port  # noqa: E402
from tests.chat.apply_template_bodies import BODIES, COLUMNS, INFORMATIVE_COLUMNS, PINNED, cases  # noqa: E402

LLAMA_SERVER = Path.home() / ".cache/llama-peer/llama.cpp/build/bin/llama-server"
SERVER_ARGS = ["--jinja", "-c", "512", "-np", "1"]

# What a date printed by a template looks like, and what in a template prints one.
_DATE_STRETCH = re.compile(r"[0-9A-Za-z ,:/-]*")
_DATE_SOURCES = ("strftime_now", "date_string", "datetime")
# The date formats of llama-server's date variables and of the templates' strftime_now calls;
# ``--pin`` writes them as ``<<date:FORMAT>>``, which the test fills in with its own today.
DATE_FORMATS = ("%d %b %Y", "%b %d %Y", "%Y-%m-%d")


@dataclass
class Answer:
    """One server's answer to one body: the prompt, or the error it gave."""

    prompt: str | None
    error: str | None = None


@dataclass
class TemplateResult:
    """Both servers' answers for one template, by case (``body/agp``), or why none came."""

    name: str
    cases: dict[str, dict[str, Answer]] = field(default_factory=dict)
    failure: str | None = None  # a server refused the template at start-up
    # /props chat_template_caps where the two servers disagree: name -> (llama-server, ours)
    caps_differ: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> Answer:
    response = client.post(url + "/apply-template", json=body)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        return Answer(None, f"{response.status_code}: {message}")
    return Answer(response.json()["prompt"])


def dates_only(source: str, peer: str, ours: str) -> bool:
    """True when the template prints a date and every stretch where the prompts differ is date-like."""
    if not any(word in source for word in _DATE_SOURCES):
        return False
    matcher = difflib.SequenceMatcher(None, peer, ours, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            continue
        for stretch in (peer[a0:a1], ours[b0:b1]):
            if not _DATE_STRETCH.fullmatch(stretch):
                return False
    return True


def verdict(source: str, answers: dict[str, Answer]) -> str:
    """``same``, ``same (dates aside)``, ``both refuse`` or ``different``."""
    peer, ours = answers["peer"], answers["ours"]
    if peer.prompt is None and ours.prompt is None:
        return "both refuse"
    if peer.prompt is None or ours.prompt is None:
        return "different"
    if peer.prompt == ours.prompt:
        return "same"
    return "same (dates aside)" if dates_only(source, peer.prompt, ours.prompt) else "different"


def run_template(name: str, source: str, model: Path, workdir: Path, python: str) -> TemplateResult:
    """Start both servers on ``source`` and post every case to each."""
    path = workdir / f"{name}.jinja"
    path.write_text(source, encoding="utf-8")
    args = ["-m", str(model), "--chat-template-file", str(path), *SERVER_ARGS]
    peer_port = free_port()
    peer = ServerProcess([str(LLAMA_SERVER), "--host", "127.0.0.1", "--port", str(peer_port), *args], peer_port,
                         name=f"llama-server-{name}")
    ours = ServerProcess.mlxcel(model, ["--chat-template-file", str(path), *SERVER_ARGS], python=python,
                                name=f"mlxcel-{name}", cwd=ROOT)
    result = TemplateResult(name)
    try:
        for server in (peer, ours):
            server.start()
        for server in (peer, ours):
            try:
                server.wait_healthy(120)
            except RuntimeError as exc:
                result.failure = f"{server.name} did not start: {str(exc).splitlines()[-1]}"
                return result
        with httpx.Client(timeout=60) as client:
            theirs, mine = (client.get(url + "/props").json().get("chat_template_caps", {})
                            for url in (peer.base_url, ours.base_url))
            result.caps_differ = {k: (theirs.get(k), mine.get(k)) for k in sorted(set(theirs) | set(mine))
                                  if theirs.get(k) != mine.get(k)}
            for case, body in cases():
                result.cases[case] = {"peer": post(client, peer.base_url, body), "ours": post(client, ours.base_url, body)}
    finally:
        for server in (peer, ours):
            server.stop(grace=5)
    return result


def column_verdicts(source: str, result: TemplateResult) -> dict[str, str]:
    """The table's cells: ``same`` when every case of the column gave the same prompt, ``different``
    when one did not; cases both servers refused are counted in the cell."""
    cells = {}
    for column in COLUMNS + INFORMATIVE_COLUMNS:
        found = [verdict(source, answers) for case, answers in result.cases.items()
                 if BODIES[case.split("/")[0]][0] == column]
        refused = found.count("both refuse")
        if "different" in found:
            cells[column] = "different"
        elif refused == len(found):
            cells[column] = "both refuse"
        else:
            cells[column] = "same (dates aside)" if "same (dates aside)" in found else "same"
            if refused:
                cells[column] += f", {refused} of {len(found)} refused by both"
    return cells


def show_diff(source: str, result: TemplateResult) -> None:
    for case, answers in result.cases.items():
        if verdict(source, answers).startswith("same") or verdict(source, answers) == "both refuse":
            continue
        peer, ours = answers["peer"], answers["ours"]
        print(f"--- {result.name} {case}")
        if peer.prompt is None or ours.prompt is None:
            print(f"  llama-server: {peer.error or 'ok'}\n  ours:         {ours.error or 'ok'}")
            continue
        diff = difflib.unified_diff(peer.prompt.splitlines(keepends=True), ours.prompt.splitlines(keepends=True),
                                    "llama-server", "mlxcel", n=1)
        sys.stdout.writelines(line if line.endswith("\n") else line + "\n" for line in diff)


def model_facts(model: Path) -> dict[str, Any]:
    """What the pinned prompts depend on besides the template: the model's BOS and EOS text, and
    whether its tokenizer adds the BOS (llama-server then leaves it out of the prompt)."""
    port = free_port()
    peer = ServerProcess([str(LLAMA_SERVER), "--host", "127.0.0.1", "--port", str(port), "-m", str(model), *SERVER_ARGS],
                         port, name="llama-server-facts")
    peer.start()
    try:
        peer.wait_healthy(120)
        with httpx.Client(base_url=peer.base_url, timeout=60) as client:
            props = client.get("/props").json()
            special = client.post("/tokenize", json={"content": "a", "add_special": True}).json()["tokens"]
            plain = client.post("/tokenize", json={"content": "a", "add_special": False}).json()["tokens"]
    finally:
        peer.stop(grace=5)
    return {"bos_token": props["bos_token"], "eos_token": props["eos_token"], "add_bos": special[:1] != plain[:1]}


def write_pins(path: Path, model: Path, results: dict[str, TemplateResult]) -> None:
    """llama-server's prompts of the pinned cases, today's date written as ``<<date:FORMAT>>``."""
    from datetime import datetime

    today = datetime.now()
    prompts: dict[str, dict[str, str]] = {}
    for name, pinned in PINNED.items():
        if name not in results:
            continue
        for case in pinned:
            prompt = results[name].cases[case]["peer"].prompt
            assert prompt is not None, f"llama-server refused the pinned case {name} {case}"
            for fmt in DATE_FORMATS:
                prompt = prompt.replace(today.strftime(fmt), f"<<date:{fmt}>>")
            prompts.setdefault(name, {})[case] = prompt
    where = path.resolve()
    shown = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
    pins = {"command": f"python scripts/check_apply_template.py --pin {shown}", **model_facts(model), "prompts": prompts}
    path.write_text(json.dumps(pins, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="templates whose name contains this (repeatable)")
    parser.add_argument("--model", help="the GGUF both servers load (default: the factory's tiny llama)")
    parser.add_argument("--diff", action="store_true", help="print the differing prompts as unified diffs")
    parser.add_argument("--save", help="write both servers' answers to this JSON file")
    parser.add_argument("--pin", help="write llama-server's prompts of the pinned cases (PINNED) to this JSON file "
                                      "(tests/chat/apply_template_pins.json)")
    parser.add_argument("--jobs", type=int, default=1, help="templates checked at once")
    args = parser.parse_args()

    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from tests.chat.conftest import read_llama_cpp_templates

    if not LLAMA_SERVER.is_file():
        print(f"{LLAMA_SERVER} is missing: ../shared/peers/build-llama-server.sh builds it", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else ensure_gguf("llama", "tiny")
    templates = read_llama_cpp_templates()
    if args.only:
        templates = {k: v for k, v in templates.items() if any(s.lower() in k.lower() for s in args.only)}
    python = sys.executable
    results: dict[str, TemplateResult] = {}
    with tempfile.TemporaryDirectory(prefix="check_apply_template_") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_template, name, source, model, Path(tmp), python): name
                       for name, source in templates.items()}
            for future in concurrent.futures.as_completed(futures):
                result = future.result()
                results[result.name] = result
                print(f"checked {result.name}", file=sys.stderr, flush=True)

    print("| template | caps | plain | tools | tool history | reasoning | prefill (informative) |")
    print("|---|---|---|---|---|---|---|")
    n_same = 0
    for name in sorted(results):
        result = results[name]
        if result.failure:
            print(f"| {name} | {result.failure} | | | | | |")
            continue
        cells = column_verdicts(templates[name], result)
        caps = "same" if not result.caps_differ else "different: " + ", ".join(
            f"{k} {a} (ours {b})" for k, (a, b) in result.caps_differ.items())
        n_same += all(cells[c] != "different" for c in COLUMNS) and not result.caps_differ
        print(f"| {name} | {caps} | " + " | ".join(cells[c] for c in COLUMNS + INFORMATIVE_COLUMNS) + " |")
    print(f"\n{n_same} of {len(results)} templates render the same on both servers (caps, plain, tools, tool "
          "history, reasoning).")
    if args.diff:
        for name in sorted(results):
            show_diff(templates[name], results[name])
    if args.pin:
        write_pins(Path(args.pin), model, results)
    if args.save:
        saved = {name: {case: {side: vars(answer) for side, answer in answers.items()}
                        for case, answers in r.cases.items()} | ({"failure": r.failure} if r.failure else {})
                 for name, r in sorted(results.items())}
        Path(args.save).write_text(json.dumps(saved, indent=1, ensure_ascii=False), encoding="utf-8")
    return 0 if n_same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
