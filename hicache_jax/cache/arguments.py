"""The checks of the facade's arguments (``HiRadixCache``'s public calls): each returns the
validated value or raises ``TypeError`` / ``ValueError`` naming the argument, before the call
changes anything.

Pure Python + numpy; no state. They run on the thread of the call that uses them (the
owner's, except ``sanity_check``'s, which reads only).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .._checks import check_int
from ..allocator import PageAllocator, check_page_ids
from .components import KVComponent


def check_flag(name: str, value: object) -> bool:
    """A bool flag (``bool`` or ``numpy.bool_``); TypeError naming ``name`` otherwise (a flag
    is never taken by truthiness: ``chunked=None`` or ``block="no"`` is a caller's bug)."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def check_priority(priority: object) -> int:
    """An eviction priority: an int (not a bool)."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError(f"priority: expected an int, got {type(priority).__name__}")
    return int(priority)


def check_retain(retain: object, retention) -> object:
    """A ``retention.RetentionHint``, accepted only while retention is enabled (``retention``
    is the installed ``retention.Retention`` or None)."""
    from .retention import RetentionHint

    if not isinstance(retain, RetentionHint):
        raise TypeError(f"retain: expected a RetentionHint or None, got {type(retain).__name__}")
    if retention is None:
        raise ValueError("retain: retention is not enabled on this cache (retention.enable_retention)")
    return retain


def check_retention_config(config: object, eviction_policy: object, enabled: bool, agreed: bool) -> None:
    """``enable_retention``'s ``config``: a ``retention.RetentionConfig``, for a cache that
    evicts by LRU, has no retention yet and runs on one rank."""
    from .config import EvictionPolicy
    from .retention import RetentionConfig

    if not isinstance(config, RetentionConfig):
        raise TypeError(f"config: expected a RetentionConfig, got {type(config).__name__}")
    if EvictionPolicy.parse(eviction_policy) != EvictionPolicy.LRU:
        raise ValueError(f"config: retention orders by LRU; the cache's eviction_policy is {eviction_policy!r}")
    if enabled:
        raise ValueError("config: retention is already enabled on this cache")
    if agreed:  # expiry reads a per-process clock: ranks' trees would diverge
        raise ValueError("config: retention is not supported with a collective agreement (several ranks) yet")


def own_component(own: Mapping[str, KVComponent], name: object) -> KVComponent:
    """The component ``name`` among ``own`` (the components with their own page ids)."""
    comp = own.get(name) if isinstance(name, str) else None
    if comp is None:
        raise ValueError(f"name: expected a component with its own page ids {sorted(own)}, got {name!r}")
    return comp


def check_component_pages(own: Mapping[str, KVComponent], component_pages: object, n: int, tier: str) -> dict:
    """Validated per-component ids (int32 copies, -1 = none), one per page of the call, for
    the components among ``own``; ``tier``: ``"device"`` or ``"host"`` (whose pool's range)."""
    if not isinstance(component_pages, Mapping):
        raise TypeError(
            f"component_pages: expected a mapping of component name -> page ids, got {type(component_pages).__name__}"
        )
    out = {}
    for name, ids in component_pages.items():
        comp = own.get(name) if isinstance(name, str) else None
        if comp is None:
            raise ValueError(f"component_pages: {name!r} is not a component with its own page ids {sorted(own)}")
        what = f"component_pages[{name!r}]"
        if ids is None:
            raise TypeError(f"{what}: expected a sequence of page ids (-1: none), got None")
        arr = np.array(ids, copy=True) if not isinstance(ids, np.ndarray) else ids.copy()
        if arr.size == 0:
            arr = np.zeros(0, np.int32)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what}: expected integer page ids, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D sequence of page ids, got shape {arr.shape}")
        if arr.shape[0] != n:
            raise ValueError(f"{what}: expected {n} ids (one per page), got {arr.shape[0]}")
        alloc = comp.device_allocator if tier == "device" else comp.host_allocator
        if arr.size and (int(arr.min()) < -1 or int(arr.max()) >= alloc.num_pages):
            raise ValueError(f"{what}: ids out of range [-1, {alloc.num_pages}) (-1: no page)")
        arr = arr.astype(np.int32)
        if tier == "host":
            comp.check_host_pages(arr, what)
        out[name] = arr
    return out


def check_host_attach(
    key_len: int, start: object, host_pages: object, page_size: int, host_allocator: PageAllocator, host_owned
) -> tuple[int, np.ndarray]:
    """``insert_host``'s ``start`` and ``host_pages`` for a key of ``key_len`` tokens: a page
    multiple, with the pages inside the key; host page ids in range, each allocated and not
    owned by the tree (``host_owned``: the tree's ownership bitmap of the host pool)."""
    start = check_int("start", start, 0)
    if host_pages is None:
        raise TypeError("host_pages: expected a sequence of host page ids, got None")
    ids = check_page_ids(host_pages, host_allocator.num_pages, "host_pages")
    end = start + ids.shape[0] * page_size
    if start % page_size or end > key_len:
        raise ValueError(f"start: {start} must be a page multiple with start + pages <= {key_len} tokens")
    if ids.size:
        bad = ids[host_owned[ids] | ~host_allocator.is_allocated(ids)]
        if bad.size:
            raise ValueError(f"host_pages: {bad[:8].tolist()} are free or owned by the tree")
    return start, ids


def check_external_pages(own: Mapping[str, KVComponent], external_pages: object) -> dict[str, int]:
    """``sanity_check``'s ``external_pages``: component name (one with its own page ids) ->
    the device pages of it the caller holds."""
    if not isinstance(external_pages, Mapping):
        raise TypeError(
            f"external_pages: expected a mapping of component name -> pages, got {type(external_pages).__name__}"
        )
    return {own_component(own, k).name: check_int(f"external_pages[{k!r}]", v, 0) for k, v in external_pages.items()}
