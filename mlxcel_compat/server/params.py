"""Parse and validate completion parameters the way llama-server's schema does.

- Unknown fields are ignored; ``null`` means "use the default".
- A wrong type is a 400 naming the field; a "hard" range violation is a 400 with the range;
  a "soft" range is clamped.
- Per-request defaults come from the server's settings (``--temp``, ``-n``, ``-r``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from mlxcel_compat.engine.reasoning_budget import ReasoningBudgetSpec
from mlxcel_compat.engine.request import CacheContext, GenerationRequest
from mlxcel_compat.engine.sampling.params import SamplingParams
from mlxcel_compat.engine.sampling.parsing import parse_logit_bias, parse_samplers
from mlxcel_compat.lora.adapters import AdapterSet
from mlxcel_compat.server.errors import InvalidRequest

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
_MISSING = object()


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _field_error(name: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"Field '{name}': {message}")


class Body:
    """Typed access to a JSON object with llama.cpp's null/alias/limit rules."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data

    def raw(self, *names: str) -> Any:
        """First present, non-null value among ``names`` (later aliases only if earlier are absent)."""
        for name in names:
            value = self.data.get(name)
            if value is not None:
                return value
        return _MISSING

    def bool(self, names: str | tuple[str, ...], default: bool) -> bool:
        names = (names,) if isinstance(names, str) else names
        value = self.raw(*names)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise _field_error(names[0], f"type must be boolean, but is {_type_name(value)}")
        return value

    def int(self, names: str | tuple[str, ...], default: int, lo: int | None = None, hi: int | None = None, soft: bool = False) -> int:
        """An integer field; without explicit bounds it must fit an int32, as in llama.cpp's schema
        (a value the engine cannot represent is a 400, never an engine error)."""
        names = (names,) if isinstance(names, str) else names
        if not soft:
            lo = INT32_MIN if lo is None else lo
            hi = INT32_MAX if hi is None else hi
        value = self.raw(*names)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _field_error(names[0], f"type must be number, but is {_type_name(value)}")
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _field_error(names[0], "value must be finite")
            value = int(value)
        return _limit(names[0], value, lo, hi, soft)

    def float(self, names: str | tuple[str, ...], default: float, lo: float | None = None, hi: float | None = None, soft: bool = False) -> float:
        names = (names,) if isinstance(names, str) else names
        value = self.raw(*names)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _field_error(names[0], f"type must be number, but is {_type_name(value)}")
        return _limit(names[0], float(value), lo, hi, soft)

    def str_list(self, name: str, default: list[str]) -> list[str]:
        value = self.raw(name)
        if value is _MISSING:
            return list(default)
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _field_error(name, f"type must be array of strings, but is {_type_name(value)}")
        return list(value)


def _range_error(name: str, value: Any, lo: Any, hi: Any, why: str = "") -> InvalidRequest:
    lo_s = "-inf" if lo is None else lo
    hi_s = "inf" if hi is None else hi
    return _field_error(name, f"Value must be between {lo_s} <= value <= {hi_s}, but got {value}{why}")


def _limit(name: str, value: Any, lo: Any, hi: Any, soft: bool) -> Any:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if soft:
            value = max(value, lo) if lo is not None else value
            return min(value, hi) if hi is not None else value
        raise _range_error(name, value, lo, hi)
    return value


def check_count(name: str, count: int, limit: int, flag: str, what: str = "entries") -> None:
    """A list-like field longer than its server cap is a 400 naming the field and the flag."""
    if count > limit:
        raise _field_error(name, f"at most {limit} {what} are allowed ({flag}), but got {count}")


def check_strings(name: str, values: Sequence[str], settings: Any) -> None:
    """``stop`` and ``dry_sequence_breakers``: both are matched against text as it is generated."""
    check_count(name, len(values), settings.max_stop_strings, "--max-stop-strings")
    longest = max((len(v) for v in values), default=0)
    if longest > settings.max_stop_chars:
        raise _field_error(name, f"each string may hold at most {settings.max_stop_chars} characters (--max-stop-chars), but one holds {longest}")


