"""Shared response pieces: the per-sequence :class:`Result`, llama-server's native JSON, SSE framing.

Builders take plain records (:class:`Result`, engine events) and return dicts; they never see
MLX. Key order follows llama-server's, because some clients and tests compare dumps.
"""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import orjson

from mlxcel_compat.engine.request import FinishEvent, GenerationRequest, TokenEvent, TokenProb
from mlxcel_compat.engine.textstream import token_bytes, token_piece

from mlxcel_compat import __version__  # noqa: E402

# llama-server's "b<build>-<commit>"; the b0- prefix keeps parsers of that shape working.
BUILD_INFO = f"b0-mlxcel_compat-{__version__}"


def random_id(prefix: str, length: int = 32) -> str:
    """A response id such as ``chatcmpl-…``: a prefix and random letters and digits."""
    return prefix + "".join(random.choices(string.ascii_letters + string.digits, k=length))


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_PING = b":\n\n"  # an SSE comment: keeps idle connections (and proxies) alive


@dataclass
class Result:
    """Everything one finished sequence produced, accumulated from its events.

    Per-token probabilities are kept as the engine sent them and turned into JSON entries only
    when the response is built (on a worker thread, see ``pipeline.respond``): building them per
    token would put that work on the event loop.
    """

    index: int
    request: GenerationRequest
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    prob_events: list[TokenEvent] = field(default_factory=list)
    finish: FinishEvent | None = None
    trailing_silent: int = 0  # tokens at the end that emitted no text (held back or stop string)
    tokenizer: Any = None

    def add(self, event: TokenEvent, tokenizer: Any) -> None:
        self.content += event.text
        self.tokens.append(event.token)
        self.trailing_silent = 0 if event.text else self.trailing_silent + 1
        if event.top is not None:
            self.tokenizer = tokenizer
            self.prob_events.append(event)

    def close(self, finish: FinishEvent) -> None:
        self.finish = finish
        self.content += finish.text
        if finish.content_cut >= 0:  # n_indent: the under-indented line is not part of the reply
            self.content = self.content[: finish.content_cut]
        if finish.stop_type == "word" and self.prob_events:
            # Non-stream mode trims the entries of the stop string's tokens (llama-server).
            self.prob_events = self.prob_events[: max(0, len(self.prob_events) - self.trailing_silent)]

    @property
    def probs(self) -> list[dict[str, Any]]:
        """The ``completion_probabilities`` / ``logprobs.content`` entries of the whole sequence."""
        post = self.request.post_sampling_probs
        return [prob_entry(self.tokenizer, event, post) for event in self.prob_events]

    @property
    def has_new_line(self) -> bool:
        return "\n" in self.content


def _prob_item(tokenizer: Any, tp: TokenProb, post: bool) -> dict[str, Any]:
    key = "prob" if post else "logprob"
    return {
        "id": tp.id,
        "token": token_piece(tokenizer, tp.id),
        "bytes": list(token_bytes(tokenizer, tp.id)),
        key: _finite(tp.logprob),
    }


def _finite(x: float) -> float:
    # llama-server reports log(0) as the lowest float, never null.
    return x if x > -3.4e38 else -3.4028234663852886e38


def prob_entry(tokenizer: Any, event: TokenEvent, post: bool) -> dict[str, Any]:
    entry = _prob_item(tokenizer, TokenProb(event.token, event.logprob or 0.0), post)
    entry["top_probs" if post else "top_logprobs"] = [_prob_item(tokenizer, tp, post) for tp in event.top or []]
    return entry


