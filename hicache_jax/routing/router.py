"""A reference KV-aware router: send a request to the engine whose tiers hold the longest
prefix of it, weighted by how cheap each tier is to serve from, unless the engines' loads
are out of balance.

Pure Python, one owner thread (the router's). It consumes the engines' KV event batches
(``hicache_jax.cache.events``, schema 1; from each engine's ``KVEventSource``, e.g. through
``source.subscribe(router.apply)``) and keeps one ``TierContents`` per engine: it never asks
an engine anything. A request is given as its page keys (``KVEventSource.request_keys`` of
any engine serving the same model: the keys are the L3's chained page keys, the same on
every engine).

Scoring (``score``): walk the request's pages in order; page ``i`` counts if some tier of the
engine holds it (the best one: device, then host, then storage) and every earlier page
counted; the walk stops at the first page no tier holds. The score is the sum of the tiers'
weights over the counted pages (``TierWeights``; defaults: device 1, host 0.7, storage 0.4,
i.e. serving a page from the host saves 70% of recomputing it, from storage 40%). With
``shared_storage`` (engines sharing one L3) the storage pages any engine reported count for
every engine, and a storage page any engine reports removed (its store evicted it) leaves every
engine's view: the store no longer holds it for anyone.

Measured weights (``TierWeights.from_load_cost``, ``tier_costs_from_stats``,
``PrefixRouter.set_measured_weights`` / ``from_measured``): a tier's weight is the share of a
recompute that serving a page from it saves, ``1 - load_cost / prefill_cost`` per token,
clamped to [0, 1] and kept in the order device >= host >= storage. The load costs come from
the caches' own metrics: host = load-back duration per token loaded (``load_back_duration_
seconds`` sum / ``load_back_tokens``), storage = the L3 store's time in reads per token a
prefetch read (``storage_read_seconds`` / ``prefetched_tokens``) plus the host cost (a storage
page is loaded back too); the device tier loads nothing (weight 1). The prefill cost per token
is the caller's measurement (the engine's). A tier nothing was measured for keeps its current
weight. Not the prefetch durations (``prefetch_duration_seconds``): every finished prefetch
observes one, also those that read nothing (a query that found no page, a revoked one), while
only the pages read count as tokens; and each runs from the prefetch's start, through its
``exists`` query and its wait behind other prefetches, to its last read. On a trace with many
storage misses that ratio came out above a recompute and set the storage weight to 0. The
load-back durations run from issue to completion, so a load-back that overlaps compute counts
in full: the host cost is an upper bound and its weight conservative.

Choice (``route``): with ``loads`` (outstanding requests or tokens per engine), when the
most loaded engine carries more than ``balance_abs`` above and ``balance_rel`` times the
least loaded, the least loaded engine is chosen (``reason="balance"``). Otherwise the best
score wins, ties going to the less loaded engine then the earlier one; with no score at all
the least loaded engine, round robin among equals (``reason="no_prefix"``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..cache.events import EVENT_TIERS, EventBatch, TierContents

__all__ = ["PrefixRouter", "RouteDecision", "TierWeights", "tier_costs_from_stats"]


@dataclass(frozen=True)
class TierWeights:
    device: float = 1.0
    host: float = 0.7
    storage: float = 0.4

    def __post_init__(self) -> None:
        for t in EVENT_TIERS:
            v = getattr(self, t)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"{t}: expected a weight in [0, 1], got {v!r}")
        if not self.device >= self.host >= self.storage:
            raise ValueError(f"weights: expected device >= host >= storage, got {self}")

    @classmethod
    def from_load_cost(
        cls,
        prefill_s_per_token: float,
        host_s_per_token: float | None = None,
        storage_s_per_token: float | None = None,
        base: "TierWeights | None" = None,
    ) -> "TierWeights":
        """Weights from measured per-token costs (see the module docstring); a cost of None
        keeps ``base``'s weight for that tier (default weights without ``base``)."""
        if base is None:
            base = cls()
        if not isinstance(base, TierWeights):
            raise TypeError(f"base: expected a TierWeights or None, got {type(base).__name__}")
        _check_cost("prefill_s_per_token", prefill_s_per_token, positive=True)
        _check_cost("host_s_per_token", host_s_per_token)
        _check_cost("storage_s_per_token", storage_s_per_token)

        def saved(cost, keep):
            return keep if cost is None else min(1.0, max(0.0, 1.0 - cost / prefill_s_per_token))

        host = saved(host_s_per_token, base.host)
        storage = min(host, saved(storage_s_per_token, base.storage))  # a storage page loads through the host
        return cls(base.device, min(base.device, host), min(base.device, storage))


