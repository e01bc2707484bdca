"""HiCacheConfig and RadixKey validation."""

import dataclasses

import numpy as np
import pytest

from hicache_jax.cache import EvictionPolicy, HiCacheConfig, RadixKey, WritePolicy, as_token_ids


def test_defaults_follow_upstream():
    c = HiCacheConfig()
    assert c.write_policy is WritePolicy.WRITE_THROUGH and c.write_through_threshold == 1
    assert c.eviction_policy is EvictionPolicy.LRU and c.load_back_threshold == 10
    assert HiCacheConfig(write_policy="write_through_selective").write_through_threshold == 2
    assert HiCacheConfig(write_policy="write_back").write_through_threshold is None


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"write_policy": "write_around"}, ValueError, "write_policy"),
        ({"eviction_policy": "slru"}, ValueError, "eviction_policy"),  # fifo, mru and priority are offered now
        ({"page_size": 0}, ValueError, "page_size"),
        ({"page_size": 1.0}, TypeError, "page_size"),
        ({"page_size": True}, TypeError, "page_size"),
        ({"write_through_threshold": 0}, ValueError, "write_through_threshold"),
        ({"load_back_threshold": -1}, ValueError, "load_back_threshold"),
        ({"host_reclaim": 1}, TypeError, "host_reclaim"),
    ],
)
def test_bad_config(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        HiCacheConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HiCacheConfig().page_size = 2


def test_radix_key():
    k = RadixKey([1, 2, 3], "lora", "salt")
    assert k.token_ids.dtype == np.int64 and len(k) == 3 and k.namespace == ("lora", "salt")
    assert k.prefix(2).token_ids.tolist() == [1, 2] and k.prefix(2).namespace == k.namespace
    assert RadixKey(np.array([1, 2], np.int32)).token_ids.dtype == np.int64
    assert len(RadixKey([])) == 0
    with pytest.raises(TypeError, match="extra_key"):
        RadixKey([1], ["unhashable"])
    with pytest.raises(TypeError, match="token_ids"):
        as_token_ids([1, None])
    with pytest.raises(TypeError, match="token_ids"):
        as_token_ids(np.array([1.0]))
