#!/usr/bin/env python3
"""Prompt-cache benchmark for llama-server-compatible and OpenAI-compatible HTTP servers.

Talks HTTP to ``--base-url`` (our server, llama-server, mlx_lm.server, ...) or starts our server
itself with ``--serve MODEL_DIR | FAMILY[:SIZE]`` on a free port and stops it at the end.

Workloads (``--workloads``, all by default; every request is deterministic: filler text comes
from a fixed word list through a seeded RNG, decoding is greedy):

* ``shared-system``: one ~1K-token system prompt, ``--users`` users each asking one question.
* ``multi-turn``: ``--mt-users`` users x ``--rounds`` rounds, round-robin; shared system prompt
  plus each user's own growing history (the assistant reply as returned, then a new question).
  Session per user through ``prompt_cache_key`` (OpenAI flavour).
* ``timestamp``: the same growing conversation re-sent with a fresh timestamp every turn, the
  timestamp at the TOP of the system prompt, at the BOTTOM of the system prompt, or in the last
  user message. The first turn of each layout primes the cache and is not counted (measuring the
  first send only tells how well a prompt matches itself).
* ``unrelated``: prompts that share no prefix (overhead guard: warm vs ``cache_prompt: false``
  should differ by < 3%). Warm and cold prompts are distinct texts and the order alternates
  (W C C W W C ...) so that a server which keeps ``cache_prompt: false`` prompts in a slot
  cannot turn a cold run into a hit, and work a server does after a response lands on both.
* ``prefix64``: a 2K-token prefix + 64 new tokens. Warm TTFT against the cold prefill of the
  64 new tokens alone and against the cold prefill of the whole prompt (goal: warm / 64-only
  <= 1.2).
* ``hit-ttft``: a ``--prefix-tokens`` prompt cold, then again (a full hit), then with ``--new-tokens``
  more, ``--repeats`` times; with ``--peer-llama-server BIN`` (and ``--serve FILE.gguf``) side by side
  with llama-server on the same file (issue 29: a hit at most as slow as llama-server's).
* ``agent``: a coding-agent loop, the same conversations once through ``/v1/chat/completions`` and
  once through the Anthropic ``/v1/messages`` (cache reset before each): a ~``--agent-system-tokens``
  system prompt (default 2048) plus ``AGENT_TOOLS`` schemas, ``--agent-sessions`` sessions (default
  5) interleaved for ``--rounds`` rounds, each turn adding the reply and a tool result to the
  history. Session through ``prompt_cache_key`` / ``metadata.user_id``. Reports hit fraction, TTFT
  and cold/warm per API, and the in-process cost of the Anthropic translation per request (request
  body to chat body, and the reply back), which is what the server adds over the chat route.
* ``apc-divergent``: a shared ~1K-token system prompt, then conversations that diverge from each
  other's stored entries, so whole-entry matching misses and only APC (partial reuse) hits: per
  shared-opening length K (``--apc-lengths``, default 32,128,512) ``--apc-users`` users open with
  the same K-token user text and then ask their own question; conversations run 1..``--apc-turns``
  turns; each user then regenerates its last turn with a different question, and 3-turn users
  edit their second message in the middle of the history. Reported per case (sys-only,
  branch K=..., followup, regen, edit). Not counted: the very first request.

``--compare-apc`` (with ``--serve``) starts two servers from the same arguments, one with
``--apc-enabled=true`` and one with ``--apc-enabled=false``, resets both caches before each
workload, and sends every request to both back to back (order alternating A B / B A). Each
conversation continues with the reply of the server it is talking to. Cold twins are skipped (the
APC-off server is the baseline). The report adds an "APC on vs off" table: reused tokens, hit
fraction, TTFT p50/p90 for both and the on/off ratios, per workload and per apc-divergent case.
Without ``--workloads`` it runs apc-divergent only.

Every warm request has a cold twin (the same request with ``cache_prompt: false``) sent right
after it, so machine noise hits both. TTFT is measured client-side by streaming: the arrival of
the first chunk that carries generated content (or, failing that, the final chunk).

Examples::

    python scripts/bench_prompt_cache.py --serve llama:small
    python scripts/bench_prompt_cache.py --serve llama:tiny --users 2 --mt-users 2 --rounds 2 \\
        --system-tokens 256 --prefix-tokens 512 --workloads shared-system,prefix64
    python scripts/bench_prompt_cache.py --base-url http://127.0.0.1:8080 --api openai --json out.json
    python scripts/bench_prompt_cache.py --serve llama:small --server-arg=--no-cache-prompt
    python scripts/bench_prompt_cache.py --serve llama:small --compare-apc
    python scripts/bench_prompt_cache.py --serve llama:tiny --compare-apc --system-tokens 256 \\
        --apc-lengths 32,96 --apc-users 2 --n-predict 4 --json apc.json

``--server-arg`` values that start with ``-`` need the ``=`` form (``--server-arg=--ctx-size=8192``);
each value is split like a shell word list, so ``--server-arg="--ctx-size 8192"`` works too.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

from benchlib import ServerProcess, free_port, pct, ratio, resolve_model

WORKLOADS = ("shared-system", "multi-turn", "timestamp", "unrelated", "prefix64", "apc-divergent", "agent", "hit-ttft")
HIT_TTFT_KINDS = ("cold", "full-hit", "hit+new")  # the hit-ttft workload's requests, in order
# The coding agent's tools (JSON schemas a Claude-Code-like client sends with every request).
AGENT_TOOLS = [
    {"name": name, "description": desc, "input_schema": {"type": "object", "properties": props, "required": list(props)}}
    for name, desc, props in (
        ("read_file", "Read a file of the repository and return its text with line numbers.", {"path": {"type": "string", "description": "Path relative to the repository root"}}),
        ("write_file", "Replace the whole content of a file.", {"path": {"type": "string"}, "content": {"type": "string"}}),
        ("edit_file", "Replace one exact occurrence of a string in a file.", {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}),
        ("run_command", "Run a shell command in the repository and return its output.", {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}),
        ("search", "Search the repository for a regular expression.", {"pattern": {"type": "string"}, "glob": {"type": "string"}}),
        ("list_dir", "List a directory of the repository.", {"path": {"type": "string"}}),
    )
]
TS_LAYOUTS = ("top", "bottom_system", "bottom_user")

# A fixed vocabulary: the same seed gives the same text on every machine, and one tokenizer
# gives the same token counts every run.
WORDS = tuple(
    """
    the of and to in is for on that with as by at from this be are or an it not which have
    has was were will can may should would could must each every any all some many more most
    other such only also very well just then than when where while after before between under
    over into through during about against among within without system model server request
    response cache prefix token tokens prompt memory layer layers value values key keys index
    table record records entry entries block blocks buffer buffers stream streams queue queues
    batch batches session sessions user users client clients message messages history reply
    question answer answers policy policies rule rules style example examples document documents
    section sections chapter paragraph sentence word words number numbers date time hour minute
    second day week month year morning evening river mountain forest valley ocean island harbor
    village city market garden bridge road station library museum school office kitchen window
    door table chair lamp paper letter book story journey traveler merchant farmer teacher
    student doctor engineer painter writer sailor captain soldier king queen child family friend
    neighbor stranger animal horse bird fish tree flower stone water fire wind light shadow color
    green blue red white black golden silver quiet loud bright dark warm cold early late quick
    slow careful simple clear exact small large long short high low new old first last next
    previous open closed ready busy free heavy light strong gentle calm rapid steady careful
    write read send receive store load keep move carry build measure count compare check verify
    explain describe answer follow repeat return report remember forget choose change improve
    reduce increase begin finish continue wait listen watch travel visit arrive leave
    """.split()
)


# --------------------------------------------------------------------------------------------
# Deterministic text


class TextMaker:
    """Filler text of a target token length, calibrated with the server's tokenizer if it has one."""

    def __init__(self, seed: int, count: Callable[[str], int | None], tokens_per_word: float) -> None:
        self.seed = seed
        self.count = count  # text -> token count (no BOS) or None when no tokenizer is reachable
        self.tokens_per_word = tokens_per_word
        self.calibrated = False
        self._memo: dict[tuple[str, int], str] = {}

    def _words(self, purpose: str, n: int) -> list[str]:
        rng = random.Random(f"{self.seed}:{purpose}")
        out: list[str] = []
        start = True
        left = rng.randint(7, 15)
        while len(out) < n:
            w = rng.choice(WORDS)
            if start:
                w = w.capitalize()
                start = False
            left -= 1
            if left == 0:
                w += "."
                start = True
                left = rng.randint(7, 15)
            out.append(w)
        return out

    def text(self, purpose: str, target_tokens: int) -> str:
        key = (purpose, target_tokens)
        if key in self._memo:
            return self._memo[key]
        words = self._words(purpose, int(target_tokens / 0.3) + 16)  # >= any plausible need
        k = max(1, round(target_tokens / self.tokens_per_word))
        text = " ".join(words[:k])
        tol = max(1, target_tokens // 100)
        for _ in range(8):
            n = self.count(text)
            if n is None:
                break
            self.calibrated = True
            if abs(n - target_tokens) <= tol:
                break
            # Re-estimate tokens/word from this measurement and step towards the target.
            tpw = max(0.2, n / k)
            step = round((target_tokens - n) / tpw)
            if step == 0:
                step = 1 if n < target_tokens else -1
            k = max(1, min(len(words), k + step))
            text = " ".join(words[:k])
        self._memo[key] = text
        return text


def timestamp_text(i: int) -> str:
    """A per-request timestamp line; the same sequence for every layout (same words, same length)."""
    base = _dt.datetime(2025, 3, 14, 9, 26, 53, tzinfo=_dt.timezone.utc)
    t = base + _dt.timedelta(seconds=97 * i + 13 * (i % 7))
    return f"Current date and time: {t.strftime('%A %Y-%m-%d %H:%M:%S')} UTC, request {i:04d}."


# --------------------------------------------------------------------------------------------
# Server process


# --------------------------------------------------------------------------------------------
# HTTP client


@dataclass
class Msg:
    role: str  # system | user | assistant
    content: str
    ids: list[int] | None = None  # generated token ids of an assistant reply (native flavour)
    # --compare-apc: each server's own reply, by server label (a client of that server would
    # send back what that server generated; greedy replies usually agree, but need not).
    variants: dict[str, tuple[str, list[int] | None]] | None = None

    def for_server(self, label: str | None) -> tuple[str, list[int] | None]:
        if self.variants and label in self.variants:
            return self.variants[label]
        return self.content, self.ids


@dataclass
class Outcome:
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None  # first generated content (or final chunk)
    total_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    server_prompt_ms: float | None = None
    predicted_n: int | None = None
    content: str = ""
    gen_ids: list[int] = field(default_factory=list)
    ttft_source: str = ""  # "content" | "final" | ""
    # --compare-apc: the same request's outcome on every server, by label (filled by Bench.run).
    peers: dict[str, "Outcome"] = field(default_factory=dict, repr=False)


class Api:
    def __init__(self, base_url: str, flavour: str, n_predict: int, seed: int, model: str | None,
                 api_key: str | None, timeout: float, label: str | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.label = label  # server label in --compare-apc ("apc-on" / "apc-off"), else None
        # Also send the session as this header (behind a router: vllm-router's consistent_hash
        # reads X-Session-ID; it ignores the body's prompt_cache_key on chat completions).
        self.session_header: str | None = None
        self.flavour = flavour
        self.n_predict = n_predict
        self.seed = seed
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers)
        self.has_tokenize: bool | None = None
        self.has_stats: bool | None = None
        self.has_reset: bool | None = None
        self._tok_memo: dict[tuple[str, bool], list[int]] = {}
        self.model_id: str | None = None

    def close(self) -> None:
        self.http.close()

    def _admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A small idempotent request, retried once on a transport error (a dropped keep-alive
        connection must not make a feature look absent for the rest of the run)."""
        try:
            return self.http.request(method, self.base + path, **kw)
        except httpx.TransportError:
            return self.http.request(method, self.base + path, **kw)

    # -- discovery ------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"base_url": self.base, "api": self.flavour}
        try:
            r = self._admin("GET", "/v1/models")
            data = r.json() if r.status_code == 200 else {}
            models = data.get("data") or []
            if models:
                self.model_id = models[0].get("id")
        except (httpx.HTTPError, ValueError):
            pass
        info["model"] = self.model_id
        self.tokenize("probe", False)
        info["tokenize"] = bool(self.has_tokenize)
        stats = self.cache_stats()
        info["cache_stats"] = stats is not None
        info["cache_enabled"] = None if stats is None else stats.get("enabled")
        return info

    def tokenize(self, text: str, add_special: bool) -> list[int] | None:
        if self.has_tokenize is False:
            return None
        key = (text, add_special)
        if key in self._tok_memo:
            return self._tok_memo[key]
        try:
            r = self._admin("POST", "/tokenize", json={"content": text, "add_special": add_special})
            toks = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            toks = None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            self.has_tokenize = False
            return None
        self.has_tokenize = True
        if len(self._tok_memo) < 4096:
            self._tok_memo[key] = toks
        return toks

    def count_tokens(self, text: str) -> int | None:
        toks = self.tokenize(text, False)
        return None if toks is None else len(toks)

    def cache_stats(self) -> dict[str, Any] | None:
        if self.has_stats is False:
            return None
        try:
            r = self._admin("GET", "/v1/cache/stats")
            data = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if not isinstance(data, dict):
            self.has_stats = False
            return None
        self.has_stats = True
        return data

    def cache_reset(self) -> bool:
        if self.has_reset is False or self.has_stats is False:
            return False
        try:
            # No body: the route takes none, and an unread request body has been seen to make
            # the server drop the next request on the same keep-alive connection.
            r = self._admin("POST", "/v1/cache/reset")
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        self.has_reset = ok
        return ok

    # -- requests -------------------------------------------------------------------------
    def native_prompt(self, msgs: list[Msg]) -> list[int] | str:
        """A plain-text chat rendering; token ids (piece by piece) when /tokenize works."""
        pieces: list[str | list[int]] = []
        for m in msgs:
            if m.role == "system":
                pieces.append(m.content + "\n\n")
            elif m.role == "user":
                pieces.append("### User:\n" + m.content + "\n\n")
            else:
                content, ids = m.for_server(self.label)
                pieces.append("### Assistant:\n")
                pieces.append(ids if ids is not None else content)
                pieces.append("\n\n")
        pieces.append("### Assistant:\n")
        # Merge adjacent strings so that tokenization is per message, not per fragment.
        merged: list[str | list[int]] = []
        for p in pieces:
            if isinstance(p, str) and merged and isinstance(merged[-1], str):
                merged[-1] = merged[-1] + p
            else:
                merged.append(p)
        if self.has_tokenize:
            ids: list[int] = []
            for i, p in enumerate(merged):
                if isinstance(p, list):
                    ids.extend(p)
                    continue
                toks = self.tokenize(p, i == 0)
                if toks is None:
                    break
                ids.extend(toks)
            else:
                return ids
        return "".join(p if isinstance(p, str) else "" for p in merged)  # ids need a tokenizer

    def send(self, msgs: list[Msg], cache_prompt: bool, session: str | None, tools: list[dict[str, Any]] | None = None) -> Outcome:
        if self.flavour == "anthropic":
            body = {
                "system": msgs[0].content,
                "messages": [{"role": m.role, "content": m.content} for m in msgs[1:]],
                "max_tokens": self.n_predict,
                "temperature": 0.0,
                "stream": True,
                "cache_prompt": cache_prompt,
                "model": self.model or self.model_id or "local",
            }
            if tools:
                body["tools"] = tools
            if session:
                body["metadata"] = {"user_id": session}
            return self._stream(self.base + "/v1/messages", body, session)
        if self.flavour == "native":
            body: dict[str, Any] = {
                "prompt": self.native_prompt(msgs),
                "n_predict": self.n_predict,
                "temperature": 0.0,
                "seed": self.seed,
                "stream": True,
                "cache_prompt": cache_prompt,
                "return_tokens": True,
            }
            url = self.base + "/completion"
        else:
            body = {
                "messages": [{"role": m.role, "content": m.for_server(self.label)[0]} for m in msgs],
                "max_tokens": self.n_predict,
                "temperature": 0.0,
                "seed": self.seed,
                "stream": True,
                "stream_options": {"include_usage": True},
                "cache_prompt": cache_prompt,
            }
            if session:
                body["prompt_cache_key"] = session
            if tools:
                body["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}} for t in tools]
            if self.model or self.model_id:
                body["model"] = self.model or self.model_id
            url = self.base + "/v1/chat/completions"
        return self._stream(url, body, session)

    def _stream(self, url: str, body: dict[str, Any], session: str | None = None) -> Outcome:
        out = Outcome()
        usage: dict[str, Any] | None = None
        timings: dict[str, Any] | None = None
        native_final: dict[str, Any] | None = None
        t0 = time.perf_counter()
        try:
            headers = {self.session_header: session} if self.session_header and session else None
            with self.http.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code != 200:
                    text = r.read().decode("utf-8", "replace")
                    out.error = f"HTTP {r.status_code}: {text[:300]}"
                    out.total_ms = (time.perf_counter() - t0) * 1000
                    return out
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if not payload or payload == "[DONE]":
                        continue
                    now = time.perf_counter()
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        continue
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk:
                        err = chunk["error"]
                        out.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                        continue
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    if isinstance(chunk.get("timings"), dict):
                        timings = chunk["timings"]
                    if self.flavour == "anthropic":
                        kind = chunk.get("type")
                        if kind == "error":
                            out.error = str((chunk.get("error") or {}).get("message"))[:300]
                        delta = chunk.get("delta") or {}
                        piece = delta.get("text") or delta.get("thinking") or ""
                        if piece:
                            if out.ttft_ms is None:
                                out.ttft_ms, out.ttft_source = (now - t0) * 1000, "content"
                            out.content += delta.get("text") or ""
                        if kind == "message_delta":
                            u = chunk.get("usage") or {}
                            read, made = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
                            usage = {"prompt_tokens": (u.get("input_tokens") or 0) + read + made, "completion_tokens": u.get("output_tokens"),
                                     "prompt_tokens_details": {"cached_tokens": read}}
                            if out.ttft_ms is None:
                                out.ttft_ms, out.ttft_source = (now - t0) * 1000, "final"
                    elif self.flavour == "native":
                        if "prompt_progress" in chunk:
                            continue
                        piece = chunk.get("content") or ""
                        toks = chunk.get("tokens") if not chunk.get("stop") else None
                        if piece or toks:
                            if out.ttft_ms is None:
                                out.ttft_ms, out.ttft_source = (now - t0) * 1000, "content"
                            out.content += piece
                            if isinstance(toks, list):
                                out.gen_ids.extend(t for t in toks if isinstance(t, int))
                        if chunk.get("stop"):
                            native_final = chunk
                            if out.ttft_ms is None:
                                out.ttft_ms, out.ttft_source = (now - t0) * 1000, "final"
                    else:
                        choices = chunk.get("choices") or []
                        for ch in choices:
                            delta = ch.get("delta") or {}
                            piece = delta.get("content") or ""
                            if piece:
                                if out.ttft_ms is None:
                                    out.ttft_ms, out.ttft_source = (now - t0) * 1000, "content"
                                out.content += piece
                            if ch.get("finish_reason") and out.ttft_ms is None:
                                out.ttft_ms, out.ttft_source = (now - t0) * 1000, "final"
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        out.total_ms = (time.perf_counter() - t0) * 1000
        self._fill_counts(out, usage, timings, native_final)
        out.ok = out.error is None and out.ttft_ms is not None
        if out.ttft_ms is None and out.error is None:
            out.error = "stream ended without a generated chunk"
        return out

    @staticmethod
    def _fill_counts(out: Outcome, usage: dict[str, Any] | None, timings: dict[str, Any] | None,
                     final: dict[str, Any] | None) -> None:
        def num(x: Any) -> float | None:
            return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None

        cache_n = prompt_n = None
        if timings:
            cache_n, prompt_n = num(timings.get("cache_n")), num(timings.get("prompt_n"))
            out.server_prompt_ms = num(timings.get("prompt_ms"))
            out.predicted_n = num(timings.get("predicted_n"))
        usage_prompt = usage_cached = None
        if usage:
            usage_prompt = num(usage.get("prompt_tokens"))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                usage_cached = num(details.get("cached_tokens"))
            if out.predicted_n is None:
                out.predicted_n = num(usage.get("completion_tokens"))
        evaluated = num(final.get("tokens_evaluated")) if final else None
        # Prompt size: usage, else the native tokens_evaluated, else the timings split.
        out.prompt_tokens = usage_prompt if usage_prompt is not None else evaluated
        if out.prompt_tokens is None and cache_n is not None and prompt_n is not None:
            out.prompt_tokens = int(cache_n + prompt_n)
        # Reused tokens: timings.cache_n (what was not prefilled), else usage cached_tokens.
        out.cached_tokens = int(cache_n) if cache_n is not None else usage_cached
        if prompt_n is not None:
            out.computed_tokens = int(prompt_n)
        elif out.prompt_tokens is not None and out.cached_tokens is not None:
            out.computed_tokens = int(out.prompt_tokens - out.cached_tokens)


# --------------------------------------------------------------------------------------------
# Recording


class Bench:
    def __init__(self, api: Api, args: argparse.Namespace, text: TextMaker, others: list[Api] | None = None) -> None:
        self.api = api  # the primary server: text calibration, the returned outcome
        # Every server a request goes to: one normally, two (APC on, APC off) with --compare-apc.
        self.apis = [api, *(others or [])]
        self.compare = len(self.apis) > 1
        self.n_sent = 0  # requests issued (each to every server); sets the interleaving order
        self.reply_mismatches = 0  # --compare-apc: warm requests whose replies differ between servers
        self.args = args
        self.text = text
        self.records: list[dict[str, Any]] = []
        self.groups: dict[str, dict[str, Any]] = {}  # group -> cache stats etc.
        self.warnings: list[str] = []
        self.any_ok = False
        self.agent_bodies: list[tuple[str, list[Msg], Outcome]] = []  # agent workload requests, for the translation cost

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(msg, file=sys.stderr, flush=True)

    def run(self, group: str, kind: str, msgs: list[Msg], session: str | None, counted: bool = True,
            **labels: Any) -> Outcome:
        """One request. kind: warm (cache_prompt true) or cold* (cache_prompt false).

        With --compare-apc the same request goes to every server back to back, the order
        alternating from one request to the next (A B, B A, ...) so that whatever a server does
        after a response (donating, logging) slows both sides equally. Returns the primary
        server's outcome; ``peers`` holds every server's.
        """
        order = self.apis if self.n_sent % 2 == 0 else self.apis[::-1]
        self.n_sent += 1
        outs: dict[str | None, Outcome] = {}
        for api in order:
            outs[api.label] = self._run_one(api, group, kind, msgs, session, counted, labels)
        primary = outs[self.api.label]
        if self.compare:
            primary.peers = {k: v for k, v in outs.items() if k is not None}
            if kind == "warm" and all(o.ok for o in outs.values()) and len({o.content for o in outs.values()}) > 1:
                self.reply_mismatches += 1
        return primary

    def _run_one(self, api: Api, group: str, kind: str, msgs: list[Msg], session: str | None, counted: bool,
                 labels: dict[str, Any]) -> Outcome:
        out = api.send(msgs, cache_prompt=(kind == "warm"), session=session)
        rec = {"group": group, "kind": kind, "counted": counted, "session": session, **labels}
        if api.label is not None:
            rec["server"] = api.label
        rec.update({k: v for k, v in asdict(out).items() if k not in ("content", "gen_ids", "peers")})
        rec["content_chars"] = len(out.content)
        self.records.append(rec)
        lab = " ".join(f"{k}={v}" for k, v in labels.items())
        tag = f"{group}@{api.label}" if api.label else group
        if out.ok:
            self.log(f"  [{tag}] {kind:<10} {lab:<14} ttft={fmt_ms(out.ttft_ms):>8} ms  prompt={fmt_n(out.prompt_tokens)}"
                     f" cached={fmt_n(out.cached_tokens)}{'' if counted else '  (priming, not counted)'}")
        else:
            self.log(f"  [{tag}] {kind:<10} {lab:<14} ERROR {out.error}")
            if out.error and out.error.startswith(("HTTP 404", "HTTP 405")) and not self.any_ok:
                hint = "--api openai" if api.flavour == "native" else "--api native"
                raise RuntimeError(f"the server has no such route ({out.error.splitlines()[0][:120]}); try {hint}")
        self.any_ok = self.any_ok or out.ok
        return out

    def pair(self, group: str, msgs: list[Msg], session: str | None, counted: bool = True, **labels: Any) -> Outcome:
        """A warm request and its cold twin; with --compare-apc the warm request only (the APC-off
        server is the baseline there)."""
        warm = self.run(group, "warm", msgs, session, counted, **labels)
        if not self.args.no_cold and not self.compare:
            self.run(group, "cold", msgs, session, counted, **labels)
        return warm

    def reply(self, out: Outcome) -> Msg:
        """The assistant turn a client would send back; per server with --compare-apc."""
        native = self.api.flavour == "native"

        def pick(o: Outcome) -> tuple[str, list[int] | None]:
            return o.content, (o.gen_ids if (o.gen_ids and native) else None)

        content, ids = pick(out)
        variants = {k: pick(o) for k, o in out.peers.items()} if out.peers else None
        return Msg("assistant", content, ids, variants)

    @staticmethod
    def group_key(group: str, label: str | None) -> str:
        return f"{group}@{label}" if label else group

    def begin_group(self, group: str) -> None:
        for api in self.apis:
            reset = None
            if not self.args.no_reset:
                reset = api.cache_reset()
            stats = api.cache_stats()
            self.groups[self.group_key(group, api.label)] = {
                "group": group, "server": api.label, "reset": reset, "stats_before": stats}
            if reset and stats and stats.get("entries"):
                self.warnings.append(f"{self.group_key(group, api.label)}: {stats.get('entries')} cache entries "
                                     "left right after the reset; reuse numbers may include earlier work")
            where = f" {api.label}" if api.label else ""
            self.log(f"== {group}{where} (cache reset: {'yes' if reset else 'skipped' if reset is None else 'n/a'})")

    def end_group(self, group: str) -> None:
        for api in self.apis:
            self.groups[self.group_key(group, api.label)]["stats_after"] = api.cache_stats()

    # -- workloads ------------------------------------------------------------------------
    def system_prompt(self) -> str:
        intro = "You are a careful assistant. Follow the rules and the style guide below. "
        n_intro = self.api.count_tokens(intro) or round(len(intro.split()) * self.args.tokens_per_word)
        return intro + self.text.text("system", max(1, self.args.system_tokens - n_intro))

    def question(self, purpose: str) -> str:
        return self.text.text(purpose, self.args.question_tokens).rstrip(".") + "?"

    def shared_system(self) -> None:
        g = "shared-system"
        self.begin_group(g)
        system = self.system_prompt()
        for u in range(self.args.users):
            msgs = [Msg("system", system), Msg("user", self.question(f"ss-q{u}"))]
            self.pair(g, msgs, f"bench-ss-{u}", user=u)
        self.end_group(g)

    def multi_turn(self) -> None:
        g = "multi-turn"
        self.begin_group(g)
        system = self.system_prompt()
        history: list[list[Msg]] = [[] for _ in range(self.args.mt_users)]
        for r in range(self.args.rounds):
            for u in range(self.args.mt_users):
                q = Msg("user", self.question(f"mt-q{u}-{r}"))
                msgs = [Msg("system", system), *history[u], q]
                warm = self.pair(g, msgs, f"bench-mt-{u}", user=u, round=r)
                history[u] += [q, self.reply(warm)]
        self.end_group(g)

    def timestamp(self) -> None:
        system = self.system_prompt()
        for layout in TS_LAYOUTS:
            g = f"timestamp/{layout}"
            self.begin_group(g)
            history: list[Msg] = []
            for r in range(self.args.ts_rounds):
                ts = timestamp_text(r)
                question = self.question(f"ts-q{r}")
                if layout == "top":
                    sys_text, q_text = ts + "\n" + system, question
                elif layout == "bottom_system":
                    sys_text, q_text = system + "\n" + ts, question
                else:
                    sys_text, q_text = system, question + "\n" + ts
                q = Msg("user", q_text)
                msgs = [Msg("system", sys_text), *history, q]
                warm = self.pair(g, msgs, f"bench-ts-{layout}", counted=r > 0, round=r)
                history += [q, self.reply(warm)]
            self.end_group(g)

    def unrelated(self) -> None:
        g = "unrelated"
        self.begin_group(g)
        n = self.args.unrelated
        for i in range(n):
            warm_msgs = [Msg("user", self.text.text(f"unrel-warm-{i}", self.args.system_tokens))]
            cold_msgs = [Msg("user", self.text.text(f"unrel-cold-{i}", self.args.system_tokens))]
            order = ("warm", "cold") if i % 2 == 0 else ("cold", "warm")
            for kind in order:
                if kind == "cold" and self.args.no_cold:
                    continue
                self.run(g, kind, warm_msgs if kind == "warm" else cold_msgs, f"bench-unrel-{i}-{kind}", i=i)
        self.end_group(g)

    def prefix64(self) -> None:
        g = "prefix64"
        self.begin_group(g)
        prefix = self.text.text("p64-prefix", self.args.prefix_tokens)
        new = lambda i: self.text.text(f"p64-new-{i}", self.args.new_tokens)  # noqa: E731
        session = "bench-p64"
        # Prime: the same prefix followed by other new tokens (a previous turn).
        self.run(g, "warm", [Msg("system", prefix), Msg("user", new(-1))], session, counted=False, i=-1)
        for i in range(self.args.repeats):
            self.run(g, "warm", [Msg("system", prefix), Msg("user", new(i))], session, i=i)
            self.run(g, "cold_new", [Msg("user", new(i))], session, i=i)
            self.run(g, "cold", [Msg("system", prefix), Msg("user", new(i))], session, i=i)
        self.end_group(g)

    def apc_divergent(self) -> None:
        """Shared system prompt, then conversations that diverge from each other's stored entries.

        For each shared-opening length K (``--apc-lengths``) there are ``--apc-users`` users whose
        first user message is the same K-token opening followed by a question of their own, so a
        user's request shares system + K tokens with the entries its siblings stored but is never a
        whole extension of one (whole-entry matching misses, APC adopts the common part). The
        conversations run 1..``--apc-turns`` turns (varying per user). Cases (the ``case`` label):

        * ``prime``: the very first request (nothing stored yet; not counted).
        * ``sys-only``: first user of a new opening: shares only the system prompt with stored entries.
        * ``branch``: a sibling with the same K-token opening: shares system + K tokens.
        * ``followup``: the next turn of one's own conversation; the previous entry is a whole prefix,
          so both modes should hit (control case).
        * ``regen``: the client regenerates the last turn with a different question: the stored
          entry of that turn diverges where the question starts; the previous turn's entry was
          superseded by it, so no whole prefix is left.
        * ``edit``: (conversations of 3+ turns) the second user message is edited in the middle
          of the history, later turns are re-sent, then a new question.
        """
        g = "apc-divergent"
        self.begin_group(g)
        a = self.args
        system = Msg("system", self.system_prompt())
        primed = False
        for gi, k in enumerate(a.apc_length_list):
            opening = self.text.text(f"apcd-open-{gi}", k)
            for u in range(a.apc_users):
                session = f"bench-apcd-{gi}-{u}"
                turns = 1 + (u + gi) % max(1, a.apc_turns)
                history: list[Msg] = []
                for t in range(turns):
                    q_text = self.question(f"apcd-q{gi}-{u}-{t}")
                    if t == 0:
                        q_text = opening + "\n\n" + q_text
                        case = "prime" if not primed else ("branch" if u > 0 else "sys-only")
                    else:
                        case = "followup"
                    q = Msg("user", q_text)
                    warm = self.pair(g, [system, *history, q], session, counted=primed, case=case, k=k, user=u, turn=t)
                    primed = True
                    history += [q, self.reply(warm)]
                # Regenerate the last turn with another question (the opening stays if it is the first).
                regen_text = self.question(f"apcd-regen-{gi}-{u}")
                if turns == 1:
                    regen_text = opening + "\n\n" + regen_text
                self.pair(g, [system, *history[:-2], Msg("user", regen_text)], session,
                          case="regen", k=k, user=u, turn=turns - 1)
                if turns >= 3:
                    edited = [*history[:2], Msg("user", self.question(f"apcd-edit-{gi}-{u}")), *history[3:]]
                    self.pair(g, [system, *edited, Msg("user", self.question(f"apcd-edit-next-{gi}-{u}"))], session,
                              case="edit", k=k, user=u, turn=turns)
        self.end_group(g)

    def agent(self) -> None:
        """The same coding-agent conversations through chat completions and the Anthropic API."""
        base, flavours = self.api, ("openai", "anthropic")
        system = "You are a coding agent working in a Python repository. " + self.text.text("agent-system", self.args.agent_system_tokens)
        for flavour in flavours:
            g = f"agent-{'chat' if flavour == 'openai' else 'anthropic'}"
            api = Api(base.base, flavour, base.n_predict, base.seed, base.model, None, 600.0)
            api.http.close()
            api.http = base.http  # same connection pool and headers
            api.model_id = base.model_id
            self.begin_group(g)
            history: list[list[Msg]] = [[] for _ in range(self.args.agent_sessions)]
            for r in range(self.args.rounds):
                for u in range(self.args.agent_sessions):
                    q = Msg("user", ("Tool result: " if r else "Task: ") + self.question(f"agent-{u}-{r}"))
                    msgs = [Msg("system", system), *history[u], q]
                    session = f"bench-agent-{u}"
                    warm = api.send(msgs, True, session, AGENT_TOOLS)
                    self._record(api, g, "warm", warm, session, user=u, round=r)
                    if not self.args.no_cold:
                        self._record(api, g, "cold", api.send(msgs, False, session, AGENT_TOOLS), session, user=u, round=r)
                    history[u] += [q, Msg("assistant", warm.content or "ok")]
                    self.agent_bodies.append((system, msgs, warm))
            self.end_group(g)

    def _record(self, api: "Api", group: str, kind: str, out: Outcome, session: str, **labels: Any) -> None:
        rec = {"group": group, "kind": kind, "counted": True, "session": session, **labels}
        rec.update({k: v for k, v in asdict(out).items() if k not in ("content", "gen_ids", "peers")})
        rec["content_chars"] = len(out.content)
        self.records.append(rec)
        self.log(f"  [{group}] {kind:<5} ttft={fmt_ms(out.ttft_ms):>8} ms prompt={fmt_n(out.prompt_tokens)} cached={fmt_n(out.cached_tokens)}"
                 + ("" if out.ok else f" ERROR {out.error}"))

    def translation_cost(self) -> dict[str, float] | None:
        """Median microseconds of the Anthropic translation (request in, reply out) on the
        workload's own requests, measured in this process with the server's code."""
        if not self.agent_bodies:
            return None
        try:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
            from mlxcel_compat.server import api_anthropic
        except ImportError:
            return None
        import statistics

        req_us, resp_us = [], []
        for system, msgs, out in self.agent_bodies:
            body = {"system": system, "messages": [{"role": m.role, "content": m.content} for m in msgs[1:]],
                    "tools": AGENT_TOOLS, "max_tokens": 8, "metadata": {"user_id": "s"}, "stream": True}
            t0 = time.perf_counter()
            for _ in range(20):
                api_anthropic.to_chat_body(body)
            req_us.append((time.perf_counter() - t0) / 20 * 1e6)
            t0 = time.perf_counter()
            for _ in range(20):
                usage = api_anthropic.usage_json(out.prompt_tokens or 0, out.cached_tokens or 0, 0, 8)
                api_anthropic.message_body("msg_x", "m", [{"type": "text", "text": out.content}], "end_turn", None, usage)
            resp_us.append((time.perf_counter() - t0) / 20 * 1e6)
        return {"request_us_p50": statistics.median(req_us), "reply_us_p50": statistics.median(resp_us), "n": len(req_us)}

    def hit_ttft(self) -> None:
        """A ``--prefix-tokens`` prompt sent cold, then again (a full hit: every prompt token but
        the last is cached), then with ``--new-tokens`` more (a hit plus new tokens), each of
        ``--repeats`` times with a fresh prompt. With ``--peer-llama-server`` every request goes to
        llama-server and to this server back to back (order alternating), on the same GGUF file."""
        g = "hit-ttft"
        self.begin_group(g)
        for i in range(self.args.repeats):
            prompt = [Msg("user", self.text.text(f"hit-prefix-{i}", self.args.prefix_tokens))]
            longer = [Msg("user", prompt[0].content + " " + self.text.text(f"hit-new-{i}", self.args.new_tokens))]
            for kind, msgs in zip(HIT_TTFT_KINDS, (prompt, prompt, longer)):
                self.run(g, "warm", msgs, f"bench-hit-{i}", i=i, case=kind)
        self.end_group(g)

    def warmup(self) -> None:
        if self.args.warmup <= 0:
            return
        self.log(f"== warm-up ({self.args.warmup} cold requests, not counted)")
        for i in range(self.args.warmup):
            msgs = [Msg("user", self.text.text(f"warmup-{i}", self.args.system_tokens if i == 0 else 64))]
            self.run("warmup", "cold", msgs, None, counted=False, i=i)


# --------------------------------------------------------------------------------------------
# Reporting


def fmt_ms(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def fmt_n(x: float | None) -> str:
    return "n/a" if x is None else f"{int(x)}"


def fmt_r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def fmt_bytes(x: Any) -> str:
    if not isinstance(x, (int, float)):
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return "n/a"


def total(values: list[Any]) -> int | None:
    """Sum, or None if any value is unknown (a partial sum would mislead)."""
    if not values or any(v is None for v in values):
        return None
    return int(sum(values))


def case_label(r: dict[str, Any]) -> str:
    return f"branch K={r.get('k')}" if r.get("case") == "branch" else str(r.get("case"))


def case_breakdown(recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """apc-divergent per case: request count, token sums, TTFT p50 (warm, and cold twins if any)."""
    out: dict[str, dict[str, Any]] = {}
    ks = sorted({r["k"] for r in recs if r.get("case") == "branch" and isinstance(r.get("k"), int)})
    order = ["sys-only", *(f"branch K={k}" for k in ks), "followup", "regen", "edit"]
    for c in order:
        warm = [r for r in recs if case_label(r) == c and r["kind"] == "warm" and r["ok"]]
        cold = [r for r in recs if case_label(r) == c and r["kind"] == "cold" and r["ok"]]
        if not warm:
            continue
        out[c] = {
            "n": len(warm),
            "prompt_tokens": total([r["prompt_tokens"] for r in warm]),
            "cached_tokens": total([r["cached_tokens"] for r in warm]),
            "ttft_p50": pct([r["ttft_ms"] for r in warm], 50),
            "ttft_p90": pct([r["ttft_ms"] for r in warm], 90),
            "cold_ttft_p50": pct([r["ttft_ms"] for r in cold], 50),
        }
        out[c]["hit_fraction"] = ratio(out[c]["cached_tokens"], out[c]["prompt_tokens"])
    return out


def compare_apc(summary: dict[str, dict[str, Any]], on: str = "apc-on", off: str = "apc-off") -> dict[str, dict[str, Any]]:
    """--compare-apc: per workload (and per apc-divergent case), APC on next to APC off."""
    out: dict[str, dict[str, Any]] = {}
    groups = list(dict.fromkeys(s["group"] for s in summary.values()))
    for g in groups:
        a, b = summary.get(f"{g}@{on}"), summary.get(f"{g}@{off}")
        if a is None or b is None:
            continue
        c: dict[str, Any] = {"n": (a["n_warm"], b["n_warm"]), "errors": a["errors"] + b["errors"]}
        for side, s in (("on", a), ("off", b)):
            c[f"prompt_tokens_{side}"] = s["warm_prompt_tokens"]
            c[f"cached_tokens_{side}"] = s["warm_cached_tokens"]
            c[f"hit_fraction_{side}"] = s["hit_fraction"]
            c[f"ttft_p50_{side}"] = s["warm_ttft_p50"]
            c[f"ttft_p90_{side}"] = s["warm_ttft_p90"]
            c[f"apc_enabled_{side}"] = s.get("apc_enabled")
            c[f"server_apc_hits_{side}"] = s.get("server_apc_hits")
        c["cached_ratio"] = ratio(c["cached_tokens_on"], c["cached_tokens_off"])
        c["ttft_p50_ratio"] = ratio(c["ttft_p50_on"], c["ttft_p50_off"])
        c["ttft_p90_ratio"] = ratio(c["ttft_p90_on"], c["ttft_p90_off"])
        if "cases" in a and "cases" in b:
            cases: dict[str, dict[str, Any]] = {}
            for name in a["cases"]:
                x, y = a["cases"][name], b["cases"].get(name)
                if y is None:
                    continue
                cases[name] = {
                    "n": x["n"], "prompt_tokens_on": x["prompt_tokens"], "prompt_tokens_off": y["prompt_tokens"],
                    "cached_tokens_on": x["cached_tokens"], "cached_tokens_off": y["cached_tokens"],
                    "hit_fraction_on": x["hit_fraction"], "hit_fraction_off": y["hit_fraction"],
                    "ttft_p50_on": x["ttft_p50"], "ttft_p50_off": y["ttft_p50"],
                    "ttft_p50_ratio": ratio(x["ttft_p50"], y["ttft_p50"]),
                }
            c["cases"] = cases
        out[g] = c
    return out


def summarize(bench: Bench) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    leaks: list[str] = []
    for key, meta in bench.groups.items():
        g, srv = meta.get("group", key), meta.get("server")
        recs = [r for r in bench.records if r["group"] == g and r.get("server") == srv and r["counted"]]
        warm = [r for r in recs if r["kind"] == "warm" and r["ok"]]
        cold = [r for r in recs if r["kind"] == "cold" and r["ok"]]
        s: dict[str, Any] = {"group": g, "server": srv, "n_warm": len(warm), "n_cold": len(cold),
                             "errors": sum(1 for r in recs if not r["ok"])}
        for name, rs in (("warm", warm), ("cold", cold)):
            s[f"{name}_ttft_p50"] = pct([r["ttft_ms"] for r in rs], 50)
            s[f"{name}_ttft_p90"] = pct([r["ttft_ms"] for r in rs], 90)
            s[f"{name}_ttft_mean"] = (sum(r["ttft_ms"] for r in rs) / len(rs)) if rs else None
            s[f"{name}_total_mean"] = (sum(r["total_ms"] for r in rs) / len(rs)) if rs else None
            s[f"{name}_server_prompt_ms_p50"] = pct([r["server_prompt_ms"] for r in rs], 50)
            s[f"{name}_prompt_tokens"] = total([r["prompt_tokens"] for r in rs])
            s[f"{name}_cached_tokens"] = total([r["cached_tokens"] for r in rs])
            s[f"{name}_computed_tokens"] = total([r["computed_tokens"] for r in rs])
        s["ttft_p50_ratio"] = ratio(s["warm_ttft_p50"], s["cold_ttft_p50"])
        s["ttft_mean_ratio"] = ratio(s["warm_ttft_mean"], s["cold_ttft_mean"])
        s["total_mean_ratio"] = ratio(s["warm_total_mean"], s["cold_total_mean"])
        s["hit_fraction"] = ratio(s["warm_cached_tokens"], s["warm_prompt_tokens"])
        known = [r for r in warm if r["cached_tokens"] is not None]
        s["hit_requests"] = (sum(1 for r in known if r["cached_tokens"] > 0), len(known)) if known else None
        after, before = meta.get("stats_after"), meta.get("stats_before")
        s["cache_reset"] = meta.get("reset")
        s["cache_entries"] = after.get("entries") if after else None
        s["cache_bytes"] = after.get("bytes") if after else None
        if after and before and all(isinstance(x.get(k), (int, float)) for x in (after, before) for k in ("hits", "lookups")):
            s["server_hits"] = after["hits"] - before["hits"]
            s["server_lookups"] = after["lookups"] - before["lookups"]
        else:
            s["server_hits"] = s["server_lookups"] = None
        s["apc_enabled"] = after.get("apc_enabled") if after else None
        for k in ("apc_hits", "apc_block_tokens_total", "apc_extended_tokens_total"):
            ok = after and before and isinstance(after.get(k), int) and isinstance(before.get(k), int)
            s[f"server_{k}"] = after[k] - before[k] if ok else None
        if g == "apc-divergent":
            s["cases"] = case_breakdown(recs)
        if g == "prefix64":
            c64 = [r for r in recs if r["kind"] == "cold_new" and r["ok"]]
            s["n_cold_new"] = len(c64)
            s["cold_new_ttft_p50"] = pct([r["ttft_ms"] for r in c64], 50)
            s["cold_new_ttft_p90"] = pct([r["ttft_ms"] for r in c64], 90)
            s["cold_new_server_prompt_ms_p50"] = pct([r["server_prompt_ms"] for r in c64], 50)
            s["cold_new_prompt_tokens_p50"] = pct([r["prompt_tokens"] for r in c64], 50)
            s["warm_computed_tokens_p50"] = pct([r["computed_tokens"] for r in warm], 50)
            s["warm_over_prefill_new"] = ratio(s["warm_ttft_p50"], s["cold_new_ttft_p50"])
            s["warm_over_prefill_new_server"] = ratio(s["warm_server_prompt_ms_p50"], s["cold_new_server_prompt_ms_p50"])
        out[key] = s
        # Sanity: a cold request that reports reuse means the server ignored cache_prompt: false.
        leaky = [r for r in recs if r["kind"].startswith("cold") and r["ok"] and (r["cached_tokens"] or 0) > 1]
        if leaky:
            leaks.append(f"{key} {len(leaky)}x (max {max(r['cached_tokens'] for r in leaky)} tokens)")
    if leaks:
        bench.warnings.append("cold requests reported cached tokens: " + ", ".join(leaks)
                              + ". The server does not honour cache_prompt: false; its 'cold' numbers are not cold")
    return out


def apc_divergent_heading(bench: Bench) -> str:
    a = bench.args
    return (f"### apc-divergent: {a.system_tokens}-token system prompt, shared user openings of "
            f"{', '.join(str(k) for k in a.apc_length_list)} tokens x {a.apc_users} users, 1..{a.apc_turns} turns")


def render_cases_single(bench: Bench, s: dict[str, Any]) -> list[str]:
    L = [apc_divergent_heading(bench), ""]
    L.append("| case | n | prompt tok | cached | hit frac | warm TTFT p50 | cold TTFT p50 | warm/cold |")
    L.append("|---|---|---|---|---|---|---|---|")
    for name, c in s.get("cases", {}).items():
        L.append(f"| {name} | {c['n']} | {fmt_n(c['prompt_tokens'])} | {fmt_n(c['cached_tokens'])} | "
                 f"{fmt_pct(c['hit_fraction'])} | {fmt_ms(c['ttft_p50'])} | {fmt_ms(c['cold_ttft_p50'])} | "
                 f"{fmt_r(ratio(c['ttft_p50'], c['cold_ttft_p50']))} |")
    L.append("")
    return L


def render_comparison(bench: Bench, comparison: dict[str, dict[str, Any]]) -> list[str]:
    L = ["### APC on vs off (same requests, interleaved)", ""]
    L.append("Two servers started with the same arguments plus `--apc-enabled=true` (on) / `--apc-enabled=false` "
             "(off); every request went to both back to back (order alternating), caches reset on both before "
             "each workload. cached = reused prompt tokens (`timings.cache_n` / `cached_tokens`), summed over the "
             "counted requests.")
    L.append("")
    hdr = ["workload", "n", "prompt tok", "cached on", "cached off", "hit frac on", "hit frac off",
           "TTFT p50 on", "TTFT p50 off", "p50 on/off", "TTFT p90 on", "TTFT p90 off", "p90 on/off",
           "srv APC hits on/off", "errors"]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join("---" for _ in hdr) + "|")
    for g, c in comparison.items():
        n_on, n_off = c["n"]
        L.append("| " + " | ".join([
            g, str(n_on) if n_on == n_off else f"{n_on}/{n_off}", fmt_n(c["prompt_tokens_on"]),
            fmt_n(c["cached_tokens_on"]), fmt_n(c["cached_tokens_off"]),
            fmt_pct(c["hit_fraction_on"]), fmt_pct(c["hit_fraction_off"]),
            fmt_ms(c["ttft_p50_on"]), fmt_ms(c["ttft_p50_off"]), fmt_r(c["ttft_p50_ratio"]),
            fmt_ms(c["ttft_p90_on"]), fmt_ms(c["ttft_p90_off"]), fmt_r(c["ttft_p90_ratio"]),
            f"{fmt_n(c['server_apc_hits_on'])}/{fmt_n(c['server_apc_hits_off'])}", str(c["errors"]),
        ]) + " |")
    L.append("")
    for g, c in comparison.items():
        if not c.get("cases"):
            continue
        L.append(apc_divergent_heading(bench) + ", per case")
        L.append("")
        L.append("| case | n | prompt tok | cached on | cached off | hit frac on | hit frac off | TTFT p50 on | TTFT p50 off | on/off |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for name, x in c["cases"].items():
            L.append(f"| {name} | {x['n']} | {fmt_n(x['prompt_tokens_on'])} | {fmt_n(x['cached_tokens_on'])} | "
                     f"{fmt_n(x['cached_tokens_off'])} | {fmt_pct(x['hit_fraction_on'])} | {fmt_pct(x['hit_fraction_off'])} | "
                     f"{fmt_ms(x['ttft_p50_on'])} | {fmt_ms(x['ttft_p50_off'])} | {fmt_r(x['ttft_p50_ratio'])} |")
        L.append("")
        on, off = c["cached_tokens_on"], c["cached_tokens_off"]
        L.append(f"Tokens reused ({g}): APC on {fmt_n(on)} vs APC off {fmt_n(off)} of {fmt_n(c['prompt_tokens_on'])} prompt "
                 f"tokens ({fmt_pct(c['hit_fraction_on'])} vs {fmt_pct(c['hit_fraction_off'])}); TTFT p50 on/off "
                 f"{fmt_r(c['ttft_p50_ratio'])}, p90 on/off {fmt_r(c['ttft_p90_ratio'])}.")
        L.append("")
    return L


def render_hit_ttft(bench: Bench) -> list[str]:
    """The hit-ttft workload: TTFT p50 of a cold prompt, its full hit and a hit plus new tokens, per
    server, and each server against llama-server where one ran beside it."""
    recs = [r for r in bench.records if r["group"] == "hit-ttft" and r["counted"] and r["ok"]]
    if not recs:
        return []
    servers = list(dict.fromkeys(r.get("server") for r in recs))
    L = [f"### Cache-hit TTFT ({bench.args.prefix_tokens}-token prompt; hit + {bench.args.new_tokens} new tokens; "
         f"{bench.args.repeats} repeats)", ""]
    hdr = ["request", *(f"TTFT p50 {s or 'server'}" for s in servers), *(f"cached {s or 'server'}" for s in servers)]
    if "llama-server" in servers and len(servers) == 2:
        hdr.append("ours / llama-server")
    L += ["| " + " | ".join(hdr) + " |", "|" + "|".join("---" for _ in hdr) + "|"]
    for case in HIT_TTFT_KINDS:
        rows = {s: [r for r in recs if r.get("case") == case and r.get("server") == s] for s in servers}
        p50 = {s: pct([r["ttft_ms"] for r in rows[s]], 50) for s in servers}
        cells = [case, *(fmt_ms(p50[s]) for s in servers),
                 *(fmt_n(pct([r["cached_tokens"] for r in rows[s] if r["cached_tokens"] is not None], 50)) for s in servers)]
        if len(hdr) > len(cells):
            ours = next(s for s in servers if s != "llama-server")
            cells.append(fmt_r(ratio(p50[ours], p50["llama-server"])))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    return L


def render(bench: Bench, summary: dict[str, dict[str, Any]], info: dict[str, Any], command: str,
           comparison: dict[str, dict[str, Any]] | None = None) -> str:
    L: list[str] = []
    L.append("## Prompt-cache benchmark")
    L.append("")
    L.append(f"Command: `{command}`")
    L.append("")
    L.append(f"Server: {info.get('base_url')} api={info.get('api')} model={info.get('model') or 'n/a'} "
             f"tokenize={'yes' if info.get('tokenize') else 'no'} "
             f"cache_stats={'yes' if info.get('cache_stats') else 'n/a'}"
             + (f" cache_enabled={info.get('cache_enabled')}" if info.get("cache_stats") else "")
             + f"; n_predict={bench.args.n_predict} seed={bench.args.seed}"
             + ("" if info.get("tokenize") else f"; text lengths estimated at {bench.args.tokens_per_word} tokens/word"))
    for label, si in (info.get("servers") or {}).items():
        L.append("")
        L.append(f"- {label}: {si.get('base_url')} apc_enabled={si.get('apc_enabled')}"
                 + (f" ({si.get('apc_disabled_reason')})" if si.get("apc_disabled_reason") else "")
                 + f" apc_hash={si.get('apc_hash')} block_size={si.get('apc_block_size')}")
    L.append("")
    if bench.compare:
        L.append("TTFT = client-side time to the first streamed content chunk. All requests `cache_prompt: true` "
                 "(no cold twins with --compare-apc: the APC-off server is the baseline); rows are `workload@server`. "
                 "Token columns are sums over the counted requests; prefill = server `timings.prompt_ms` p50.")
    else:
        L.append("TTFT = client-side time to the first streamed content chunk. warm = `cache_prompt: true`, "
                 "cold = the same request with `cache_prompt: false`, sent right after it. Token columns are sums over "
                 "the warm requests; prefill = server `timings.prompt_ms` p50.")
    L.append("")
    hdr = ["workload", "n", "warm TTFT p50", "warm p90", "cold TTFT p50", "cold p90", "warm/cold p50",
           "prefill ms warm/cold", "prompt tok", "computed", "cached", "hit frac", "hit reqs",
           "cache entries", "cache bytes", "srv hits/lookups", "errors"]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join("---" for _ in hdr) + "|")
    for g, s in summary.items():
        hr = s["hit_requests"]
        srv = "n/a" if s["server_hits"] is None else f"{s['server_hits']}/{s['server_lookups']}"
        row = [
            g,
            f"{s['n_warm']}+{s['n_cold']}",
            fmt_ms(s["warm_ttft_p50"]), fmt_ms(s["warm_ttft_p90"]),
            fmt_ms(s["cold_ttft_p50"]), fmt_ms(s["cold_ttft_p90"]),
            fmt_r(s["ttft_p50_ratio"]),
            f"{fmt_ms(s['warm_server_prompt_ms_p50'])} / {fmt_ms(s['cold_server_prompt_ms_p50'])}",
            fmt_n(s["warm_prompt_tokens"]), fmt_n(s["warm_computed_tokens"]), fmt_n(s["warm_cached_tokens"]),
            fmt_pct(s["hit_fraction"]),
            "n/a" if hr is None else f"{hr[0]}/{hr[1]}",
            fmt_n(s["cache_entries"]), fmt_bytes(s["cache_bytes"]), srv, str(s["errors"]),
        ]
        L.append("| " + " | ".join(row) + " |")
    L.append("")

    def of(group: str) -> list[tuple[str, dict[str, Any]]]:
        """(suffix for headings, summary) of one workload on every server."""
        return [(f" [{s['server']}]" if s.get("server") else "", s) for s in summary.values() if s["group"] == group]

    for where, s in of("unrelated"):
        r1, r2 = s["ttft_mean_ratio"], s["total_mean_ratio"]
        verdict = "n/a" if r1 is None else ("OK" if r1 < 1.03 else "OVER")
        L.append(f"Overhead guard{where} (unrelated, goal < +3%): warm/cold mean TTFT {fmt_r(r1)} "
                 f"({'n/a' if r1 is None else f'{100 * (r1 - 1):+.1f}%'}) -> {verdict}; "
                 f"mean request time {fmt_r(r2)}; p50 TTFT {fmt_r(s['ttft_p50_ratio'])}.")
        L.append("")
    for where, s in of("prefix64"):
        a = bench.args
        L.append(f"### prefix64{where}: {a.prefix_tokens}-token prefix + {a.new_tokens} new tokens ({a.repeats} repeats)")
        L.append("")
        L.append("| measure | TTFT p50 | TTFT p90 | prefill ms p50 (server) | prompt tok computed (p50) |")
        L.append("|---|---|---|---|---|")
        L.append(f"| warm (prefix cached) | {fmt_ms(s['warm_ttft_p50'])} | {fmt_ms(s['warm_ttft_p90'])} | "
                 f"{fmt_ms(s['warm_server_prompt_ms_p50'])} | {fmt_n(s['warm_computed_tokens_p50'])} |")
        L.append(f"| cold, new tokens only | {fmt_ms(s['cold_new_ttft_p50'])} | {fmt_ms(s['cold_new_ttft_p90'])} | "
                 f"{fmt_ms(s['cold_new_server_prompt_ms_p50'])} | {fmt_n(s['cold_new_prompt_tokens_p50'])} |")
        cold_n = (s["cold_prompt_tokens"] // s["n_cold"]) if s["cold_prompt_tokens"] and s["n_cold"] else None
        L.append(f"| cold, full prompt | {fmt_ms(s['cold_ttft_p50'])} | {fmt_ms(s['cold_ttft_p90'])} | "
                 f"{fmt_ms(s['cold_server_prompt_ms_p50'])} | {fmt_n(cold_n)} |")
        r = s["warm_over_prefill_new"]
        verdict = "n/a" if r is None else ("OK" if r <= 1.2 else "OVER")
        L.append("")
        L.append(f"warm_ttft / prefill_{a.new_tokens}_only = {fmt_r(r)} (goal <= 1.2 -> {verdict}); "
                 f"server prefill ratio {fmt_r(s['warm_over_prefill_new_server'])}; "
                 f"warm / full cold = {fmt_r(s['ttft_p50_ratio'])}.")
        L.append("")
    agent = [(g, summary[g]) for g in ("agent-chat", "agent-anthropic") if g in summary]
    if agent:
        a = bench.args
        L.append(f"### agent: {a.agent_system_tokens}-token system prompt + {len(AGENT_TOOLS)} tool schemas, "
                 f"{a.agent_sessions} sessions interleaved, {a.rounds} rounds")
        L.append("")
        L.append("| API | hit fraction | warm TTFT p50 | warm TTFT p90 | cold TTFT p50 | cold/warm p50 |")
        L.append("|---|---|---|---|---|---|")
        for g, s in agent:
            cw = ratio(s["cold_ttft_p50"], s["warm_ttft_p50"])
            L.append(f"| {g.split('-', 1)[1]} | {fmt_pct(s['hit_fraction'])} | {fmt_ms(s['warm_ttft_p50'])} | {fmt_ms(s['warm_ttft_p90'])} | "
                     f"{fmt_ms(s['cold_ttft_p50'])} | {fmt_r(cw)} |")
        cost = info.get("agent_translation")
        if cost:
            L.append("")
            L.append(f"Anthropic translation per request (in process, p50 over {cost['n']} requests): request "
                     f"{cost['request_us_p50']:.0f} us, reply {cost['reply_us_p50']:.0f} us (goal <= 1 ms).")
        L.append("")
    ts = [g for g in summary if g.startswith("timestamp/")]
    if ts:
        parts = [f"{g.split('/', 1)[1]}: {fmt_pct(summary[g]['hit_fraction'])} cached, warm/cold TTFT {fmt_r(summary[g]['ttft_p50_ratio'])}"
                 for g in ts]
        L.append(f"Timestamp placement (turns 2..{bench.args.ts_rounds}): " + "; ".join(parts) + ".")
        L.append("")
    if not bench.compare:
        for _, s in of("apc-divergent"):
            L.extend(render_cases_single(bench, s))
    if comparison:
        L.extend(render_comparison(bench, comparison))
    L.extend(render_hit_ttft(bench))
    for w in bench.warnings:
        L.append(f"WARNING: {w}")
    return "\n".join(L).rstrip() + "\n"


# --------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Workloads: " + ", ".join(WORKLOADS))
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an already running server, e.g. http://127.0.0.1:8080")
    target.add_argument("--serve", metavar="MODEL_DIR|FAMILY[:SIZE]",
                        help="start our server on a free port (e.g. llama:small, llama:tiny, or a model directory)")
    p.add_argument("--size", default="small", help="test-model size when --serve names a family without one (default small)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help="extra server arguments (repeatable; use the = form: --server-arg=--no-cache-prompt)")
    p.add_argument("--server-python", default=sys.executable, help="Python that runs the server (default: this one)")
    p.add_argument("--peer-llama-server", metavar="BIN",
                   help="with --serve FILE.gguf: also start this llama-server binary on the same file and the same "
                        "--server-arg flags, and send every request to both (order alternating); rows are "
                        "workload@mlxcel and workload@llama-server")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-log", metavar="FILE", help="keep the started server's output in FILE (default: a temp file, "
                   "deleted unless start-up fails)")
    p.add_argument("--api", choices=("native", "openai"), default="native")
    p.add_argument("--model", help="model name to put into OpenAI requests (default: the server's first /v1/models id)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"))
    p.add_argument("--workloads", default=None,
                   help="comma-separated subset (default: all; apc-divergent only with --compare-apc)")
    p.add_argument("--compare-apc", action="store_true",
                   help="with --serve: start two servers, --apc-enabled=true and --apc-enabled=false, and send every "
                        "request to both (interleaved); report reused tokens and TTFT side by side")
    p.add_argument("--n-predict", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--users", type=int, default=8, help="shared-system users (default 8)")
    p.add_argument("--mt-users", type=int, default=10, help="multi-turn users (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="multi-turn and agent rounds (default 5)")
    p.add_argument("--agent-system-tokens", type=int, default=2048, help="agent workload: system prompt tokens (default 2048)")
    p.add_argument("--agent-sessions", type=int, default=5, help="agent workload: sessions interleaved (default 5)")
    p.add_argument("--ts-rounds", type=int, default=4, help="timestamp turns per layout, first one primes (default 4)")
    p.add_argument("--unrelated", type=int, default=8, help="unrelated warm/cold pairs (default 8)")
    p.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt size (default 1024)")
    p.add_argument("--question-tokens", type=int, default=24, help="user question size (default 24)")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="prefix64 prefix size (default 2048)")
    p.add_argument("--new-tokens", type=int, default=64, help="prefix64 new tokens (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="prefix64 repeats (default 5)")
    p.add_argument("--apc-lengths", default="32,128,512", metavar="K,K,...",
                   help="apc-divergent: token lengths of the shared opening user turn, one user group each "
                        "(default 32,128,512)")
    p.add_argument("--apc-users", type=int, default=3, help="apc-divergent: users per opening (default 3)")
    p.add_argument("--apc-turns", type=int, default=3,
                   help="apc-divergent: longest conversation in turns; users get 1..N turns (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted cold requests before the workloads (default 2)")
    p.add_argument("--tokens-per-word", type=float, default=1.3,
                   help="length estimate when the server has no /tokenize (default 1.3)")
    p.add_argument("--no-cold", action="store_true", help="skip the cache_prompt:false twins")
    p.add_argument("--no-reset", action="store_true", help="do not POST /v1/cache/reset before each workload")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request read timeout, seconds")
    p.add_argument("--json", metavar="FILE", help="write raw results (every request) to FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-request progress on stderr")
    args = p.parse_args(argv)
    if args.workloads is None:
        args.workloads = "apc-divergent" if args.compare_apc else ",".join(WORKLOADS)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workload_list if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}")
    try:
        args.apc_length_list = [int(x) for x in args.apc_lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--apc-lengths: expected comma-separated integers, got {args.apc_lengths!r}")
    if not args.apc_length_list or any(k < 1 for k in args.apc_length_list):
        p.error("--apc-lengths: expected positive token counts")
    if args.apc_users < 1 or args.apc_turns < 1:
        p.error("--apc-users and --apc-turns must be >= 1")
    if args.peer_llama_server and not (args.serve and args.serve.endswith(".gguf") and not args.compare_apc):
        p.error("--peer-llama-server needs --serve FILE.gguf (the file both servers load) and no --compare-apc")
    if args.compare_apc:
        if not args.serve:
            p.error("--compare-apc needs --serve (it starts both servers itself)")
        if any(x.startswith("--apc-enabled") for a in args.server_arg for x in shlex.split(a)):
            p.error("--compare-apc sets --apc-enabled on each server itself; drop it from --server-arg")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([os.path.relpath(sys.executable) if not os.path.isabs(sys.executable) else sys.executable,
                          sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    servers: list[ServerProcess] = []
    apis: list[Api] = []
    try:
        # (label, extra server flags): one unlabelled server, or the APC-on / APC-off pair. Both get
        # the explicit flag (the CLI wins over APC_ENABLED / MLXCEL_APC_ENABLED in the environment).
        specs: list[tuple[str | None, list[str]]] = [(None, [])]
        if args.compare_apc:
            specs = [("apc-on", ["--apc-enabled=true"]), ("apc-off", ["--apc-enabled=false"])]
        elif args.peer_llama_server:
            specs = [("mlxcel", [])]
        if args.serve:
            model_dir = resolve_model(args.serve, args.size)
            extra = [x for a in args.server_arg for x in shlex.split(a)]
            targets: list[tuple[str | None, str]] = []
            for label, flags in specs:
                log = f"{args.server_log}.{label}" if (args.server_log and label) else args.server_log
                # Separate processes: each server has its own in-memory store (reset again before
                # every workload, see Bench.begin_group).
                # A temporary log is deleted after a clean stop; an explicit --server-log is kept.
                server = ServerProcess.mlxcel(model_dir, [*extra, *flags], python=args.server_python,
                                              name=label or "server", log_path=log,
                                              keep_log=log is not None)
                servers.append(server)
                print(f"starting{' ' + label if label else ''}: {shlex.join(server.cmd)}", file=sys.stderr, flush=True)
                server.start()
                server.wait_healthy(args.startup_timeout)
                targets.append((label, server.base_url))
            if args.peer_llama_server:
                port = free_port()
                peer = ServerProcess([args.peer_llama_server, "-m", model_dir, "--host", "127.0.0.1", "--port", str(port),
                                      *extra], port, name="llama-server")
                servers.append(peer)
                print(f"starting llama-server: {shlex.join(peer.cmd)}", file=sys.stderr, flush=True)
                peer.start()
                peer.wait_healthy(args.startup_timeout)
                targets.append(("llama-server", peer.base_url))
        else:
            targets = [(None, args.base_url)]
        for label, base_url in targets:
            apis.append(Api(base_url, args.api, args.n_predict, args.seed, args.model, args.api_key, args.timeout,
                            label=label))
        info = apis[0].probe()
        if servers:
            info["server_cmd"] = servers[0].cmd
        if args.compare_apc:
            info["servers"] = {}
            for api, server in zip(apis, servers):
                si = info if api is apis[0] else api.probe()
                st = api.cache_stats() or {}
                info["servers"][api.label] = {
                    "base_url": api.base, "cmd": server.cmd, "cache_enabled": si.get("cache_enabled"),
                    "apc_enabled": st.get("apc_enabled"), "apc_disabled_reason": st.get("apc_disabled_reason"),
                    "apc_hash": st.get("hash"), "apc_block_size": st.get("block_size"),
                }
        text = TextMaker(args.seed, apis[0].count_tokens, args.tokens_per_word)
        bench = Bench(apis[0], args, text, apis[1:])
        if args.compare_apc:
            on, off = info["servers"]["apc-on"], info["servers"]["apc-off"]
            if on.get("apc_enabled") is not True:
                bench.warnings.append(f"APC is not active on the apc-on server (apc_enabled={on.get('apc_enabled')}, "
                                      f"reason={on.get('apc_disabled_reason')}): the comparison shows no APC effect")
            if off.get("apc_enabled") is not False:
                bench.warnings.append(f"the apc-off server reports apc_enabled={off.get('apc_enabled')}")
            if on.get("cache_enabled") is False or off.get("cache_enabled") is False:
                bench.warnings.append("the prompt cache is off on a compared server: nothing is reused at all")
        t_start = time.time()
        bench.warmup()
        for w in args.workload_list:
            {"shared-system": bench.shared_system, "multi-turn": bench.multi_turn, "timestamp": bench.timestamp,
             "unrelated": bench.unrelated, "prefix64": bench.prefix64, "apc-divergent": bench.apc_divergent,
             "agent": bench.agent, "hit-ttft": bench.hit_ttft}[w]()
        summary = summarize(bench)
        info["agent_translation"] = bench.translation_cost()
        comparison = compare_apc(summary) if args.compare_apc else None
        if bench.compare and bench.reply_mismatches:
            bench.warnings.append(f"{bench.reply_mismatches} request(s) got different replies from the two servers "
                                  "(each conversation continues with its own server's reply, so later prompts differ "
                                  "slightly between them)")
        if servers and any(not r["ok"] for r in bench.records):
            for server in servers:
                server.failed = True  # keep their logs for the errors
        if not text.calibrated:
            bench.warnings.append("no /tokenize: text lengths are estimates; see the prompt token columns for real sizes")
        report = render(bench, summary, info, command, comparison)
        print(report)
        if args.json:
            payload = {
                "command": command,
                "argv": sys.argv[1:] if argv is None else argv,
                "started": t_start,
                "elapsed_s": time.time() - t_start,
                "server": info,
                "config": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
                "summary": summary,
                "comparison": comparison,
                "cache_stats": bench.groups,
                "warnings": bench.warnings,
                "requests": bench.records,
            }
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=2)
            print(f"raw results: {args.json}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        for server in servers:
            server.failed = True
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        for server in servers:
            server.failed = True
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for api in apis:
            api.close()
        for server in reversed(servers):
            if (kept := server.stop()) is not None:
                print(f"server log: {kept}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
