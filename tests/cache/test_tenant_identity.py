"""Issue 21 point 4: tenant identity (``extra_key`` / ``cache_salt``) is one type-aware rule in
every tier. The tree (L1/L2) and L3's key namespace both use ``RadixKey.namespace``, the
canonical typed encoding: ``True``, ``1`` and ``1.0`` are three tenants, ``numpy.int64(1)``
and ``1`` one; values without a stable encoding are refused when the key is built."""

import itertools

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, prefill_insert
from hicache_jax.cache import RadixKey
from hicache_jax.cache.radix_key import canonical_namespace_value, encode_namespace

# Values Python's == conflates (or separates) differently from a typed identity.
VALUES = [None, True, 1, 1.0, "1", b"1", 0, False, 0.0, -0.0, (1,), (True,), ("1",), (1, (b"x", 2.5))]


def seq(n, ns=None, salt=None):
    return RadixKey(np.arange(100, 100 + n, dtype=np.int64), ns, salt)


@pytest.mark.parametrize(
    "a, b", [(True, 1), (1, 1.0), (True, 1.0), (0, False), (0.0, -0.0), ((1,), (True,)), (False, 0.0)]
)
@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
def test_equal_under_python_eq_are_different_tenants(backend_factory, a, b, field):
    assert a == b  # Python's == conflates them; the cache must not
    cache, be = make_cache(backend_factory, page_size=4)
    prefill_insert(cache, KVOracle(be), seq(8, **{"ns" if field == "extra_key" else "salt": a}))
    assert cache.match_prefix(seq(8, **{"ns" if field == "extra_key" else "salt": a})).device_hit_length == 8
    assert cache.match_prefix(seq(8, **{"ns" if field == "extra_key" else "salt": b})).device_hit_length == 0
    assert cache.peek_prefix(seq(8, **{"ns" if field == "extra_key" else "salt": b})) == (0, 0)
    # Inserting under the other tenant makes a second node, not a duplicate of the first.
    prefill_insert(cache, KVOracle(be), seq(8, **{"ns" if field == "extra_key" else "salt": b}))
    assert len(cache.root.children) == 2
    cache.sanity_check(0)


def test_numpy_scalars_are_the_python_tenant(backend_factory):
    cache, be = make_cache(backend_factory, page_size=4)
    prefill_insert(cache, KVOracle(be), seq(8, np.int64(7), np.float64(2.5)))
    assert cache.match_prefix(seq(8, 7, 2.5)).device_hit_length == 8
    assert cache.match_prefix(seq(8, np.int32(7), np.float32(2.5))).device_hit_length == 8
    assert cache.match_prefix(seq(8, bytearray(b"x"))).device_hit_length == 0
    prefill_insert(cache, KVOracle(be), seq(8, b"x"))
    assert cache.match_prefix(seq(8, bytearray(b"x"))).device_hit_length == 8


def test_tree_identity_and_l3_encoding_agree():
    """Two values are one tenant in the tree exactly when L3 encodes them the same way."""
    for a, b in itertools.product(VALUES, repeat=2):
        for salt in ("", "s"):
            ka, kb = RadixKey([1], a), RadixKey([1], b)
            same_tree = ka.namespace == kb.namespace and hash(ka.namespace) == hash(kb.namespace)
            same_l3 = encode_namespace(salt, ka.namespace) == encode_namespace(salt, kb.namespace)
            assert same_tree == same_l3, (a, b)
            assert same_tree == (a is b or (type(a) is type(b) and repr(a) == repr(b))), (a, b)


def test_encoding_matches_the_l3_controllers_for_the_values_it_accepted():
    """The L3 key strings stay what ``l3.controller.encode_namespace`` wrote for raw values,
    so data already in a store keeps its keys once L3 encodes the canonical namespace."""
    expected = {
        (None, None): "",
        ("lora", None): '["",[{"s":"lora"},null]]',
        (1, "u7"): '["",[{"i":1},{"s":"u7"}]]',
        (True, None): '["",[{"b":true},null]]',
        (1.5, b"\x01"): '["",[{"f":"1.5"},{"x":"01"}]]',
        ((1, "a"), None): '["",[{"t":[{"i":1},{"s":"a"}]},null]]',
    }
    for (extra, salt), want in expected.items():
        assert encode_namespace("", RadixKey([1], extra, salt).namespace) == want
    assert encode_namespace("m", RadixKey([1]).namespace) == '["m",[null,null]]'


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {1}, object(), frozenset([1]), (1, [2])])
@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
def test_values_without_a_stable_encoding_are_refused(bad, field):
    with pytest.raises(TypeError, match=field):
        RadixKey([1, 2], **{field: bad})
    with pytest.raises(TypeError, match=field):
        canonical_namespace_value(bad, field)


def test_default_namespace_and_strings_are_unchanged():
    assert RadixKey([1]).namespace == (None, None)
    assert RadixKey([1], "lora", "salt").namespace == ("lora", "salt")
    assert RadixKey([1], "lora", "salt").prefix(1).namespace == ("lora", "salt")