def _check_cost(name: str, v: object, positive: bool = False) -> None:
    if v is None and not positive:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name}: expected a finite number of seconds {'> 0' if positive else '>= 0'}, got {v!r}")


def tier_costs_from_stats(stats: Mapping | Sequence[Mapping]) -> dict[str, float | None]:
    """Measured seconds per token of loading from ``host`` and ``storage`` (see the module
    docstring), from one ``cache.stats()`` or several (summed: engines serving one model);
    None for a tier with nothing measured."""
    if isinstance(stats, Mapping):
        stats = [stats]
    if (
        isinstance(stats, (str, bytes))
        or not isinstance(stats, Sequence)
        or any(not isinstance(s, Mapping) for s in stats)
    ):
        raise TypeError("stats: expected cache.stats() or a sequence of them")

    def total(hist: str, tokens: str) -> tuple[float, int]:
        secs = sum(s[hist]["sum"] for s in stats if hist in s)
        toks = sum(s[tokens] for s in stats if tokens in s)
        return secs, toks

    h_s, h_t = total("load_back_duration_seconds", "load_back_tokens")
    host = h_s / h_t if h_t else None
    r_s = sum(s.get("storage_read_seconds") or 0.0 for s in stats)  # None where no L3 is attached
    p_t = sum(s.get("prefetched_tokens", 0) for s in stats)
    storage = r_s / p_t + (host or 0.0) if p_t else None
    return {"host": host, "storage": storage}


