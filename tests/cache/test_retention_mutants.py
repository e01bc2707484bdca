"""Retention behaviours no other test pinned (each seen failing with the code broken on
purpose): the weight scales the bonus, a split's upper part expires with its lower part, and
a weight of 0 is refused."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert

from hicache_jax.cache import RadixKey
from hicache_jax.cache.retention import RetentionConfig, RetentionHint, enable_retention


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup(bonus=100):
    cache, be = make_cache(numpy_backend_factory, page_size=1, device_pages=32, host_pages=64)
    clock = Clock()
    ret = enable_retention(cache, RetentionConfig(64, bonus, clock))
    return cache, be, KVOracle(be), ret, clock


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def test_a_weaker_hint_moves_a_prefix_less_far():
    """bonus = round(weight * bonus_ticks): a weight-0.1 hint (10 ticks) is overtaken by the
    unhinted prefixes used more than 10 ticks after it, a weight-1 hint (100 ticks) is not."""
    cache, be, oracle, ret, clock = setup(bonus=100)
    weak, strong = seq(0, 2), seq(100, 2)
    for k in (weak, strong):
        prefill_insert(cache, oracle, k)
    cache.insert(weak, cache.match_prefix(weak).device_indices, retain=RetentionHint(10, weight=0.1))
    cache.insert(strong, cache.match_prefix(strong).device_indices, retain=RetentionHint(10, weight=1.0))
    others = [seq(1000 + 10 * i, 2) for i in range(12)]
    for k in others:
        prefill_insert(cache, oracle, k)  # each a tick or more: past the weak bonus, not the strong one
    # Two ticks per insert: ``weak`` (tick 6 + 10) goes after others[:3] (ticks 10, 12, 14).
    cache.evict(8)
    assert cache.peek_prefix(weak)[0] == 0, "the weak hint outlived younger data: its weight was ignored"
    assert [cache.peek_prefix(k)[0] for k in others] == [0] * 3 + [2] * 9
    assert cache.peek_prefix(strong)[0] == 2
    cache.sanity_check(0)


def test_the_upper_part_of_a_split_retained_node_expires_too():
    cache, be, oracle, ret, clock = setup()
    key = seq(0, 8)
    prefill_insert(cache, oracle, key)
    cache.insert(key, cache.match_prefix(key).device_indices, retain=RetentionHint(10))
    assert ret.retained_tokens == 8
    cache.match_prefix(seq(0, 4))  # splits the retained node: two entries, same expiry
    assert ret.retained_tokens == 8
    clock.t = 100.0
    cache.evict(0)
    ret.expire()
    assert ret.retained_tokens == 0 and not ret.entries
    assert ret.stats()["expired_tokens"] == 8
    cache.sanity_check(0)


@pytest.mark.parametrize("weight", [0, 0.0, -0.5, 1.01])
def test_a_weight_outside_0_1_is_refused(weight):
    with pytest.raises(ValueError, match=r"weight: expected a number in \(0, 1\]"):
        RetentionHint(5, weight=weight)
