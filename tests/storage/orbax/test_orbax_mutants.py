"""Orbax store rules that only a targeted scenario can see (issue 28 point 2's surviving
mutants): a store holding exactly ``capacity_bytes`` keeps every segment (the bound is "at
most", so ``>`` and not ``>=`` decides eviction), and ``integrity="sampled"`` at sample rate 1.0
checks every page: a corrupted page is a miss, never the wrong bytes.

Each test was seen failing with its mutant applied (see the issue-28 report)."""

import numpy as np
import pytest

from hicache_jax import HostKVPool
from hicache_jax.storage import PageCodec

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store
from test_orbax_store import _page_location, _read_back, _seg_dirs

pytest.importorskip("orbax.checkpoint")


def _write(tmp_path, n=8, **cfg):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 31)
    keys = keys_for(n, seed=32)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, **cfg)
    for lo in range(0, n, 4):  # one segment per batch: the capacity check runs after each save
        assert all(st.batch_set(keys[lo : lo + 4], range(lo, lo + 4)))
        assert st.flush(60)
    return st, src, keys


@pytest.mark.parametrize("slack,kept", [(0, 8), (-1, 4)], ids=["exactly-at-capacity", "one-byte-over"])
def test_a_store_at_exactly_its_capacity_keeps_every_segment(tmp_path, slack, kept):
    page_bytes = PageCodec(HostKVPool(GEOM, 1, "page_first")).page_bytes
    st, src, keys = _write(tmp_path, capacity_bytes=8 * page_bytes + slack)
    assert st.stored_bytes == kept * page_bytes
    assert st.metrics.segments_evicted == (8 - kept) // 4
    flags, dst = _read_back(st, keys)
    assert flags == [False] * (8 - kept) + [True] * kept  # the oldest segment goes first
    assert_pages_equal(src, range(8 - kept, 8), dst, range(8 - kept, 8))
    st.close()


def test_sampled_integrity_at_rate_one_catches_a_corrupted_page(tmp_path):
    st, src, keys = _write(tmp_path, integrity="sampled", integrity_sample_rate=1.0)
    f, off = _page_location(_seg_dirs(tmp_path)[0], st.codecs["target"].pack(np.array([2]))[0].tobytes())
    with open(f, "r+b") as fh:
        fh.seek(off + 100)
        b = fh.read(1)
        fh.seek(off + 100)
        fh.write(bytes([b[0] ^ 0x01]))
    flags, dst = _read_back(st, keys)
    assert flags[2] is False
    assert not dst.read_pages("k", [2]).any()  # never the wrong bytes
    assert_pages_equal(src, range(4, 8), dst, range(4, 8))
    assert st.metrics.snapshot()["corrupt"] >= 1
    st.close()