def timings_json(fin: FinishEvent | TokenEvent) -> dict[str, Any]:
    """``timings`` as llama-server computes them (``server_slot_stats``).

    ``prompt_n`` counts only prefilled tokens, so ``prompt_per_second`` is never inflated. The
    generation rate is over ``predicted_n - 1`` decode steps: the first token comes from the
    prompt's last pass, and ``predicted_ms`` runs from it to the last token. A rate whose divisor
    is not known yet (no prompt token computed, a single generated token) is 0.0. Token events
    carry the running values (``timings_per_token``), finish events the final ones.
    """
    prompt_n = fin.n_prompt - fin.n_cached
    steps = max(fin.n_decoded - 1, 0)
    out = {
        "cache_n": fin.n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": fin.prompt_ms,
        "prompt_per_token_ms": fin.prompt_ms / prompt_n if prompt_n > 0 else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / fin.prompt_ms if fin.prompt_ms > 0 else 0.0,
        "predicted_n": fin.n_decoded,
        "predicted_ms": fin.predicted_ms,
        "predicted_per_token_ms": fin.predicted_ms / steps if steps > 0 else 0.0,
        "predicted_per_second": 1000.0 * steps / fin.predicted_ms if fin.predicted_ms > 0 else 0.0,
    }
    if fin.n_draft > 0:  # llama-server adds them once speculative decoding has drafted
        out.update(draft_n=fin.n_draft, draft_n_accepted=fin.n_draft_accepted)
    return out


def generation_settings(
    request: GenerationRequest,
    stream: bool,
    seed: int,
    n_keep: int | None = None,
    n_discard: int | None = None,
    eog_ids: Sequence[int] = (),
    timings_per_token: bool = False,
) -> dict[str, Any]:
    """llama-server's ``generation_settings`` (task_params::to_json), in its key order
    (``n_keep``/``n_discard``: the request's context-shift fields unless given).

    With ``ignore_eos``, the end-of-generation bans follow the request's biases as
    ``{"bias": null, "token": id}`` entries, as llama-server appends them.
    """
    s = request.sampling
    c = request.constraint
    sampling = s.to_json(seed=seed)
    samplers = sampling.pop("samplers")
    out: dict[str, Any] = dict(sampling)
    out.update(
        mirostat=s.mirostat,
        mirostat_tau=s.mirostat_tau,
        mirostat_eta=s.mirostat_eta,
        adaptive_target=s.adaptive_target,
        adaptive_decay=s.adaptive_decay,
        stop=list(request.stop),
        max_tokens=request.n_predict,
        n_predict=request.n_predict,
        n_keep=request.n_keep if n_keep is None else n_keep,
        n_discard=request.n_discard if n_discard is None else n_discard,
        ignore_eos=s.ignore_eos,
        stream=stream,
        logit_bias=[{"bias": (b if b != float("-inf") else None), "token": t} for t, b in sorted(s.logit_bias.items())]
        + ([{"bias": None, "token": t} for t in eog_ids] if s.ignore_eos else []),
        n_probs=request.n_probs,
        min_keep=s.min_keep,
        grammar=c.lark if c is not None else "",
        grammar_lazy=c.lazy if c is not None else False,
        grammar_triggers=[t.to_json() for t in c.triggers] if c is not None else [],
        preserved_tokens=list(c.preserved_words) if c is not None else [],
        chat_format="Content-only",
        reasoning_format="none",
        reasoning_in_content=False,
        generation_prompt="",
        samplers=samplers,
    )
    out["speculative.types"] = request.spec_types
    out.update(timings_per_token=timings_per_token, post_sampling_probs=request.post_sampling_probs, backend_sampling=False,
               lora=[{"id": i, "scale": scale} for i, scale in enumerate(request.lora)])
    return out


# ---------------------------------------------------------------------- native /completion


