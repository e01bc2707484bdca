"""Speculative decoding counters and their Prometheus export. Pure Python.

``SpecMetrics`` counts verify steps, proposed / accepted draft tokens, emitted tokens and a
histogram of per-request mean accept lengths; ``Engine.stats()`` includes ``stats()``.
``register_prometheus(metrics)`` exports them (prometheus_client imported only then; values
read at scrape time): ``<prefix>_spec_accept_length`` (gauge: mean accept length per verify
step since start, upstream's ``sglang:spec_accept_length``), ``<prefix>_spec_verify_steps``,
``<prefix>_spec_draft_tokens`` / ``<prefix>_spec_accepted_draft_tokens`` /
``<prefix>_spec_emitted_tokens`` (counters) and ``<prefix>_spec_request_accept_length``
(histogram of each finished request's mean accept length).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecMetrics:
    max_accept_length: int = 5  # k + 1: the histogram's top bucket
    verify_steps: int = 0
    draft_tokens: int = 0  # proposed
    accepted_draft_tokens: int = 0  # proposals the target agreed with
    emitted_tokens: int = 0  # accepted + one bonus per step (before truncation at max_new)
    requests: int = 0
    request_accept_length_sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=list)  # per ``buckets``, not cumulative

    def __post_init__(self) -> None:
        self.buckets = [1.0 + 0.5 * i for i in range(2 * self.max_accept_length - 1)]  # 1, 1.5, ..., k + 1
        self.bucket_counts = [0] * (len(self.buckets) + 1)  # the last: +Inf

    def observe_step(self, k: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += k
        self.accepted_draft_tokens += accepted
        self.emitted_tokens += accepted + 1

    def observe_request(self, accept_length: float) -> None:
        self.requests += 1
        self.request_accept_length_sum += accept_length
        self.bucket_counts[bisect.bisect_left(self.buckets, accept_length)] += 1

    @property
    def accept_length(self) -> float:
        """Mean accept length per verify step (0.0 before the first)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def stats(self) -> dict:
        return {"spec_verify_steps": self.verify_steps, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_draft_tokens": self.accepted_draft_tokens, "spec_emitted_tokens": self.emitted_tokens,
                "spec_accept_length_mean": self.accept_length, "spec_requests": self.requests,
                "spec_request_accept_length_mean": (self.request_accept_length_sum / self.requests
                                                    if self.requests else 0.0)}


class _Collector:
    def __init__(self, metrics: SpecMetrics, prefix: str) -> None:
        self.metrics = metrics
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m, p = self.metrics, self.prefix
        g = GaugeMetricFamily(f"{p}_spec_accept_length", "Mean accept length per verify step (bonus token included)")
        g.add_metric([], m.accept_length)
        yield g
        for name, help_text, value in (
                ("spec_verify_steps", "Speculative verify steps", m.verify_steps),
                ("spec_draft_tokens", "Draft tokens proposed", m.draft_tokens),
                ("spec_accepted_draft_tokens", "Draft tokens the target accepted", m.accepted_draft_tokens),
                ("spec_emitted_tokens", "Tokens emitted by verify steps", m.emitted_tokens)):
            c = CounterMetricFamily(f"{p}_{name}", help_text)
            c.add_metric([], value)
            yield c
        cumulative, running = [], 0
        for bound, count in zip([*map(str, m.buckets), "+Inf"], m.bucket_counts):
            running += count
            cumulative.append((bound, running))
        h = HistogramMetricFamily(f"{p}_spec_request_accept_length", "Mean accept length of each finished request")
        h.add_metric([], cumulative, m.request_accept_length_sum)
        yield h


def register_prometheus(metrics: SpecMetrics, registry: Any = None, prefix: str = "hicache") -> Any:
    """Export ``metrics`` through prometheus_client (``registry``: default the global one)."""
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("register_prometheus needs the prometheus_client package "
                          "(pip install prometheus_client)") from e
    collector = _Collector(metrics, prefix)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
