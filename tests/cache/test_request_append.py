"""``CacheRequest.append``: a decode step's tokens added in O(new tokens), the key joined when
it is read. The request and the tree end up as ``extend`` with the grown key leaves them
(driven side by side on two caches, KV bytes checked); bad input raises naming the argument
and changes neither the request nor the cache."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from swa_harness import SWADriver, make_swa_cache
from test_bad_input import snapshot
from test_request_fast_path import _eviction_order, _state

from hicache_jax.cache import CacheRequest, RadixKey


def _request_state(req: CacheRequest) -> tuple:
    cp = req.component_pages
    return (
        req.num_tokens,
        req.key.token_ids.tolist(),
        req.key.namespace,
        req.device_pages.tolist(),
        req.cached_pages,
        None if cp is None else {k: v.tolist() for k, v in sorted(cp.items())},
        req.last_node.kb if req.last_node is not None else None,
    )


def _counters(cache) -> dict:
    """The cache's metrics but the measured durations (they differ from run to run)."""
    return {k: v for k, v in cache.metrics.as_dict().items() if "seconds" not in k}


def _serve(cache, be, seed: int, page: int, use_append: bool) -> list:
    """Conversations on one cache: prompt (``extend``), decode one token at a time (``append``
    or ``extend`` with the grown key), now and then ``cache_unfinished_req`` mid-decode, then
    ``cache_finished_req``. Returns what each step left observable."""
    rng = random.Random(seed)
    oracle = KVOracle(be)
    histories = [[rng.randrange(0, 40) for _ in range(2 * page)] for _ in range(3)]
    log = []
    for step in range(30):
        c = rng.randrange(3)
        histories[c] += [rng.randrange(0, 40) for _ in range(rng.randrange(1, 2 * page))]
        prompt = RadixKey(np.array(histories[c], np.int64), extra_key=c % 2 or None)
        req, lb = cache.begin_request(prompt)
        if lb is not None:
            lb.handle.wait()
        need = -(-len(prompt) // page) - req.device_pages.shape[0]
        new = cache.alloc_device(need)
        assert new is not None, "test pool too small"
        first = req.device_pages.shape[0]
        req.extend(prompt, new)
        oracle.write(prompt, new, first)
        cache.cache_unfinished_req(req)
        for i in range(rng.randrange(1, 3 * page)):
            token = rng.randrange(0, 2**32) if rng.random() < 0.1 else rng.randrange(0, 40)
            histories[c].append(token)
            n = len(histories[c])
            need = -(-n // page) - req.device_pages.shape[0]
            pages = cache.alloc_device(need)
            assert pages is not None, "test pool too small"
            if use_append:
                req.append([token], pages)
            else:
                req.extend(RadixKey(np.array(histories[c], np.int64), extra_key=c % 2 or None), pages)
            assert req.num_tokens == n
            if n % page == 0:  # the page is complete: its KV is written (the pass wrote each token)
                full = RadixKey(np.array(histories[c], np.int64), extra_key=c % 2 or None)
                oracle.write(full, req.device_pages[n // page - 1 : n // page], n // page - 1)
            if rng.random() < 0.15:
                cache.cache_unfinished_req(req)
                log.append(("unfinished", step, i, _request_state(req)))
        log.append(("before finish", step, _request_state(req)))
        cache.cache_finished_req(req)
        cache.check_events()
        cache.sanity_check(0)
        log.append((step, _state(cache), _eviction_order(cache), _counters(cache)))
    cache.flush()
    for c, h in enumerate(histories):
        key = RadixKey(np.array(h, np.int64), extra_key=c % 2 or None)
        m = cache.match_prefix(key)
        assert m.device_hit_length == len(h) // page * page  # every whole page was inserted
        oracle.check_device(key, m.device_indices)
    return log


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_append_leaves_the_request_and_the_tree_as_extend_does(seed, page):
    logs = []
    for use_append in (False, True):
        cache, be = make_cache(numpy_backend_factory, page_size=page, device_pages=512, host_pages=1024)
        logs.append(_serve(cache, be, seed, page, use_append))
    assert logs[0] == logs[1]


def test_append_then_finish_inserts_exactly_its_tokens_and_pages():
    p = 2
    cache, be = make_cache(numpy_backend_factory, page_size=p, device_pages=32, host_pages=32)
    oracle = KVOracle(be)
    req, _ = cache.begin_request(RadixKey([7, 8, 9]))
    req.extend(RadixKey([7, 8, 9]), cache.alloc_device(2))
    tokens = [7, 8, 9]
    for t in (10, 11, 12, 13):  # 4 decode steps: pages at 5 (the third) and ... none at 6, 7
        tokens.append(t)
        req.append([t], cache.alloc_device(-(-len(tokens) // p) - req.device_pages.shape[0]))
    assert req.num_tokens == 7 and req.device_pages.shape[0] == 4
    assert req.key.token_ids.tolist() == tokens == [7, 8, 9, 10, 11, 12, 13]
    oracle.write(req.key, req.device_pages[:3])
    pages = req.device_pages.tolist()
    tail = pages[3]
    free = be.device.allocator.available
    cache.cache_finished_req(req)
    cache.flush()
    m = cache.match_prefix(RadixKey(tokens + [99]))
    assert m.device_hit_length == 6 and m.device_indices.tolist() == pages[:3]
    oracle.check_device(RadixKey(tokens[:6]), m.device_indices)
    assert be.device.allocator.available == free + 1 and be.device.allocator.is_allocated(np.array([tail])) == [False]
    cache.sanity_check(0)


@pytest.mark.parametrize(
    "tokens",
    [[5, 6], (5, 6), np.array([5, 6]), np.array([5, 6], np.int32), np.array([5, 6], np.uint64), range(5, 7)],
    ids=["list", "tuple", "int64", "int32", "uint64", "range"],
)
def test_append_takes_any_sequence_of_token_ids(tokens):
    req = CacheRequest(RadixKey([1, 2, 3], extra_key="t"), 2, np.array([0, 1], np.int32))
    req.append(tokens, [4])
    assert req.key.token_ids.tolist() == [1, 2, 3, 5, 6] and req.key.namespace == RadixKey([], "t").namespace
    assert req.key.extra_key == "t" and req.device_pages.tolist() == [0, 1, 4]


def test_the_key_is_joined_once_and_setting_it_drops_what_was_appended():
    req = CacheRequest(RadixKey([1, 2]), 4, np.array([0], np.int32))
    req.append([3], [])
    req.append(np.array([4]), np.zeros(0, np.int32))
    req.append([], [])  # nothing: a no-op
    assert req.num_tokens == 4
    key = req.key
    assert key.token_ids.tolist() == [1, 2, 3, 4] and req.key is key  # joined once
    assert not key.token_ids.flags.writeable
    req.append([5], [9])
    assert req.key.token_ids.tolist() == [1, 2, 3, 4, 5] and key.token_ids.tolist() == [1, 2, 3, 4]
    req.append([6], [])
    req.key = RadixKey([1, 2, 3, 4, 5])  # the key as set: the appended 6 is gone
    assert req.num_tokens == 5 and req.key.token_ids.tolist() == [1, 2, 3, 4, 5]
    req.extend(RadixKey([1, 2, 3, 4, 5, 6, 7]), [])  # extend sees the appended tokens as the current ones
    req.append([8], [])
    with pytest.raises(ValueError, match="key: must extend"):
        req.extend(RadixKey([1, 2, 3, 4, 5, 6, 7, 9]), [])
    req.extend(RadixKey([1, 2, 3, 4, 5, 6, 7, 8, 9]), [10])
    assert req.key.token_ids.tolist() == list(range(1, 10)) and req.device_pages.tolist() == [0, 9, 10]


def test_a_copy_appends_on_its_own():
    req = CacheRequest(RadixKey([1, 2]), 4, np.array([0], np.int32))
    req.append([3], [])
    other = copy.copy(req)
    other.append([4], [])
    req.append([5], [])
    assert req.key.token_ids.tolist() == [1, 2, 3, 5] and other.key.token_ids.tolist() == [1, 2, 3, 4]


BAD = [
    ("a bool token", [True], [], TypeError, "tokens: expected integer token ids, got bool"),
    ("a float token", [1.0], [], TypeError, "tokens: expected integer token ids, got float"),
    ("a negative token", [-1], [], ValueError, r"tokens: token ids must be in \[0, 2\*\*32\)"),
    ("a token of 2**32", [2**32], [], ValueError, r"tokens: token ids must be in \[0, 2\*\*32\)"),
    ("uint64 above 2**63", np.array([2**63 + 5], np.uint64), [], ValueError, r"tokens: token ids must be in"),
    ("a float array", np.array([1.0]), [], TypeError, "tokens: expected integer token ids, got dtype float64"),
    ("a 2-D array", np.array([[1]]), [], ValueError, "tokens: expected a 1-D"),
    ("a string", "ab", [], TypeError, "tokens: expected a sequence of ints, got str"),
    ("None", None, [], TypeError, "tokens: expected a sequence of ints, got NoneType"),
    ("a bare int", 7, [], TypeError, "tokens: expected a sequence of ints, got int"),
    ("a page short", [1, 2, 3], [], ValueError, "new_pages: 14 tokens need 7 pages in all, the request has 6"),
    ("a page too many", [1], [5], ValueError, "new_pages: 12 tokens need 6 pages in all"),
    ("float page ids", [1, 2, 3], [1.0], TypeError, "new_pages: expected integer page ids"),
    ("2-D page ids", [1, 2, 3], [[1]], ValueError, "new_pages: expected a 1-D"),
    ("page ids beyond int32", [1, 2, 3], [2**40], ValueError, "new_pages: page id out of int32 range"),
]


@pytest.mark.parametrize("tokens, pages, exc, match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_refused_naming_the_argument_and_changes_nothing(tokens, pages, exc, match):
    p = 2
    cache, be = make_cache(numpy_backend_factory, page_size=p, device_pages=32, host_pages=32)
    prefill_insert(cache, KVOracle(be), RadixKey(np.arange(8)))
    req, _ = cache.begin_request(RadixKey(np.arange(8)))
    req.extend(RadixKey(np.arange(10)), cache.alloc_device(1))
    req.append([10], cache.alloc_device(1))  # 11 tokens, 6 pages: one appended token waits to be joined
    before = _request_state(req), snapshot(cache, be)
    with pytest.raises(exc, match=match):
        req.append(tokens, pages)
    assert (_request_state(req), snapshot(cache, be)) == before
    assert req.key.token_ids.tolist() == list(range(11))
    cache.cache_finished_req(req)
    cache.sanity_check(0)


def test_a_key_that_is_not_a_radix_key_is_named():
    req = CacheRequest(RadixKey([1]), 1, np.array([0], np.int32))
    req.key = [1, 2]
    with pytest.raises(TypeError, match="req.key: expected a RadixKey, got list"):
        req.append([3], [1])
    with pytest.raises(TypeError, match="req.key: expected a RadixKey, got list"):
        req.num_tokens  # noqa: B018
    assert req.device_pages.tolist() == [0]


def test_component_pages_are_validated_as_extend_does():
    cache, full, swa_be, swa = make_swa_cache(page_size=1, window=3)
    req, _ = cache.begin_request(RadixKey([5]))
    req.extend(RadixKey([5]), cache.alloc_device(1), {"swa": cache.alloc_component("swa", 1)})
    before = _request_state(req)
    for comp, exc, match in (
        (None, ValueError, "component_pages: the request tracks 'swa' pages"),
        ({"swa": [1, 2]}, ValueError, r"component_pages\['swa'\]: expected 1 ids"),
        ({"swa": [-2]}, ValueError, r"component_pages\['swa'\]: ids must be >= -1"),
        ([1], TypeError, "component_pages: expected a dict"),
    ):
        with pytest.raises(exc, match=match):
            req.append([6], [3], comp)
        assert _request_state(req) == before


class _AppendingDriver(SWADriver):
    """``SWADriver`` whose decode steps use ``append`` (the engine's hybrid decode step):
    the grown key's new tokens only, with both pools' pages; the window slides by
    ``num_tokens`` (the key is not joined per step)."""

    def extend(self, req, key):
        n0 = req.num_tokens
        if len(key) - n0 != 1:  # a prefill chunk: the reference call sequence
            return super().extend(req, key)
        p = self.p
        need = -(-len(key) // p) - req.device_pages.shape[0]
        got = self.alloc(need) if need else (np.zeros(0, np.int32), np.zeros(0, np.int32))
        if got is None:
            return False
        full, sw = got
        start = n0 // p
        req.append(key.token_ids[n0:].tolist(), full, {"swa": sw})
        assert req.num_tokens == len(key)
        self.full.write(key, req.device_pages[start:], start)
        spg = req.component_pages["swa"][start:]
        for i in np.flatnonzero(spg >= 0).tolist():
            self.sw.write(key, np.array([spg[i]]), start + i)
        self.cache.slide_window(req, written=req.num_tokens)
        return True


@pytest.mark.parametrize("page, window", [(1, 3), (2, 5), (4, 6)])
def test_swa_decode_by_append_matches_extend(page, window):
    results = []
    for driver in (SWADriver, _AppendingDriver):
        cache, full, swa_be, swa = make_swa_cache(
            page_size=page, window=window, device_pages=96, host_pages=192, swa_device_pages=48, swa_host_pages=96
        )
        drv = driver(cache, full, swa_be, swa)
        finished = []
        finish = cache.cache_finished_req

        def logged(req, _finish=finish, _log=finished):
            _log.append(_request_state(req))
            return _finish(req)

        cache.cache_finished_req = logged
        rng = random.Random(page * 100 + window)
        out = []
        history = [rng.randrange(0, 30) for _ in range(3 * page)]
        for _turn in range(6):
            history += [rng.randrange(0, 30) for _ in range(rng.randrange(1, 2 * page + 1))]
            answer = [rng.randrange(0, 30) for _ in range(rng.randrange(1, 4 * page))]
            got = drv.serve(RadixKey(np.array(history, np.int64)), chunk=page + 1, out=answer)
            assert got is not None
            history += answer
            assert got.token_ids.tolist() == history
            cache.flush()
            cache.sanity_check(0, {"swa": 0})
            out.append((_state(cache), _counters(cache), cache.debug_view().digest()))
        results.append((out, finished))
    assert results[0] == results[1]


def test_empty_page_ids_of_any_dtype_keep_the_page_table_int32():
    cache, full, swa_be, swa = make_swa_cache(page_size=4, window=6)
    req, _ = cache.begin_request(RadixKey([5]))
    req.extend(RadixKey([5]), cache.alloc_device(1), {"swa": cache.alloc_component("swa", 1)})
    req.append([6], np.zeros(0, np.float64), {"swa": np.zeros(0, np.float64)})
    plain = CacheRequest(RadixKey([1]), 4, np.array([0], np.int32))
    plain.append([2], np.zeros(0, np.float64))
    for r in (req, plain):
        assert r.device_pages.dtype == np.int32 and r.num_tokens == 2
    assert req.component_pages["swa"].dtype == np.int32
