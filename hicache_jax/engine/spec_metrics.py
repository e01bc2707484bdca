"""Speculative decoding metrics: engine-level families under the cache's naming scheme. Pure
Python (prometheus_client is imported only by ``register_prometheus``).

``SPEC_FAMILIES`` follows the rules of ``hicache_jax.cache.metrics.FAMILIES`` (one name for the
``Engine.stats()`` key, the Prometheus family ``<prefix>_<name>`` with ``_total`` on counters,
and the row in docs/speculative-decoding.md; the unit last; upstream's name where one exists: sglang's
``spec_accept_length``). They are the engine's, not the cache's: the cache knows nothing of
verify steps, so they live beside ``FAMILIES``, not in it.

* ``spec_verify_steps`` (counter): target steps that verified ``k`` draft tokens;
* ``spec_draft_tokens`` / ``spec_accepted_tokens`` / ``spec_emitted_tokens`` (counters): draft
  tokens proposed, the ones the target agreed with, and tokens emitted by verify steps
  (accepted + one bonus each, before the cut at ``max_new_tokens``);
* ``spec_accept_length`` (gauge): mean accept length per verify step since start
  (``spec_emitted_tokens / spec_verify_steps``; 0 before the first);
* ``spec_request_accept_length`` (histogram): each finished request's mean accept length
  (buckets 1, 1.5, ..., k + 1), so a dashboard sees per-request spread, e.g. the requests whose
  prefix came back without its draft KV.

``SpecMetrics`` is updated on the engine's scheduler thread and read at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..cache.metrics import Family, Histogram


@dataclass
class SpecMetrics:
    max_accept_length: int = 5  # k + 1: the histogram's top bucket
    verify_steps: int = 0
    draft_tokens: int = 0  # proposed
    accepted_tokens: int = 0  # proposals the target agreed with
    emitted_tokens: int = 0  # accepted + one bonus per step (before truncation at max_new)
    request_accept_length: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.request_accept_length = Histogram(
            tuple(1.0 + 0.5 * i for i in range(2 * self.max_accept_length - 1))
        )  # 1, 1.5, ..., k + 1

    def observe_step(self, k: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1

    def observe_request(self, accept_length: float) -> None:
        self.request_accept_length.observe(accept_length)

    @property
    def accept_length(self) -> float:
        """Mean accept length per verify step (0.0 before the first)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def stats(self) -> dict:
        """Every family by name (a histogram as ``{"count", "sum", "buckets"}``)."""
        out = {}
        for f in SPEC_FAMILIES:
            v = f.value(self)
            out[f.name] = v.as_stats() if isinstance(v, Histogram) else v
        return out


def _m(attr: str) -> Callable[[SpecMetrics], Any]:
    return lambda m: getattr(m, attr)


C, G, H = "counter", "gauge", "histogram"
SPEC_FAMILIES: tuple[Family, ...] = (
    Family("spec_verify_steps", C, "Target steps that verified k draft tokens", (), _m("verify_steps")),
    Family("spec_draft_tokens", C, "Draft tokens proposed", (), _m("draft_tokens")),
    Family("spec_accepted_tokens", C, "Draft tokens the target accepted", (), _m("accepted_tokens")),
    Family(
        "spec_emitted_tokens", C, "Tokens emitted by verify steps (accepted + one bonus each)", (), _m("emitted_tokens")
    ),
    Family(
        "spec_accept_length",
        G,
        "Mean accept length per verify step since start (bonus token included)",
        (),
        _m("accept_length"),
    ),
    Family(
        "spec_request_accept_length", H, "Mean accept length of each finished request", (), _m("request_accept_length")
    ),
)
SPEC_FAMILY_NAMES = tuple(f.name for f in SPEC_FAMILIES)


class _Collector:
    def __init__(self, metrics: SpecMetrics, prefix: str, labels: Mapping[str, str]) -> None:
        self.metrics, self.prefix, self.labels = metrics, prefix, dict(labels)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        for f in SPEC_FAMILIES:
            cls = {C: CounterMetricFamily, G: GaugeMetricFamily, H: HistogramMetricFamily}[f.kind]
            fam = cls(f"{self.prefix}_{f.name}", f.help, labels=names)
            v = f.value(self.metrics)
            if f.kind == H:
                fam.add_metric(values, v.cumulative(), v.sum)
            else:
                fam.add_metric(values, v)
            yield fam

    def describe(self):
        return []


class SpecPrometheusExport:
    """What ``register_prometheus`` returns: ``unregister()`` stops the export."""

    def __init__(self, registry: Any, collector: _Collector) -> None:
        self.registry, self.collector = registry, collector

    def unregister(self) -> None:
        self.registry.unregister(self.collector)


def register_prometheus(
    metrics: SpecMetrics, registry: Any = None, prefix: str = "hicache", labels: Mapping[str, object] | None = None
) -> SpecPrometheusExport:
    """Export ``metrics`` (``Engine.spec.metrics``) as ``SPEC_FAMILIES`` through prometheus_client,
    read at scrape time. ``registry``: default the global one; ``labels`` are added to every
    sample (e.g. ``{"model": ...}``, as for the cache's families)."""
    if not isinstance(metrics, SpecMetrics):
        raise TypeError(f"metrics: expected SpecMetrics (Engine.spec.metrics), got {type(metrics).__name__}")
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "register_prometheus needs the prometheus_client package "
            "(pip install 'hicache-jax[metrics]' or prometheus_client)"
        ) from e
    if not isinstance(prefix, str) or not prefix.isidentifier():
        raise ValueError(f"prefix: expected a Prometheus name prefix (letters, digits, _), got {prefix!r}")
    if labels is not None and not isinstance(labels, Mapping):
        raise TypeError(f"labels: expected a dict of label name -> value, got {type(labels).__name__}")
    clean = {}
    for k, v in (labels or {}).items():
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("__") or k == "le":
            raise ValueError(f"labels: {k!r} is not a valid Prometheus label name")
        clean[k] = str(v)
    registry = registry if registry is not None else prometheus_client.REGISTRY
    collector = _Collector(metrics, prefix, clean)
    registry.register(collector)
    return SpecPrometheusExport(registry, collector)