def cache_prompt_flag(body: Mapping[str, Any], default: bool) -> bool:
    """``cache_prompt`` at the top level, else nested under ``extra_body`` (raw HTTP clients)."""
    value = body.get("cache_prompt")
    if value is None and isinstance(body.get("extra_body"), Mapping):
        value = body["extra_body"].get("cache_prompt")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _field_error("cache_prompt", f"type must be boolean, but is {_type_name(value)}")
    return value


LORA_FIELD_ERROR = "Error: 'lora' must be an array of objects with 'id' and 'scale' fields"


def parse_lora(data: Mapping[str, Any], adapters: AdapterSet | None) -> tuple[float, ...]:
    """The request's effective LoRA scales (one per adapter id), as llama-server reads ``lora``:
    absent or empty, the global scales; else the listed ids take their scales and the others 0
    (ids out of range are ignored, as there). Not an array: 400 with llama-server's message."""
    adapters = adapters if adapters is not None else AdapterSet()
    lora = data.get("lora")
    if lora is not None and not isinstance(lora, list):
        raise InvalidRequest(LORA_FIELD_ERROR)
    try:
        return adapters.for_request(lora)
    except ValueError as exc:
        raise _field_error("lora", str(exc)) from None


@dataclass
class CompletionOptions:
    """Everything a completion route needs besides the prompt tokens."""

    request: GenerationRequest  # a template; one copy per prompt and per n
    stream: bool = False
    include_usage: bool = False
    n_cmpl: int = 1
    return_tokens: bool = False
    timings_per_token: bool = False
    response_fields: list[str] = field(default_factory=list)
    n_keep: int = 0
    n_discard: int = 0
    sse_ping_interval: int = -1  # seconds of stream silence before a keep-alive comment; <= 0: never
    generation_extra: dict[str, Any] = field(default_factory=dict)


def parse_completion_options(
    data: Mapping[str, Any],
    settings: Any,
    n_parallel: int,
    vocab_size: int,
    tokenize: Callable[[str], list[int]],
    eog_ids: Sequence[int],
    adapters: AdapterSet | None = None,
) -> CompletionOptions:
    """Build the per-request options, starting from the server's CLI defaults."""
    lora = parse_lora(data, adapters)
    b = Body(data)
    sampling = parse_sampling(b, settings, vocab_size, tokenize)
    n_predict = cap_n_predict(b.int(("n_predict", "max_completion_tokens", "max_tokens"), settings.n_predict, -1, INT32_MAX), settings)
    n_probs = parse_n_probs(b, data, settings.n_probs_max)
    requested_stop = b.str_list("stop", [])
    check_strings("stop", requested_stop, settings)
    stop = [s for s in requested_stop if s] or list(settings.reverse_prompt or [])
    stream_options = data.get("stream_options")
    include_usage = isinstance(stream_options, Mapping) and stream_options.get("include_usage") is True
    response_fields = b.str_list("response_fields", [])
    id_slot = data.get("id_slot")
    request = GenerationRequest(
        prompt_tokens=[],
        sampling=sampling,
        n_predict=n_predict,
        stop=stop,
        n_probs=n_probs,
        post_sampling_probs=b.bool("post_sampling_probs", False),
        return_progress=b.bool("return_progress", False),
        id_slot=id_slot if isinstance(id_slot, int) and not isinstance(id_slot, bool) else -1,
        cache=CacheContext(enabled=cache_prompt_flag(data, settings.cache_prompt),
                           lora_id=adapters.lora_id(lora) if adapters is not None else "",
                           explain=b.bool("cache_explain", False)),
        lora=lora,
        t_max_predict_ms=b.int("t_max_predict_ms", -1, -1, None),
        n_indent=b.int("n_indent", 0, 0, None),
        reasoning_budget=parse_reasoning_budget(b, settings, tokenize),
        spec_types=spec_type_names(settings),
        n_keep=b.int("n_keep", settings.n_keep, -1, None),
        n_discard=b.int("n_discard", 0, 0, None),
    )
    sampling.n_probs = n_probs
    sampling.post_sampling_probs = request.post_sampling_probs
    return CompletionOptions(
        request=request,
        stream=b.bool("stream", False),
        include_usage=include_usage,
        n_cmpl=b.int(("n_cmpl", "n"), 1, 1, n_parallel),
        return_tokens=b.bool("return_tokens", False),
        timings_per_token=b.bool("timings_per_token", False),
        response_fields=response_fields,
        n_keep=request.n_keep,
        n_discard=request.n_discard,
        sse_ping_interval=b.int("sse_ping_interval", settings.sse_ping_interval, -1, None),
    )


