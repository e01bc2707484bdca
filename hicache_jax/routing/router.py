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
i.e. serving a page from the host saves 70% of recomputing it, from storage 40%: set them
from measured load costs). With ``shared_storage`` (engines sharing one L3) the storage
pages any engine reported count for every engine.

Choice (``route``): with ``loads`` (outstanding requests or tokens per engine), when the
most loaded engine carries more than ``balance_abs`` above and ``balance_rel`` times the
least loaded, the least loaded engine is chosen (``reason="balance"``). Otherwise the best
score wins, ties going to the less loaded engine then the earlier one; with no score at all
the least loaded engine, round robin among equals (``reason="no_prefix"``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..cache.events import EVENT_TIERS, EventBatch, TierContents

__all__ = ["PrefixRouter", "RouteDecision", "TierWeights"]


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


@dataclass(frozen=True)
class RouteDecision:
    engine: str
    reason: str  # "prefix" | "balance" | "no_prefix"
    score: float
    pages: dict  # tier -> pages of the chosen engine's prefix served from that tier


class PrefixRouter:
    """See the module docstring."""

    def __init__(self, engines: Sequence[str], weights: TierWeights | None = None, *, shared_storage: bool = True,
                 balance_abs: float = 32, balance_rel: float = 1.5) -> None:
        engines = list(engines)
        if not engines or any(not isinstance(e, str) for e in engines) or len(set(engines)) != len(engines):
            raise ValueError(f"engines: expected distinct engine names (str), got {engines!r}")
        if weights is None:
            weights = TierWeights()
        if not isinstance(weights, TierWeights):
            raise TypeError(f"weights: expected a TierWeights, got {type(weights).__name__}")
        for name, v in (("balance_abs", balance_abs), ("balance_rel", balance_rel)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name}: expected a number >= 0, got {v!r}")
        self.engines = engines
        self.weights = weights
        self.shared_storage = shared_storage
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.views = {e: TierContents() for e in engines}
        self._rr = itertools.count()
        self.decisions = {"prefix": 0, "balance": 0, "no_prefix": 0}

    def apply(self, batch: EventBatch) -> None:
        """Fold one engine's batch into its view (batches of an engine in ``seq`` order)."""
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batch: expected an EventBatch, got {type(batch).__name__}")
        view = self.views.get(batch.engine)
        if view is None:
            raise ValueError(f"batch: engine {batch.engine!r} is not one of {self.engines}")
        view.apply(batch)

    def score(self, engine: str, keys: Sequence[bytes]) -> tuple[float, dict]:
        """(weighted prefix score, pages per tier) of ``keys`` on ``engine``."""
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
        if isinstance(keys, (bytes, str)) or any(not isinstance(k, bytes) for k in keys):
            raise TypeError("keys: expected a sequence of page keys (bytes)")
        if loads is None:
            loads = {}
        if not isinstance(loads, Mapping):
            raise TypeError(f"loads: expected a mapping engine -> load, got {type(loads).__name__}")
        unknown = set(loads) - set(self.engines)
        if unknown:
            raise ValueError(f"loads: unknown engines {sorted(unknown)}")
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
