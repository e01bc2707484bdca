"""A page key held by two segments of the orbax log (two writers that each stored it before
seeing the other's segment): losing one segment must not lose the key while the other still
holds it, and the key goes (with one ``removed`` event) only when the last copy goes."""

import os
import shutil

import pytest

from hicache_jax import HostKVPool

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store


def _two_writers_sharing_a_key(tmp_path, b_capacity=0):
    """Stores ``a`` and ``b`` on one log (never refreshing on their own), both holding
    ``keys[0]``: ``a`` wrote keys 0-1, ``b`` (before indexing ``a``'s segment) keys 0 and 2,
    then ``b`` refreshed and indexed ``a``'s segment too."""
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 3)
    keys = keys_for(3, seed=5)
    a = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, refresh_interval_s=0)
    b = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, refresh_interval_s=0, capacity_bytes=b_capacity)
    assert a.batch_set(keys[:2], [0, 1]) == [True, True] and a.flush(60)
    assert b.batch_exists(keys[:1]) == 0  # b has not seen a's segment: it writes the key again
    assert b.batch_set([keys[0], keys[2]], [0, 2]) == [True, True] and b.flush(60)
    b.refresh()  # indexes a's segment (then applies b's capacity bound)
    return src, keys, a, b


def _read(store, keys, ids):
    dst = HostKVPool(GEOM, 8, "page_first")
    store.codecs["target"].pool = dst
    return store.batch_get(keys, ids), dst


@pytest.mark.parametrize("first", ["indexed", "other"])
def test_a_vanished_segment_keeps_the_keys_another_segment_holds(tmp_path, first):
    src, keys, a, b = _two_writers_sharing_a_key(tmp_path)
    assert len(b.segment_names()) == 2
    removed = []
    b.add_listener(lambda kind, pool, ks: removed.extend(ks) if kind == "removed" else None)
    try:
        segs = b.index.segments
        indexed = b.index.location("target", keys[0])[0]  # the segment the key map names
        other = next(n for n in segs if n != indexed)
        order = [indexed, other] if first == "indexed" else [other, indexed]
        only_in = {n: [k for k in keys[1:] if b.index.location("target", k)[0] == n] for n in segs}

        # The first segment vanishes (another process evicted it): b's refresh forgets it.
        shutil.rmtree(segs[order[0]].path)
        b.refresh()
        assert b.segment_names() == [order[1]]
        assert b.batch_exists(keys[:1]) == 1, "the key another live segment holds was dropped"
        flags, dst = _read(b, keys[:1], [0])
        assert flags == [True]
        assert_pages_equal(src, [0], dst, [0])  # served from the segment that is left
        assert sorted(removed) == sorted(only_in[order[0]])  # keys[0] is still stored: no event
        for k in only_in[order[0]]:
            assert b.batch_exists([k]) == 0

        # The last copy goes: now the key goes, reported once.
        shutil.rmtree(segs[order[1]].path)
        b.refresh()
        assert b.segment_names() == [] and b.batch_exists(keys[:1]) == 0
        assert sorted(removed) == sorted(keys)
        assert b.index.stored_bytes == 0
    finally:
        a.close()
        b.close()


def test_capacity_eviction_of_the_other_writers_segment_keeps_the_shared_key(tmp_path):
    """The same through the capacity bound: ``b`` (room for 3 pages) indexes ``a``'s segment
    and evicts the oldest segment, ``a``'s, which its key map names for the shared key; ``b``'s
    own segment still serves the key."""
    src, keys, a, b = _two_writers_sharing_a_key(tmp_path, b_capacity=3 * _page_bytes())
    try:
        a_name = os.path.basename(a.writer_dir)
        assert [n.split("/")[0] for n in b.segment_names()] == [os.path.basename(b.writer_dir)]
        assert b.metrics.segments_evicted == 1 and not any(n.startswith(a_name) for n in b.segment_names())
        flags, dst = _read(b, keys[:1], [0])
        assert flags == [True], "the shared key was dropped with the other writer's segment"
        assert_pages_equal(src, [0], dst, [0])
        assert b.batch_exists([keys[1]]) == 0 and b.batch_exists([keys[2]]) == 1
    finally:
        a.close()
        b.close()


def _page_bytes():
    src = HostKVPool(GEOM, 1, "page_first")
    st = make_store("memory", None, {"target": src})
    try:
        return st.codecs["target"].page_bytes
    finally:
        st.close()
