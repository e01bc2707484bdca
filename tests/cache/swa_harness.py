"""Test helpers for the SWA component: a cache factory, a shadow model of both pools, and the
driver that serves a request the way an engine must (the call sequence the engine mirrors).

The shadow model: KV at a position is a function of (namespace, prefix) (``KVOracle``), with a
different salt for the SWA pool, so an SWA page served for a full one (or the other way round,
or from another position) is caught byte for byte.

``SWADriver`` is the reference call sequence (see ``HiRadixCache``'s "Sliding-window (SWA)
requests"):

* admission: ``begin_request`` (match, load-back of the host / L3 continuation, lock); wait for
  the load's layers; the prefix is ``req.device_pages`` and, for the SWA layers, the window
  pages in ``req.component_pages["swa"]``;
* each prefill chunk and each decode step: allocate the new pages of both pools
  (``alloc_device`` + ``alloc_component("swa", n)``, each evicting by its own rules; on
  failure free what was taken), ``req.extend(key, pages, {"swa": swa_pages})``, run the
  forward pass (here: write the oracle's bytes into both pools), then ``slide_window(req)``
  (frees the request's own SWA pages that fell out of the window); a chunk ends with
  ``cache_unfinished_req(req, chunked=True)``;
* finish: ``cache_finished_req(req)``; abort: free the request's own pages of both pools
  (index >= ``cached_pages``, ids >= 0) and ``dec_lock_ref(req.last_node)``.
"""

from __future__ import annotations

import numpy as np

from cache_harness import Backend, KVOracle, numpy_backend_factory, small_geom

from hicache_jax.cache import CacheRequest, HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.cache.components import SWAComponent
from hicache_jax.reference_model.window import swa_first_needed_page, swa_pages_needed


class SaltedOracle(KVOracle):
    """``KVOracle`` with a salt: the SWA layers' KV differs from the full layers'."""

    def __init__(self, be: Backend, salt: int) -> None:
        super().__init__(be)
        self.salt = np.uint64(salt)

    def pages(self, key, first_page, npages):
        out = super().pages(key, first_page, npages)
        return {c: (a.astype(np.uint64) ^ self.salt).astype(a.dtype) for c, a in out.items()}


def make_swa_cache(
    *,
    page_size=2,
    window=5,
    device_pages=24,
    host_pages=48,
    swa_device_pages=12,
    swa_host_pages=24,
    layout="page_first",
    deferred=False,
    kind="mha",
    swa_deferred=None,
    agreement=None,
    sidecars=None,
    **cfg,
):
    """A cache with an SWA component: ``(cache, full backend, swa backend, swa component)``.
    ``agreement``: the cache's (several ranks); ``sidecars``: name -> a sidecar backend's
    engine (e.g. a draft's KV, sharing the full page ids)."""
    geom = small_geom(page_size, kind)
    full = numpy_backend_factory(geom, device_pages, host_pages, layout, deferred)
    swa_be = numpy_backend_factory(
        small_geom(page_size, kind, layers=1),
        swa_device_pages,
        swa_host_pages,
        layout,
        deferred if swa_deferred is None else swa_deferred,
    )
    swa = SWAComponent(swa_be.engine, swa_be.device.allocator, window)
    cfg.setdefault("load_back_threshold", 0)
    cache = HiRadixCache(
        HiCacheConfig(page_size=page_size, **cfg),
        full.engine,
        full.device.allocator,
        sidecars,
        components=[swa],
        agreement=agreement,
    )
    return cache, full, swa_be, swa


def insert_with_frontier(cache, drv, k, frontier_page):
    """Insert ``k`` on the device with SWA pages from page ``frontier_page`` on (the window's
    pages; -1 before them), every page's bytes written through ``drv`` first."""
    n = len(k) // cache.page_size
    full = cache.alloc_device(n)
    sw = cache.alloc_component("swa", n - frontier_page)
    drv.full.write(k, full)
    ids = np.full(n, -1, np.int32)
    ids[frontier_page:] = sw
    for i in range(frontier_page, n):
        drv.sw.write(k, np.array([ids[i]]), i)
    return cache.insert(k, full, component_pages={"swa": ids})


