"""Prometheus ``/metrics``: llama-server's ``llamacpp:*`` families, then the prompt cache's.

The ``llamacpp:*`` part is written as llama-server writes it (``server_task_result_metrics::
to_metrics``): the same names, help texts, types and order, values in C++'s default stream format
(6 significant digits: ``117``, ``0.0324773``, ``1.23457e+06``), counters named as llama-server
names them (``n_tokens_max`` is a counter without ``_total``, which the Prometheus client would
rename). The two throughput gauges cover the window since the previous scrape, as llama-server's
buckets do (each scrape resets them). They are read from the engine's plain counters at scrape
time, so the engine thread does no Prometheus work per token. Extra families (the prompt
cache's) register through :meth:`Metrics.add_collector` and are rendered by the Prometheus client.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable

from mlxcel_compat.engine.core import Engine
from mlxcel_compat.engine.metrics import Bucket

if TYPE_CHECKING:
    from prometheus_client.core import Metric

# The Prometheus client is imported by the first scrape, not at start-up: a server that is never
# scraped (most) does not hold its ~90 modules (a few MiB of RSS; issue 51's Gemma 3 budget).


def _counter(name: str, doc: str, value: float) -> Metric:
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _gauge(name: str, doc: str, value: float) -> Metric:
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def cpp_number(value: float) -> str:
    """A value as C++'s ``operator<<`` prints a double by default (``%g``, 6 significant digits)."""
    return format(float(value), "g")


class LlamaCppFamilies:
    """The ``llamacpp:*`` text of a scrape; remembers the previous scrape for the rate gauges."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._prompt_seen = Bucket()
        self._predict_seen = Bucket()

    def _rates(self) -> tuple[float, float]:
        """Prompt and generation throughput since the previous scrape, which this one replaces."""
        m = self.engine.metrics
        prompt, predict = m.prompt, m.predict
        with self._lock:
            rates = prompt.rate_since(self._prompt_seen), predict.rate_since(self._predict_seen)
            self._prompt_seen, self._predict_seen = prompt, predict
        return rates

    def render(self) -> str:
        m = self.engine.metrics
        prompt_rate, predict_rate = self._rates()
        counters = (
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", m.prompt.count),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", m.prompt_tokens_cached_total),
            ("prompt_seconds_total", "Total time spent processing prompts", m.prompt.seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", m.predict.count),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", m.predict.seconds),
            ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding", m.n_decode_total),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", m.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", m.n_draft_tokens),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", m.n_draft_accepted),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", m.n_draft_rounds),
        )
        gauges = (
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", predict_rate),
            ("requests_processing", "Number of requests processing", self.engine.n_processing),
            ("requests_deferred", "Number of requests deferred", self.engine.n_deferred),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", m.n_busy_slots_total / max(m.n_decode_total, 1)),
        )
        lines: list[str] = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, doc, value in items:
                lines += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {cpp_number(value)}"]
        if m.accepted_per_pos:  # llama-server's labelled counter, once speculation has run
            name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
            lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(m.accepted_per_pos)]
        return "\n".join(lines) + "\n"


class _FunctionCollector:
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        return self.fn()


class Metrics:
    def __init__(self, engine: Engine) -> None:
        self.llamacpp = LlamaCppFamilies(engine)
        self.collectors: list[Callable[[], Iterable[Metric]]] = []  # rendered in this order

    def add_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.collectors.append(fn)

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        for fn in self.collectors:
            registry.register(_FunctionCollector(fn))  # type: ignore[arg-type]
        return self.llamacpp.render().encode() + generate_latest(registry)


__all__ = ["Metrics"]


def _labelled(name: str, doc: str, label: str, values: dict[str, float], kind: str = "counter") -> Metric:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    family = CounterMetricFamily(name, doc, labels=[label]) if kind == "counter" else GaugeMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def prompt_cache_metrics(engine: Engine) -> Iterable[Metric]:
    """``mlxcel_prompt_cache_*`` families, from the cache's last published stats snapshot."""
    cache = engine.prefix_cache
    if cache is None:
        return []
    s = cache.last_stats
    return [
        _gauge("mlxcel_prompt_cache_enabled", "1 when the prompt cache is on.", 1.0 if s["enabled"] else 0.0),
        _counter("mlxcel_prompt_cache_lookups_total", "Prompt-cache lookups.", s["lookups"]),
        _counter("mlxcel_prompt_cache_hits_total", "Lookups that adopted a cached prefix.", s["hits"]),
        _counter("mlxcel_prompt_cache_misses_total", "Lookups that found nothing adoptable.", s["misses"]),
        _labelled("mlxcel_prompt_cache_hits_by_stage_total", "Hits by lookup stage (own session, another session).", "stage", s["hits_by_stage"]),
        _labelled("mlxcel_prompt_cache_miss_reasons_total", "Misses by reason.", "reason", s["miss_reasons"]),
        _labelled(
            "mlxcel_prompt_cache_adoption_rejects_total",
            "Candidates refused at adoption because their stored tokens differ from the request's (hash collisions).",
            "reason",
            s["adoption_rejects"],
        ),
        _counter("mlxcel_prompt_cache_prefix_tokens_reused_total", "Prompt tokens adopted instead of prefilled.", s["prefix_tokens_reused_total"]),
        _counter("mlxcel_prompt_cache_inserts_total", "Entries stored.", s["inserts"]),
        _counter("mlxcel_prompt_cache_supersedes_total", "Entries replaced by a longer entry of the same session.", s["supersedes"]),
        _labelled("mlxcel_prompt_cache_evictions_total", "Entries evicted, by reason.", "reason", s["evictions"]),
        _labelled("mlxcel_prompt_cache_rejections_total", "Entries refused at insert, by reason.", "reason", s["rejections"]),
        _gauge("mlxcel_prompt_cache_bytes", "KV bytes the prompt cache holds, shared blocks counted once.", s["bytes"]),
        _gauge("mlxcel_prompt_cache_logical_bytes", "Bytes the entries would hold as whole copies (no sharing).", s["logical_bytes"]),
        _gauge("mlxcel_prompt_cache_logical_tokens", "Tokens the entries hold, a shared prefix counted per entry.", s["logical_tokens"]),
        _gauge("mlxcel_prompt_cache_sharing_ratio", "logical_bytes / bytes: how many times shared blocks are reused.", s["sharing_ratio"]),
        _gauge("mlxcel_prompt_cache_kv_blocks", "Shared KV blocks alive (held by entries or running sequences).", s["kv_blocks"]),
        _gauge("mlxcel_prompt_cache_kv_block_bytes", "Bytes of the shared KV blocks alive.", s["kv_block_bytes"]),
        _counter("mlxcel_prompt_cache_kv_blocks_merged_total",
                 "Blocks computed again, found bit-identical to a live block and shared instead.", s["kv_blocks_merged"]),
        _gauge("mlxcel_prompt_cache_kv_blocks_stored", "Shared KV blocks held by stored entries.", s["kv_blocks_stored"]),
        _gauge("mlxcel_prompt_cache_kv_block_leases", "Running sequences holding shared KV blocks.", s["kv_block_leases"]),
        _gauge("mlxcel_prompt_cache_kv_blocks_leased", "Shared KV blocks held by running sequences (per lease).", s["kv_blocks_leased"]),
        _gauge("mlxcel_prompt_cache_kv_block_stray_refs",
               "References on shared KV blocks held by no stored entry and no running sequence (0 unless blocks leak).",
               s["kv_block_stray_refs"]),
        _gauge("mlxcel_prompt_cache_entries", "Entries held by the prompt cache.", s["entries"]),
        _gauge("mlxcel_prompt_cache_capacity_bytes", "Byte budget of the prompt cache.", s["capacity_bytes"]),
        _gauge("mlxcel_prompt_cache_kv_bytes_per_token",
               "KV bytes one token takes across the layers in the cache's storage types (-ctk/-ctv).", s["kv_bytes_per_token"]),
        _counter("mlxcel_prompt_cache_partial_hits_total", "Hits that adopted less than the whole entry.", s["partial_hits"]),
        *_apc_metrics(s),
        *_pin_metrics(s),
        *_snapshot_metrics(s),
        *_disk_metrics(s["tiers"]["disk"]),
    ]


