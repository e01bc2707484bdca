"""Contents listeners (``HiCacheStorage.add_listener``): folding what a store reports gives
exactly the keys it holds, evictions for capacity included; the argument checks; nothing is
called without a listener."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from hicache_jax import HostKVPool
from hicache_jax.storage import PoolSpec

from storage_helpers import GEOM, fill_random, keys_for, make_store


class Folded:
    """What a listener learns: (pool, key) pairs, folded from the calls in order."""

    def __init__(self) -> None:
        self.keys: set = set()
        self.calls: list = []
        self.threads: set = set()

    def __call__(self, kind: str, pool: str, keys: list) -> None:
        import threading

        assert kind in ("stored", "removed") and keys and all(len(k) == 32 for k in keys)
        self.calls.append((kind, pool, list(keys)))
        self.threads.add(threading.current_thread().name)
        for k in keys:
            if kind == "stored":
                self.keys.add((pool, k))
            else:
                self.keys.discard((pool, k))


def held(st, pool: str, keys: list) -> set:
    there = st.exists_each(keys, pool)
    assert there is not None
    return {(pool, k) for k, t in zip(keys, there) if t}


@pytest.mark.parametrize("seed", [0, 1])
def test_folded_reports_equal_the_stores_contents_through_capacity_evictions(backend, tmp_path, seed):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, seed)
    keys = keys_for(40, seed=seed)
    rng = random.Random(seed)
    with make_store(backend, tmp_path, {"target": src}, segment_pages=4) as probe:
        page = probe.codecs["target"].page_bytes
    cap = 10 * (page + 64)  # about ten pages (the file store counts its 64-byte headers)
    with make_store(
        backend, tmp_path / "s", {"target": src}, capacity_bytes=cap, segment_pages=4, refresh_interval_s=0
    ) as st:
        seen = Folded()
        st.add_listener(seen)
        for step in range(30):
            n = rng.randrange(1, 6)
            ks = rng.sample(keys, n)
            st.batch_set(ks, rng.sample(range(16), n))
            if step % 5 == 4:
                assert st.flush(30)
                assert seen.keys == held(st, "target", keys), f"step {step}"
        assert st.flush(30)
        assert seen.keys == held(st, "target", keys)
        m = st.metrics.snapshot()
        assert m["pages_evicted"] > 0  # the bound was hit: removals were reported, not just stores
        assert any(kind == "removed" for kind, _, _ in seen.calls)


def test_one_write_past_the_capacity_reports_its_store_before_the_eviction(tmp_path):
    """A memory store bounded to one page: a write of three pages keeps only the last; the
    reports come in the order of effect (stored, then removed), so the fold holds that one."""
    src = HostKVPool(GEOM, 4, "page_first")
    with make_store("memory", tmp_path, {"target": src}) as probe:
        page = probe.codecs["target"].page_bytes
    keys = keys_for(3)
    with make_store("memory", tmp_path, {"target": src}, capacity_bytes=page) as st:
        seen = Folded()
        st.add_listener(seen)
        st.batch_set(keys, [0, 1, 2])
        assert seen.calls == [("stored", "target", keys), ("removed", "target", keys[:2])]
        assert seen.keys == {("target", keys[2])} == held(st, "target", keys)


def test_a_corrupt_page_dropped_on_read_is_reported_removed(tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 3)
    keys = keys_for(2)
    with make_store("memory", tmp_path, {"target": src}) as st:
        seen = Folded()
        st.add_listener(seen)
        st.batch_set(keys, [0, 1])
        st._corrupt_for_test("target", keys[1])
        assert st.batch_get(keys, [2, 3]) == [True, False]
        assert seen.calls[-1] == ("removed", "target", [keys[1]])
        assert seen.keys == {("target", keys[0])} == held(st, "target", keys)


def test_file_quarantine_is_reported_and_a_file_left_in_place_is_not(tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 4)
    keys = keys_for(2)
    with make_store("file", tmp_path, {"target": src}) as st:
        seen = Folded()
        st.add_listener(seen)
        st.batch_set(keys, [0, 1])
        path = st._path("target", keys[0])
        with open(path, "r+b") as f:  # flip a page byte: a CRC mismatch
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        assert st.batch_get(keys, [2, 3]) == [False, True]
        assert seen.calls[-1] == ("removed", "target", [keys[0]])
        assert seen.keys == {("target", keys[1])} == held(st, "target", keys)


def test_pools_are_named_and_listeners_fan_out_in_order(tmp_path):
    pools = {"target": HostKVPool(GEOM, 4, "page_first"), "draft": HostKVPool(GEOM, 4, "page_first")}
    specs = [PoolSpec("target"), PoolSpec("draft")]
    keys = keys_for(2)
    with make_store("memory", tmp_path, pools, specs) as st:
        order = []
        a, b = Folded(), Folded()
        st.add_listener(lambda *c: order.append("a") or a(*c))
        st.add_listener(lambda *c: order.append("b") or b(*c))
        st.batch_set(keys, [0, 1], "draft")
        assert a.calls == b.calls == [("stored", "draft", keys)] and order == ["a", "b"]


def test_listener_arguments_and_removal(tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    keys = keys_for(2)
    with make_store("memory", tmp_path, {"target": src}) as st:
        assert st._notify is None  # nothing registered: each change site tests None only
        seen = Folded()
        with pytest.raises(TypeError, match="fn"):
            st.add_listener(object())
        st.add_listener(seen)
        with pytest.raises(ValueError, match="already"):
            st.add_listener(seen)
        st.remove_listener(seen)
        assert st._notify is None
        with pytest.raises(ValueError, match="not a listener"):
            st.remove_listener(seen)
        st.batch_set(keys, [0, 1])
        assert seen.calls == []


def test_exists_each_reports_every_key_and_an_unanswerable_store_as_none(tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    keys = keys_for(3)
    with make_store("memory", tmp_path, {"target": src}) as st:
        st.batch_set([keys[1]], [0])
        assert st.exists_each(keys) == [False, True, False]  # not only the leading run
        assert st.exists_each([]) == []
        with pytest.raises(TypeError, match="keys"):
            st.exists_each(keys[0])
        with pytest.raises(ValueError, match="pool"):
            st.exists_each(keys, "nope")

        def broken(pool, ks):
            raise OSError("store gone")

        st._contains = broken
        assert st.exists_each(keys) is None  # an unknown is not an absence
        assert st.metrics.read_errors == 1


def test_file_removals_by_another_process_are_not_reported(tmp_path):
    """The documented limit: a file another process deletes goes unreported (the event source's
    probe is what finds it)."""
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 5)
    keys = keys_for(1)
    with make_store("file", tmp_path, {"target": src}) as st:
        seen = Folded()
        st.add_listener(seen)
        st.batch_set(keys, [0])
        os.unlink(st._path("target", keys[0]))
        assert st.exists_each(keys) == [False]
        assert seen.keys == {("target", keys[0])}


def test_orbax_failed_save_reports_the_accepted_pages_removed(tmp_path, monkeypatch):
    """Orbax accepts pages into a buffer (readable there: reported stored at once); a save that
    fails drops them, and the fold must lose them too."""
    import errno

    from storage_helpers import HAVE_ORBAX

    if not HAVE_ORBAX:
        pytest.skip("orbax-checkpoint / tensorstore / google-crc32c not installed")
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 6)
    keys = keys_for(4, seed=9)
    with make_store("orbax", tmp_path, {"target": src}, segment_pages=4) as st:
        seen = Folded()
        st.add_listener(seen)
        cls = type(st.writer.manager)

        def enospc(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(cls, "save", enospc)
        assert st.batch_set(keys, range(4)) == [True] * 4
        assert st.flush(60)
        assert seen.calls == [("stored", "target", keys), ("removed", "target", keys)]
        assert seen.keys == set() == held(st, "target", keys)
        assert "l3-orbax-writer" in seen.threads  # reported from the writer thread that dropped them


def test_orbax_refresh_reports_other_writers_segments_arriving_and_vanishing(tmp_path):
    """Two orbax stores on one directory (two writer directories): the reader's listener hears
    of the writer's segment when a refresh indexes it, and of its eviction when a refresh finds
    it gone."""
    from storage_helpers import HAVE_ORBAX

    if not HAVE_ORBAX:
        pytest.skip("orbax-checkpoint / tensorstore / google-crc32c not installed")
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 7)
    keys = keys_for(4, seed=10)
    more = keys_for(4, seed=11)
    w = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, refresh_interval_s=0)
    r = make_store(
        "orbax", tmp_path, {"target": HostKVPool(GEOM, 8, "page_first")}, segment_pages=4, refresh_interval_s=0
    )
    try:
        seen = Folded()
        r.add_listener(seen)
        assert all(w.batch_set(keys, range(4))) and w.flush(60)
        r.refresh()
        assert seen.calls == [("stored", "target", keys)] and seen.keys == held(r, "target", keys)
        # The writer, now bounded to one segment, evicts the first when it saves the second.
        w.config = dataclasses.replace(w.config, capacity_bytes=4 * w.codecs["target"].page_bytes)
        assert all(w.batch_set(more, range(4, 8))) and w.flush(60)
        assert w.metrics.segments_evicted == 1
        r.refresh()
        assert ("removed", "target", keys) in seen.calls
        assert seen.keys == held(r, "target", keys + more) == {("target", k) for k in more}
    finally:
        r.close()
        w.close()