class SWADriver:
    """Serves requests through the cache the way an engine must (module docstring), writing
    oracle bytes as the forward passes would and checking every byte it is served."""

    def __init__(self, cache: HiRadixCache, full: Backend, swa_be: Backend, swa: SWAComponent) -> None:
        self.cache, self.full_be, self.swa_be, self.swa = cache, full, swa_be, swa
        self.full = KVOracle(full)
        self.sw = SaltedOracle(swa_be, 0x5A5A5A5A)
        self.p = cache.page_size
        self.w = swa.window

    # ------------------------------------------------------------------ checks
    def window_first_page(self, n_tokens: int) -> int:
        """The first page a step starting at ``n_tokens`` reads in the SWA layers: the model's
        own arithmetic (``reference_model.window``), not the component's."""
        return swa_first_needed_page(n_tokens, self.w, self.p)

    def check_step_reads(self, req: CacheRequest, end: int, swa_busy: set | None = None) -> None:
        """Before a step computes ``[len(req.key), end)``: every SWA page it reads below its
        start (``swa_pages_needed``, the model's rule) is in the request's SWA page table and
        holds that page's SWA KV, so what ``slide_window`` freed, the step never reads."""
        start = len(req.key)
        if not start:
            return
        sw = req.component_pages["swa"]
        p = self.p
        for i in swa_pages_needed(start, end, self.w, p):
            if i * p >= start:
                break
            pg = int(sw[i])
            assert pg >= 0, f"step [{start}, {end}) reads SWA page {i}, freed (W={self.w}, p={p}): {sw.tolist()}"
            if swa_busy is None or pg not in swa_busy:
                self.sw.check_device(req.key, np.array([pg]), i)

    def check_prefix(self, req: CacheRequest, busy: set | None = None, swa_busy: set | None = None) -> None:
        """The request's full pages hold its prefix's KV; its SWA pages cover the window before
        the prefix end and hold the SWA KV (pages named in ``busy`` are skipped: in flight)."""
        key, p = req.key, self.p
        n = req.cached_pages
        for i, pg in enumerate(req.device_pages[:n].tolist()):
            if busy is None or pg not in busy:
                self.full.check_device(key, np.array([pg]), i)
        sw = req.component_pages["swa"]
        for i in range(self.window_first_page(n * p), n):
            pg = int(sw[i])
            assert pg >= 0, f"window page {i} of {n} missing (W={self.w}, p={p}): {sw[:n].tolist()}"
            if swa_busy is None or pg not in swa_busy:
                self.sw.check_device(key, np.array([pg]), i)

    # ------------------------------------------------------------------ the call sequence
    def admit(self, key: RadixKey, load: bool = True) -> tuple[CacheRequest, object]:
        """Match all but the last token (it is always computed), load the continuation back,
        and trim the request's key to the prefix it holds (the engine's ``_match``)."""
        req, lb = self.cache.begin_request(RadixKey(key.token_ids[:-1], key.extra_key), load_back=load)
        if lb is not None:
            lb.handle.wait()  # the forward pass waits for its layers (both pools)
        req.key = RadixKey(key.token_ids[: req.device_pages.shape[0] * self.p], key.extra_key)
        return req, lb

    def alloc(self, n: int):
        """``n`` pages of both pools, or None (nothing kept) when either has no room."""
        full = self.cache.alloc_device(n)
        if full is None:
            return None
        sw = self.cache.alloc_component("swa", n)
        if sw is None:
            self.cache.device_allocator.free(full)
            return None
        return full, sw

    def extend(self, req: CacheRequest, key: RadixKey) -> bool:
        """Grow ``req`` to ``key`` (new pages of both pools; the partial last page is rewritten),
        write their KV (the forward pass), slide the window. False: no room (nothing changed)."""
        p = self.p
        need = -(-len(key) // p) - req.device_pages.shape[0]
        got = self.alloc(need) if need else (np.zeros(0, np.int32), np.zeros(0, np.int32))
        if got is None:
            return False
        full, sw = got
        if req.component_pages is not None:
            self.check_step_reads(req, len(key))
        start = len(req.key) // p  # the first page this pass writes (a partial one is rewritten)
        req.extend(key, full, {"swa": sw})
        self.full.write(key, req.device_pages[start:], start)
        spg = req.component_pages["swa"][start:]
        own = spg >= 0
        if own.any():
            idx = np.flatnonzero(own)
            for i in idx.tolist():
                self.sw.write(key, np.array([spg[i]]), start + i)
        self.cache.slide_window(req)
        return True

    def serve(self, key: RadixKey, chunk: int | None = None, out: list | None = None, unfinished: bool = True):
        """A whole request: admit, chunked prefill of ``key``, decode ``out``, finish. Returns
        the finished request's key, or None when there was no room (the request is aborted)."""
        req, _lb = self.admit(key)
        self.check_prefix(req)
        toks = key.token_ids
        pos = req.cached_pages * self.p
        chunk = chunk or max(1, len(toks))
        while pos < len(toks):
            end = min(len(toks), pos + chunk)
            if not self.extend(req, RadixKey(toks[:end], key.extra_key)):
                self.abort(req)
                return None
            pos = end
            if unfinished:
                self.cache.cache_unfinished_req(req, chunked=True)
                self.check_prefix(req)
        for t in out or []:
            toks = np.append(req.key.token_ids, t)
            if not self.extend(req, RadixKey(toks, key.extra_key)):
                self.abort(req)
                return None
        final = req.key
        self.cache.cache_finished_req(req)
        return final

    def abort(self, req: CacheRequest) -> None:
        own = req.device_pages[req.cached_pages :]
        if own.size:
            self.cache.device_allocator.free(own)
        sw = req.component_pages["swa"][req.cached_pages :]
        sw = sw[sw >= 0]
        if sw.size:
            self.swa.device_allocator.free(sw)
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)

    @staticmethod
    def own_pages(req: CacheRequest) -> tuple[int, int]:
        """(full, SWA) device pages the request holds outside the tree."""
        sw = req.component_pages["swa"][req.cached_pages :] if req.component_pages else np.zeros(0)
        return req.device_pages.shape[0] - req.cached_pages, int((sw >= 0).sum())