def native_final(
    result: Result,
    model_id: str,
    prompt_text: str,
    stream: bool,
    return_tokens: bool,
    n_keep: int,
    include_probs: bool,
    eog_ids: Sequence[int] = (),
    timings_per_token: bool = False,
) -> dict[str, Any]:
    fin = result.finish
    assert fin is not None
    out: dict[str, Any] = {
        "index": result.index,
        "content": "" if stream else result.content,
        "tokens": [] if stream or not return_tokens else list(result.tokens),
        "id_slot": fin.id_slot,
        "stop": True,
        "model": model_id,
        "tokens_predicted": fin.n_decoded,
        "tokens_evaluated": fin.n_prompt,
        "generation_settings": generation_settings(result.request, stream, fin.seed, n_keep, eog_ids=eog_ids, timings_per_token=timings_per_token),
        "prompt": prompt_text,
        "has_new_line": result.has_new_line,
        "truncated": fin.truncated,
        "stop_type": fin.stop_type,
        "stopping_word": fin.stopping_word,
        "tokens_cached": fin.tokens_cached,
        "timings": timings_json(fin),
    }
    if include_probs and not stream and result.request.n_probs > 0:
        out["completion_probabilities"] = result.probs
    return out


def metrics_params(request: GenerationRequest, stream: bool) -> dict[str, Any]:
    """The "metrics-only" settings /props and /slots show (no stop, logit_bias, grammar, ...)."""
    full = generation_settings(request, stream, request.sampling.seed)
    for key in ("stop", "logit_bias", "grammar", "dry_sequence_breakers", "grammar_lazy", "grammar_triggers", "preserved_tokens"):
        full.pop(key, None)
    return full


def native_partial(result: Result, event: TokenEvent, tokenizer: Any, id_slot: int, timings: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": result.index,
        "content": event.text,
        "tokens": [event.token],
        "stop": False,
        "id_slot": id_slot,
        "tokens_predicted": event.n_decoded,
        "tokens_evaluated": len(result.request.prompt_tokens),
    }
    if event.top is not None:
        out["completion_probabilities"] = [prob_entry(tokenizer, event, result.request.post_sampling_probs)]
    if timings:
        out["timings"] = timings_json(event)
    return out


def native_progress(result: Result, id_slot: int) -> dict[str, Any]:
    """A native progress chunk before its ``timings`` / ``prompt_progress``: llama-server sends
    it as a partial of an empty token (``tokens: [0]``), nothing predicted yet."""
    return {
        "index": result.index,
        "content": "",
        "tokens": [0],
        "stop": False,
        "id_slot": id_slot,
        "tokens_predicted": 0,
        "tokens_evaluated": len(result.request.prompt_tokens),
    }


def filter_fields(data: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """``response_fields``: keep only the listed (possibly nested ``a/b``) keys, flattened."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = data
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


# ---------------------------------------------------------------------- usage


@dataclass
class TokenCounts:
    """Token usage of a whole response: each distinct prompt once, every completion's tokens."""

    prompt: int  # all prompt tokens, cached ones included
    cached: int  # prompt tokens adopted from the prompt cache
    completion: int


def token_counts(results: list[Result]) -> TokenCounts:
    # Children of one prompt (n > 1) share its token list object: count that prompt once.
    seen: dict[int, tuple[int, int]] = {}
    for r in results:
        if r.finish is not None:
            seen.setdefault(id(r.request.prompt_tokens), (r.finish.n_prompt, r.finish.n_cached))
    completion = sum(r.finish.n_decoded for r in results if r.finish)
    return TokenCounts(prompt=sum(p for p, _ in seen.values()), cached=sum(c for _, c in seen.values()), completion=completion)


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------- response schemas (OpenAPI)

NUMBER_OR_NULL = {"type": ["number", "null"]}
TIMINGS_SCHEMA = {
    "type": "object",
    "properties": {
        "cache_n": {"type": "integer"},
        "prompt_n": {"type": "integer"},
        "prompt_ms": {"type": "number"},
        "prompt_per_token_ms": NUMBER_OR_NULL,
        "prompt_per_second": NUMBER_OR_NULL,
        "predicted_n": {"type": "integer"},
        "predicted_ms": {"type": "number"},
        "predicted_per_token_ms": NUMBER_OR_NULL,
        "predicted_per_second": NUMBER_OR_NULL,
    },
    "required": ["cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"],
}
PROB_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "token": {"type": "string"}, "bytes": {"type": "array", "items": {"type": "integer"}}},
    "required": ["id", "token", "bytes"],
}
