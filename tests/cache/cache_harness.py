"""Test helpers for the cache: a backend bundle, a KV oracle and a cache factory.

Backend-neutral: everything goes through the bundle's ``device`` (``write``/``read``/
``allocator``), ``host`` (a HostKVPool) and ``engine`` (a KVTransferEngine), plus
``complete_all`` / ``pending`` / ``complete`` for deferred transfers. Another backend (the
torch one in npu_bridge) plugs in by providing a factory with the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hicache_jax import KVGeometry
from hicache_jax.backends.numpy_backend import make_numpy_backend
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey


@dataclass
class Backend:
    geom: KVGeometry
    device: object  # .write(component, ids, pages), .read(component, ids), .allocator
    host: object  # HostKVPool
    engine: object  # KVTransferEngine

    @property
    def pending(self) -> list:
        return getattr(self.engine, "pending", [])

    def complete(self, handle) -> None:
        self.engine.complete(handle)

    def complete_all(self) -> None:
        if hasattr(self.engine, "complete_all"):
            self.engine.complete_all()


BackendFactory = Callable[..., Backend]


def numpy_backend_factory(
    geom: KVGeometry, device_pages: int, host_pages: int, layout: str = "page_first", deferred: bool = False
) -> Backend:
    device, host, engine = make_numpy_backend(geom, device_pages, host_pages, layout, deferred)
    return Backend(geom, device, host, engine)


def small_geom(page_size: int = 1, kind: str = "mha", layers: int = 2) -> KVGeometry:
    if kind == "mha":
        return KVGeometry.mha(layers, page_size, 1, 2, "float32")
    return KVGeometry.mla(layers, page_size, 2, 1, "float32")


def make_cache(
    factory: BackendFactory,
    *,
    page_size: int = 1,
    device_pages: int = 32,
    host_pages: int = 64,
    deferred: bool = False,
    layout: str = "page_first",
    kind: str = "mha",
    **cfg,
):
    geom = small_geom(page_size, kind)
    be = factory(geom, device_pages, host_pages, layout, deferred)
    cache = HiRadixCache(HiCacheConfig(page_size=page_size, **cfg), be.engine, be.device.allocator)
    return cache, be


def _prefix_hashes(namespace: tuple, tokens: np.ndarray, salt: int = 0) -> np.ndarray:
    """h[i] identifies (namespace, tokens[:i+1]): KV at a position depends on the whole prefix."""
    h = (hash(namespace) & 0xFFFFFFFF) ^ 0x9E3779B9 ^ salt
    out = np.empty(len(tokens), np.uint64)
    for i, t in enumerate(tokens.tolist()):
        h = (h * 1000003 + int(t) + 1) & 0xFFFFFFFF
        out[i] = h
    return out


class KVOracle:
    """Deterministic KV content per (namespace, prefix): the shadow model of the fuzz tests.

    ``salt``: another model's KV for the same prefixes (a draft sidecar's pool differs from
    the target's, so bytes landing in the wrong pool show)."""

    def __init__(self, be: Backend, salt: int = 0) -> None:
        self.be = be
        self.geom = be.geom
        self.salt = salt

    def pages(self, key: RadixKey, first_page: int, npages: int) -> dict[str, np.ndarray]:
        """Expected content (L, n, page, H, D) of pages [first_page, first_page + npages) of key."""
        g = self.geom
        p = g.page_size
        toks = key.token_ids[: (first_page + npages) * p]
        h = np.zeros((first_page + npages) * p, np.uint64)  # a partial last page is zero-padded
        h[: len(toks)] = _prefix_hashes(key.namespace, toks, self.salt)
        h = h[first_page * p :].reshape(npages, p)
        L, H, D = g.num_layers, g.heads, g.width
        lay = np.arange(L, dtype=np.uint64).reshape(L, 1, 1, 1, 1) * np.uint64(7919)
        hd = np.arange(H * D, dtype=np.uint64).reshape(1, 1, 1, H, D) * np.uint64(31)
        out = {}
        for ci, c in enumerate(g.components):
            v = h.reshape(1, npages, p, 1, 1) + lay + hd + np.uint64(104729 * (ci + 1))
            out[c] = (v & np.uint64(0xFFFFFFFF)).astype(g.container_dtype)
        return out

    def write(self, key: RadixKey, device_ids: np.ndarray, first_page: int = 0) -> None:
        """What a prefill does: write the KV of pages [first_page, ...) into device_ids."""
        if len(device_ids) == 0:
            return
        for c, arr in self.pages(key, first_page, len(device_ids)).items():
            self.be.device.write(c, device_ids, arr)

    def check_device(self, key: RadixKey, device_ids: np.ndarray, first_page: int = 0) -> None:
        if len(device_ids) == 0:
            return
        exp = self.pages(key, first_page, len(device_ids))
        for c, arr in exp.items():
            got = self.be.device.read(c, device_ids)
            if not np.array_equal(got, arr):
                bad = np.flatnonzero((got != arr).reshape(arr.shape[0], arr.shape[1], -1).any(axis=(0, 2)))
                raise AssertionError(
                    f"device KV mismatch for component {c} at pages "
                    f"{(bad + first_page).tolist()} (ids {np.asarray(device_ids)[bad].tolist()})"
                )

    def host_pages_lnp(self, component: str, host_ids: np.ndarray) -> np.ndarray:
        host = self.be.host
        buf = host.read_pages(component, host_ids)
        order = host.layout.transfer_order
        if order == "npl":
            return buf.transpose(2, 0, 1, 3, 4)
        if order == "nlp":
            return buf.transpose(1, 0, 2, 3, 4)
        return buf

    def check_host(self, key: RadixKey, host_ids: np.ndarray, first_page: int = 0) -> None:
        if len(host_ids) == 0:
            return
        exp = self.pages(key, first_page, len(host_ids))
        for c, arr in exp.items():
            if not np.array_equal(self.host_pages_lnp(c, host_ids), arr):
                raise AssertionError(f"host KV mismatch for component {c}")


