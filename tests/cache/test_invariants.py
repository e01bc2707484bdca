"""Issue 21 point 12: every check of ``sanity_check`` (``invariants.collect_violations``, with
``EvictionIndex.check``, the allocators' ``check`` and the plug-in components' ``check``) has
a test that builds its violation, by corrupting nodes, counters, indexes or allocators
directly, and expects that check's own message.

Each case starts from a healthy scene (page_size 2, write_through, everything acknowledged):

    root ── A [0, 8)  (device + host)
            ├── B [0, 8) + [50, 54)   (device + host, a device leaf, reclaimable)
            └── C [0, 8) + [60, 64)   (device + host, a device leaf, reclaimable)
    root ── D [100, 108)  (host only: a host leaf)

and the in-flight cases from one with a deferred engine and a backup of E [200, 204) pending.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert, small_geom
from shadow_component import ShadowComponent

from hicache_jax.cache import CacheInvariantError, HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.cache.invariants import collect_violations

P = 2


def _scene(factory):
    cache, be = make_cache(factory, page_size=P, device_pages=32, host_pages=32)
    oracle = KVOracle(be)
    d = prefill_insert(cache, oracle, RadixKey(np.arange(100, 108))).last_node
    a = prefill_insert(cache, oracle, RadixKey(np.arange(8))).last_node
    b = prefill_insert(cache, oracle, RadixKey(np.r_[np.arange(8), 50, 51, 52, 53])).last_node
    c = prefill_insert(cache, oracle, RadixKey(np.r_[np.arange(8), 60, 61, 62, 63])).last_node
    cache.flush()
    assert cache.evict(8) == 8  # D is the least recently used leaf
    cache.flush()
    assert d.value is None and d.host_value is not None and a.value is not None
    assert b.parent is a and c.parent is a and a.parent is cache.root and d.parent is cache.root
    assert b in cache.device_lru and d in cache.host_lru and b in cache.reclaim_lru
    cache.sanity_check(0)
    return SimpleNamespace(cache=cache, be=be, view=cache.debug_view(), root=cache.root, A=a, B=b, C=c, D=d)


def _in_flight_scene(factory):
    cache, be = make_cache(factory, page_size=P, device_pages=32, host_pages=32, deferred=True)
    e = prefill_insert(cache, KVOracle(be), RadixKey(np.arange(200, 204))).last_node
    assert cache.in_flight == (1, 0) and cache.debug_view().pending() == [("backup", e)]
    cache.sanity_check(0)
    return SimpleNamespace(cache=cache, be=be, view=cache.debug_view(), root=cache.root, E=e)


def _live_entry(index, node):
    return next(e for e in index.heap_snapshot() if e[-1] is node and node.heap_stamp[index.slot] == e[-2])


def _child_key(parent, child):
    return next(k for k, v in parent.children.items() if v is child)


class FakeStorageHook:
    def __init__(self, reserved):
        self.reserved = np.asarray(reserved, np.int64)

    def reserved_host_pages(self):
        return self.reserved


def _set(obj, **fields):
    for k, v in fields.items():
        setattr(obj, k, v)


def _reserved(s, pages):
    s.cache.storage_hook = FakeStorageHook(pages)


def _free_list_duplicate(alloc):
    """A page freed twice through ``free_owned`` (whose caller vouches for distinct ids)."""
    page = alloc.alloc(1)
    alloc.free_owned(np.r_[page, page])


# (case id, corruption, the message of the one check that must report it)
CASES = [
    # ---- root and links
    ("root-parent", lambda s: _set(s.root, parent=s.D), r"root has a parent"),
    ("root-value", lambda s: _set(s.root, value=np.array([0])), r"root must hold an empty value on both tiers"),
    ("root-host-value", lambda s: _set(s.root, host_value=None), r"root must hold an empty value on both tiers"),
    ("root-unlocked", lambda s: _set(s.root, lock_ref=0), r"root must stay locked on both tiers"),
    ("root-host-unlocked", lambda s: _set(s.root, host_lock_ref=0), r"root must stay locked on both tiers"),
    ("root-key", lambda s: _set(s.root, key=np.arange(P)), r"root has a non-empty key"),
    ("shared-child", lambda s: s.C.children.__setitem__(_child_key(s.A, s.B), s.B), r"cycle or shared child at"),
    ("owner", lambda s: _set(s.B, owner=object()), r"owner is not this cache"),
    ("parent-link", lambda s: _set(s.B, parent=s.C), r"parent link does not point at"),
    ("deleted-linked", lambda s: _set(s.B, deleted=True), r"deleted node still linked"),
    (
        "key-not-page-multiple",
        lambda s: _set(s.B, key=np.arange(50, 53)),
        r"key length 3 is not a positive multiple of page_size 2",
    ),
    ("key-empty", lambda s: _set(s.B, key=np.zeros(0, np.int64)), r"key length 0 is not a positive multiple"),
    ("namespace", lambda s: _set(s.B, namespace=("tenant", None)), r"namespace .* differs from its parent's"),
    (
        "child-dict-key",
        lambda s: s.A.children.__setitem__(b"\0" * 8 * P, s.A.children.pop(_child_key(s.A, s.B))),
        r"child-dict key does not match its first page",
    ),
    (
        "root-child-dict-key",
        lambda s: s.root.children.__setitem__(
            (("other", None), _child_key(s.root, s.A)[1]), s.root.children.pop(_child_key(s.root, s.A))
        ),
        r"child-dict key does not match its first page",
    ),
    # ---- per node
    ("dead-node", lambda s: _set(s.B, value=None, host_value=None), r"dead node \(neither on device nor backed up\)"),
    ("device-page-count", lambda s: _set(s.B, value=s.B.value[:1]), r"1 device pages for 2 pages of tokens"),
    ("device-parent", lambda s: _set(s.A, value=None), r"on device but its parent .* is not"),
    ("evicted-but-locked", lambda s: _set(s.D, lock_ref=1), r"evicted but device-locked"),
    ("host-page-count", lambda s: _set(s.B, host_value=s.B.host_value[:1]), r"1 host pages for 2 pages of tokens"),
    ("contiguity", lambda s: _set(s.A, host_value=None), r"backed up but its parent .* is not \(contiguity\)"),
    ("negative-lock", lambda s: _set(s.B, lock_ref=-1), r"negative lock count"),
    ("negative-host-lock", lambda s: _set(s.D, host_lock_ref=-1), r"negative lock count"),
    ("path-lock", lambda s: _set(s.B, lock_ref=1), r"children's path locks exceed its own 0"),
    ("host-path-lock", lambda s: _set(s.B, host_lock_ref=1), r"children's host path locks exceed its own 0"),
    ("child-counters", lambda s: _set(s.A, dev_children=s.A.dev_children + 1), r"child counters \(3, 2\) != actual"),
    ("host-child-counters", lambda s: _set(s.A, host_children=0), r"child counters \(2, 0\) != actual \(2, 2\)"),
    (
        "host-only-with-children",
        lambda s: (_set(s.A, value=None), _set(s.B, host_value=None), _set(s.C, host_value=None)),
        r"host-only node with children that are not backed up",
    ),
    (
        "root-child-counters",
        lambda s: _set(s.root, dev_children=0),
        r"root: child counters \(0, 2\) != actual \(1, 2\)",
    ),
    # ---- tracking sets and their heaps (EvictionIndex.check)
    ("device-index-stale-member", lambda s: s.cache.device_lru.members.add(s.A), r"device_leaves: stale members \["),
    (
        "device-index-missing",
        lambda s: s.cache.device_lru.members.discard(s.B),
        r"device_leaves: stale members \[\], missing \[TreeNode",
    ),
    (
        "host-index-missing",
        lambda s: s.cache.host_lru.members.discard(s.D),
        r"host_leaves: stale members \[\], missing \[TreeNode",
    ),
    (
        "reclaim-index-missing",
        lambda s: s.cache.reclaim_lru.members.discard(s.C),
        r"host_reclaimable: stale members \[\], missing \[TreeNode",
    ),
    (
        "heap-two-live-entries",
        lambda s: s.cache.device_lru.inject_entry(_live_entry(s.cache.device_lru, s.B)),
        r"device_leaves: two live heap entries for",
    ),
    (
        "heap-member-without-entry",
        lambda s: s.B.heap_stamp.__setitem__(s.cache.device_lru.slot, -5),
        r"device_leaves: member .* has no live heap entry",
    ),
    ("heap-stale-priority", lambda s: _set(s.D, last_access=s.D.last_access + 1000), r"host_leaves: stale priority"),
    (
        "heap-non-member",
        lambda s: s.cache.reclaim_lru.members.discard(s.B),
        r"host_reclaimable: live heap entry for non-member",
    ),
    (
        "both-eviction-sets",
        lambda s: s.cache.host_lru.members.add(s.B),
        r"nodes in both the device and host eviction sets",
    ),
    # ---- counters
    (
        "evictable-counter",
        lambda s: s.view.inject_counter_error("evictable_tokens", 2),
        r"device counts: evictable 18 / protected 0, recomputed 16 / 0",
    ),
    (
        "protected-counter",
        lambda s: s.view.inject_counter_error("protected_tokens", -2),
        r"device counts: evictable 16 / protected -2, recomputed 16 / 0",
    ),
    ("host-counter", lambda s: s.view.inject_counter_error("host_tokens", 4), r"host tokens 28, recomputed 24"),
    # ---- pages and allocators
    (
        "device-allocator",
        lambda s: _free_list_duplicate(s.be.device.allocator),
        r"device allocator: device: duplicate ids in the free list",
    ),
    (
        "host-allocator",
        lambda s: _free_list_duplicate(s.be.host.allocator),
        r"host allocator: .*duplicate ids in the free list",
    ),
    ("device-double-owner", lambda s: _set(s.C, value=s.B.value.copy()), r"device pages held by two nodes"),
    ("host-double-owner", lambda s: _set(s.C, host_value=s.B.host_value.copy()), r"host pages held by two nodes"),
    (
        "device-page-free",
        lambda s: s.be.device.allocator.free(s.B.value[:1]),
        r"device pages in the tree but free in the allocator",
    ),
    (
        "host-page-free",
        lambda s: s.be.host.allocator.free(s.D.host_value[:1]),
        r"host pages in the tree but free in the allocator",
    ),
    (
        "device-bitmap",
        lambda s: s.view.inject_ownership_error("device", 31),
        r"device ownership bitmap disagrees with the tree at pages \[31\]",
    ),
    (
        "host-bitmap",
        lambda s: s.view.inject_ownership_error("host", int(s.B.host_value[0])),
        r"host ownership bitmap disagrees with the tree at pages",
    ),
    (
        "reserved-repeated",
        lambda s: _reserved(s, np.r_[s.be.host.allocator.alloc(1)].repeat(2)),
        r"host pages reserved by the storage controller are repeated, free or owned by the tree",
    ),
    (
        "reserved-owned",
        lambda s: _reserved(s, s.D.host_value[:1]),
        r"host pages reserved by the storage controller are repeated, free or owned by the tree",
    ),
    (
        "reserved-free",
        lambda s: _reserved(s, [31]),
        r"host pages reserved by the storage controller are repeated, free or owned by the tree",
    ),
    ("host-leak", lambda s: s.be.host.allocator.alloc(1), r"host pool memory leak detected: free 19 \+ tree 12"),
    (
        "device-pages-vs-tokens",
        lambda s: _set(s.C, value=s.B.value.copy()),
        r"device pages 6 != \(evictable \+ protected\) tokens / page_size",
    ),
    ("device-leak", lambda s: s.be.device.allocator.alloc(1), r"device pool memory leak detected: free 23 \+ tree 8"),
    # ---- several ranks
    (
        "reservation-outlives-step",
        lambda s: s.view.inject_phantom_pages(3),
        r"reservations outlive their agreement step: 0 pending, 3 phantom host pages",
    ),
    (
        "reserved-backup-outlives-step",
        lambda s: s.view.inject_reserved_backup(s.B),
        r"1 nodes still count as reserved for a backup outside an agreement",
    ),
    # ---- caller locks
    (
        "caller-locks",
        lambda s: (s.cache.inc_lock_ref(s.B), _set(s.B, lock_ref=0), _set(s.A, lock_ref=0)),
        r"1 caller locks but only 0 device path locks reach the root",
    ),
]

IN_FLIGHT_CASES = [
    ("in-flight-deleted", lambda s: _set(s.E, deleted=True), r"backup in flight on a deleted node"),
    ("in-flight-unlocked", lambda s: _set(s.E, lock_ref=0), r"backup in flight on .* without device and host locks"),
    (
        "in-flight-host-unlocked",
        lambda s: _set(s.E, host_lock_ref=0),
        r"backup in flight on .* without device and host locks",
    ),
    ("in-flight-pages-gone", lambda s: _set(s.E, host_value=None), r"backup in flight on .* whose pages are gone"),
]


def _detected(factory, scene, corrupt, message, collect=collect_violations) -> tuple[bool, list[str]]:
    s = scene(factory)
    assert collect(s.view, 0) == []
    corrupt(s)
    errs = collect(s.view, 0)
    return any(re.search(message, e) for e in errs), errs


@pytest.mark.parametrize("case, corrupt, message", CASES, ids=[c[0] for c in CASES])
def test_each_check_reports_its_violation(backend_factory, case, corrupt, message):
    found, errs = _detected(backend_factory, _scene, corrupt, message)
    assert found, f"{case}: no {message!r} among {errs}"


@pytest.mark.parametrize("case, corrupt, message", IN_FLIGHT_CASES, ids=[c[0] for c in IN_FLIGHT_CASES])
def test_each_in_flight_check_reports_its_violation(backend_factory, case, corrupt, message):
    found, errs = _detected(backend_factory, _in_flight_scene, corrupt, message)
    assert found, f"{case}: no {message!r} among {errs}"


def test_sanity_check_raises_the_violations(backend_factory):
    s = _scene(backend_factory)
    s.view.inject_counter_error("host_tokens", 4)
    _set(s.B, lock_ref=-1)
    with pytest.raises(
        CacheInvariantError,
        match=r"(?s)^[2-9] cache invariant violation\(s\):\n  .*negative lock count.*host tokens 28",
    ):
        s.cache.sanity_check(0)


def test_external_device_pages_are_counted(backend_factory):
    s = _scene(backend_factory)
    s.be.device.allocator.alloc(3)
    s.cache.sanity_check(3)
    with pytest.raises(CacheInvariantError, match=r"device pool memory leak detected: .* external 2 != total"):
        s.cache.sanity_check(2)
    s.cache.sanity_check()  # without the count, external pages are not checked


def test_component_check_joins_sanity_check():
    geom = small_geom(P)
    full, side = numpy_backend_factory(geom, 16, 32), numpy_backend_factory(geom, 16, 32)
    shadow = ShadowComponent(side.engine)
    cache = HiRadixCache(HiCacheConfig(page_size=P), full.engine, full.device.allocator, components=[shadow])
    prefill_insert(cache, KVOracle(full), RadixKey(np.arange(8)))
    cache.flush()
    cache.sanity_check(0)
    node = cache.match_prefix(RadixKey(np.arange(8))).last_device_node
    node.ext[shadow.name]["dev"] = (99,)  # the plug-in's mirror drifts from the tree
    with pytest.raises(CacheInvariantError, match=r"shadow: TreeNode.*: shadow .* != tree"):
        cache.sanity_check(0)


ALL_CASES = [(_scene, c) for c in CASES] + [(_in_flight_scene, c) for c in IN_FLIGHT_CASES]


def _mutants(source: str, call: str):
    """``source`` with its i-th ``call`` disabled (evaluates its argument, records nothing),
    for every i: one check switched off at a time."""
    starts = [m.start() for m in re.finditer(re.escape(call), source)]
    for i, at in enumerate(starts):
        yield i, source[:at] + "(lambda *_: None)(" + source[at + len(call) :]


def test_disabling_any_check_fails_a_case(monkeypatch):
    """Mutation test of this file and ``test_swa_invariants.py``: switch off each check of
    ``collect_violations`` (each ``errs.append``), of ``EvictionIndex.check`` (each
    ``errors.append``) and of the SWA component's ``check`` (each ``errs.append``) in turn;
    some case must then miss its message. So every check has a case that sees it, and a new
    check without one fails here."""
    import inspect
    import textwrap

    from test_swa_invariants import SWA_CASES, swa_detected

    from hicache_jax.cache import eviction_index, invariants
    from hicache_jax.cache.components import swa as swa_module

    def caught(collect, swa_only=False) -> bool:
        if not swa_only and any(
            not _detected(numpy_backend_factory, scene, corrupt, message, collect)[0]
            for scene, (_case, corrupt, message) in ALL_CASES
        ):
            return True
        return any(not swa_detected(corrupt, message, collect)[0] for _case, corrupt, message in SWA_CASES)

    src = inspect.getsource(invariants)
    uncaught = []
    n_checks = 0
    for i, mutant in _mutants(src, "errs.append("):
        n_checks += 1
        ns = dict(vars(invariants))
        exec(compile(mutant, invariants.__file__, "exec"), ns)
        if not caught(ns["collect_violations"]):
            uncaught.append(f"invariants.py check #{i}")
    method = textwrap.dedent(inspect.getsource(eviction_index.EvictionIndex.check))
    for i, mutant in _mutants(method, "errors.append("):
        n_checks += 1
        ns = dict(vars(eviction_index))
        exec(compile(mutant, eviction_index.__file__, "exec"), ns)
        with monkeypatch.context() as m:
            m.setattr(eviction_index.EvictionIndex, "check", ns["check"])
            if not caught(collect_violations):
                uncaught.append(f"EvictionIndex.check check #{i}")
    method = textwrap.dedent(inspect.getsource(swa_module.SWAComponent.check))
    for i, mutant in _mutants(method, "errs.append("):
        n_checks += 1
        ns = dict(vars(swa_module))
        exec(compile(mutant, swa_module.__file__, "exec"), ns)
        with monkeypatch.context() as m:
            m.setattr(swa_module.SWAComponent, "check", ns["check"])
            if not caught(collect_violations, swa_only=True):
                uncaught.append(f"SWAComponent.check check #{i}")
    assert n_checks == 45 + 24
    assert not uncaught, f"checks no case sees: {uncaught}"
