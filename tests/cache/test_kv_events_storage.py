"""KV events of the storage tier: a store bounded to a few pages evicts while a trace runs, and
the view folded from the events alone still equals what the store holds after every step
(device and host equal ``debug_view()`` as in ``test_kv_events``); what a store cannot report
(a page another process deleted) the source's probe finds; a storage queue nobody drains is
bounded."""

from __future__ import annotations

import os
import time
import types

import pytest
from test_kv_events import OPS, WEIGHTS, Trace, stored_keys

from hicache_jax.cache import event_source
from hicache_jax.cache.event_source import KVEventSource
from hicache_jax.cache.events import TierContents

CAPACITY_PAGES = 6


def _page_bytes(t: Trace) -> int:
    return t.ctl.storage.codecs["target"].page_bytes


def _bounded_trace(seed: int, backend: str, tmp_path) -> Trace:
    """A trace whose store holds about ``CAPACITY_PAGES`` pages (sized from a first store)."""
    probe = Trace(seed, storage={"backend": backend, "path": None if backend == "memory" else str(tmp_path / "p")})
    page = _page_bytes(probe) + (64 if backend == "file" else 0)  # the file store counts its headers
    probe.close()
    path = None if backend == "memory" else str(tmp_path / "s")
    return Trace(seed, storage={"backend": backend, "path": path, "capacity_bytes": CAPACITY_PAGES * page})


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_a_bounded_store_evicts_and_the_events_alone_rebuild_it_after_every_step(backend, tmp_path):
    t = _bounded_trace(7, backend, tmp_path)
    try:
        for _i in range(160):
            op = t.rng.choices(OPS, WEIGHTS)[0]
            t.do(op)
            t.check(settle=True)  # L3 writes flushed, then exact (device, host, storage)
        removed = sum(len(e.keys) for e in t.events if e.tier == "storage" and e.kind == "removed")
        stored = sum(len(e.keys) for e in t.events if e.tier == "storage" and e.kind == "stored")
        held = stored_keys(t.ctl.storage)
        assert t.view.keys("storage") == held and 0 < len(held) <= CAPACITY_PAGES
    finally:
        t.close()
    m = t.ctl.storage.metrics.snapshot()
    # Evictions happened, and every one reached the view as an event.
    assert m["pages_evicted"] > 10 and removed >= m["pages_evicted"] and stored > CAPACITY_PAGES


def _probed_source_after_four_inserts(t: Trace, **probe) -> None:
    """Replace the trace's event source by one whose storage observation probes (``probe``),
    then insert four conversations and flush them to storage; the view matches the cache."""
    t.src.close()
    t.src = KVEventSource(t.cache, model="tiny", engine="e0")
    t.src.observe_storage(t.ctl.storage, **probe)
    t.view = TierContents()
    t.view.apply(t.src.drain())
    for _ in range(4):
        t.do("insert")
    t.do("flush")
    t.check()


def test_a_page_deleted_behind_the_stores_back_is_found_by_the_probe(tmp_path):
    """Another process (or Mooncake's own eviction) removes a page this store cannot report:
    ``probe_pages`` asks the store at a drain and reports it removed."""
    t = Trace(8, storage={"backend": "file", "path": str(tmp_path)})
    try:
        _probed_source_after_four_inserts(t, probe_pages=64, probe_interval_s=0)
        held = stored_keys(t.ctl.storage)
        assert held and t.view.keys("storage") == held
        victim = sorted(held)[0]
        os.unlink(t.ctl.storage._path("target", victim))  # as another process evicting it
        b = t.src.drain()
        t.view.apply(b)
        assert [(e.kind, e.tier, e.keys) for e in b.events] == [("removed", "storage", (victim,))]
        assert t.view.keys("storage") == held - {victim} == stored_keys(t.ctl.storage)
        assert t.src.stats()["storage_probe_removed_pages"] == 1
        # A store that cannot answer reports nothing missing (an unknown is not an absence).
        t.ctl.storage._contains = lambda pool, keys: (_ for _ in ()).throw(OSError("gone"))
        assert t.src.drain().events == ()
    finally:
        t.close()


def test_the_probe_waits_its_interval_and_checks_only_its_last_pages(tmp_path, monkeypatch):
    t = Trace(9, storage={"backend": "memory"})
    try:
        _probed_source_after_four_inserts(t, probe_pages=2, probe_interval_s=3600)
        last = t.src.probed_pages(t.ctl.storage)
        assert len(last) == 2  # bounded: the two pages reported last
        for k in last:
            del t.ctl.storage._pages[("target", k)]  # behind the store's back: nothing reported
        assert t.src.drain().events == ()  # not due yet
        real = time.monotonic
        monkeypatch.setattr(event_source, "time", types.SimpleNamespace(monotonic=lambda: real() + 7200))
        b = t.src.drain()
        assert [(e.kind, e.tier, e.keys) for e in b.events] == [("removed", "storage", last)]
    finally:
        t.close()


def test_a_probe_is_due_once_exactly_its_interval_has_passed(monkeypatch):
    clock = [1000.0]  # the source's monotonic clock, frozen and moved by hand
    monkeypatch.setattr(event_source, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    t = Trace(11, storage={"backend": "memory"})
    try:
        _probed_source_after_four_inserts(t, probe_pages=2, probe_interval_s=5.0)
        last = t.src.probed_pages(t.ctl.storage)
        for k in last:
            del t.ctl.storage._pages[("target", k)]
        clock[0] = 1004.75
        assert t.src.drain().events == ()  # a quarter second early
        clock[0] = 1005.0
        assert [(e.kind, e.tier, e.keys) for e in t.src.drain().events] == [("removed", "storage", last)]
    finally:
        t.close()


def test_a_storage_queue_nobody_drains_is_bounded_and_the_receiver_forgets(tmp_path):
    t = Trace(10, max_pending=4, storage={"backend": "memory"})
    try:
        for _ in range(8):
            t.do("insert")
        t.do("flush")  # many storage changes queued, nobody drained
        assert t.src.stats()["storage_changes_queued"] <= 4 + 1
        b = t.src.drain()
        kinds = [(e.kind, e.tier) for e in b.events]
        assert ("cleared", "storage") in kinds
        t.view.apply(b)
        # It under-reports (never over-reports): what it kept is held.
        assert t.view.keys("storage") <= stored_keys(t.ctl.storage)
    finally:
        t.close()