THINK_START_TAG = "<think>"
UNLIMITED_BUDGET = 2**31 - 1  # reasoning_control without a budget: the block ends by the model or on request
THINK_END_TAG = "</think>"


def _str_field(b: Body, name: str, default: str) -> str:
    value = b.raw(name)
    if value is _MISSING:
        return default
    if not isinstance(value, str):
        raise _field_error(name, f"type must be string, but is {_type_name(value)}")
    return value


def parse_reasoning_budget(b: Body, settings: Any, tokenize: Callable[[str], list[int]]) -> ReasoningBudgetSpec | None:
    """``reasoning_budget_tokens`` (or ``thinking_budget_tokens``; default ``--reasoning-budget``).

    The tags default to ``<think>``/``</think>``; the forced text is ``reasoning_budget_message``
    (default ``--reasoning-budget-message``) followed by the end tag. Whether the prompt already
    opens a block is decided per prompt (``pipeline.expand``). ``reasoning_control: true`` arms
    the budget without a limit, so that ``/v1/chat/completions/control`` can end the block.
    """
    budget = b.int(("reasoning_budget_tokens", "thinking_budget_tokens"), settings.reasoning_budget, -1, None)
    start = _str_field(b, "reasoning_budget_start_tag", THINK_START_TAG)
    end = _str_field(b, "reasoning_budget_end_tag", THINK_END_TAG)
    message = _str_field(b, "reasoning_budget_message", settings.reasoning_budget_message or "")
    control = b.bool("reasoning_control", False)
    if (budget < 0 and not control) or not end:
        return None
    return ReasoningBudgetSpec(
        budget=budget if budget >= 0 else UNLIMITED_BUDGET, start=tuple(tokenize(start)) if start else (),
        end=tuple(tokenize(end)), forced=tuple(tokenize(message + end)), control=control,
    )


def cap_n_predict(n_predict: int, settings: Any) -> int:
    """``--n-predict-max``: larger values, and -1 (no limit), are lowered to the cap."""
    cap = settings.n_predict_max
    if cap < 0:
        return n_predict
    return cap if n_predict < 0 else min(n_predict, cap)


def parse_n_probs(b: Body, data: Mapping[str, Any], cap: int) -> int:
    """``n_probs`` (or the integer ``logprobs`` of /v1/completions): a negative value counts as 0
    (llama-server clamps it), a value above ``--n-probs-max`` is a 400."""
    n_probs = b.int(("n_probs",), 0, 0, None, soft=True)
    name = "n_probs"
    logprobs = data.get("logprobs")
    if n_probs == 0 and isinstance(logprobs, int) and not isinstance(logprobs, bool):
        n_probs, name = max(0, logprobs), "logprobs"  # /v1/completions: integer logprobs = n_probs
    if n_probs > cap:
        raise _range_error(name, n_probs, 0, cap, " (--n-probs-max)")
    return n_probs


