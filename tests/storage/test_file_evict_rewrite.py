"""The ``file`` store's capacity eviction against a rewrite of the page it evicts.

Another process may delete a page file this store still counts (its own eviction); the key is
then written again here. Eviction of the stale entry must never delete the new file: not when
the rewrite lands between the eviction's choice and its unlink (threads), and not later (the
rewrite is this store's newest page, not its oldest)."""

import os
import threading
import time

from hicache_jax import HostKVPool
import hicache_jax.storage.file as file_mod
from hicache_jax.storage.file import HEADER_BYTES

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store


def _page_path(root, key: bytes) -> str:
    h = key.hex()
    return os.path.join(str(root), "pages-v1", "target", h[:2], h + ".kv")


def _store(tmp_path, pages: int):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 7)
    probe = make_store("memory", None, {"target": src})
    file_bytes = HEADER_BYTES + probe.codecs["target"].page_bytes
    probe.close()
    st = make_store("file", tmp_path, {"target": src}, capacity_bytes=pages * file_bytes)
    return st, src


def _reads_back(st, src, key, page) -> bool:
    dst = HostKVPool(GEOM, 8, "page_first")
    st.codecs["target"].pool = dst
    try:
        if st.batch_get([key], [page]) != [True]:
            return False
        assert_pages_equal(src, [page], dst, [page])
        return True
    finally:
        st.codecs["target"].pool = src


class _PausingUnlink:
    """``os`` for ``hicache_jax.storage.file``, whose ``unlink`` of one path first runs
    ``before()`` (the test's window between an eviction's choice and its delete)."""

    def __init__(self, path: str, before) -> None:
        self._path, self._before = path, before

    def __getattr__(self, name):
        return getattr(os, name)

    def unlink(self, path, *args, **kwargs):
        if path == self._path:
            self._before()
        return os.unlink(path, *args, **kwargs)


def test_a_rewrite_landing_during_the_eviction_of_its_stale_entry_is_kept(tmp_path, monkeypatch):
    st, src = _store(tmp_path, pages=2)
    keys = keys_for(3, seed=9)
    path0 = _page_path(tmp_path, keys[0])
    events = []
    try:
        for i in (0, 1):  # one call each: keys[0] is the oldest file
            assert st.batch_set([keys[i]], [i]) == [True]
        os.unlink(path0)  # another process evicted it; st still counts it (its oldest)
        # While st evicts keys[0]'s stale entry to make room for keys[2], keys[0] is written
        # again on another thread: started when the eviction reports the removal (after it
        # chose its victims), given up to 2 s to land right before the eviction's unlink.
        rewrite = threading.Thread(target=lambda: events.append(("rewrite", st.batch_set([keys[0]], [0]))))

        def listener(kind, pool, ks):
            events.append((kind, list(ks)))
            if kind == "removed" and keys[0] in ks and rewrite.ident is None:
                rewrite.start()

        def let_the_rewrite_land():
            deadline = time.monotonic() + 2.0
            while rewrite.ident is not None and not os.path.isfile(path0) and time.monotonic() < deadline:
                time.sleep(0.005)

        st.add_listener(listener)
        monkeypatch.setattr(file_mod, "os", _PausingUnlink(path0, let_the_rewrite_land))
        assert st.batch_set([keys[2]], [2]) == [True]
        rewrite.join(30)
        monkeypatch.undo()
        assert rewrite.ident is not None and ("rewrite", [True]) in events
        # The rewrite was accepted and reported stored after the stale entry's removal: its
        # file must be there, with its page.
        last = [k for k, ks in events if k in ("stored", "removed") and keys[0] in ks][-1]
        assert last == "stored"
        assert os.path.isfile(path0), "the rewritten page was deleted"
        assert _reads_back(st, src, keys[0], 0)
        assert _reads_back(st, src, keys[2], 2)
    finally:
        st.close()


def test_a_rewritten_page_is_the_newest_not_the_next_victim(tmp_path):
    st, src = _store(tmp_path, pages=2)
    keys = keys_for(3, seed=10)
    try:
        for i in (0, 1):  # one call each: keys[0] is the oldest file
            assert st.batch_set([keys[i]], [i]) == [True]
        os.unlink(_page_path(tmp_path, keys[0]))  # evicted by another process
        assert st.batch_set([keys[0]], [0]) == [True]  # written again: now the newest page
        assert st.batch_set([keys[2]], [2]) == [True]  # over the bound: the oldest (keys[1]) goes
        assert _reads_back(st, src, keys[0], 0), "the page just written was evicted first"
        assert _reads_back(st, src, keys[2], 2)
        assert not os.path.isfile(_page_path(tmp_path, keys[1]))
    finally:
        st.close()
