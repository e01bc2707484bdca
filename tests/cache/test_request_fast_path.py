"""The request helpers insert from the request's locked node (``RequestHelpers.request_path``) instead of
walking from the root. These tests pin that shortcut to the full walk: same tree, same
pages, same locks, hits, access times, eviction order and metrics, for random request
streams with shared prefixes, duplicate continuations, chunked inserts and evictions."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache
from hicache_jax.cache import HiRadixCache, RadixKey


def _state(cache: HiRadixCache) -> list:
    """Everything observable about the tree, in a canonical order (node ids differ between caches)."""
    out = []
    stack = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for _, child in sorted(node.children.items(), key=lambda kv: repr(kv[0])):
            key = path + (child.kb,)
            out.append(
                (
                    key,
                    None if child.value is None else child.value.tolist(),
                    None if child.host_value is None else child.host_value.tolist(),
                    child.lock_ref,
                    child.host_lock_ref,
                    child.hit_count,
                    child.last_access,
                    child in cache.device_lru,
                    child in cache.host_lru,
                    child in cache.reclaim_lru,
                )
            )
            stack.append((child, key))
    out.sort(key=lambda r: r[0])
    return out


def _eviction_order(cache: HiRadixCache) -> list:
    """The order the device index would hand out its members (drains a copy of the heap)."""
    import heapq

    heap = cache.device_lru.heap_snapshot()
    heapq.heapify(heap)
    order = []
    while heap:
        entry = heapq.heappop(heap)
        node = entry[-1]
        if node in cache.device_lru.members and node.heap_stamp[0] == entry[-2]:
            order.append(entry[:-2] + (node.kb,))
    return order


def _run(cache, be, seed: int, page: int, full_walk: bool, monkeypatch) -> list:
    if full_walk:
        monkeypatch.setattr(cache.debug_view().requests, "request_path", lambda req, qb, n: (None, None, 0))
    rng = random.Random(seed)
    oracle = KVOracle(be)
    systems = [[rng.randrange(1, 50) for _ in range(3 * page)] for _ in range(2)]
    histories = [list(systems[c % 2]) for c in range(4)]
    snapshots = []
    for step in range(40):
        c = rng.randrange(4)
        histories[c].extend(rng.randrange(1, 50) for _ in range(rng.randrange(1, 3 * page)))
        prompt = RadixKey(np.array(histories[c], np.int64))
        req, lb = cache.begin_request(prompt)
        if lb is not None:
            lb.handle.wait()
        need = -(-len(prompt) // page) - req.device_pages.shape[0]
        new = cache.alloc_device(need)
        if new is None:
            if req.last_node is not None:
                cache.dec_lock_ref(req.last_node)
            snapshots.append(("skip", step))
            continue
        req.extend(prompt, new)
        oracle.write(prompt, new, req.device_pages.shape[0] - need)
        if rng.random() < 0.3:  # another request inserts the same prompt meanwhile: duplicates
            dup = cache.alloc_device(len(prompt) // page)
            if dup is not None:
                oracle.write(prompt, dup)
                cache.insert(prompt.prefix(len(prompt) // page * page), dup)
        cache.cache_unfinished_req(req, chunked=rng.random() < 0.2)
        oracle.check_device(prompt, req.device_pages[: req.cached_pages])
        answer = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 2 * page))]
        histories[c].extend(answer)
        full = RadixKey(np.array(histories[c], np.int64))
        need = -(-len(full) // page) - req.device_pages.shape[0]
        out = cache.alloc_device(need)
        if out is None:  # give the request's own pages back and drop it
            cache.device_allocator.free(req.device_pages[req.cached_pages :])
            req.device_pages = req.device_pages[: req.cached_pages]
            req.key = prompt.prefix(req.cached_pages * page)
            cache.cache_finished_req(req)
        else:
            req.extend(full, out)
            a = len(prompt) // page  # decode also fills the prompt's partial last page
            oracle.write(full, req.device_pages[a:], a)
            cache.cache_finished_req(req)
        cache.check_events()
        cache.sanity_check(0)
        snapshots.append((_state(cache), _eviction_order(cache), cache.metrics.as_dict().get("evicted_device_tokens")))
    cache.flush()
    for h in histories:
        key = RadixKey(np.array(h, np.int64))
        m = cache.match_prefix(key)
        oracle.check_device(key, m.device_indices)
    return snapshots


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_request_helpers_match_full_walk(backend_factory, monkeypatch, page, seed, policy):
    runs = []
    for full_walk in (False, True):
        cache, be = make_cache(backend_factory, page_size=page, device_pages=48, host_pages=64, write_policy=policy)
        runs.append(_run(cache, be, seed, page, full_walk, monkeypatch))
    assert runs[0] == runs[1]


def test_fast_path_is_taken_and_refused_when_the_request_disagrees(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=32)
    oracle = KVOracle(be)
    key = RadixKey(np.arange(1, 7, dtype=np.int64))
    req, _ = cache.begin_request(key)
    req.extend(key, cache.alloc_device(6))
    oracle.write(key, req.device_pages)
    cache.cache_unfinished_req(req)
    path, qb, depth = cache.debug_view().requests.request_path(req, key.token_bytes, 6)
    assert depth == 6 and path[-1] is req.last_node and qb == key.token_bytes
    # A request whose count of tree pages disagrees with its node's depth walks from the root.
    req.cached_pages = 5
    assert cache.debug_view().requests.request_path(req, key.token_bytes, 6) == (None, None, 0)
    req.cached_pages = 6
    # A key whose tokens differ from the locked path (the caller replaced req.key) walks too.
    other = RadixKey(np.arange(2, 8, dtype=np.int64))
    assert cache.debug_view().requests.request_path(req, other.token_bytes, 6) == (None, None, 0)
    cache.cache_finished_req(req)
    cache.flush()
    cache.sanity_check(0)


def test_duplicate_continuation_after_the_cached_prefix_is_replaced(backend_factory):
    """The request holds 3 tree pages; another request inserts the same continuation; the
    request's own pages there are freed and replaced by the tree's, at the right offset."""
    cache, be = make_cache(backend_factory, device_pages=32)
    oracle = KVOracle(be)
    head = RadixKey(np.arange(1, 4, dtype=np.int64))
    ids = cache.alloc_device(3)
    oracle.write(head, ids)
    cache.insert(head, ids)
    key = RadixKey(np.arange(1, 9, dtype=np.int64))
    req, _ = cache.begin_request(key)
    assert req.cached_pages == 3
    mine = cache.alloc_device(5)
    req.extend(key, mine)
    oracle.write(key, mine, 3)
    theirs = cache.alloc_device(8)
    oracle.write(key, theirs)
    cache.insert(key, theirs)  # the first 3 are duplicates of the tree's and get freed
    free_before = cache.device_allocator.available
    cache.cache_unfinished_req(req)
    tree_pages = cache.match_prefix(key).device_indices
    assert req.device_pages.tolist() == tree_pages.tolist()
    assert req.device_pages[3:].tolist() == theirs[3:].tolist()
    assert cache.device_allocator.available == free_before + 5  # the request's 5 pages came back
    oracle.check_device(key, req.device_pages)
    cache.cache_finished_req(req)
    cache.flush()
    cache.sanity_check(0)