def _disk_metrics(d: dict[str, Any]) -> list[Metric]:
    """Disk-tier families (zero, with ``disk_enabled`` 0, without ``--prompt-cache-dir``)."""
    return [
        _gauge("mlxcel_prompt_cache_disk_enabled", "1 when the disk tier (--prompt-cache-dir) is on.", 1.0 if d["enabled"] else 0.0),
        _gauge("mlxcel_prompt_cache_disk_entries", "Entries held by the disk tier.", d["entries"]),
        _gauge("mlxcel_prompt_cache_disk_bytes", "Bytes of the disk tier's files.", d["bytes"]),
        _gauge("mlxcel_prompt_cache_disk_capacity_bytes", "Byte budget of the disk tier.", d["capacity_bytes"]),
        _counter("mlxcel_prompt_cache_disk_lookups_total", "Lookups that consulted the disk tier.", d["lookups"]),
        _counter("mlxcel_prompt_cache_disk_hits_total", "Lookups served from the disk tier.", d["hits"]),
        _counter("mlxcel_prompt_cache_disk_tokens_loaded_total", "Prompt tokens adopted from the disk tier.", d["tokens_loaded_total"]),
        _counter("mlxcel_prompt_cache_disk_load_seconds_total", "Time spent reading and checking disk-tier files.", d["load_ms_total"] / 1000.0),
        _counter("mlxcel_prompt_cache_disk_read_bytes_total", "Bytes of disk-tier files read back.", d["bytes_read_total"]),
        _counter("mlxcel_prompt_cache_disk_writes_total", "Entries written to the disk tier.", d["writes"]),
        _counter("mlxcel_prompt_cache_disk_written_bytes_total", "Bytes written to the disk tier.", d["bytes_written_total"]),
        _counter("mlxcel_prompt_cache_disk_writes_dropped_total", "Evicted entries not written because the write queue was full.", d["writes_dropped"]),
        _counter("mlxcel_prompt_cache_disk_write_errors_total", "Disk-tier writes that failed.", d["write_errors"]),
        _counter("mlxcel_prompt_cache_disk_write_paced_seconds_total", "Time the disk-tier writer paused because the engine was busy.",
                 d["write_paced_ms_total"] / 1000.0),
        _gauge("mlxcel_prompt_cache_disk_write_queue_bytes", "Bytes of evicted entries waiting to be written.", d["write_queue_bytes"]),
        _counter("mlxcel_prompt_cache_disk_evictions_total", "Disk-tier files deleted to keep the byte budget.", d["evictions"]),
        _counter("mlxcel_prompt_cache_disk_picked_up_total",
                 "Disk-tier files other servers sharing the directory wrote, indexed while running.", d["picked_up"]),
        _labelled("mlxcel_prompt_cache_disk_rejections_total", "Disk-tier files rejected and removed, by reason.", "reason", d["rejections"]),
    ]


