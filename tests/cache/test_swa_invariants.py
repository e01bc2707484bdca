"""Every check of the SWA component's ``check`` (its part of ``sanity_check``) has a case that
builds its violation and expects that check's own message; the mutation test in
``test_invariants.py`` switches each check off in turn and needs a case here to fail.

The scene (page_size 2, window 3 tokens = 2 pages, write_through, everything acknowledged):

    root ── A0 [0, 4)  tombstone (full on device + host, no SWA state at all)
            └── A1 [4, 8)  SWA device + host
                ├── B [.., 50..54)  SWA device + host, a caller lock (its window hold)
                └── C [.., 60..64)  SWA device + host, unlocked
    root ── D [100, 104)  host only, SWA host: in the SWA host list
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.cache import LockReceipt, RadixKey
from hicache_jax.cache.invariants import collect_violations

P = 2


def _insert(cache, drv, k, frontier):
    n = len(k) // P
    full = cache.alloc_device(n)
    sw = cache.alloc_component("swa", n - frontier)
    drv.full.write(k, full)
    ids = np.full(n, -1, np.int32)
    ids[frontier:] = sw
    for i in range(frontier, n):
        drv.sw.write(k, np.array([ids[i]]), i)
    return cache.insert(k, full, component_pages={"swa": ids}).last_node


def swa_scene(_factory=None):
    cache, full, swa_be, swa = make_swa_cache(
        page_size=P, window=4, device_pages=32, host_pages=32, swa_device_pages=16, swa_host_pages=16
    )
    drv = SWADriver(cache, full, swa_be, swa)
    d = _insert(cache, drv, RadixKey(np.arange(100, 104)), 0)
    a1 = _insert(cache, drv, RadixKey(np.arange(8)), 2)
    b = _insert(cache, drv, RadixKey(np.r_[np.arange(8), 50, 51, 52, 53]), 4)
    c = _insert(cache, drv, RadixKey(np.r_[np.arange(8), 60, 61, 62, 63]), 4)
    cache.flush()
    assert cache.evict(4) == 4  # D, the least recently used leaf
    cache.inc_lock_ref(b)
    a0 = a1.parent
    st = swa.state
    assert st(a0) is None and st(a1).dev is not None and st(b).holders and st(d).host is not None
    assert st(d) in swa.host_index and st(c) in swa.device_index and a0.parent is cache.root
    cache.sanity_check(0, {"swa": 0})
    return SimpleNamespace(
        cache=cache, swa=swa, view=cache.debug_view(), root=cache.root, A0=a0, A1=a1, B=b, C=c, D=d, st=st
    )


class FakeHook:
    def __init__(self, reserved):
        self.reserved = np.asarray(reserved, np.int64)

    def reserved_host_pages(self):
        return np.zeros(0, np.int64)

    def reserved_component_host_pages(self, name):
        return self.reserved


def _set(obj, **kw):
    for k, v in kw.items():
        setattr(obj, k, v)


def _free_list_duplicate(alloc):
    page = alloc.alloc(1)
    alloc.free_owned(np.r_[page, page])


class _Stray:
    """A hold that lists nothing."""

    states: list = []


def _any_hold(st):
    return next(iter(st.holders))


def _drop_from_hold(st):
    hold = _any_hold(st)
    hold.states.remove(st)
    st.holders.discard(hold)


SWA_CASES = [
    ("root-holds-swa", lambda s: _set(s.root, ext={"swa": s.st(s.C)}), r"the root holds SWA pages or holds"),
    ("state-owner", lambda s: _set(s.st(s.B), node=s.C), r"SWA state belongs to"),
    (
        "swa-device-without-full",
        lambda s: _set(s.st(s.D), dev=np.array([15, 14], np.int32)),
        r"SWA on the device without its full KV there",
    ),
    (
        "swa-device-page-count",
        lambda s: _set(s.st(s.C), dev=s.st(s.C).dev[:1]),
        r"1 SWA device pages for 2 pages of tokens",
    ),
    ("tombstone-locked", lambda s: _set(s.st(s.B), dev=None), r"a tombstone \(no SWA device pages\) is locked"),
    ("swa-host-without-full", lambda s: _set(s.C, host_value=None), r"SWA on the host without its full KV there"),
    (
        "swa-host-page-count",
        lambda s: _set(s.st(s.C), host=s.st(s.C).host[:1]),
        r"1 SWA host pages for 2 pages of tokens",
    ),
    ("swa-lock-exceeds-full", lambda s: _set(s.B, lock_ref=0), r"SWA lock 1 exceeds its full lock 0"),
    ("hold-does-not-list", lambda s: s.st(s.B).holders.add(_Stray()), r"held by .* which does not list it"),
    ("hold-lists-unheld", lambda s: _any_hold(s.st(s.B)).states.append(s.st(s.C)), r"lists .* without holding it"),
    (
        "device-list-missing",
        lambda s: s.swa.device_index.members.discard(s.st(s.C)),
        r"swa_device: stale members \[\], missing",
    ),
    (
        "host-list-missing",
        lambda s: s.swa.host_index.members.discard(s.st(s.D)),
        r"swa_host: stale members \[\], missing",
    ),
    (
        "both-lists",
        lambda s: s.swa.host_index.members.add(s.st(s.C)),
        r"nodes in both the SWA device and host eviction lists",
    ),
    ("counters", lambda s: _set(s.swa, evictable_tokens=s.swa.evictable_tokens + 2), r"SWA counts: evictable"),
    ("window-holds", lambda s: s.swa.on_lock(LockReceipt(s.C, None)), r"2 SWA window holds for 1 caller locks"),
    (
        "window-hold-misses",
        lambda s: _drop_from_hold(s.st(s.B)),
        r"a window hold of a caller lock on .* misses SWA pages",
    ),
    ("device-allocator", lambda s: _free_list_duplicate(s.swa.device_allocator), r"SWA device allocator: "),
    ("host-allocator", lambda s: _free_list_duplicate(s.swa.host_allocator), r"SWA host allocator: "),
    ("two-nodes", lambda s: _set(s.st(s.C), dev=s.st(s.B).dev.copy()), r"SWA device pages held by two nodes"),
    (
        "tree-page-free",
        lambda s: s.swa.device_allocator.free(s.st(s.C).dev[:1]),
        r"SWA device pages in the tree but free in the allocator",
    ),
    (
        "bitmap",
        lambda s: s.swa.dev_owned.__setitem__(15, True),
        r"SWA device ownership bitmap disagrees with the tree at pages \[15\]",
    ),
    (
        "pages-vs-tokens",
        lambda s: _set(s.st(s.C), dev=s.st(s.B).dev.copy()),
        r"SWA device pages 4 != \(evictable \+ protected\) tokens / page_size",
    ),
    ("device-leak", lambda s: s.swa.device_allocator.alloc(1), r"SWA device pool memory leak detected: free 9 \+"),
    (
        "reserved-bad",
        lambda s: _set(s.cache, storage_hook=FakeHook(s.st(s.D).host[:1])),
        r"SWA host pages reserved by the storage controller are repeated, free or owned by the tree",
    ),
    (
        "host-leak",
        lambda s: s.swa.host_allocator.alloc(1),
        r"SWA host pool memory leak detected: free 7 \+ tree 8 \+ reserved 0 != total 16",
    ),
    (
        "phantom-pages",
        lambda s: _set(s.swa, phantom_pages=2),
        r"SWA host reservations left 2 phantom pages after their step",
    ),
]


def swa_detected(corrupt, message, collect=collect_violations) -> tuple[bool, list[str]]:
    s = swa_scene()
    assert collect(s.view, 0, {"swa": 0}) == []
    corrupt(s)
    errs = collect(s.view, 0, {"swa": 0})
    return any(re.search(message, e) for e in errs), errs


@pytest.mark.parametrize("case, corrupt, message", SWA_CASES, ids=[c[0] for c in SWA_CASES])
def test_each_swa_check_reports_its_violation(case, corrupt, message):
    found, errs = swa_detected(corrupt, message)
    assert found, f"{case}: no {message!r} among {errs}"


def test_external_swa_pages_are_counted():
    s = swa_scene()
    s.swa.device_allocator.alloc(3)
    s.cache.sanity_check(0, {"swa": 3})
    with pytest.raises(Exception, match=r"SWA device pool memory leak detected: .* external 2 != total"):
        s.cache.sanity_check(0, {"swa": 2})
    s.cache.sanity_check()  # without the count, external pages are not checked
    with pytest.raises(ValueError, match="name"):
        s.cache.sanity_check(0, {"draft": 1})
