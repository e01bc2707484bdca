"""Cache metrics: the counters and histograms the cache updates, the gauges read at scrape
time, ``stats()`` and the Prometheus export, under one naming scheme.

Pure Python (prometheus_client is imported only by ``register_prometheus``).

Naming: every metric is a *family* in ``FAMILIES`` (the single source of truth), named for
what it counts with its unit last: ``_tokens``, ``_pages``, ``_bytes``, ``_seconds``, or a
count of events (``_calls``, ``_errors``, ``_retries``, ...). The same name is

* the key in ``HiRadixCache.stats()`` (a number; a ``{label value: number}`` dict for a
  labelled family; ``{"count", "sum", "buckets"}`` for a histogram);
* the Prometheus family ``<prefix>_<name>`` (prefix ``hicache``; counters get ``_total``);
* the row of the metrics table in ``docs/metrics.md`` (``tests/cache/test_metrics_export.py``
  checks that it lists every family).

Upstream sglang's names are kept where one exists (``cached_tokens{cache_source}``,
``cache_hit_rate``, ``host_used_tokens``, ``load_back_duration_seconds``,
``load_back_tokens``, ``backup_tokens``, ``dropped_tokens{reason}``, ``prefetched_tokens``;
upstream's ``backuped_tokens`` is ``storage_backup_tokens`` here).

``CacheMetrics`` holds the raw counters (field names are the code's; ``FAMILIES`` maps each
to its family): monotonic counts updated on the owner thread, and ``Histogram`` s of copy
durations measured from issue to *completion* (the handle's or worker's stamp,
``TransferHandle.completed_at``), not to the caller's next poll.

``cached_tokens{cache_source}`` is non-overlapping: ``device`` (matched on the device),
``host`` (loaded back from host copies), ``storage`` (loaded back from pages an L3 prefetch
attached, never on the device since); the three sum to every cached prompt token.

Several caches in one process (draft and target, several ranks or models) share a registry:
``register_prometheus(cache, labels={"cache": "draft", "rank": "0", "model": "m"})`` adds the
labels to every sample of that cache; caches registered on one registry and prefix must use
the same label names and distinct values.
"""

from __future__ import annotations

import bisect
import numbers
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Protocol

# Upper bounds (seconds) of the duration histograms' buckets: 100 us .. 30 s, then +Inf.
DURATION_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class MetricsSource(Protocol):
    """What the families and the Prometheus export read from a cache (``HiRadixCache`` is one).
    Typed against this rather than the cache, so this module never imports the module that
    imports it (no import circle in ``cache``)."""

    build_info: dict[str, str]
    metrics: "CacheMetrics"
    storage_hook: Any  # an object with ``stats() -> dict`` (an attached L3 controller), or None

    def gauges(self) -> dict[str, Any]: ...


