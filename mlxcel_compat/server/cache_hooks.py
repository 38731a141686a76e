"""What the routes compute for the prompt cache before a request reaches the engine.

The cache key needs facts only the HTTP side has: the session (``prompt_cache_key``/``user``),
the template signature (template source, merged kwargs, tools, tool_choice), the per-request
opt-out (``cache_prompt: false``) and the tenant namespace (``--prompt-cache-isolation``: the API
key that authenticated the request, the ``cache_salt`` field). Pure Python; no MLX.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, cache_namespace, resolve_session_key, template_signature
from mlxcel_compat.cache.snapshot import common_prefix_len
from mlxcel_compat.chat.messages import render_history_boundary, render_next_history
from mlxcel_compat.engine.request import GenerationRequest, WarmupJob
from mlxcel_compat.server.errors import InvalidRequest


class CacheHooks:
    def __init__(
        self,
        enabled: bool,
        template: Any,
        tokenize: Callable[[str], list[int]] | None = None,
        boundary_snapshots: bool = False,
        warmup: bool = False,
        isolation: str = "none",
    ) -> None:
        self.enabled = enabled
        self.isolation = isolation
        self.template = template
        self.tokenize = tokenize
        self.boundary_snapshots = enabled and boundary_snapshots and tokenize is not None
        self.warmup = enabled and warmup and tokenize is not None

    def template_defaults(self, data: Mapping[str, Any], server_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Server template kwargs, plus ``preserve_thinking: true`` while the cache is on.

        Thinking-preserving templates otherwise drop past reasoning from the history, which
        rewrites the prefix every turn and defeats the cache. A request's own
        ``chat_template_kwargs`` still wins.
        """
        merged = dict(server_kwargs)
        requested = data.get("chat_template_kwargs")
        if (
            self.enabled
            and self.template is not None
            and self.template.supports_kwarg("preserve_thinking")
            and "preserve_thinking" not in merged
            and not (isinstance(requested, Mapping) and "preserve_thinking" in requested)
        ):
            merged["preserve_thinking"] = True
        return merged

    def prepare_raw(self, data: Mapping[str, Any], requests: list[GenerationRequest], api_key_id: str | None = None) -> None:
        """``/completion`` and ``/v1/completions``: raw prompts share one fixed signature."""
        self._apply(data, requests, RAW_PROMPT_TEMPLATE_SIG, api_key_id)

    def prepare_chat(
        self, data: Mapping[str, Any], chat: Any, requests: list[GenerationRequest], prompt: str, api_key_id: str | None = None
    ) -> None:
        sig = template_signature(self.template.source, chat.template_kwargs, chat.tool_choice, chat.tools)
        self._apply(data, requests, sig, api_key_id)
        if self.boundary_snapshots and requests and requests[0].cache.enabled:
            boundary = self.history_boundary(chat, prompt, requests[0].prompt_tokens)
            for req in requests:
                req.cache.history_boundary = boundary or None

    def history_boundary(self, chat: Any, prompt: str, prompt_tokens: list[int]) -> int:
        """Tokens of the rendered history alone, clipped to the common prefix with the prompt."""
        text = render_history_boundary(self.template, chat, prompt)
        if not text:
            return 0
        return common_prefix_len(self.tokenize(text), prompt_tokens)

    def warmup_job(self, data: Mapping[str, Any], chat: Any, request: GenerationRequest, reply: Mapping[str, Any]) -> WarmupJob | None:
        """What the engine should prefill while idle so the session's next turn starts warm."""
        if not self.warmup or not request.cache.enabled:
            return None
        tokens = self.tokenize(render_next_history(self.template, chat, reply))
        ctx = request.cache
        return WarmupJob(session_key=ctx.session_key, template_sig=ctx.template_sig, tokens=tokens, namespace=ctx.namespace)

    def _apply(self, data: Mapping[str, Any], requests: list[GenerationRequest], template_sig: str, api_key_id: str | None) -> None:
        session = resolve_session_key(data)
        namespace = cache_namespace(self.isolation, api_key_id, cache_salt(data))
        for req in requests:
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
