"""The hybrid reference model served through the tree's SWA call sequence, on JAX pools.

A tree-level end-to-end check of the SWA component's engine-facing API (the sequence of
``HiRadixCache``'s "Sliding-window (SWA) requests", as ``tests/cache/swa_harness.SWADriver``
runs it on numpy): the full and SWA pools are ``JaxDevicePool`` s behind
``JaxTransferEngine`` s, the model's paged step reads the page tables the cache hands out
(``req.device_pages``, ``req.component_pages["swa"]``), and the greedy tokens and logits of a
conversation served from a device hit, and from a host load-back of only the window's SWA
pages, equal those of the same prompt computed cold. Before each hit every device page the
request may not read (free pages of both pools, the tree's SWA pages out of the window) is
poisoned with NaN, so a read of a page the tree dropped or never loaded shows in the logits.
The windows are chosen so the prefix ends where the tree keeps exactly ``W - 1`` tokens of
SWA KV (``W - 1`` a page multiple, where upstream's ``>= W`` rule would keep a page more)
and where the window ends inside a page.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax import HostKVPool
from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.cache.components import SWAComponent
from hicache_jax.reference_model import ModelConfig, PagedRunner
from pallas_kernels.page_copy import PageCopyConfig

SMALL = dict(
    vocab_size=256,
    hidden=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn=64,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)
PAGE = 4
CHUNK = 8


class Served:
    """One cache over JAX pools and the model; ``serve`` runs the engine's call sequence."""

    def __init__(self, runner: PagedRunner, window: int, device_pages: int = 48, swa_device_pages: int = 24):
        cfg = runner.config
        self.runner = runner
        self.full = JaxDevicePool(cfg.kv_geometry(PAGE), device_pages)
        self.swa = JaxDevicePool(cfg.swa_kv_geometry(PAGE), swa_device_pages)
        copy = PageCopyConfig(max_pages=64)
        self.full_eng = JaxTransferEngine(self.full, HostKVPool(self.full.geom, 96), copy_config=copy)
        self.swa_eng = JaxTransferEngine(self.swa, HostKVPool(self.swa.geom, 48), copy_config=copy)
        self.comp = SWAComponent(self.swa_eng, self.swa.allocator, window)
        self.cache = HiRadixCache(
            HiCacheConfig(page_size=PAGE, load_back_threshold=0),
            self.full_eng,
            self.full.allocator,
            components=[self.comp],
        )

    def close(self):
        self.full_eng.close()
        self.swa_eng.close()

    def _step(self, req, tokens, start):
        swa_table = req.component_pages["swa"]
        logits, new, new_swa = self.runner.step(
            self.full.buffers,
            [tokens],
            [start],
            [req.device_pages],
            swa_pools=self.swa.buffers,
            swa_page_tables=[swa_table],
        )
        for pool, arrays in ((self.full, new), (self.swa, new_swa)):
            for c, layers in arrays.items():
                for layer, a in enumerate(layers):
                    pool.set_layer(c, layer, a)
        return logits[0]

    def _grow(self, req, toks, end):
        """Pages of both pools for ``toks[:end]`` (the decode allocation evicts SWA if short)."""
        need = -(-end // PAGE) - req.device_pages.shape[0]
        full = self.cache.alloc_device(need)
        sw = self.cache.alloc_component("swa", need)
        assert full is not None and sw is not None, "no room"
        req.extend(RadixKey(toks[:end]), full, {"swa": sw})

    def poison_unreadable(self, req):
        """NaN into every device page the request's next step may not read: free pages of both
        pools and the tree's SWA pages outside the request's table (after every backup landed:
        the host copies keep what the tree backed up)."""
        self.cache.flush()
        keep_swa = set(req.component_pages["swa"][req.component_pages["swa"] >= 0].tolist())
        for pool, keep in ((self.full, set(req.device_pages.tolist())), (self.swa, keep_swa)):
            owned = np.zeros(pool.allocator.num_pages, bool)
            owned[list(keep)] = True
            bad = np.flatnonzero(~owned)
            for c in pool.geom.components:
                for layer, a in enumerate(pool.layers(c)):
                    arr = np.array(a)  # on the host: no compile per index count
                    arr[bad] = np.nan
                    pool.set_layer(c, layer, jnp.asarray(arr))

    def serve(self, prompt: list, new_tokens: int, poison: bool = False):
        """Admission, chunked prefill, greedy decode, finish. Returns (tokens generated, the
        logits of the prompt's last position, tokens the prefix hit covered, the load-back's SWA
        tokens)."""
        cache = self.cache
        swa_loaded = self.comp.metrics.loaded_tokens
        req, lb = cache.begin_request(RadixKey(prompt[:-1]))
        if lb is not None:
            for layer in range(self.full.geom.num_layers):
                lb.handle.wait_layer(layer)
            for layer in range(self.swa.geom.num_layers):
                lb.handle.wait_layer(layer, component="swa")
        hit = req.cached_pages * PAGE
        req.key = RadixKey(prompt[:hit])
        if poison:
            self.poison_unreadable(req)
        toks = list(prompt)
        pos = hit
        while pos < len(toks):  # chunked prefill
            end = min(len(toks), pos + CHUNK)
            self._grow(req, toks, end)
            logits = self._step(req, toks[pos:end], pos)
            cache.slide_window(req)
            pos = end
            if pos < len(toks):
                cache.cache_unfinished_req(req, chunked=True)
        prompt_logits = logits
        out = []
        for _ in range(new_tokens):  # greedy decode
            t = int(np.argmax(logits))
            out.append(t)
            toks.append(t)
            self._grow(req, toks, len(toks))
            logits = self._step(req, [t], len(toks) - 1)
            cache.slide_window(req)
        cache.cache_finished_req(req)
        cache.sanity_check(0, {"swa": 0})
        return out, prompt_logits, hit, self.comp.metrics.loaded_tokens - swa_loaded


@pytest.mark.parametrize("window", [9, 7])  # W - 1 = 8: two whole pages; W - 1 = 6: ends inside a page
def test_hybrid_model_served_from_device_and_host_hits_equals_cold(window):
    cfg = ModelConfig(num_layers=3, layer_types="SF", sliding_window=window, **SMALL)
    runner = PagedRunner(cfg, PAGE, max_pages_per_seq=16, token_buckets=(8,))  # one table width: few compiles
    rng = np.random.default_rng(window)
    first = rng.integers(0, 256, 21).tolist()
    s = Served(runner, window)

    def cold(prompt, n):
        c = Served(runner, window)
        try:
            return c.serve(prompt, n)[:2]
        finally:
            c.close()

    try:
        out1, _, hit, _ = s.serve(first, 5)
        assert hit == 0
        follow = first + out1 + rng.integers(0, 256, 6).tolist()  # the next turn of the conversation
        want, want_logits = cold(follow, 6)
        # L1: the tree's prefix (full pages, and the SWA window before its end) on the device.
        got, logits, hit, loaded = s.serve(follow, 6, poison=True)
        assert hit == (len(first) + len(out1)) // PAGE * PAGE and loaded == 0
        assert got == want
        np.testing.assert_allclose(logits, want_logits, rtol=2e-4, atol=2e-4)
        # L2: everything leaves the device; the host copies come back, only the window's SWA pages.
        follow2 = follow + got + rng.integers(0, 256, 5).tolist()
        want, want_logits = cold(follow2, 6)
        s.cache.flush()
        s.cache.evict(s.cache.evictable_tokens)
        assert s.comp.evictable_tokens == 0 and s.full.allocator.available == s.full.allocator.num_pages
        got, logits, hit, loaded = s.serve(follow2, 6, poison=True)
        assert hit == (len(follow) + 6) // PAGE * PAGE  # the whole second conversation, from the host
        assert loaded == -(-(window - 1) // PAGE) * PAGE  # ceil((W - 1) / page) pages of SWA KV, no more
        assert got == want
        np.testing.assert_allclose(logits, want_logits, rtol=2e-4, atol=2e-4)
        s.cache.flush()
        s.cache.reset()
        for alloc in (s.full.allocator, s.swa.allocator, s.comp.host_allocator, s.cache.host_allocator):
            assert alloc.available == alloc.num_pages
    finally:
        s.close()
