"""The agreement seam: the number of copies acknowledged per pass is what the ``Agreement``
returns (MIN over ranks in several processes), asked once per pass with a fixed topic."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, numpy_backend_factory, prefill_insert, small_geom

from hicache_jax.cache import Agreement, HiCacheConfig, HiRadixCache, RadixKey, SingleProcessAgreement


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


class CappedAgreement(Agreement):
    """Another rank that has finished at most ``cap`` copies of each queue."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls: list[tuple[str, int]] = []

    def min_count(self, topic: str, n: int) -> int:
        self.calls.append((topic, n))
        return min(n, self.cap)


def make(agreement, **cfg):
    be = numpy_backend_factory(small_geom(1), 32, 64, "page_first", True)  # deferred copies
    cache = HiRadixCache(HiCacheConfig(page_size=1, load_back_threshold=0, **cfg), be.engine, be.device.allocator,
                         agreement=agreement)
    return cache, be


def test_acknowledgements_wait_for_the_agreed_count():
    agree = CappedAgreement(0)
    cache, be = make(agree)
    oracle = KVOracle(be)
    nodes = [prefill_insert(cache, oracle, seq(100 * i, 4)).last_node for i in range(3)]
    be.complete_all()  # every copy finished on this rank
    assert cache.writing_check() == 0  # ...but the other rank has none: nothing is released
    assert agree.calls[-1] == ("backup", 3)
    assert cache.in_flight == (3, 0) and all(n.lock_ref == 1 for n in nodes)
    agree.cap = 2
    assert cache.writing_check() == 2
    assert cache.in_flight == (1, 0) and [n.lock_ref for n in nodes] == [0, 0, 1]
    agree.cap = 10
    assert cache.writing_check() == 1
    cache.sanity_check(0)


def test_loads_pass_through_the_agreement_too_and_every_pass_asks():
    agree = CappedAgreement(10)
    cache, be = make(agree)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))
    be.complete_all()
    cache.flush()
    cache.evict(100)
    m = cache.match_prefix(seq(0, 8))
    agree.cap = 0
    lb = cache.load_back(m.last_host_node)
    be.complete_all()
    n_calls = len(agree.calls)
    assert cache.loading_check() == 0 and cache.in_flight == (0, 1)
    assert agree.calls[n_calls:] == [("load", 1)]
    assert cache.writing_check() == 0  # nothing queued: the pass still asks, with 0
    assert agree.calls[-1] == ("backup", 0)
    agree.cap = 1
    assert cache.loading_check() == 1
    oracle.check_device(seq(0, 8), np.concatenate([m.device_indices, lb.device_pages]))
    cache.sanity_check(0)


def test_the_default_agreement_is_the_identity():
    assert SingleProcessAgreement().min_count("backup", 7) == 7
    cache, be = make(None)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    be.complete_all()
    assert cache.writing_check() == 1


def test_agreement_must_be_an_agreement():
    be = numpy_backend_factory(small_geom(1), 8, 16)
    with pytest.raises(TypeError, match="agreement"):
        HiRadixCache(HiCacheConfig(), be.engine, be.device.allocator, agreement=lambda topic, n: n)
