"""What the routes compute for the prompt cache before a request reaches the engine.

The cache key needs facts only the HTTP side has: the session (``prompt_cache_key``, a router's
session header, ``user``), the template signature (template source, merged kwargs, the tools it
renders: what shapes the prompt, never ``tool_choice`` or a grammar), the per-request opt-out (``cache_prompt: false``), the tenant namespace
(``--prompt-cache-isolation``: the API key that authenticated the request, the ``cache_salt``
field) and the explicit cache breakpoints (``cache_control`` on a content part, a message or a
tool). Pure Python; no MLX.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, cache_namespace, resolve_session_key, template_signature
from mlxcel_compat.cache.snapshot import common_prefix_len
from mlxcel_compat.chat.render import render_history_boundary, render_next_history, render_prefix
from mlxcel_compat.chat.sandbox import TemplateError
from mlxcel_compat.engine.request import GenerationRequest, WarmupJob
from mlxcel_compat.server.errors import InvalidRequest

log = logging.getLogger(__name__)

MAX_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control
PIN_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control ttl values; 5m when absent


@dataclass(frozen=True)
class Breakpoint:
    """Where a ``cache_control`` block ends: after ``n_messages`` messages, the last cut to
    ``n_parts`` content parts (None: whole); ``n_messages`` counts only leading system messages
    for a breakpoint on a tool."""

    n_messages: int
    n_parts: int | None
    ttl: float


def _pin_ttl(marker: Any, where: str) -> float:
    if not isinstance(marker, Mapping) or marker.get("type") != "ephemeral":
        raise InvalidRequest(f"{where}.cache_control: type must be 'ephemeral'")
    ttl = marker.get("ttl", "5m")
    if ttl not in PIN_TTLS:
        raise InvalidRequest(f"{where}.cache_control.ttl: must be one of '5m' or '1h'")
    return PIN_TTLS[ttl]


def find_breakpoints(data: Mapping[str, Any]) -> list[Breakpoint]:
    """Every ``cache_control`` marker of an OpenAI-shaped chat body (400 on a malformed one)."""
    found: list[Breakpoint] = []
    messages = data.get("messages")
    messages = messages if isinstance(messages, list) else []
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, Mapping) and tool.get("cache_control") is not None:
            n_system = next((k for k, m in enumerate(messages) if not (isinstance(m, Mapping) and m.get("role") == "system")), len(messages))
            found.append(Breakpoint(n_system, None, _pin_ttl(tool["cache_control"], f"tools[{i}]")))
    for m, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        for k, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, Mapping) and part.get("cache_control") is not None:
                found.append(Breakpoint(m + 1, k + 1, _pin_ttl(part["cache_control"], f"messages[{m}].content[{k}]")))
        if message.get("cache_control") is not None:
            found.append(Breakpoint(m + 1, None, _pin_ttl(message["cache_control"], f"messages[{m}]")))
    if len(found) > MAX_BREAKPOINTS:
        raise InvalidRequest(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(found)}.")
    return found


class CacheHooks:
    def __init__(
        self,
        enabled: bool,
        template: Any,
        tokenize: Callable[[str], list[int]] | None = None,
        boundary_snapshots: bool = False,
        warmup: bool = False,
        isolation: str = "none",
        pins: bool = False,
        pin_max_ttl: float = 3600.0,
    ) -> None:
        self.enabled = enabled
        self.isolation = isolation
        self.template = template
        self.tokenize = tokenize
        self.boundary_snapshots = enabled and boundary_snapshots and tokenize is not None
        self.warmup = enabled and warmup and tokenize is not None
        self.pins = enabled and pins and tokenize is not None
        self.pin_max_ttl = pin_max_ttl

    def prepare_raw(
        self, data: Mapping[str, Any], requests: list[GenerationRequest], session: str | None = None, api_key_id: str | None = None
    ) -> None:
        """``/completion`` and ``/v1/completions``: raw prompts share one fixed signature."""
        self._apply(data, requests, RAW_PROMPT_TEMPLATE_SIG, session, api_key_id)

    def prepare_chat(
        self,
        data: Mapping[str, Any],
        chat: Any,
        requests: list[GenerationRequest],
        prompt: str,
        session: str | None = None,
        breakpoints: list[Breakpoint] | None = None,
        api_key_id: str | None = None,
    ) -> None:
        source = self.template.for_tools(chat.render_tools).source  # the template the prompt was rendered with
        sig = template_signature(source, chat.template_kwargs, chat.render_tools)
        self._apply(data, requests, sig, session, api_key_id)
        if not requests or not requests[0].cache.enabled:
            return
        if self.boundary_snapshots:
            boundary = self.history_boundary(chat, prompt, requests[0].prompt_tokens)
            for req in requests:
                req.cache.history_boundary = boundary or None
        if self.pins and breakpoints:
            positions = self.breakpoint_positions(chat, prompt, requests[0].prompt_tokens, breakpoints)
            for req in requests:
                req.cache.breakpoints = positions

    def breakpoint_positions(
        self, chat: Any, prompt: str, prompt_tokens: list[int], breakpoints: list[Breakpoint]
    ) -> list[tuple[int, float]]:
        """Token positions of the breakpoints (the rendering technique of ``history_boundary``).

        A breakpoint the template cannot render alone is skipped (logged at DEBUG); the pin
        time is the longest asked for at a position, capped at ``--prompt-cache-pin-max-ttl``.
        """
        positions: dict[int, float] = {}
        for bp in breakpoints:
            try:
                text = render_prefix(self.template, chat, bp.n_messages, bp.n_parts, prompt)
            except TemplateError as exc:
                log.debug("cache breakpoint after %d messages skipped: %s", bp.n_messages, exc)
                continue
            position = common_prefix_len(self.tokenize(text), prompt_tokens) if text else 0
            if position > 0:
                positions[position] = max(positions.get(position, 0.0), min(bp.ttl, self.pin_max_ttl))
        return sorted(positions.items())

    def history_boundary(self, chat: Any, prompt: str, prompt_tokens: list[int]) -> int:
        """Tokens of the rendered history alone, clipped to the common prefix with the prompt."""
        text = render_history_boundary(self.template, chat, prompt)
        if not text:
            return 0
        return common_prefix_len(self.tokenize(text), prompt_tokens)

    def warmup_job(self, data: Mapping[str, Any], chat: Any, request: GenerationRequest, reply: Mapping[str, Any]) -> WarmupJob | None:
        """What the engine should prefill while idle so the session's next turn starts warm."""
        if not self.warmup or not request.cache.enabled or request.media is not None:
            return None  # (a warm-up prefills text alone: it cannot place the images' positions)
        tokens = self.tokenize(render_next_history(self.template, chat, reply))
        ctx = request.cache
        return WarmupJob(session_key=ctx.session_key, template_sig=ctx.template_sig, tokens=tokens, namespace=ctx.namespace,
                         lora_id=ctx.lora_id, lora=request.lora)

    def _apply(
        self, data: Mapping[str, Any], requests: list[GenerationRequest], template_sig: str, header: str | None, api_key_id: str | None
    ) -> None:
        session = resolve_session_key(data, header)
        namespace = cache_namespace(self.isolation, api_key_id, cache_salt(data))
        for req in requests:
            req.cache.cache_prompt = req.cache.enabled
            req.cache.enabled = req.cache.enabled and self.enabled
            req.cache.session_key = session
            req.cache.template_sig = template_sig
            req.cache.mm_digest = TEXT_ONLY_MM_DIGEST
            req.cache.namespace = namespace


def cache_salt(data: Mapping[str, Any]) -> str | None:
    """vLLM's ``cache_salt`` (top level, or nested in ``extra_body``): a string, or absent."""
    value = data.get("cache_salt")
    if value is None and isinstance(data.get("extra_body"), Mapping):
        value = data["extra_body"].get("cache_salt")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidRequest("Field 'cache_salt': type must be string")
    return value
