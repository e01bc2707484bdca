"""The component plug-in interface: a stateful component sees every change of the tree through
its hooks, its pages ride through every transfer, its ``check`` joins ``sanity_check``, its
match validation shortens matches; stateless components' hooks never run; registration is
validated."""

from __future__ import annotations

import random

import numpy as np
import pytest
from cache_harness import Backend, KVOracle, numpy_backend_factory, prefill_insert, small_geom
from shadow_component import ShadowComponent

from hicache_jax.cache import CacheInvariantError, HiCacheConfig, HiRadixCache, KVComponent, RadixKey


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def make(shadow_cls=ShadowComponent, *, device_pages=24, host_pages=48, page_size=2, load_back_threshold=0, **cfg):
    geom = small_geom(page_size)
    full = numpy_backend_factory(geom, device_pages, host_pages)
    side = numpy_backend_factory(geom, device_pages, host_pages)
    shadow = shadow_cls(side.engine)
    cache = HiRadixCache(
        HiCacheConfig(page_size=page_size, load_back_threshold=load_back_threshold, **cfg),
        full.engine,
        full.device.allocator,
        components=[shadow],
    )
    return cache, full, side, shadow


class _Both:
    """Writes the same KV into the full and the shadow pools (what a model with two KV pools does)."""

    def __init__(self, full: Backend, side: Backend) -> None:
        self.full, self.side = KVOracle(full), KVOracle(side)

    def write(self, key, ids, first_page=0):
        self.full.write(key, ids, first_page)
        self.side.write(key, ids, first_page)

    def check_device(self, key, ids, first_page=0):
        self.full.check_device(key, ids, first_page)
        self.side.check_device(key, ids, first_page)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_stateful_component_mirrors_the_tree_through_every_path(policy):
    cache, full, side, shadow = make(write_policy=policy, host_pages=20)
    kv = _Both(full, side)
    rng = random.Random(7)
    keys = []
    for _step in range(300):
        op = rng.random()
        if op < 0.45 or not keys:  # insert a new branch or extend an old one (splits happen)
            base = rng.choice(keys) if keys and rng.random() < 0.6 else seq(rng.randrange(1000) * 100, 0)
            cut = rng.randrange(0, len(base) + 1)
            toks = np.concatenate(
                [base.token_ids[:cut], rng.randrange(1, 9) * 1000 + np.arange(2 * rng.randrange(1, 5))]
            )
            key = RadixKey(toks.astype(np.int64))
            req, lb = cache.begin_request(key)
            if lb is not None:
                lb.handle.wait()
            need = -(-len(key) // 2) - req.device_pages.shape[0]
            new = cache.alloc_device(need)
            if new is None:
                if req.last_node is not None:
                    cache.dec_lock_ref(req.last_node)
                continue
            kv.write(key, new, req.device_pages.shape[0])
            req.extend(key, new)
            cache.cache_finished_req(req)
            keys.append(key)
        elif op < 0.65:
            cache.evict(rng.randrange(1, 12))
        elif op < 0.75:
            cache.evict_host(rng.randrange(1, 12))
        else:  # a hit, loaded back and checked byte for byte in both pools
            key = rng.choice(keys)
            m = cache.match_prefix(key)
            pages = m.device_indices
            if m.host_hit_length:
                lb = cache.load_back(m.last_host_node)
                if lb is not None:
                    cache.flush()
                    pages = np.concatenate([pages, lb.device_pages])
            kv.check_device(key, pages)
        cache.flush()
        cache.sanity_check(0)
    for hook in (
        "on_split",
        "on_insert",
        "on_backup",
        "on_load",
        "on_evict_device",
        "on_evict_host",
        "on_lock",
        "on_release",
        "usable_device_nodes",
    ):
        assert shadow.calls.get(hook, 0) > 0, (hook, shadow.calls)
    cache.reset()
    assert shadow.calls["reset"] == 1
    cache.sanity_check(0)


@pytest.mark.parametrize("skipped", ["on_split", "on_insert", "on_backup", "on_load", "on_evict"])
def test_a_skipped_hook_is_caught_by_sanity_check(skipped):
    """The mirror is kept by the hooks alone: a component that ignores one drifts, and
    ``sanity_check`` (through the component's ``check``) names it."""
    cls = type("Lazy", (ShadowComponent,), {skipped: lambda self, *a: None})
    cache, full, side, shadow = make(cls, device_pages=12, host_pages=24)
    kv = _Both(full, side)
    prefill = lambda key: prefill_insert(cache, kv.full, key)  # noqa: E731
    with pytest.raises(CacheInvariantError, match="shadow"):
        prefill(seq(0, 8))
        cache.flush()
        cache.sanity_check()
        cache.match_prefix(seq(0, 4))  # split
        cache.sanity_check()
        cache.evict(100)  # demote everything
        cache.sanity_check()
        m = cache.match_prefix(seq(0, 8))
        cache.load_back(m.last_host_node)
        cache.flush()
        cache.sanity_check()
        cache.evict(100)
        cache.evict_host(100)
        cache.sanity_check()


def test_match_validation_shortens_the_usable_device_prefix():
    cache, full, side, shadow = make()
    kv = _Both(full, side)
    prefill_insert(cache, kv.full, seq(0, 4))
    prefill_insert(cache, kv.full, seq(0, 8))  # two nodes: [0, 4) and [4, 8)
    assert cache.match_prefix(seq(0, 8)).device_hit_length == 8
    shadow.max_usable_nodes = 1
    m = cache.match_prefix(seq(0, 8))
    assert m.device_hit_length == 4 and m.host_hit_length == 0
    assert m.last_device_node is m.last_host_node and len(m.last_device_node) == 4
    shadow.max_usable_nodes = 0
    m = cache.match_prefix(seq(0, 8))
    assert m.device_hit_length == 0 and m.last_device_node is cache.root


def test_stateless_components_hooks_never_run():
    class Loud(KVComponent):
        def __getattribute__(self, name):
            if name.startswith("on_") or name in ("usable_device_nodes", "check", "reset"):
                raise AssertionError(f"hook {name} ran for a stateless component")
            return object.__getattribute__(self, name)

    geom = small_geom(2)
    full = numpy_backend_factory(geom, 16, 32)
    side = numpy_backend_factory(geom, 16, 32)
    cache = HiRadixCache(
        HiCacheConfig(page_size=2), full.engine, full.device.allocator, components=[Loud("draft2", side.engine)]
    )
    oracle = KVOracle(full)
    prefill_insert(cache, oracle, seq(0, 8))
    cache.match_prefix(seq(0, 4))
    cache.flush()
    cache.evict(100)
    m = cache.match_prefix(seq(0, 8))
    cache.load_back(m.last_host_node)
    cache.flush()
    oracle.check_device(seq(0, 8), cache.match_prefix(seq(0, 8)).device_indices)
    KVOracle(side).check_device(seq(0, 0), np.zeros(0, np.int32))
    cache.reset()
    cache.sanity_check(0)


def test_component_registration_is_validated():
    geom = small_geom(2)
    full = numpy_backend_factory(geom, 16, 32)
    side = numpy_backend_factory(geom, 16, 32)
    cfg = HiCacheConfig(page_size=2)
    with pytest.raises(TypeError, match="components"):
        HiRadixCache(cfg, full.engine, full.device.allocator, components=[side.engine])
    with pytest.raises(ValueError, match="taken"):
        HiRadixCache(cfg, full.engine, full.device.allocator, components=[ShadowComponent(side.engine, name="full")])
    other = numpy_backend_factory(small_geom(1), 16, 32)
    with pytest.raises(ValueError, match="page_size"):
        HiRadixCache(cfg, full.engine, full.device.allocator, components=[ShadowComponent(other.engine)])
    with pytest.raises(ValueError, match="name"):
        ShadowComponent(side.engine, name="")
    with pytest.raises(TypeError, match="engine"):
        ShadowComponent(object())


def test_a_failed_component_copy_shows_on_the_combined_handle_and_is_retried():
    """With several components a load is one handle over all of them: a failed copy on any
    of them shows as ``error`` (what a reader checks before trusting the pages), and the
    acknowledgement retries it for every component."""
    cache, full, side, shadow = make()
    kv = _Both(full, side)
    pages = cache.alloc_device(4)  # page_size 2
    kv.write(seq(0, 8), pages)
    cache.insert(seq(0, 8), pages)
    cache.flush()
    cache.evict(100)
    full.engine.inject_failures(1, "load")
    m = cache.match_prefix(seq(0, 8))
    lb = cache.load_back(m.last_host_node)
    assert lb.handle.done() and lb.handle.error is not None  # garbage until retried
    assert cache.loading_check() == 1 and cache.metrics.transfer_retries == 1
    kv.check_device(seq(0, 8), lb.device_pages)
    cache.sanity_check(0)