@dataclass
class Histogram:
    """Counts of observations per bucket (``bounds``: upper bounds, then +Inf; the duration
    buckets by default), their sum and count. Owner thread only."""

    bounds: tuple[float, ...] = DURATION_BUCKETS_S
    counts: list = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations <= le)`` per bucket, Prometheus style (``le`` "+Inf" last)."""
        out, total = [], 0
        for le, n in zip([*map(repr, self.bounds), "+Inf"], self.counts):
            total += n
            out.append((le, total))
        return out

    def as_stats(self) -> dict:
        return {"count": self.count, "sum": self.sum, "buckets": dict(self.cumulative())}


@dataclass
class CacheMetrics:
    # match_prefix calls made by callers (the cache's own re-matches are not counted)
    match_calls: int = 0
    match_tokens: int = 0  # page-aligned tokens asked for
    device_hit_tokens: int = 0  # served from the device tier
    host_match_tokens: int = 0  # host-only continuation reported by match (loadable)
    # load-back (H2D)
    load_back_calls: int = 0
    load_back_skipped: int = 0  # under the threshold, over the quota or no device memory
    loaded_tokens: int = 0
    loaded_storage_tokens: int = 0  # the part of loaded_tokens that an L3 prefetch had attached
    loaded_bytes: int = 0
    load_back_duration_seconds: Histogram = field(default_factory=Histogram)  # issue -> completed
    # backup (D2H)
    backup_tokens: int = 0
    backup_bytes: int = 0
    backup_failed_tokens: int = 0  # no host memory even after host eviction
    backup_duration_seconds: Histogram = field(default_factory=Histogram)  # issue -> completed
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
    prefetch_attached_tokens: int = 0  # prefetched tokens attached to the tree (finish_prefetch's result)
    # prefetch start -> its storage reads ended (or it was revoked / cut short)
    prefetch_duration_seconds: Histogram = field(default_factory=Histogram)
    storage_backup_tokens: int = 0  # tokens written host -> storage
    storage_backup_bytes: int = 0
    storage_backup_failed_tokens: int = 0  # the storage refused or failed them
    storage_backup_duration_seconds: Histogram = field(default_factory=Histogram)  # queued -> stored

    # Backward-compatible read-only aliases (names before issue 20).
    host_hit_tokens = property(lambda self: self.host_match_tokens)
    storage_hit_tokens = property(lambda self: self.prefetch_attached_tokens)
    load_back_seconds = property(lambda self: self.load_back_duration_seconds.sum)
    backup_seconds = property(lambda self: self.backup_duration_seconds.sum)
    prefetch_seconds = property(lambda self: self.prefetch_duration_seconds.sum)
    storage_backup_seconds = property(lambda self: self.storage_backup_duration_seconds.sum)

    def as_dict(self) -> dict[str, float]:
        """The counters as one flat dict of numbers: each histogram as ``<name>_count`` and
        ``<name>_sum``; the per-reason breakdowns are left out (``stats()`` has them)."""
        out: dict[str, float] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Histogram):
                out[f.name + "_count"], out[f.name + "_sum"] = v.count, v.sum
            elif not isinstance(v, dict):
                out[f.name] = v
        return out

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())


# ---------------------------------------------------------------------------------------------
# The families. Each: (name, kind, help, label names, value). ``value(ctx)`` returns a number,
# a {label value(s): number} dict (a tuple key for several labels), a Histogram, or None when
# the family does not apply (the L3 families without a storage controller).
@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...]
    value: Callable[["_Context"], Any]


def build_info(engine: object) -> dict[str, str]:
    """``{"version", "backend", "platform"}`` of a cache built on ``engine``: the hicache_jax
    version, the KV backend (the package of the engine's class: ``jax``, ``numpy``, ``torch``
    for ``npu_bridge``, else its top-level module) and the platform its device pool is on
    (a JAX device's platform, e.g. ``cpu`` / ``gpu`` / ``tpu``; ``host`` for the numpy
    backend, whose "device" pool is host memory). Read once, when the cache is built."""
    from ..version import __version__

    module = type(engine).__module__
    parts = module.split(".")
    if parts[0] == "hicache_jax" and len(parts) > 2 and parts[1] == "backends":
        backend = parts[2].removesuffix("_backend")
    elif parts[0] == "npu_bridge":
        backend = "torch"
    else:
        backend = parts[0]
    platform = getattr(engine, "platform", None)
    if platform is None:
        try:  # a JaxDevicePool: the platform of its (first local) device
            platform = engine.device_pool.local_device.platform  # type: ignore[attr-defined]
        except Exception:
            platform = "host" if backend == "numpy" else "unknown"
    return {"version": __version__, "backend": backend, "platform": str(platform)}


def _build_info(c: "_Context") -> dict:
    b = c.build
    return {(b["version"], b["backend"], b["platform"]): 1}


class _Context:
    """What the families read, gathered once per scrape / ``stats()`` call."""

    def __init__(self, cache: "MetricsSource") -> None:
        self.build = cache.build_info
        self.m = cache.metrics
        self.g = cache.gauges()
        hook = cache.storage_hook
        self.l3 = hook.stats() if hook is not None else None
        self.ret = getattr(cache, "retention", None)  # ``retention.Retention`` once enabled


def _m(attr: str) -> Callable[[_Context], Any]:
    return lambda c: getattr(c.m, attr)


def _g(key: str) -> Callable[[_Context], Any]:
    return lambda c: c.g[key]


def _l3(key: str) -> Callable[[_Context], Any]:
    return lambda c: None if c.l3 is None else c.l3[key]


def _ret(read: Callable[[Any], Any]) -> Callable[[_Context], Any]:
    # Plain int fields of the owner thread's ``Retention`` (a scrape reads them from any thread).
    return lambda c: None if c.ret is None else read(c.ret)


def _cached(c: _Context) -> dict:
    m = c.m
    return {
        "device": m.device_hit_tokens,
        "host": m.loaded_tokens - m.loaded_storage_tokens,
        "storage": m.loaded_storage_tokens,
    }


def _hit_rate(c: _Context) -> float:
    m = c.m
    return (m.device_hit_tokens + m.loaded_tokens) / m.match_tokens if m.match_tokens else 0.0


def _in_flight(c: _Context) -> dict:
    out = {"backup": c.g["backups_in_flight"], "load_back": c.g["load_backs_in_flight"]}
    if c.l3 is not None:
        out["prefetch"] = c.l3["prefetches_in_flight"]
        out["storage_backup"] = c.l3["storage_backups_in_flight"]
    return out


C, G, H = "counter", "gauge", "histogram"
FAMILIES: tuple[Family, ...] = (
    Family(
        "build_info",
        G,
        "Always 1; the labels name the hicache_jax version, the KV backend (jax, numpy, "
        "torch) and the platform of its device pool (cpu, gpu, tpu; host for numpy)",
        ("version", "backend", "platform"),
        _build_info,
    ),
    # ---- hits
    Family(
        "cached_tokens",
        C,
        "Prompt tokens served from each cache tier; the sources do not overlap "
        "(storage: loaded back from pages an L3 prefetch attached)",
        ("cache_source",),
        _cached,
    ),
    Family("cache_hit_rate", G, "Cached / looked-up prompt tokens since start", (), _hit_rate),
    Family("match_calls", C, "match_prefix calls", (), _m("match_calls")),
    Family("match_tokens", C, "Page-aligned prompt tokens looked up by match_prefix", (), _m("match_tokens")),
    Family(
        "host_match_tokens",
        C,
        "Host-only tokens match_prefix found after the device hit (loadable)",
        (),
        _m("host_match_tokens"),
    ),
    # ---- load-back (host -> device)
    Family("load_back_calls", C, "Load-backs issued", (), _m("load_back_calls")),
    Family(
        "load_back_skipped",
        C,
        "Load-backs not issued (under the threshold, over the quota, no device room)",
        (),
        _m("load_back_skipped"),
    ),
    Family("load_back_tokens", C, "Tokens loaded host -> device", (), _m("loaded_tokens")),
    Family("load_back_bytes", C, "KV bytes loaded host -> device", (), _m("loaded_bytes")),
    Family(
        "load_back_duration_seconds",
        H,
        "Load-back duration, issue to the copy's completion",
        (),
        _m("load_back_duration_seconds"),
    ),
    # ---- backup (device -> host)
    Family("backup_tokens", C, "Tokens backed up device -> host", (), _m("backup_tokens")),
    Family("backup_bytes", C, "KV bytes backed up device -> host", (), _m("backup_bytes")),
    Family("backup_failed_tokens", C, "Tokens not backed up for lack of host memory", (), _m("backup_failed_tokens")),
    Family(
        "backup_duration_seconds",
        H,
        "Backup duration, issue to the copy's completion",
        (),
        _m("backup_duration_seconds"),
    ),
    Family("transfer_retries", C, "Failed KV copies issued again", (), _m("transfer_retries")),
    Family(
        "transfer_failures",
        C,
        "KV copies that failed after every retry (the cache stopped)",
        (),
        _m("transfer_failures"),
    ),
    # ---- eviction
    Family("evict_calls", C, "Device evictions", (), _m("evict_calls")),
    Family(
        "evicted_tokens",
        C,
        "Tokens evicted from a tier",
        ("tier",),
        lambda c: {"device": c.m.evicted_device_tokens, "host": c.m.evicted_host_tokens},
    ),
    Family("demoted_tokens", C, "Evicted device tokens that stayed on the host", (), _m("demoted_tokens")),
    Family("deleted_device_tokens", C, "Evicted device tokens that left the cache", (), _m("deleted_device_tokens")),
    Family(
        "dropped_tokens",
        C,
        "Tokens dropped instead of backed up",
        ("reason",),
        lambda c: {"host_pressure": c.m.dropped_tokens},
    ),
    Family("eviction_seconds", C, "Time spent in device eviction", (), _m("eviction_seconds")),
    Family("evict_host_calls", C, "Host evictions", (), _m("evict_host_calls")),
    Family(
        "reclaimed_host_tokens",
        C,
        "Host copies of on-device tokens dropped by host eviction",
        (),
        _m("reclaimed_host_tokens"),
    ),
    Family("host_eviction_seconds", C, "Time spent in host eviction", (), _m("host_eviction_seconds")),
    # ---- capacity and occupancy (gauges)
    Family("device_capacity_tokens", G, "Tokens the device pool holds", (), _g("device_capacity_tokens")),
    Family("device_free_tokens", G, "Free device pool tokens", (), _g("device_free_tokens")),
    Family("device_used_tokens", G, "Device tokens held by the tree", (), _g("device_used_tokens")),
    Family(
        "device_evictable_tokens", G, "Device tokens of the tree no lock protects", (), _g("device_evictable_tokens")
    ),
    Family(
        "device_protected_tokens",
        G,
        "Device tokens of the tree under a lock (requests' locks, and copies in flight until acknowledged)",
        (),
        _g("device_protected_tokens"),
    ),
    Family("host_capacity_tokens", G, "Tokens the host pool holds", (), _g("host_capacity_tokens")),
    Family("host_free_tokens", G, "Free host pool tokens", (), _g("host_free_tokens")),
    Family("host_used_tokens", G, "Host tokens held by the tree", (), _g("host_used_tokens")),
    Family(
        "pool_capacity_bytes",
        G,
        "KV bytes of each pool (tier x KV component)",
        ("tier", "pool"),
        _g("pool_capacity_bytes"),
    ),
    Family(
        "in_flight_operations",
        G,
        "Copies and L3 operations issued and not yet acknowledged on the owner "
        "thread (check_events acknowledges finished ones; stats() does too when the owner calls it)",
        ("operation",),
        _in_flight,
    ),
    # ---- L3, cache side (an attached StorageController updates these)
    Family("prefetch_calls", C, "L3 prefetches started", (), _m("prefetch_calls")),
    Family(
        "prefetch_skipped",
        C,
        "L3 prefetches not started, by reason (below_threshold: see StorageConfig.prefetch_threshold_tokens)",
        ("reason",),
        _m("prefetch_skipped_by_reason"),
    ),
    Family("prefetch_revoked", C, "L3 prefetches dropped after they started", (), _m("prefetch_revoked")),
    Family("prefetch_timeouts", C, "L3 prefetches cut short by the timeout policy", (), _m("prefetch_timeouts")),
    Family("prefetch_truncated", C, "L3 prefetches cut to the host memory free for them", (), _m("prefetch_truncated")),
    Family("prefetched_tokens", C, "Tokens read from L3 storage into host pages", (), _m("prefetched_tokens")),
    Family("prefetch_attached_tokens", C, "Prefetched tokens attached to the tree", (), _m("prefetch_attached_tokens")),
    Family(
        "prefetch_duration_seconds",
        H,
        "L3 prefetch duration, start to its last read",
        (),
        _m("prefetch_duration_seconds"),
    ),
    Family(
        "storage_backup_tokens",
        C,
        "Tokens of host -> L3 backups the L3 store accepted (buffered or written; "
        "storage_written_pages counts them once durable)",
        (),
        _m("storage_backup_tokens"),
    ),
    Family(
        "storage_backup_bytes",
        C,
        "KV bytes of host -> L3 backups the L3 store accepted (see storage_backup_tokens)",
        (),
        _m("storage_backup_bytes"),
    ),
    Family(
        "storage_backup_failed_tokens", C, "Tokens L3 storage refused or failed", (), _m("storage_backup_failed_tokens")
    ),
    Family(
        "storage_backup_duration_seconds",
        H,
        "L3 backup duration, queued to stored",
        (),
        _m("storage_backup_duration_seconds"),
    ),
    # ---- L3 store (``controller.stats()``; absent without a storage controller)
    Family("storage_capacity_bytes", G, "Configured L3 capacity (0: unbounded)", (), _l3("storage_capacity_bytes")),
    Family(
        "storage_writes_pending",
        G,
        "1 while the L3 store has accepted writes not yet durable",
        (),
        _l3("storage_writes_pending"),
    ),
    Family(
        "prefetch_reserved_host_pages",
        G,
        "Host pages reserved for prefetches in flight",
        (),
        _l3("prefetch_reserved_host_pages"),
    ),
    Family("storage_read_hit_pages", C, "Pages the L3 store found and returned", (), _l3("storage_read_hit_pages")),
    Family(
        "storage_read_miss_pages",
        C,
        "Pages asked of the L3 store and not returned (absent, corrupt, unreadable)",
        (),
        _l3("storage_read_miss_pages"),
    ),
    Family(
        "storage_corrupt_pages",
        C,
        "L3 pages that failed a check (CRC, length, header)",
        (),
        _l3("storage_corrupt_pages"),
    ),
    Family(
        "storage_read_errors", C, "L3 reads that raised (I/O errors, vanished files)", (), _l3("storage_read_errors")
    ),
    Family(
        "storage_quarantined_files",
        C,
        "L3 segments / files moved aside after a failed check",
        (),
        _l3("storage_quarantined_files"),
    ),
    Family("storage_verified_pages", C, "L3 pages whose checksum was verified", (), _l3("storage_verified_pages")),
    Family("storage_read_bytes", C, "Bytes read from the L3 store", (), _l3("storage_read_bytes")),
    Family("storage_read_seconds", C, "Time in L3 reads", (), _l3("storage_read_seconds")),
    Family(
        "storage_written_pages",
        C,
        "Pages the L3 store made durable (committed to its files; a buffering "
        "backend such as orbax commits at its flush points, so this lags storage_backup_tokens)",
        (),
        _l3("storage_written_pages"),
    ),
    Family(
        "storage_written_bytes",
        C,
        "Bytes the L3 store made durable (see storage_written_pages)",
        (),
        _l3("storage_written_bytes"),
    ),
    Family("storage_write_seconds", C, "Time in L3 commits", (), _l3("storage_write_seconds")),
    Family("storage_write_errors", C, "Failed L3 commits (disk full, read-only, ...)", (), _l3("storage_write_errors")),
    Family(
        "storage_dropped_pages",
        C,
        "Pages offered to the L3 store and never committed",
        (),
        _l3("storage_dropped_pages"),
    ),
    Family(
        "storage_duplicate_pages",
        C,
        "Pages not written because the L3 store held or was writing them",
        (),
        _l3("storage_duplicate_pages"),
    ),
    Family("storage_evicted_pages", C, "Pages the L3 store evicted for capacity", (), _l3("storage_evicted_pages")),
    # soft retention (``retention``): present once ``enable_retention`` ran
    Family(
        "retained_tokens",
        G,
        "Tokens under a live retention hint (every namespace; each node once whatever its tiers)",
        (),
        _ret(lambda r: r.total),
    ),
    Family(
        "retention_hint_calls",
        C,
        "Retention hints applied (begin_request / insert / a request's inserts)",
        (),
        _ret(lambda r: r.hints),
    ),
    Family(
        "retention_clamped_calls",
        C,
        "Retention hints cut short by their namespace's token cap",
        (),
        _ret(lambda r: r.clamped_hints),
    ),
    Family(
        "retention_clamped_tokens",
        C,
        "Tokens a hint asked for beyond its namespace's cap (not retained)",
        (),
        _ret(lambda r: r.clamped_tokens),
    ),
    Family(
        "retention_expired_tokens",
        C,
        "Retained tokens whose hint expired (back to plain LRU order)",
        (),
        _ret(lambda r: r.expired_tokens),
    ),
    Family(
        "retention_overridden_tokens",
        C,
        "Tokens evicted from a tier while their hint was live (memory "
        "pressure overrode it; a reclaimed redundant host copy does not count)",
        ("tier",),
        _ret(lambda r: dict(r.overridden_tokens)),
    ),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def family_values(cache: "MetricsSource") -> dict[str, Any]:
    """Every family that applies, by name: a number, a {label value: number} dict, or a
    histogram as ``{"count", "sum", "buckets"}`` (what ``stats()`` returns)."""
    ctx = _Context(cache)
    out = {}
    for f in FAMILIES:
        v = f.value(ctx)
        if v is None:
            continue
        if isinstance(v, Histogram):
            v = v.as_stats()
        elif isinstance(v, dict):
            v = {(k if isinstance(k, str) else "/".join(k)): x for k, x in v.items()}
        out[f.name] = v
    return out


def occupancy(cache: Any) -> dict[str, Any]:
    """``HiRadixCache.gauges()``'s values, read through the cache's public attributes only
    (token counters, allocators, copies in flight, components): capacity / free / used per
    tier, KV bytes per (tier, pool), copies in flight. No tree walk, no change: any thread may
    call it (a scrape's values are as fresh as the owner's last poll)."""
    p = cache.page_size
    writes, loads = cache.in_flight
    dev, host = cache.device_allocator, cache.host_allocator
    dev_pages, host_pages = dev.num_pages, host.num_pages
    evictable, protected = cache.evictable_tokens, cache.protected_tokens
    pools = {}
    for name, comp in cache.components.components.items():
        bpp = comp.engine.geom.bytes_per_page
        if comp.own_page_ids:  # its own pools (e.g. a sliding window's, smaller)
            pools[("device", name)] = comp.device_allocator.num_pages * bpp
            pools[("host", name)] = comp.host_allocator.num_pages * bpp
        else:
            pools[("device", name)] = dev_pages * bpp
            pools[("host", name)] = host_pages * bpp
    return {
        "device_capacity_tokens": dev_pages * p,
        "device_free_tokens": dev.available * p,
        "device_used_tokens": evictable + protected,
        "device_evictable_tokens": evictable,
        "device_protected_tokens": protected,
        "host_capacity_tokens": host_pages * p,
        "host_free_tokens": host.available * p,
        "host_used_tokens": cache.host_tokens,
        "pool_capacity_bytes": pools,
        "backups_in_flight": writes,
        "load_backs_in_flight": loads,
    }


def cache_stats(cache: Any, agreement: dict | None) -> dict[str, Any]:
    """``HiRadixCache.stats()``: the configuration and every family (``family_values``), the
    pre-issue-20 aliases, the stateful components' and retention's own stats, and with
    several ranks ``agreement`` (the step agreement's exchanges and the cache's agreed
    counts). Public attributes of the cache only; read-only, any thread."""
    out = {
        "write_policy": cache.write_policy.value,
        "eviction_policy": cache.config.eviction_policy.value,
        "page_size": cache.page_size,
        "nodes": len(cache.all_nodes()) - 1,
    }
    out.update(family_values(cache))
    out["device_tree_tokens"] = out["device_used_tokens"]
    out["host_tree_tokens"] = out["host_used_tokens"]
    out["hit_rate"] = out["cache_hit_rate"]
    stateful = cache.components.stateful
    if stateful:
        out["components"] = {c.name: c.stats() for c in stateful}
    if cache.retention is not None:
        out["retention"] = cache.retention.stats()
    if agreement is not None:
        out["agreement"] = agreement
    return out


# ---------------------------------------------------------------------------------------------
# Prometheus
class _Collector:
    """One per (registry, prefix): every registered cache's families, with its labels."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.label_names: tuple[str, ...] | None = None
        self.caches: list[tuple["MetricsSource", tuple[str, ...]]] = []
        self.lock = threading.Lock()

    def add(self, cache: "MetricsSource", labels: Mapping[str, str]) -> None:
        names, values = tuple(labels), tuple(labels.values())
        with self.lock:
            if self.label_names is not None and set(names) == set(self.label_names):
                # the same names in another order: the collector's order (samples are by name)
                names, values = self.label_names, tuple(labels[n] for n in self.label_names)
            if self.label_names is not None and names != self.label_names:
                raise ValueError(
                    f"labels: caches exported with prefix {self.prefix!r} on one registry must use "
                    f"the same label names {list(self.label_names)}, got {list(names)}"
                )
            for other, vals in self.caches:
                if other is cache:
                    raise ValueError("cache: already registered on this registry with this prefix")
                if vals == values:
                    raise ValueError(
                        f"labels: another cache is registered with {dict(labels) or 'no labels'}; give "
                        f"each cache distinct labels, e.g. labels={{'cache': 'draft', 'rank': '0', "
                        f"'model': 'name'}}"
                    )
            self.label_names = names
            self.caches.append((cache, values))

    def remove(self, cache: "MetricsSource") -> bool:
        with self.lock:
            self.caches = [(c, v) for c, v in self.caches if c is not cache]
            if not self.caches:
                self.label_names = None
            return not self.caches

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self.lock:
            caches = list(self.caches)
            const = self.label_names or ()
        if not caches:
            return
        fams: dict[str, Any] = {}
        for cache, const_vals in caches:
            ctx = _Context(cache)
            for f in FAMILIES:
                v = f.value(ctx)
                if v is None:
                    continue
                name = f"{self.prefix}_{f.name}"
                fam = fams.get(f.name)
                if fam is None:
                    labels = [*const, *f.labels]
                    cls = {C: CounterMetricFamily, G: GaugeMetricFamily, H: HistogramMetricFamily}[f.kind]
                    fam = fams[f.name] = cls(name, f.help, labels=labels)
                if f.kind == H:
                    fam.add_metric(list(const_vals), v.cumulative(), v.sum)
                elif f.labels:
                    for k, x in v.items():
                        fam.add_metric([*const_vals, *((k,) if isinstance(k, str) else k)], x)
                else:
                    fam.add_metric(list(const_vals), v)
        yield from fams.values()

    def describe(self):
        return []  # families appear as caches register; names are checked per cache in ``add``


