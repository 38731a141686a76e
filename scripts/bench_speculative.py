#!/usr/bin/env python3
"""Speculative decoding's decode speed-up, measured side by side in one run (issue 33).

Two workloads, each served plain and speculating by our server (and by llama-server with the
same flags when ``--peer-llama-server`` names its binary), every request greedy, through
``/completion``; the figure is ``timings.predicted_per_second`` (llama-server's own), and the
ratio is speculating over plain of the same server, measured in alternation:

- ``edit``: a real trained model (default: SmolLM2-135M-Instruct, fetched as the demo fetches it;
  ``--model`` another GGUF) asked to give back a file with a small fix: the answer repeats most of
  its prompt, which n-gram drafting (``--spec-type ngram-simple``; ``--spec-types`` others, e.g.
  ``ngram-simple,ngram-cache``) turns into long drafts; three files (``EDITS``, a typo each), each
  reported, and all three together (their tokens over their decoding time);
- ``draft``: the factory's derived target/draft pair (``mlxcel_compat.testing.draft_pair``: the
  draft is the target's first layers, the target's deeper layers damped), written as GGUF so
  llama-server serves the same weights, speculating with ``-md``.

Both servers' greedy outputs with and without speculation are compared and reported.

    scripts/bench_speculative.py [--workload edit|draft|both] [--peer-llama-server BIN] [--reps 3]
        [--baseline DIR]  (another checkout's package beside this one: e.g. main's, under the same load)
        [--edits N]  (the edit workload's first N files)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import httpx

from benchlib import ROOT, ServerProcess, free_port, mean, ratio, run

sys.path.insert(0, str(ROOT))

FILE = '''import json
import os


def load_settings(path):
    """Read the settings file, or the defaults when it is missing."""
    if not os.path.exists(path):
        retrun {"theme": "light", "font_size": 12, "autosave": True}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save_settings(path, settings):
    """Write the settings as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=2, sort_keys=True)


def update_setting(path, key, value):
    settings = load_settings(path)
    settings[key] = value
    save_settings(path, settings)
    return settings
'''
SCRIPT = """const fs = require("fs");
const path = require("path");

function readConfig(dir) {
  const file = path.join(dir, "config.json");
  if (!fs.existsSync(file)) {
    return { port: 8080, host: "localhost", debug: false };
  }
  const text = fs.readFileSync(file, "utf8");
  return JSON.prase(text);
}

function writeConfig(dir, config) {
  const file = path.join(dir, "config.json");
  fs.writeFileSync(file, JSON.stringify(config, null, 2));
}

function setOption(dir, key, value) {
  const config = readConfig(dir);
  config[key] = value;
  writeConfig(dir, config);
  return config;
}

module.exports = { readConfig, writeConfig, setOption };
"""
CLASS = '''class Inventory:
    """Items and their counts."""

    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] -= count
        if self.items[name] <= 0:
            del self.itmes[name]

    def total(self):
        return sum(self.items.values())

    def report(self):
        lines = [f"{name}: {count}" for name, count in sorted(self.items.items())]
        return "\\n".join(lines)