def parse_sampling(b: Body, settings: Any, vocab_size: int, tokenize: Callable[[str], list[int]]) -> SamplingParams:
    s = settings
    seed = b.int("seed", s.seed, INT32_MIN, 2**32 - 1)  # -1 (random) and the whole uint32 range
    samplers_raw = b.raw("samplers")
    if samplers_raw is _MISSING:
        # --samplers is a ';'-separated list of names; --sampling-seq a string of sampler characters.
        if s.sampling_seq and not s.is_set("samplers"):
            samplers = parse_samplers(s.sampling_seq)
        else:
            samplers = parse_samplers([n for n in s.samplers.split(";") if n]) if s.samplers else SamplingParams().samplers
    else:
        if not isinstance(samplers_raw, (list, str)):
            raise _field_error("samplers", f"type must be array or string, but is {_type_name(samplers_raw)}")
        check_count("samplers", len(samplers_raw), s.max_samplers, "--max-samplers", "samplers")
        try:
            samplers = parse_samplers(samplers_raw)
        except ValueError as exc:
            raise _field_error("samplers", str(exc)) from None
    breakers = b.raw("dry_sequence_breakers")
    if breakers is _MISSING:
        breakers = list(s.dry_sequence_breaker)
    elif not isinstance(breakers, list) or not all(isinstance(x, str) for x in breakers) or not breakers:
        raise _field_error("dry_sequence_breakers", "Error: dry_sequence_breakers must be a non-empty array of strings")
    else:
        check_strings("dry_sequence_breakers", breakers, s)
    dry_base = b.float("dry_base", s.dry_base)
    logit_bias_raw = b.raw("logit_bias")
    if isinstance(logit_bias_raw, (list, dict)):
        check_count("logit_bias", len(logit_bias_raw), s.max_logit_bias, "--max-logit-bias")
    try:
        logit_bias = {} if logit_bias_raw is _MISSING else parse_logit_bias(logit_bias_raw, vocab_size, tokenize)
    except ValueError as exc:
        raise _field_error("logit_bias", str(exc)) from None
    return SamplingParams(
        temperature=b.float(("temperature", "temp"), s.temp, 0.0, None, soft=True),
        dynatemp_range=b.float("dynatemp_range", s.dynatemp_range),
        dynatemp_exponent=b.float("dynatemp_exponent", s.dynatemp_exp),
        top_k=b.int("top_k", s.top_k, 0, INT32_MAX, soft=True),
        top_p=b.float("top_p", s.top_p, 0.0, 1.0, soft=True),
        min_p=b.float("min_p", s.min_p, 0.0, 1.0, soft=True),
        typical_p=b.float("typical_p", s.typical_p),
        top_n_sigma=b.float("top_n_sigma", s.top_n_sigma),
        xtc_probability=b.float("xtc_probability", s.xtc_probability, 0.0, 1.0, soft=True),
        xtc_threshold=b.float("xtc_threshold", s.xtc_threshold, 0.0, 1.0, soft=True),
        repeat_last_n=b.int("repeat_last_n", s.repeat_last_n, 0, None),
        repeat_penalty=b.float("repeat_penalty", s.repeat_penalty),
        presence_penalty=b.float("presence_penalty", s.presence_penalty),
        frequency_penalty=b.float("frequency_penalty", s.frequency_penalty),
        dry_multiplier=b.float("dry_multiplier", s.dry_multiplier),
        dry_base=dry_base if dry_base >= 1.0 else s.dry_base,
        dry_allowed_length=b.int("dry_allowed_length", s.dry_allowed_length, 0, None),
        dry_penalty_last_n=b.int("dry_penalty_last_n", s.dry_penalty_last_n, -1, None),
        dry_sequence_breakers=breakers,
        min_keep=b.int("min_keep", s.min_keep, 0, None),
        seed=(seed & 0xFFFFFFFF),
        samplers=samplers,
        logit_bias=logit_bias,
        ignore_eos=b.bool("ignore_eos", s.ignore_eos),
        mirostat=b.int("mirostat", s.mirostat, 0, 2, soft=True),
        mirostat_tau=b.float("mirostat_tau", s.mirostat_ent),
        mirostat_eta=b.float("mirostat_eta", s.mirostat_lr),
        adaptive_target=b.float("adaptive_target", s.adaptive_target, None, 1.0, soft=True),
        adaptive_decay=b.float("adaptive_decay", s.adaptive_decay, 0.0, 0.99),
    )


def spec_type_names(settings: Any) -> str:
    """``speculative.types`` as llama-server shows it: the --spec-type names in force (a draft
    model alone drafts as draft-simple)."""
    from mlxcel_compat.engine.speculative import SpecConfig

    return SpecConfig.from_settings(settings).type_names
