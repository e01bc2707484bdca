"""Cache metrics: plain counters updated by the cache, optional Prometheus export.

Pure Python. ``CacheMetrics`` is a dataclass of monotonically increasing counters (tokens,
bytes, seconds, calls); ``HiRadixCache.stats()`` adds the current gauges. Export to
Prometheus with ``register_prometheus(cache)``: prometheus_client is imported only then,
and values are read at scrape time by a custom collector (no per-operation overhead).

Names follow upstream's ``sglang:`` metrics (REFERENCE.md section 2.9) where one exists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .hiradix_cache import HiRadixCache


@dataclass
class CacheMetrics:
    # match_prefix calls made by callers (the cache's own re-matches are not counted)
    match_calls: int = 0
    match_tokens: int = 0  # page-aligned tokens asked for
    device_hit_tokens: int = 0  # served from the device tier
    host_hit_tokens: int = 0  # host-only continuation reported by match (loadable)
    # load-back (H2D)
    load_back_calls: int = 0
    load_back_skipped: int = 0  # under the threshold, over the quota or no device memory
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_back_seconds: float = 0.0  # issue -> acknowledged, summed
    # backup (D2H)
    backup_tokens: int = 0
    backup_bytes: int = 0
    backup_failed_tokens: int = 0  # no host memory even after host eviction
    backup_seconds: float = 0.0  # issue -> acknowledged, summed
    # failed copies (either direction)
    transfer_retries: int = 0  # failed copies issued again
    transfer_failures: int = 0  # copies that still failed after every retry (the cache stopped)
    # device eviction
    evict_calls: int = 0
    evicted_device_tokens: int = 0  # freed from the device tier (demoted + deleted)
    demoted_tokens: int = 0  # stayed on host
    deleted_device_tokens: int = 0  # left the cache entirely
    dropped_tokens: int = 0  # write_back: host full, the node was dropped (reason="host_pressure")
    eviction_seconds: float = 0.0
    # host eviction
    evict_host_calls: int = 0
    evicted_host_tokens: int = 0  # host-only nodes removed
    reclaimed_host_tokens: int = 0  # host copies of on-device nodes dropped
    host_eviction_seconds: float = 0.0
    # L3 (updated by an attached StorageController, on the owner thread)
    prefetch_calls: int = 0  # prefetches started (a storage lookup was queued)
    prefetch_skipped: int = 0  # not started: continuation under the threshold, host budget, closed
    prefetch_skipped_by_reason: dict = field(default_factory=dict)  # the same, per PrefetchOperation.reason_code
    prefetch_revoked: int = 0  # started, then dropped: hit under the threshold, no host room, tree moved
    prefetch_timeouts: int = 0  # ``timeout`` policy: the deadline passed before the last page
    prefetch_truncated: int = 0  # the host could hold only the first part of the hit: that part was read
    prefetched_tokens: int = 0  # tokens read from storage into host pages
    storage_hit_tokens: int = 0  # prefetched tokens attached to the tree (finish_prefetch's result)
    prefetch_seconds: float = 0.0  # prefetch start -> finish_prefetch, summed
    storage_backup_tokens: int = 0  # tokens written host -> storage
    storage_backup_bytes: int = 0
    storage_backup_failed_tokens: int = 0  # the storage refused or failed them
    storage_backup_seconds: float = 0.0  # queued -> stored, summed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())


# (metric name, help, CacheMetrics field, label values) for counters.
_COUNTERS = [
    ("cached_tokens", "Prompt tokens served from a cache tier", "device_hit_tokens", {"cache_source": "device"}),
    ("cached_tokens", "Prompt tokens served from a cache tier", "loaded_tokens", {"cache_source": "host"}),
    ("match_tokens", "Page-aligned tokens looked up by match_prefix", "match_tokens", {}),
    ("load_back_tokens", "Tokens loaded host -> device", "loaded_tokens", {}),
    ("load_back_bytes", "KV bytes loaded host -> device", "loaded_bytes", {}),
    ("backup_tokens", "Tokens backed up device -> host", "backup_tokens", {}),
    ("backup_bytes", "KV bytes backed up device -> host", "backup_bytes", {}),
    ("backup_failed_tokens", "Tokens not backed up for lack of host memory", "backup_failed_tokens", {}),
    ("evicted_tokens", "Tokens evicted from a tier", "evicted_device_tokens", {"tier": "device"}),
    ("evicted_tokens", "Tokens evicted from a tier", "evicted_host_tokens", {"tier": "host"}),
    ("dropped_tokens", "Tokens dropped instead of backed up", "dropped_tokens", {"reason": "host_pressure"}),
    ("transfer_retries", "Failed KV copies issued again", "transfer_retries", {}),
    ("transfer_failures", "KV copies that failed after every retry", "transfer_failures", {}),
    ("eviction_duration_seconds", "Time spent in device eviction", "eviction_seconds", {}),
    ("load_back_duration_seconds", "Load-back time, issue to acknowledgement", "load_back_seconds", {}),
    ("backup_duration_seconds", "Backup time, issue to acknowledgement", "backup_seconds", {}),
    # L3. Storage hits reach the device through a host load-back, so the host source above
    # includes them; storage_hit_tokens is the part of it that came from L3.
    ("cached_tokens", "Prompt tokens served from a cache tier", "storage_hit_tokens", {"cache_source": "storage"}),
    ("prefetched_tokens", "Tokens read from L3 storage into host pages", "prefetched_tokens", {}),
    ("prefetch_revoked", "Prefetches dropped after they started", "prefetch_revoked", {}),
    ("prefetch_timeouts", "Prefetches cut short by the timeout policy", "prefetch_timeouts", {}),
    ("prefetch_truncated", "Prefetches cut to the host memory free for them", "prefetch_truncated", {}),
    ("prefetch_duration_seconds", "Prefetch time, start to finish_prefetch", "prefetch_seconds", {}),
    ("storage_backup_tokens", "Tokens backed up host -> L3 storage", "storage_backup_tokens", {}),
    ("storage_backup_bytes", "KV bytes backed up host -> L3 storage", "storage_backup_bytes", {}),
    ("storage_backup_failed_tokens", "Tokens L3 storage refused or failed", "storage_backup_failed_tokens", {}),
    ("storage_backup_duration_seconds", "L3 backup time, queued to stored", "storage_backup_seconds", {}),
]


class _Collector:
    """Reads a cache's metrics and gauges at scrape time."""

    def __init__(self, cache: "HiRadixCache", prefix: str) -> None:
        self.cache = cache
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.cache.metrics
        families: dict[str, CounterMetricFamily] = {}
        for name, help_text, field, labels in _COUNTERS:
            fam = families.get(name)
            if fam is None:
                fam = families[name] = CounterMetricFamily(f"{self.prefix}_{name}", help_text,
                                                           labels=sorted(labels))
            fam.add_metric([labels[k] for k in sorted(labels)], getattr(m, field))
        yield from families.values()
        s = self.cache.stats()
        hit = GaugeMetricFamily(f"{self.prefix}_cache_hit_rate", "Cached / looked-up tokens since start")
        hit.add_metric([], s["hit_rate"])
        yield hit
        for tier in ("device", "host"):
            g = GaugeMetricFamily(f"{self.prefix}_{tier}_used_tokens", f"Tokens held by the tree on the {tier} tier")
            g.add_metric([], s[f"{tier}_tree_tokens"])
            yield g


def register_prometheus(cache: "HiRadixCache", registry: Any = None, prefix: str = "hicache") -> Any:
    """Export ``cache``'s metrics through prometheus_client; returns the collector.

    ``registry`` defaults to prometheus_client's global REGISTRY. Raises ImportError with a
    hint when prometheus_client is not installed.
    """
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("register_prometheus needs the prometheus_client package "
                          "(pip install prometheus_client)") from e
    collector = _Collector(cache, prefix)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
