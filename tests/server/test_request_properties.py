"""Property tests: any JSON value in any request field gives an answer or a 4xx naming the field.

Every field of the request-field table gets arbitrary JSON (Hypothesis) in an otherwise valid
body, and goes through the same preparation the routes run (options, prompt shapes, chat
rendering, tokenization, prompt-cache facts). The outcome must be a prepared request, or an
``ApiError`` with a 4xx status whose message names the field (fields the manifest marks
unsupported may answer 501, naming the field). Every prepared request's sampler parameters
must then build a sampler chain that samples a token: the engine never sees parameters it
cannot run.

Real parts: the tiny model's tokenizer and chat template on a started engine; no mocks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel_compat.engine.core import Engine, EngineConfig
from mlxcel_compat.engine.sampling.chain import SamplerChain
from mlxcel_compat.request_fields import REQUEST_FIELDS
from mlxcel_compat.server.api_openai import check_logprobs
from mlxcel_compat.server.app import model_info
from mlxcel_compat.server.cache_hooks import CacheHooks
from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import ApiError
from mlxcel_compat.server.pipeline import build_chat_job, build_completion_job
from mlxcel_compat.server.structured import StructuredOutput
from mlxcel_compat.settings import resolve_settings

pytestmark = pytest.mark.engine

EXAMPLES = 30  # per field; about 90 fields
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Where a field's error names one of its parts instead (a message's content, a tool's function).
PARTS = {
    "messages": ("messages", "message", "content", "role", "tool_calls", "tool_call_id", "name"),
    "tools": ("tools", "tool", "function"),
    "grammar_lazy": ("lazy grammar",),  # llama-server's "Error: no triggers set for lazy grammar!"
    "grammar_triggers": ("grammar trigger",),
}


@pytest.fixture(scope="module")
def ctx(llama_dir):
    settings = resolve_settings(["-m", str(llama_dir), "-c", "512", "-np", "2", "--n-predict-max", "4"], {})
    engine = Engine(EngineConfig(model=str(llama_dir), ctx_size=512, n_parallel=2))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    context = ServerContext(settings=settings, engine=engine)
    model = model_info(engine, settings)
    context.cache_hooks = CacheHooks(enabled=True, template=model.chat_template, tokenize=context.tokenize_rendered, isolation="salt")
    context.model = model
    context.structured = StructuredOutput(engine.grammars, context.tokenize, None)
    yield context
    engine.stop()
    context.workers.close()


def names_of(field_name: str) -> tuple[str, ...]:
    top = field_name.split(".")[0].split("[")[0]
    entry = next(f for f in REQUEST_FIELDS if f.field == field_name)
    return (top, *entry.aliases, *PARTS.get(top, ()))


def check_sampler(ctx: ServerContext, requests: list) -> None:
    """The parameters the engine would receive build a chain that samples a valid token."""
    vocab = ctx.model.vocab_size
    logits = mx.random.normal((vocab,), key=mx.random.key(0))
    for request in requests:
        chain = SamplerChain(request.sampling, vocab_size=vocab, eog_token_ids=ctx.model.eog_ids, tokenizer=ctx.model.tokenizer, n_ctx=512)
        result = chain.sample(logits, list(request.prompt_tokens))
        assert 0 <= int(result.token.item()) < vocab


def prepare(ctx: ServerContext, route: str, body: dict[str, Any]) -> list:
    """What the route does with a body before the engine (the handlers' own steps)."""
    if route == "chat":
        return build_chat_job(ctx, check_logprobs(body), None, None).requests
    return build_completion_job(ctx, body, None, None).requests


def assert_answer_or_named_4xx(ctx: ServerContext, route: str, field_name: str, body: dict[str, Any]) -> None:
    try:
        requests = prepare(ctx, route, body)
    except ApiError as exc:
        entry = next(f for f in REQUEST_FIELDS if f.field == field_name)
        allowed = {400} | ({501} if entry.status in ("unsupported", "partial") else set())
        assert exc.status_code in allowed, (field_name, exc.status_code, exc.message)
        assert any(name.lower() in exc.message.lower() for name in names_of(field_name)), (field_name, exc.message)
        return
    check_sampler(ctx, requests)


COMPLETION_FIELDS = [f.field for f in REQUEST_FIELDS if f.scope in ("all", "completion") and "[" not in f.field]
CHAT_FIELDS = [f.field for f in REQUEST_FIELDS if f.scope == "chat" and "[" not in f.field]


def body_with(base: dict[str, Any], field_name: str, value: Any) -> dict[str, Any]:
    body = dict(base)
    if "." in field_name:
        parent, member = field_name.split(".", 1)
        body[parent] = {member: value}
    else:
        body[field_name] = value
    return body


@pytest.mark.parametrize("field_name", COMPLETION_FIELDS)
def test_completion_field_takes_any_json(ctx, field_name: str) -> None:
    @given(value=JSON_VALUES)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(value: Any) -> None:
        assert_answer_or_named_4xx(ctx, "completion", field_name, body_with({"prompt": "Hello there", "n_predict": 2}, field_name, value))

    run()


@pytest.mark.parametrize("field_name", CHAT_FIELDS + ["temperature", "samplers", "logit_bias", "stop", "n_probs"])
def test_chat_field_takes_any_json(ctx, field_name: str) -> None:
    base = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}

    @given(value=JSON_VALUES)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(value: Any) -> None:
        assert_answer_or_named_4xx(ctx, "chat", field_name, body_with(base, field_name, value))

    run()


SAMPLER_NUMBERS = st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-(2**31), 2**31 - 1)


@given(
    values=st.fixed_dictionaries(
        {},
        optional={
            name: SAMPLER_NUMBERS
            for name in (
                "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma",
                "xtc_probability", "xtc_threshold", "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty",
                "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "min_keep", "seed",
            )
        },
    ),
    samplers=st.none() | st.lists(st.sampled_from(["dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "penalties", "infill"]), max_size=8),
)
@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_sampler_parameters_in_combination(ctx, values: dict[str, Any], samplers: list[str] | None) -> None:
    """All sampler numbers at once, in any chain order: a 400 naming one of them, or a chain that
    samples a valid token."""
    body: dict[str, Any] = {"prompt": "Hello there, hello there", "n_predict": 2, **values}
    if samplers is not None:
        body["samplers"] = samplers
    try:
        requests = build_completion_job(ctx, body, None, None).requests
    except ApiError as exc:
        assert exc.status_code == 400 and any(f"'{name}'" in exc.message for name in (*values, "samplers")), exc.message
        return
    check_sampler(ctx, requests)


def test_preparation_builds_the_infill_piece_index_off_the_engine_thread(ctx) -> None:
    """The infill sampler's piece index sorts the whole vocabulary (a second for 150k tokens): the
    request's worker thread builds it, so the engine thread's first infill step does not."""
    from mlxcel_compat.engine.textstream import derived_values
    from mlxcel_compat.tokenizer.served import unwrap_tokenizer

    per_tokenizer = derived_values[unwrap_tokenizer(ctx.model.tokenizer)]
    per_tokenizer.pop("infill piece index", None)
    prepare(ctx, "completion", {"prompt": "Hi", "n_predict": 1, "samplers": ["top_k", "temperature"]})
    assert "infill piece index" not in per_tokenizer  # only a chain with infill needs it
    prepare(ctx, "completion", {"prompt": "Hi", "n_predict": 1, "samplers": ["infill"]})
    assert "infill piece index" in per_tokenizer