_COLLECTORS: "weakref.WeakKeyDictionary[Any, dict[str, _Collector]]" = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


class PrometheusExport:
    """What ``register_prometheus`` returns: ``unregister()`` stops exporting the cache."""

    def __init__(self, registry: Any, collector: _Collector, cache: "MetricsSource") -> None:
        self.registry, self.collector, self.cache = registry, collector, cache

    def unregister(self) -> None:
        with _COLLECTORS_LOCK:
            if self.collector.remove(self.cache):
                self.registry.unregister(self.collector)
                _COLLECTORS.get(self.registry, {}).pop(self.collector.prefix, None)


def _check_labels(labels: object) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise TypeError(f"labels: expected a dict of label name -> value, got {type(labels).__name__}")
    out = {}
    for k, v in labels.items():
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("__"):
            raise ValueError(f"labels: {k!r} is not a valid Prometheus label name")
        if k in ("cache_source", "tier", "pool", "reason", "operation", "le", "version", "backend", "platform"):
            raise ValueError(f"labels: {k!r} is a label of the cache's own families; pick another name")
        if isinstance(v, bool) or not isinstance(v, (str, numbers.Integral)):
            raise TypeError(f"labels: the value of {k!r} must be a str or an int, got {type(v).__name__} {v!r}")
        out[k] = str(v)
    return out


