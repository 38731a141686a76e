"""Plain records that cross the boundary between the HTTP side and the engine thread.

Nothing here holds an ``mx.array``: the engine converts to Python values before emitting.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from mlxcel_compat.engine.grammar import Constraint
from mlxcel_compat.engine.reasoning_budget import ReasoningBudgetSpec
from mlxcel_compat.engine.sampling.params import SamplingParams
from mlxcel_compat.vision.inputs import MediaInput

_task_ids = itertools.count()


def next_task_id() -> int:
    return next(_task_ids)


@dataclass
class CacheContext:
    """How the prompt cache should treat this request (computed by the route, used by the engine)."""

    enabled: bool = True  # False: cold prefill, no lookup, no donation (cache_prompt: false)
    # The request's own cache_prompt, even while the server-wide prompt cache is off: a slot's kept
    # state (--slot-save-path) is then still reused, as llama-server reuses a slot's KV.
    cache_prompt: bool = True
    session_key: str = "__mlxcel_anon__"
    template_sig: str = ""  # 64 hex chars; the raw-prompt sentinel on /completion
    mm_digest: bytes = b""
    namespace: str = ""  # tenant (cache.key.cache_namespace): entries of other tenants are invisible
    # The effective LoRA adapters and scales (lora.AdapterSet.lora_id): "" for the base model.
    lora_id: str = ""
    # Chat routes: token length of the rendered history alone (snapshot boundary), if known.
    history_boundary: int | None = None
    # Explicit cache breakpoints (``cache_control``): (token position, pin seconds), ascending.
    breakpoints: list[tuple[int, float]] = field(default_factory=list)
    # cache_explain (or X-Cache-Explain: 1): the finish event says why the cache reused what it did.
    explain: bool = False


@dataclass
class GenerationRequest:
    """One sequence to generate: a tokenized prompt plus everything that shapes its output."""

    prompt_tokens: list[int]
    sampling: SamplingParams
    n_predict: int = -1  # -1: until EOS, stop or a full context
    stop: list[str] = field(default_factory=list)
    n_probs: int = 0
    post_sampling_probs: bool = False
    return_progress: bool = False
    id_slot: int = -1
    cache: CacheContext = field(default_factory=CacheContext)
    task_id: int = field(default_factory=next_task_id)
    index: int = 0  # position among the results of a multi-prompt / n>1 request
    # n_cmpl > 1: the task id of the first completion of the same prompt (-1: not shared).
    share_group: int = -1
    # What /slots shows as the task's "params" (llama-server's metrics-only settings).
    slot_params: dict[str, Any] = field(default_factory=dict)
    # Stop ("limit") at the first newline generated after this many ms of generation (<= 0: off).
    t_max_predict_ms: int = -1
    # Stop ("limit") when a new line is indented by fewer than this many spaces or tabs (0: off).
    n_indent: int = 0
    # reasoning_budget_tokens: close the thinking block after so many tokens (None: no budget).
    reasoning_budget: ReasoningBudgetSpec | None = None
    # Grammar, JSON schema or tool-call constraint on the output (None: free text).
    constraint: Constraint | None = None
    # Images in the prompt (a vision-language model only); None for text.
    media: MediaInput | None = None
    # LoRA scales, one per adapter id (the global ones unless the request's ``lora`` overrides
    # them); () or all zeros: the base model.
    lora: tuple[float, ...] = ()
    # What generation_settings shows as "speculative.types" (the server's --spec-type, resolved).
    spec_types: str = "none"
    # Context shift (--context-shift): prompt tokens kept (-1: all of them) and tokens dropped
    # after them (0: half of the rest) when the context fills.
    n_keep: int = 0
    n_discard: int = 0

    @property
    def is_child(self) -> bool:
        """A later completion of a shared prompt: it copies the prompt's KV and never donates."""
        return self.share_group >= 0 and self.share_group != self.task_id


@dataclass(slots=True)
class TokenProb:
    """One candidate of ``completion_probabilities`` (already in Python values)."""

    id: int
    logprob: float  # or the probability itself when post_sampling_probs is on


@dataclass
class TokenEvent:
    """A sampled token and the text that may be sent for it now (possibly "" while held back)."""

    token: int
    text: str
    n_decoded: int
    logprob: float | None = None  # of the chosen token (post-sampling prob if requested)
    top: list[TokenProb] | None = None
    id_slot: int = -1
    # Running timings, for ``timings_per_token`` (llama-server's meanings, see FinishEvent).
    n_prompt: int = 0
    n_cached: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    n_cache_written: int = 0  # prompt tokens newly pinned at cache breakpoints (beyond n_cached)
    n_draft: int = 0  # speculative decoding so far: draft tokens (timings draft_n) ...
    n_draft_accepted: int = 0  # ... and those accepted (draft_n_accepted)


@dataclass
class ProgressEvent:
    """Prompt-processing progress (llama-server's ``prompt_progress``)."""

    total: int
    cache: int
    processed: int  # prompt tokens in the slot so far, cached ones included (llama-server)
    time_ms: float
    id_slot: int = -1


@dataclass
class FinishEvent:
    """The sequence ended; counts and timings follow llama-server's meanings."""

    stop_type: Literal["eos", "word", "limit", "none"]
    stopping_word: str
    text: str  # held-back text flushed at the end (never part of a stop string)
    n_prompt: int  # tokens_evaluated: all prompt tokens, cached ones included
    n_cached: int  # prompt tokens adopted from the prompt cache (timings.cache_n)
    n_decoded: int  # tokens_predicted
    tokens_cached: int  # tokens whose KV the sequence's cache holds at the end
    prompt_ms: float
    predicted_ms: float
    truncated: bool
    id_slot: int
    seed: int
    cancelled: bool = False
    # n_indent: the reply ends at this many characters of sent text (-1: keep everything).
    content_cut: int = -1
    n_cache_written: int = 0  # prompt tokens newly pinned at cache breakpoints (beyond n_cached)
    n_draft: int = 0  # speculative decoding: draft tokens proposed (timings draft_n)
    n_draft_accepted: int = 0  # ... accepted by the model (timings draft_n_accepted)
    n_draft_rounds: int = 0  # ... verification passes
    accepted_per_pos: tuple[int, ...] = ()  # rounds whose draft was accepted at least up to position i
    # cache_explain: why the prompt cache reused what it did (cache/explain.py; token ids in its windows)
    cache_explain: dict[str, Any] | None = None


@dataclass
class ErrorEvent:
    """The engine could not run the sequence; rendered as llama.cpp error JSON."""

    message: str
    type: str = "server_error"
    code: int = 500
    extra: dict[str, Any] = field(default_factory=dict)


EngineEvent = Union[TokenEvent, ProgressEvent, FinishEvent, ErrorEvent]
# Where the engine thread sends one request's events (the client's queue filler, or a test's).
Sink = Callable[[EngineEvent], None]


@dataclass
class WarmupJob:
    """Extend a session's boundary snapshot through the reply, as the next turn will render it."""

    session_key: str
    template_sig: str
    tokens: list[int]  # the rendered history including the assistant reply (no generation prompt)
    mm_digest: bytes = b""  # empty: text only
    namespace: str = ""  # the tenant of the request it follows
    lora_id: str = ""  # and its adapters: the warm-up prefills under the same scales
    lora: tuple[float, ...] = ()
