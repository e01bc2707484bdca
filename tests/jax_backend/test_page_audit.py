"""``PageAudit`` on its own: what counts as a match, a mismatch and an unknown page (the engine's
use of it is in test_engine_deterministic.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.backends.jax import JaxDevicePool
from hicache_jax.engine.page_audit import PageAudit
from hicache_jax.kv_geometry import KVGeometry

PAGE = 4


@pytest.fixture(scope="module")
def pool():
    return JaxDevicePool(KVGeometry.mha(2, PAGE, 2, 8, "float32"), 16)


def _fill(pool, ids, seed):
    rng = np.random.default_rng(seed)
    for c in pool.geom.components:
        shape = (pool.geom.num_layers, len(ids)) + pool.geom.page_shape
        pool.write_pages_host(c, np.asarray(ids), rng.standard_normal(shape).astype(np.float32))


def test_served_pages_match_what_was_computed_for_their_prefix(pool):
    audit = PageAudit(PAGE)
    key = np.arange(3 * PAGE)
    _fill(pool, [0, 1, 2], seed=1)
    audit.record([pool], key, np.array([0, 1, 2]), 0, 3)
    assert audit.check([pool], key, np.array([0, 1, 2]), ["device", "host", "storage"], 0) == []
    # A recomputation of the same prefix that rounds differently: both versions are legitimate.
    _fill(pool, [3], seed=2)
    audit.record([pool], key, np.array([0, 3]), 1, 2)
    assert audit.check([pool], key, np.array([0, 3]), ["host", "host"], 1) == []
    # The right pages in another order, and a page of garbage: mismatches, per tier.
    assert audit.check([pool], key, np.array([1, 0, 2]), ["device", "host", "host"], 2) == [0, 1]
    _fill(pool, [4], seed=3)
    assert audit.check([pool], key, np.array([0, 1, 4]), ["storage"] * 3, 3) == [2]
    # Another prefix whose pages were never computed here: unknown, not a match.
    other = key + 1
    assert audit.check([pool], other, np.array([0]), ["storage"], 4) == []
    s = audit.stats()
    assert s["pages_mismatched"] == {"device": 1, "host": 1, "storage": 1}
    assert s["pages_unknown"] == {"device": 0, "host": 0, "storage": 1}
    assert s["requests_mismatched"] == 2 and s["first_mismatches"] == [[2, 0, "device"], [3, 2, "storage"]]
    assert s["byte_identical"] is False and s["pages_recorded"] == 4


def test_a_page_is_named_by_its_whole_prefix(pool):
    """Page 1 after prefix A is not page 1 after prefix B, even with the same tokens in it."""
    audit = PageAudit(PAGE)
    a = np.arange(2 * PAGE)
    b = np.concatenate([a[:PAGE] + 100, a[PAGE:]])
    _fill(pool, [5, 6], seed=4)
    audit.record([pool], a, np.array([5, 6]), 0, 2)
    _fill(pool, [7, 8], seed=5)
    audit.record([pool], b, np.array([7, 8]), 0, 2)
    assert audit.check([pool], b, np.array([7, 6]), ["host", "host"], 0) == [1]
    assert PageAudit(PAGE).byte_identical is None  # nothing checked yet


def test_submitted_reads_see_the_bytes_at_submission_and_compare_in_order(pool):
    """The engine's deferred form: a submitted page read captures the bytes the page held when
    it was submitted (a later overwrite changes nothing), a check compares against every record
    submitted before it, and nothing is compared until ``settle`` (or ``stats``)."""
    audit = PageAudit(PAGE)
    key = np.arange(2 * PAGE)
    _fill(pool, [9, 10], seed=6)
    audit.submit_record([pool], key, np.array([9, 10]), 0, 2)
    audit.submit_check([pool], key, np.array([9, 10]), ["host", "storage"], 0)  # the same bytes: a match
    _fill(pool, [10], seed=7)  # page 10 overwritten after both were submitted
    audit.submit_check([pool], key, np.array([9, 10]), ["device", "device"], 1)  # now page 1 differs
    assert audit.pending == 3 and audit._counts.recorded == 0  # nothing compared yet
    audit.settle()
    assert audit.pending == 0
    s = audit.stats()
    assert s["pages_recorded"] == 2 and s["pages_checked"] == {"device": 2, "host": 1, "storage": 1}
    assert s["pages_mismatched"] == {"device": 1, "host": 0, "storage": 0}
    assert s["first_mismatches"] == [[1, 1, "device"]]
    # A check submitted before the record it would need finds no digest: unknown, not a match.
    late = PageAudit(PAGE)
    late.submit_check([pool], key + 7, np.array([9]), ["host"], 0)
    late.submit_record([pool], key + 7, np.array([9]), 0, 1)
    assert late.stats()["pages_unknown"]["host"] == 1


def test_pending_reads_past_the_bound_settle_at_once(pool):
    audit = PageAudit(PAGE, max_pending_bytes=0)
    _fill(pool, [11], seed=8)
    audit.submit_record([pool], np.arange(PAGE), np.array([11]), 0, 1)
    assert audit.pending == 0 and audit._counts.recorded == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [({"page_size": 0}, "page_size"), ({"page_size": PAGE, "max_pending_bytes": -1}, "max_pending_bytes")],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageAudit(**kwargs)