def _check_keys(keys: object) -> Sequence[bytes]:
    """``keys`` as given when it is a sequence of page keys (a list or tuple of bytes: an
    iterator would be consumed by the check); TypeError otherwise."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys: expected a sequence (list or tuple) of page keys (bytes), got {type(keys).__name__}")
    if any(not isinstance(k, bytes) for k in keys):
        raise TypeError("keys: expected a sequence of page keys (bytes), got an item that is not bytes")
    return keys


@dataclass(frozen=True)
class RouteDecision:
    engine: str
    reason: str  # "prefix" | "balance" | "no_prefix"
    score: float
    pages: dict  # tier -> pages of the chosen engine's prefix served from that tier


class PrefixRouter:
    """See the module docstring."""

    def __init__(
        self,
        engines: Sequence[str],
        weights: TierWeights | None = None,
        *,
        shared_storage: bool = True,
        balance_abs: float = 32,
        balance_rel: float = 1.5,
    ) -> None:
        if isinstance(engines, (str, bytes)) or not isinstance(engines, (Sequence, set, frozenset)):
            raise TypeError(
                f"engines: expected a sequence of engine names (e.g. a list of str), got "
                f"{type(engines).__name__} {engines!r}"
            )
        engines = list(engines)
        if not engines or any(not isinstance(e, str) or not e for e in engines) or len(set(engines)) != len(engines):
            raise ValueError(f"engines: expected distinct, non-empty engine names (str), got {engines!r}")
        if weights is None:
            weights = TierWeights()
        if not isinstance(weights, TierWeights):
            raise TypeError(f"weights: expected a TierWeights, got {type(weights).__name__}")
        if not isinstance(shared_storage, bool):
            raise TypeError(f"shared_storage: expected a bool, got {type(shared_storage).__name__} {shared_storage!r}")
        for name, v in (("balance_abs", balance_abs), ("balance_rel", balance_rel)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        self.engines = engines
        self.weights = weights
        self.shared_storage = shared_storage
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.views = {e: TierContents() for e in engines}
        self._rr = itertools.count()
        self.decisions = {"prefix": 0, "balance": 0, "no_prefix": 0}

    @classmethod
    def from_measured(
        cls, engines: Sequence[str], stats: Mapping | Sequence[Mapping], prefill_s_per_token: float, **kwargs
    ) -> "PrefixRouter":
        """A router whose tier weights come from the caches' measured load costs (``stats``:
        ``cache.stats()`` of one or several engines) against ``prefill_s_per_token``."""
        router = cls(engines, **kwargs)
        router.set_measured_weights(stats, prefill_s_per_token)
        return router

    def set_measured_weights(self, stats: Mapping | Sequence[Mapping], prefill_s_per_token: float) -> TierWeights:
        """Re-weight the tiers from measured load costs (module docstring); a tier with
        nothing measured keeps its weight. Returns the new weights."""
        costs = tier_costs_from_stats(stats)
        self.weights = TierWeights.from_load_cost(
            prefill_s_per_token, costs["host"], costs["storage"], base=self.weights
        )
        return self.weights

    def apply(self, batch: EventBatch) -> None:
        """Fold one engine's batch into its view (batches of an engine in ``seq`` order)."""
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batch: expected an EventBatch, got {type(batch).__name__}")
        view = self.views.get(batch.engine)
        if view is None:
            raise ValueError(f"batch: engine {batch.engine!r} is not one of {self.engines}")
        view.apply(batch)
        if self.shared_storage:  # the shared L3 dropped them for every engine
            for e in batch.events:
                if e.kind == "removed" and e.tier == "storage":
                    for other in self.views.values():
                        pages = other.tiers["storage"]
                        for k in e.keys:
                            pages.pop(k, None)

    def score(self, engine: str, keys: Sequence[bytes]) -> tuple[float, dict]:
        """(weighted prefix score, pages per tier) of ``keys`` on ``engine``."""
        if engine not in self.views:
            raise ValueError(f"engine: expected one of {self.engines}, got {engine!r}")
        keys = _check_keys(keys)
        tiers = self.views[engine].tiers
        dev, host = tiers["device"], tiers["host"]
        shared = [v.tiers["storage"] for v in self.views.values()] if self.shared_storage else [tiers["storage"]]
        w = self.weights
        pages = {"device": 0, "host": 0, "storage": 0}
        score = 0.0
        for k in keys:
            if k in dev:
                pages["device"] += 1
                score += w.device
            elif k in host:
                pages["host"] += 1
                score += w.host
            elif any(k in s for s in shared):
                pages["storage"] += 1
                score += w.storage
            else:
                break
        return score, pages

    def route(self, keys: Sequence[bytes], loads: Mapping[str, float] | None = None) -> RouteDecision:
        """The engine for a request whose page keys are ``keys`` (see the module docstring)."""
        keys = _check_keys(keys)
        if loads is None:
            loads = {}
        if not isinstance(loads, Mapping):
            raise TypeError(f"loads: expected a mapping engine -> load, got {type(loads).__name__}")
        unknown = set(loads) - set(self.engines)
        if unknown:
            raise ValueError(f"loads: unknown engines {sorted(unknown, key=repr)}")
        for e, v in loads.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"loads: expected a finite number >= 0 per engine, got {e!r}: {v!r}")
        load = {e: float(loads.get(e, 0)) for e in self.engines}
        lo, hi = min(load.values()), max(load.values())
        least = [e for e in self.engines if load[e] == lo]
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            e = least[next(self._rr) % len(least)]
            return self._decide(e, "balance", *self.score(e, keys))
        best, best_key, best_pages = None, None, None
        for i, e in enumerate(self.engines):
            s, pages = self.score(e, keys)
            k = (s, -load[e], -i)
            if best_key is None or k > best_key:
                best, best_key, best_pages = e, k, pages
        if best_key[0] > 0:
            return self._decide(best, "prefix", best_key[0], best_pages)
        e = least[next(self._rr) % len(least)]
        return self._decide(e, "no_prefix", 0.0, {"device": 0, "host": 0, "storage": 0})

    def _decide(self, engine: str, reason: str, score: float, pages: dict) -> RouteDecision:
        self.decisions[reason] += 1
        return RouteDecision(engine, reason, score, pages)