'''


@dataclass(frozen=True)
class Edit:
    """One "edit this file" request: a file with one typo, to be given back fixed."""

    name: str
    language: str  # the code fence's
    text: str
    typo: str

    @property
    def ask(self) -> str:
        return f"Fix the typo '{self.typo}' in this file and output the complete corrected file.\n\n```{self.language}\n"


# The workload's files: the first is the one every earlier figure used (`--edits 1`); the others
# make the speed-up a property of the speculation rather than of one text (whether a 135M model's
# greedy answer keeps to the file or strays from it moves with any change to rounding).
EDITS = (Edit("settings.py", "python", FILE, "retrun"), Edit("config.js", "javascript", SCRIPT, "prase"),
         Edit("inventory.py", "python", CLASS, "itmes"))


def start(name: str, cmd: list[str], port: int, env: dict[str, str] | None = None) -> ServerProcess:
    # ``python -m`` imports from its working directory first: a checkout's own (``--baseline``)
    server = ServerProcess(cmd, port, name=name, env=env, cwd=(env or {}).get("PYTHONPATH"))
    server.start()
    server.wait_healthy(300)
    return server


THREADS: list[str] = []  # -t/-tb for our servers (--threads)


def ours(model: Path, extra: list[str]) -> tuple[list[str], int]:
    port = free_port()
    return [sys.executable, "-m", "mlxcel_compat", "-m", str(model), "--port", str(port), "-np", "1", "-c", "4096",
            *THREADS, *extra], port


def peer(binary: str, model: Path, extra: list[str]) -> tuple[list[str], int]:
    port = free_port()
    return [binary, "-m", str(model), "--port", str(port), "-np", "1", "-c", "4096", "-t", "2", *extra], port


def completion(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(base_url=server.base_url, timeout=600) as http:
        out = http.post("/completion", json=body)
        out.raise_for_status()
        return out.json()


# The answer starts with the code fence: on the bare prompt the model's first token is a near-tie
# (float32 logits 33.77 for "```" against 33.52 for "To" on SmolLM2-135M-Instruct Q4_1, the first
# file), so whether it gave back the file or talked about it hung on 8-bit activations' rounding
# (both happened, 2026-12-07), and with it how much there was to draft. Begun, the answer is the file.
def edit_prompt(server: ServerProcess, edit: Edit) -> str:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        messages = [{"role": "user", "content": edit.ask + edit.text + "```"}]
        return http.post("/apply-template", json={"messages": messages}).json()["prompt"] + f"```{edit.language}\n"


def cpu_seconds(server: ServerProcess) -> float:
    """The server process's CPU time so far (user + system, all its threads), from /proc."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_completion(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    """``completion`` with the CPU seconds its decoding took: the server's CPU time over the
    request less its CPU time over the same prompt with ``n_predict`` 1 (the prefill and the
    request's own costs), as ``timings["decode_cpu_s"]``."""
    t0 = cpu_seconds(server)
    completion(server, dict(body, n_predict=1))
    t1 = cpu_seconds(server)
    out = completion(server, body)
    out["timings"]["decode_cpu_s"] = max(cpu_seconds(server) - t1 - (t1 - t0), 1e-9)
    return out


def measure(servers: dict[str, ServerProcess], body: dict[str, Any], reps: int,
            clock: str = "wall") -> dict[str, dict[str, Any]]:
    """Each server answers ``body`` ``reps`` times, in alternation (noisy machines drift).
    ``clock`` "cpu": tokens per CPU second of the server's decoding (best of the reps), which
    other processes on a busy machine disturb far less than wall-clock time."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for name, server in servers.items():  # warm-up: first requests pay one-off costs
        completion(server, dict(body, n_predict=8))
    for _ in range(reps):
        for name, server in servers.items():
            runs[name].append(cpu_completion(server, body) if clock == "cpu" else completion(server, body))
    out = {}
    for name, answers in runs.items():
        t = [a["timings"] for a in answers]
        out[name] = {
            "tok_s": (max(a["tokens_predicted"] / x["decode_cpu_s"] for a, x in zip(answers, t)) if clock == "cpu"
                      else mean(x["predicted_per_second"] for x in t)),
            "n": answers[0]["tokens_predicted"],
            "draft_n": sum(x.get("draft_n", 0) for x in t) / reps,
            "accepted": sum(x.get("draft_n_accepted", 0) for x in t) / reps,
            "content": answers[0]["content"],
        }
    return out


def report(title: str, results: dict[str, dict[str, Any]], pairs: list[tuple[str, str]]) -> list[str]:
    lines = [f"### {title}", "", "| server | plain tok/s | speculating tok/s | ratio | drafted | accepted | acceptance | same text |",
             "|---|---|---|---|---|---|---|---|"]
    for plain, spec in pairs:
        if plain not in results:
            continue
        p, s = results[plain], results[spec]
        acc = s["accepted"] / s["draft_n"] if s["draft_n"] else 0.0
        lines.append(f"| {spec.split(':')[0]} | {p['tok_s']:.1f} | {s['tok_s']:.1f} | {ratio(s['tok_s'], p['tok_s']):.2f}x | "
                     f"{s['draft_n']:.0f} | {s['accepted']:.0f} | {acc:.2f} | {p['content'] == s['content']} |")
    return lines + [""]


def run_edit(args: argparse.Namespace) -> list[str]:
    from mlxcel_compat.testing.real_model import ensure_real_model

    model = Path(args.model) if args.model else ensure_real_model()
    ngram = ["--spec-type", args.spec_types, "--spec-ngram-simple-size-n", str(args.ngram_n),
             "--spec-ngram-simple-size-m", str(args.ngram_m)]
    cmds = {"mlxcel:plain": ours(model, []), "mlxcel:ngram": ours(model, ngram)}
    if args.peer_llama_server:
        cmds.update({"llama-server:plain": peer(args.peer_llama_server, model, []),
                     "llama-server:ngram": peer(args.peer_llama_server, model, ngram)})
    envs: dict[str, dict[str, str]] = {}
    if args.baseline:  # another checkout's package, side by side under the same load
        cmds.update({"baseline:plain": ours(model, []), "baseline:ngram": ours(model, ngram)})
        envs = {name: {"PYTHONPATH": str(Path(args.baseline).resolve())} for name in ("baseline:plain", "baseline:ngram")}
    servers = {name: start(name, cmd, port, envs.get(name)) for name, (cmd, port) in cmds.items()}
    pairs = [("mlxcel:plain", "mlxcel:ngram"), ("baseline:plain", "baseline:ngram"), ("llama-server:plain", "llama-server:ngram")]
    clock = ", tok/s per CPU second of decoding (best of the reps)" if args.clock == "cpu" else ""
    lines: list[str] = []
    per_edit: list[dict[str, dict[str, Any]]] = []
    try:
        for edit in EDITS[:args.edits]:
            body = {"prompt": edit_prompt(servers["mlxcel:plain"], edit), "n_predict": args.n_predict,
                    "temperature": 0, "cache_prompt": False}
            per_edit.append(measure(servers, body, args.reps, args.clock))
            lines += report(f"edit {edit.name}: {model.name}, {args.spec_types} (ngram-simple n={args.ngram_n} "
                            f"m={args.ngram_m}), {args.n_predict} tokens{clock}", per_edit[-1], pairs)
    finally:
        for server in servers.values():
            server.stop()
    if len(per_edit) > 1:  # the files together: every file's tokens over every file's decoding time
        lines += report(f"edit, the {len(per_edit)} files together (tokens over decoding time)",
                        {name: together([r[name] for r in per_edit]) for name in per_edit[0]}, pairs)
    return lines


def together(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several files' results as one: tokens over decoding time, drafts summed, the texts joined."""
    n = sum(r["n"] for r in results)
    return {"tok_s": n / sum(r["n"] / r["tok_s"] for r in results), "n": n,
            "draft_n": sum(r["draft_n"] for r in results), "accepted": sum(r["accepted"] for r in results),
            "content": "\0".join(r["content"] for r in results)}


def run_draft(args: argparse.Namespace) -> list[str]:
    from mlxcel_compat.testing.draft_pair import ensure_pair_gguf

    target, draft = ensure_pair_gguf("llama", "small", args.draft_layers, args.damping, args.gguf_type)
    spec = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.n_max)]
    cmds = {"mlxcel:plain": ours(target, []), "mlxcel:draft": ours(target, spec)}
    if args.peer_llama_server:
        cmds.update({"llama-server:plain": peer(args.peer_llama_server, target, []),
                     "llama-server:draft": peer(args.peer_llama_server, target, spec)})
    servers = {name: start(name, cmd, port) for name, (cmd, port) in cmds.items()}
    try:
        body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "n_predict": args.n_predict,
                "temperature": 0, "cache_prompt": False, "ignore_eos": True}
        results = measure(servers, body, args.reps)
    finally:
        for server in servers.values():
            server.stop()
    return report(f"draft model: factory llama-small pair ({args.gguf_type} GGUF, draft = first {args.draft_layers} "
                  f"layers, damping {args.damping:g}), n_max {args.n_max}, {args.n_predict} tokens",
                  results, [("mlxcel:plain", "mlxcel:draft"), ("llama-server:plain", "llama-server:draft")])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("edit", "draft", "both"), default="both")
    parser.add_argument("--model", help="GGUF for the edit workload (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--peer-llama-server", metavar="BIN", help="llama-server binary to compare with")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n-predict", type=int, default=256)
    parser.add_argument("--ngram-n", type=int, default=12, help="--spec-ngram-simple-size-n of both servers (default 12, llama-server's; 4 is fastest on the edit workload)")
    parser.add_argument("--ngram-m", type=int, default=48)
    parser.add_argument("--spec-types", default="ngram-simple",
                        help="edit workload: --spec-type of the speculating servers (e.g. ngram-simple,ngram-cache)")
    parser.add_argument("--baseline", metavar="DIR", help="edit workload: also serve the package of this checkout "
                        "(PYTHONPATH=DIR), plain and speculating, in the same alternation (rows 'baseline')")
    parser.add_argument("--edits", type=int, default=len(EDITS), help=f"edit workload: how many of its {len(EDITS)} files "
                        "(1: the first alone, as every figure before 2026-12-07 22:40)")
    parser.add_argument("--n-max", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--damping", type=float, default=0.02)
    parser.add_argument("--gguf-type", default="f32")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="edit workload: cpu measures tokens per CPU second of each server's decoding "
                             "(use with --threads 1 on a busy machine)")
    parser.add_argument("--threads", type=int, default=0, help="-t and -tb of our servers (default: theirs)")
    args = parser.parse_args()
    if args.threads:
        THREADS[:] = ["-t", str(args.threads), "-tb", str(args.threads)]
    lines = ["command: " + shlex.join(["scripts/bench_speculative.py", *sys.argv[1:]]), ""]
    if args.workload in ("edit", "both"):
        lines += run_edit(args)
    if args.workload in ("draft", "both"):
        lines += run_draft(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run(main)
