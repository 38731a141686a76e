"""One served model: its settings turned into an engine, a ``ServerContext`` and the app over them.

The single-model server builds one of these at start-up (``cli.py``); the router (``server/router.py``)
builds one per model it loads, each with that model's own settings. Both go through the same two
steps, so a model behind the router behaves as it would served alone:

1. :func:`prepare_model`, which touches no MLX: find the model (a path, or a hub repository
   downloaded first) and its projector, read its LoRA adapter files, find the draft model, parse
   the loading flags (``--override-kv``, RoPE, mmap). Any mistake is a
   :class:`InstanceError` whose message says what is wrong.
2. :func:`build_server`: the engine (not started), its prompt cache, metrics and the app.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


class InstanceError(RuntimeError):
    """A model that cannot be served with these settings (missing file, bad adapter, bad draft)."""


@dataclass
class PreparedModel:
    """What :func:`prepare_model` found: the local path and the checked adapter and draft settings."""

    path: str
    adapters: Any  # lora.adapters.AdapterSet
    speculative: Any  # engine.speculative.SpecConfig
    load_options: Any = None  # model.load_options.LoadOptions
    mmproj: str | None = None  # the projector GGUF served with a GGUF text model (model/mmproj.py)


def prepare_model(settings: Any, model_arg: str) -> PreparedModel:
    """Resolve ``model_arg`` (downloading from the hub where allowed) and check the adapter and
    draft files, without loading any weights."""
    from mlxcel_compat.engine.speculative import SpecConfig, SpecError
    from mlxcel_compat.lora.adapters import AdapterError, AdapterSet, adapter_specs
    from mlxcel_compat.model.loader import ModelNotFoundError, resolve_model_path

    try:
        model_path = resolve_model_path(model_arg, offline=bool(settings.offline), hf_file=settings.hf_file,
                                        token=settings.hf_token, cache_dir=settings.llama_cache)
    except ModelNotFoundError as exc:
        raise InstanceError(str(exc)) from exc
    try:
        # Adapter files are checked before the weights load (their shapes once the model is loaded).
        adapters = AdapterSet.from_specs(adapter_specs(settings), bool(settings.lora_init_without_apply))
    except (AdapterError, OSError) as exc:
        raise InstanceError(f"failed to load LoRA adapter: {exc}") from exc
    try:
        speculative = SpecConfig.from_settings(settings)
        if speculative.draft_model:
            speculative = dataclasses.replace(speculative, draft_model=str(resolve_model_path(
                speculative.draft_model, offline=True, cache_dir=settings.llama_cache)))
    except (SpecError, ModelNotFoundError) as exc:
        raise InstanceError(str(exc)) from exc
    from mlxcel_compat.model.load_options import LoadOptions

    try:
        load_options = LoadOptions.from_settings(settings)  # --override-kv items are checked before loading
    except ValueError as exc:
        raise InstanceError(f"--override-kv: {exc}") from exc
    try:
        mmproj = projector_path(settings, model_arg)
    except (ModelNotFoundError, ValueError, OSError) as exc:
        raise InstanceError(str(exc)) from exc
    return PreparedModel(str(model_path), adapters, speculative, load_options, mmproj)


def projector_path(settings: Any, model_arg: str) -> str | None:
    """The projector to serve, checked before loading: ``--mmproj FILE`` (its type must be
    served), ``--mmproj-url`` downloaded, else with ``-hf`` the repository's own unless
    ``--no-mmproj`` (as llama-server)."""
    from mlxcel_compat.model.loader import resolve_mmproj_path
    from mlxcel_compat.model.mmproj import check_projector

    mmproj = getattr(settings, "mmproj", None) or None
    if url := getattr(settings, "mmproj_url", None):
        from pathlib import Path

        from mlxcel_compat.model import hub

        target = Path(mmproj) if mmproj else hub.url_cache_path(url, settings.llama_cache)
        try:
            mmproj = str(hub.fetch_url(url, target, offline=bool(settings.offline), token=settings.hf_token))
        except hub.HubError as exc:
            raise ValueError(f"--mmproj-url: {exc}") from exc
    elif mmproj is None and getattr(settings, "mmproj_auto", True):
        found = resolve_mmproj_path(model_arg, offline=bool(settings.offline), hf_file=settings.hf_file,
                                    token=settings.hf_token, cache_dir=settings.llama_cache)
        mmproj = str(found) if found is not None else None
    if mmproj is not None:
        check_projector(mmproj)
    return mmproj


def build_server(settings: Any, model_arg: str, api_keys: list[str], model_name: str | None = None,
                 adapters: Any = None, speculative: Any = None, edge: bool = True,
                 prefix_cache_hook: Callable[[Any, Any], Any] | None = None, load_options: Any = None,
                 mmproj: str | None = None) -> Any:
    """The app serving ``model_arg`` with ``settings``; its engine starts with the app's lifespan
    (or when the router starts it). ``edge``: see ``server.app.build_app``. ``prefix_cache_hook``
    is given the engine and its ``PrefixCache`` on the engine thread once it is built (the router hands
    a reloaded model the entries it kept from its previous load)."""
    from mlxcel_compat.engine.core import Engine, EngineConfig
    from mlxcel_compat.engine.prefix_cache import PrefixCache
    from mlxcel_compat.engine.prefix_cache_config import PrefixCacheConfig
    from mlxcel_compat.engine.speculative import SpecConfig
    from mlxcel_compat.lora.adapters import AdapterSet
    from mlxcel_compat.server.app import build_app
    from mlxcel_compat.server.context import ServerContext
    from mlxcel_compat.server.metrics import Metrics, prompt_cache_metrics

    def prefix_cache(engine: Engine) -> PrefixCache:
        cache = PrefixCache(engine, PrefixCacheConfig.from_settings(settings))
        return prefix_cache_hook(engine, cache) if prefix_cache_hook is not None else cache

    # llama-server's auto slot count: 4 slots sharing one unified KV buffer (each may use all of -c).
    adapters = adapters if adapters is not None else AdapterSet()
    auto_parallel = settings.n_parallel <= 0
    n_parallel = 4 if auto_parallel else settings.n_parallel
    engine = Engine(
        EngineConfig(
            model=model_arg,
            model_name=model_name,
            mmproj=mmproj if mmproj is not None else (getattr(settings, "mmproj", None) or None),
            image_min_tokens=settings.image_min_tokens,
            image_max_tokens=settings.image_max_tokens,
            aliases=list(settings.alias or []),
            offline=bool(settings.offline),
            repack=settings.repack is not False,
            ctx_size=settings.ctx_size,
            n_parallel=n_parallel,
            kv_unified=auto_parallel or bool(settings.kv_unified),
            batch_size=min(settings.batch_size, settings.ubatch_size),  # the prefill chunk
            cont_batching=bool(settings.cont_batching),
            sleep_idle_seconds=settings.sleep_idle_seconds,
            keep_slot_state=bool(settings.slot_save_path),
            adapters=list(adapters.adapters),
            speculative=speculative if speculative is not None else SpecConfig.from_settings(settings),
            load_options=load_options,
            context_shift=bool(settings.context_shift),
        ),
        prefix_cache_factory=prefix_cache,
    )
    ctx = ServerContext(settings=settings, engine=engine, api_keys=api_keys, adapters=adapters)
    ctx.metrics = Metrics(engine)
    ctx.metrics.add_collector(lambda: prompt_cache_metrics(engine))
    return build_app(ctx, edge=edge)


__all__ = ["InstanceError", "PreparedModel", "build_server", "prepare_model", "projector_path"]