def node_path_pages(cache: HiRadixCache, node, host: bool = False) -> np.ndarray:
    """Page ids along root -> node (device or host tier)."""
    vals = []
    while node is not cache.root:
        vals.append(node.host_value if host else node.value)
        node = node.parent
    vals.reverse()
    return np.concatenate(vals) if vals else np.zeros(0, np.int32)


def fail_next_allocs(allocator, count: int = 1) -> None:
    """Make ``allocator.alloc`` return None for its next ``count`` calls (a rank's failed
    allocation), then allocate as before."""
    real, left = allocator.alloc, [count]

    def alloc(n):
        if left[0]:
            left[0] -= 1
            return None
        return real(n)

    allocator.alloc = alloc


def device_only_path(cache: HiRadixCache, key: RadixKey) -> list[bool]:
    """The nodes of ``key``'s device match, root first: whether each is on the device only
    (device pages, no host copy)."""
    node = cache.match_prefix(key).last_device_node
    out = []
    while node is not cache.root:
        out.append(node.value is not None and node.host_value is None)
        node = node.parent
    return out[::-1]


def serve_checked(cache: HiRadixCache, oracle: KVOracle, key: RadixKey) -> dict[str, int]:
    """Begin a request for ``key`` (waiting for its load-back), check the device bytes it is
    served against the oracle, release it; returns its hit tokens per tier."""
    req, load = cache.begin_request(key)
    if load is not None:
        load.handle.wait()
    cache.flush()
    n = req.cached_pages
    oracle.check_device(RadixKey(key.token_ids[: n * cache.page_size]), req.device_pages[:n])
    hits = dict(req.hit_tokens)
    cache.dec_lock_ref(req.last_node)
    return hits


def prefill_insert(cache: HiRadixCache, oracle: KVOracle, key: RadixKey, chunked: bool = False):
    """Match, allocate the rest, write KV, insert (no load-back, no lock). Returns the insert result."""
    p = cache.page_size
    m = cache.match_prefix(key)
    n = len(key) // p
    have = len(m.device_indices)
    cache.inc_lock_ref(m.last_device_node)
    try:
        new = cache.alloc_device(n - have)
    finally:
        cache.dec_lock_ref(m.last_device_node)
    assert new is not None, "test pool too small"
    oracle.write(key, new, have)
    return cache.insert(key, np.concatenate([m.device_indices, new]), chunked=chunked)