def register_prometheus(
    cache: "MetricsSource", registry: Any = None, prefix: str = "hicache", labels: Mapping[str, object] | None = None
) -> PrometheusExport:
    """Export ``cache``'s families (``FAMILIES``) through prometheus_client; values are read at
    scrape time (no per-operation cost). Returns a ``PrometheusExport`` (``unregister()``).

    ``registry`` defaults to prometheus_client's global REGISTRY. ``labels`` (e.g.
    ``{"cache": "target", "rank": "0", "model": "llama-3-8b"}``) are added to every sample of
    this cache, so several caches share one registry; on one registry and prefix they must
    use the same label names with distinct values (ValueError otherwise, naming the fix).
    The L3 families appear while a ``StorageController`` is attached. Raises ImportError with
    a hint when prometheus_client is not installed.
    """
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "register_prometheus needs the prometheus_client package "
            "(pip install 'hicache-jax[metrics]' or prometheus_client)"
        ) from e
    if not isinstance(prefix, str) or not prefix.isidentifier():
        raise ValueError(f"prefix: expected a Prometheus name prefix (letters, digits, _), got {prefix!r}")
    labels = _check_labels(labels)
    registry = registry if registry is not None else prometheus_client.REGISTRY
    with _COLLECTORS_LOCK:
        per_registry = _COLLECTORS.setdefault(registry, {})
        collector = per_registry.get(prefix)
        new = collector is None
        if new:
            collector = _Collector(prefix)
        collector.add(cache, labels)
        if new:
            try:
                registry.register(collector)
            except Exception:
                collector.remove(cache)
                raise
            per_registry[prefix] = collector
    return PrometheusExport(registry, collector, cache)
