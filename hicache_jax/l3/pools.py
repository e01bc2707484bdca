"""The L3 storage pools of one cache and the namespaces that seed their page keys.

``L3Pools`` maps the cache's KV components to storage pools (component ``full`` is the pool
``target``, a sidecar keeps its own name; several ranks with a sharded pool add the one-byte
``commit`` marker pool), says how each pool is hit (every page, or the trailing window of a
windowed component), which pools rank 0 alone writes (replicated: MLA latents, or an engine
whose ``replicated`` says every rank holds the same heads) and builds the per-pool
``Namespace`` of a tree namespace (model identity with the KV geometry folded in, weights
revision, TP rank, salt and the radix key's namespace).

Threading: built once and read-only afterwards, except ``namespaces``' memo, which only the
owner thread fills (the worker threads receive the namespaces an operation was started with).
Owns nothing that needs closing.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..cache.components import FULL
from ..cache.radix_key import encode_namespace
from ..host_pool import HostKVPool
from ..kv_geometry import KVGeometry
from ..storage import Namespace, PoolHitPolicy, PoolSpec

log = logging.getLogger("hicache_jax.cache.storage")

TARGET_POOL = "target"
COMMIT_POOL = "commit"  # several ranks, sharded pools: one marker page per committed page group


class L3Pools:
    """Storage pools of a cache (see the module docstring).

    Attributes: ``pools`` (pool -> host pool), ``trailing`` (trailing-pages pool -> (component,
    window pages)), ``order`` (write order: other pools first, target last), ``all_pools``
    (pools read in full up to a hit), ``replicated`` (pools rank 0 alone writes), ``markers``
    (whether committed page groups get a marker), ``specs`` (the storage's ``PoolSpec`` per pool).
    """

    def __init__(self, components, *, model: str, weights_revision: str, tp_size: int, tp_rank: int, salt: str) -> None:
        engines = components.engines
        comps = components.components
        names = {}
        for comp in engines:
            name = TARGET_POOL if comp == FULL else comp
            if name in names.values() or name == COMMIT_POOL:
                raise ValueError(f"cache: sidecar {comp!r} clashes with the storage pool name {name!r}")
            names[comp] = name
        self.salt = salt
        self.tp_rank = tp_rank
        self.pools = {names[c]: engines[c].host_pool for c in engines}
        # Components whose pages are stored for the window before a hit's end only.
        self.trailing = {
            names[c]: (comps[c], comps[c].l3_trailing_pages) for c in engines if comps[c].l3_trailing_pages is not None
        }
        for comp, _wp in self.trailing.values():
            if not comp.own_page_ids:
                raise ValueError(
                    f"cache: component {comp.name!r} has a trailing-pages L3 policy but shares the full page ids"
                )
        # The other pools (draft, swa) first, the target last: its pages are written only after theirs.
        self.order = [n for n in self.pools if n != TARGET_POOL] + [TARGET_POOL]
        # Several ranks: a replicated pool (MLA latent KV, or an engine that says it holds the
        # same heads on every rank, e.g. a draft with fewer KV heads than ranks) is the same on
        # every rank; rank 0 alone writes it, under keys every rank shares.
        self.replicated = {
            names[c]
            for c, e in engines.items()
            if tp_size > 1 and (e.geom.kind == "mla" or bool(getattr(e, "replicated", False)))
        }
        self._ns_base = {}
        for comp, eng in engines.items():
            g = eng.geom
            shared = names[comp] in self.replicated
            self._ns_base[names[comp]] = Namespace.from_geometry(
                g,
                eng.host_pool.layout,
                model=_identity(model, g),
                weights_revision=weights_revision,
                pool=names[comp],
                tp_size=1 if shared else tp_size,
                tp_rank=0 if shared else tp_rank,
            )
        # Commit markers when a pool is sharded over several ranks: rank-independent keys.
        self.markers = tp_size > 1 and len(self.replicated) < len(engines)
        if self.markers:
            g = engines[FULL].geom
            self._ns_base[COMMIT_POOL] = Namespace.from_geometry(
                g,
                engines[FULL].host_pool.layout,
                model=_identity(model, g),
                weights_revision=weights_revision,
                pool=COMMIT_POOL,
                tp_size=tp_size,
                tp_rank=0,
            )
            self.pools[COMMIT_POOL] = HostKVPool(KVGeometry.mla(1, 1, 1, 0, "float8_e4m3fn"), 1)
        self.all_pools = [n for n in self.pools if n not in self.trailing]
        self.specs = [
            PoolSpec(n, PoolHitPolicy.TRAILING_PAGES, self.trailing[n][1]) if n in self.trailing else PoolSpec(n)
            for n in self.pools
        ]
        self._ns_memo: dict[tuple, dict[str, Namespace] | None] = {}
        self._bad_ns_logged: set = set()

    def queried_pools(self) -> list[str]:
        """Pools a prefetch query asks for: every fully-read pool; the commit markers on rank 0
        only (it wrote them, so it sees them at once even in a store that buffers per process)."""
        return [p for p in self.all_pools if p != COMMIT_POOL or self.tp_rank == 0]

    def read_pools(self) -> list[str]:
        """Pools a prefetch reads in full (the markers are checked, never read)."""
        return [p for p in self.all_pools if p != COMMIT_POOL]

    def namespaces(self, radix_ns: tuple) -> dict[str, Namespace] | None:
        """Per-pool namespaces of a tree namespace (memoised), or None if it has no stable
        encoding (logged once; its pages skip storage)."""
        if radix_ns in self._ns_memo:
            return self._ns_memo[radix_ns]
        try:
            extra = encode_namespace(self.salt, radix_ns)
            out = {pool: replace(ns, extra_key=extra) for pool, ns in self._ns_base.items()}
        except TypeError as e:
            if radix_ns not in self._bad_ns_logged:
                self._bad_ns_logged.add(radix_ns)
                log.warning("L3: namespace %r is not supported (%s); its pages skip storage", radix_ns, e)
            out = None
        self._ns_memo[radix_ns] = out
        return out


def _identity(model: str, g: KVGeometry) -> str:
    return f"{model}#{g.kind}:L{g.num_layers}:H{g.heads}:D{g.width}"