def _pin_metrics(s: dict[str, Any]) -> list[Metric]:
    """Explicit cache breakpoints (``cache_control``) kept as pinned entries."""
    return [
        _gauge("mlxcel_prompt_cache_pinned_entries", "Entries pinned by explicit cache breakpoints.", s["pinned_entries"]),
        _gauge("mlxcel_prompt_cache_pinned_bytes", "Logical bytes of the pinned entries.", s["pinned_bytes"]),
        _counter("mlxcel_prompt_cache_pins_total", "Entries stored pinned at a cache breakpoint.", s["pins"]),
        _counter("mlxcel_prompt_cache_pin_hits_total", "Hits on a pinned entry.", s["pin_hits"]),
        _labelled("mlxcel_prompt_cache_unpins_total", "Pins demoted to ordinary entries, by reason.", "reason", s["unpins"]),
    ]


def _apc_metrics(s: dict[str, Any]) -> list[Metric]:
    """APC block-chain families (zero, with ``apc_enabled`` 0, while APC is off)."""
    return [
        _gauge("mlxcel_prompt_cache_apc_enabled", "1 when APC (partial reuse by block-hash chains) is active.", 1.0 if s["apc_enabled"] else 0.0),
        _gauge("mlxcel_prompt_cache_apc_blocks_stored", "Block hashes held by all stored chains.", s["total_blocks_stored"]),
        _gauge("mlxcel_prompt_cache_apc_unique_block_hashes", "Distinct block hashes over all chains.", s["unique_block_hashes"]),
        _gauge("mlxcel_prompt_cache_apc_active_entries", "Entries that hold a block-hash chain.", s["apc_active_entries"]),
        _counter("mlxcel_prompt_cache_apc_hits_total", "Hits on an entry that overlaps the request only partly.", s["apc_hits"]),
    ]


def _snapshot_metrics(s: dict[str, Any]) -> list[Metric]:
    """Session-snapshot families (recurrent / sliding-window models; zero for dense-KV models)."""
    return [
        _gauge("mlxcel_prompt_cache_snapshot_entries", "Session snapshots held.", s["snapshot_entries"]),
        _gauge("mlxcel_prompt_cache_snapshot_bytes", "Logical bytes held by session snapshots.", s["snapshot_bytes"]),
        _gauge("mlxcel_prompt_cache_snapshot_capacity_bytes", "Byte budget of the snapshot store.", s["snapshot_capacity_bytes"]),
        _counter("mlxcel_prompt_cache_snapshot_lookups_total", "Snapshot lookups.", s["snapshot_lookups"]),
        _labelled("mlxcel_prompt_cache_snapshot_hits_total", "Snapshot restores, by the snapshot's origin.", "origin", s["snapshot_hits_by_origin"]),
        _labelled("mlxcel_prompt_cache_snapshot_inserts_total", "Snapshots stored, by origin.", "origin", s["snapshot_inserts_by_origin"]),
        _counter("mlxcel_prompt_cache_snapshot_tokens_restored_total", "Prompt tokens restored from snapshots.", s["snapshot_tokens_restored_total"]),
        _counter("mlxcel_prompt_cache_snapshot_supersedes_total", "Snapshots replaced by a longer one of the same session and origin.", s["snapshot_supersedes"]),
        _labelled(
            "mlxcel_prompt_cache_snapshot_evictions_total",
            "Snapshots evicted, by reason.",
            "reason",
            {"lru": s["snapshot_evictions_lru"], "ttl": s["snapshot_evictions_ttl"]},
        ),
        _labelled("mlxcel_prompt_cache_snapshot_rejections_total", "Snapshot lookups and inserts refused, by reason.", "reject", s["snapshot_rejections"]),
        _labelled(
            "mlxcel_prompt_cache_snapshot_warmups_total",
            "Background warm-ups of a session's next turn.",
            "result",
            {"run": s["snapshot_warmups_run"], "skipped": s["snapshot_warmups_skipped"]},
        ),
    ]
