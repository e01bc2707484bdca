"""Request helpers: ``begin_request`` / ``cache_unfinished_req`` / ``cache_finished_req``.

Pure numpy, owner thread only. A ``CacheRequest``'s first ``cached_pages`` pages are the
tree's, on the path to the node it holds a caller lock on (``last_node``). The helpers insert
from that node: the path is checked against the request's tokens byte by byte (one memcmp
per node, no child lookups) and only the pages after it are validated and compared with the
tree's. A request whose node does not spell its first ``cached_pages`` pages is inserted by a
walk from the root, as ``insert`` does. Either way the tree ends up identical (tested).

Locks: the request's lock is one of the cache's caller locks (``locks.CallerLocks``), moved
down the path as the request grows and released when it finishes. A request whose lock was
released meanwhile (``dec_lock_ref(req.last_node)`` to abandon it) is refused before
anything changes.

Components with their own page ids (``own``, set by the facade; e.g. ``swa``): the request
carries their ids in ``component_pages``. Its inserts hand them to the tree with the full
pages (taken or freed, each one); after ``begin`` and each insert the tree's part is re-read
from the request's node (``request_pages``: the ids its lock holds, -1 elsewhere);
``finished`` frees the partial tail page's ids with the full one.

Abort (``abort``): the request's own pages (from ``cached_pages`` on, of every pool) are
checked to be allocated and not the tree's, then freed; its lock is released; nothing is
inserted. Hits by tier: ``begin`` records the device prefix, the load-back's tokens and,
of those, the ones an L3 prefetch attached (the ``loaded_storage_tokens`` counter's growth
across the load-back) on the request.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..allocator import check_page_ids
from .insert import Inserter
from .locks import CallerLocks
from .metrics import CacheMetrics
from .radix_key import RadixKey, aligned_len
from .cache_request import CacheRequest
from .residency import EMPTY_IDS, Residency
from .results import LoadBackResult, MatchResult
from .tree import RadixTree


class RequestHelpers:
    """The three request helpers; ``match`` and ``load_back`` are the facade's (validated,
    counted) calls."""

    def __init__(
        self,
        tree: RadixTree,
        residency: Residency,
        inserter: Inserter,
        callers: CallerLocks,
        match: Callable[[RadixKey], MatchResult],
        load_back: Callable[..., LoadBackResult | None],
        page_size: int,
        metrics: CacheMetrics,
    ) -> None:
        self.tree = tree
        self.res = residency
        self.inserter = inserter
        self.callers = callers
        self.match = match
        self.load_back = load_back
        self.page_size = page_size
        self.metrics = metrics
        self.own: tuple = ()  # stateful components with their own page ids (the facade sets them)
        self.retention = None  # the cache's ``retention.Retention`` once enabled (the facade sets it)
        # Several ranks with own-id components: the agreed window slides (``component_steps``;
        # the facade sets it), which forget a request that finishes or is aborted.
        self.component_steps = None

    def begin(
        self, key: RadixKey, mem_quota: int | None, load_back: bool, priority: int, retain: object = None
    ) -> tuple[CacheRequest, LoadBackResult | None]:
        """``begin_request`` (validated): match, load back, lock; ``retain`` (a checked
        ``RetentionHint`` or None) is kept in the request and applied to the matched prefix."""
        res = self.match(key)
        pages, last = res.device_indices, res.last_device_node
        lb = None
        loaded = from_storage = 0
        if load_back and res.host_hit_length:
            before = self.metrics.loaded_storage_tokens
            lb = self.load_back(res.last_host_node, mem_quota)
            if lb is not None:
                pages = np.concatenate([pages, lb.device_pages])
                last = lb.node
                loaded = lb.num_tokens
                from_storage = self.metrics.loaded_storage_tokens - before
        root = self.tree.root
        if last is not root:
            self.callers.take(last)
        req = CacheRequest(
            key,
            self.page_size,
            pages,
            last if last is not root else None,
            pages.shape[0],
            priority,
            None,
            res.device_indices.shape[0] * self.page_size,
            loaded - from_storage,
            from_storage,
        )
        req.owner = self
        if self.own:
            req.component_pages = {c.name: c.request_pages(last, pages.shape[0]) for c in self.own}
        if retain is not None:
            req.retain = retain
            if req.last_node is not None:
                self.retention.retain(root, req.last_node, retain)
        return req, lb

    def check(self, req: object, partial: bool = False) -> CacheRequest:
        """``req`` as a well-formed request of this cache; TypeError/ValueError naming the bad
        field otherwise (cheap: it runs on every request helper call). ``partial`` (abort):
        the request may hold fewer device pages than its tokens need (as ``begin_request``
        returns it: pages for the cached prefix only, before ``extend``), at least its
        ``cached_pages``."""
        if not isinstance(req, CacheRequest):
            raise TypeError(f"req: expected a CacheRequest, got {type(req).__name__}")
        if req.owner is not None and req.owner is not self:
            raise ValueError("req: a request of another cache (begun by another cache's begin_request)")
        if req.released:
            raise ValueError("req: already finished or aborted (cache_finished_req / abort_request released it)")
        p = self.page_size
        if req.page_size != p:
            raise ValueError(f"req: page_size {req.page_size} != cache page_size {p}")
        n = req.num_tokens  # TypeError naming req.key for one that is not a RadixKey
        pages = req.device_pages
        if type(pages) is not np.ndarray or pages.ndim != 1 or pages.dtype.kind not in "iu":
            shape = f" {pages.dtype}{pages.shape}" if isinstance(pages, np.ndarray) else ""
            raise TypeError(
                f"req.device_pages: expected a 1-D integer array of device page ids, got {type(pages).__name__}{shape}"
            )
        if pages.shape[0] != -(-n // p) and not (partial and pages.shape[0] < -(-n // p)):
            raise ValueError(f"req: {n} tokens need {-(-n // p)} device pages, it holds {pages.shape[0]}")
        prio, cached = req.priority, req.cached_pages
        if type(prio) is not int and (isinstance(prio, bool) or not isinstance(prio, np.integer)):
            raise TypeError(f"req.priority: expected an int, got {type(prio).__name__}")
        if type(cached) is not int and (isinstance(cached, bool) or not isinstance(cached, np.integer)):
            raise TypeError(f"req.cached_pages: expected an int, got {type(cached).__name__}")
        if cached < 0 or cached > min(n // p, pages.shape[0]):
            raise ValueError(
                f"req.cached_pages: expected an int in [0, {min(n // p, pages.shape[0])}] (the "
                f"request's whole pages it holds), got {cached}"
            )
        retain = req.retain
        if retain is not None:
            from .retention import RetentionHint

            if not isinstance(retain, RetentionHint):
                raise TypeError(f"req.retain: expected a RetentionHint or None, got {type(retain).__name__}")
            if self.retention is None:
                raise ValueError("req.retain: retention is not enabled on this cache (retention.enable_retention)")
        node = req.last_node
        if node is not None:
            self.tree.check_node(node, "req.last_node")
            if not self.callers.holds(node):
                raise ValueError(f"req.last_node: the request's lock on {node!r} was released")
        cp = req.component_pages
        if cp is not None:
            self._check_component_pages(cp, pages.shape[0])
        return req

    def _check_component_pages(self, cp: object, n: int) -> None:
        if not isinstance(cp, dict):
            raise TypeError(
                f"req.component_pages: expected a dict of name -> page ids or None, got {type(cp).__name__}"
            )
        known = {c.name: c for c in self.own}
        for name, arr in cp.items():
            comp = known.get(name)
            if comp is None:
                raise ValueError(
                    f"req.component_pages: {name!r} is not a component with its own page ids (those: {sorted(known)})"
                )
            if type(arr) is not np.ndarray or arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise TypeError(f"req.component_pages[{name!r}]: expected a 1-D integer array")
            if arr.shape[0] != n:
                raise ValueError(f"req.component_pages[{name!r}]: {arr.shape[0]} ids for {n} device pages")
            if arr.shape[0] and (int(arr.min()) < -1 or int(arr.max()) >= comp.device_allocator.num_pages):
                raise ValueError(
                    f"req.component_pages[{name!r}]: ids out of range [-1, {comp.device_allocator.num_pages})"
                )

    def _component_pages(self, req: CacheRequest) -> dict:
        """The request's ids per own-id component (-1 arrays for one it does not track yet)."""
        cp = dict(req.component_pages or {})
        n = req.device_pages.shape[0]
        for c in self.own:
            if c.name not in cp:
                cp[c.name] = np.full(n, -1, np.int32)
        req.component_pages = cp
        return cp

    def request_path(self, req: CacheRequest, qb: bytes, n: int) -> tuple[list | None, bytes | None, int]:
        """The nodes from the root to ``req.last_node``, when they spell the request's first
        ``cached_pages`` pages (checked byte by byte against ``qb``, the bytes of at least
        the request's first ``n`` tokens, its whole pages): the helpers then insert from
        there, with ``qb`` and the path's length in tokens. ``(None, None, 0)`` when they do
        not (the insert then walks from the root).

        Their pages are the request's first ``cached_pages`` (``CacheRequest``'s contract: the
        tree's pages, kept on the device by the request's lock), so only the pages after them
        need checking, and the walk over them needs no child lookups."""
        node = req.last_node
        if node is None or node.lock_ref < 1 or node.namespace != req.key.namespace:
            return None, None, 0
        depth = req.cached_pages * self.page_size
        if depth > n:
            return None, None, 0
        path = self.tree.path_bytes_match(node, qb, depth)
        if path is None:
            return None, None, 0
        return path, qb, depth

    def _insert(self, req: CacheRequest, chunked: bool):
        """Insert of the request's whole pages; returns ``(result, dup_mask, tree_head, first
        page dup_mask refers to)``."""
        p = self.page_size
        key = req.key
        aligned = len(key) // p
        n_dev = self.res.device_allocator.num_pages
        path, _qb, depth = self.request_path(req, key.token_bytes, aligned * p)
        start = 0 if path is None else req.cached_pages
        cp = None
        if self.own:
            cp = {name: arr[start:aligned] for name, arr in self._component_pages(req).items()}
        if path is None:
            pages = check_page_ids(req.device_pages[:aligned], n_dev, "req.device_pages", unique=False)
            return self.inserter.insert(key, pages, chunked, priority=req.priority, comp_pages=cp) + (0,)
        pages = check_page_ids(req.device_pages[req.cached_pages : aligned], n_dev, "req.device_pages", unique=False)
        return self.inserter.insert(key, pages, chunked, path, depth, req.priority, cp) + (req.cached_pages,)

    def _reread_component_pages(self, req: CacheRequest, node, aligned: int) -> None:
        """After an insert: the tree's part of the request's own-id component pages are the
        ids its lock on ``node`` holds (-1 elsewhere); the rest stays the request's."""
        if not self.own:
            return
        cp = self._component_pages(req)
        for c in self.own:
            arr = cp[c.name].copy()
            arr[:aligned] = c.request_pages(node, aligned) if aligned else arr[:0]
            cp[c.name] = arr

    def unfinished(self, req: CacheRequest, chunked: bool) -> None:
        p = self.page_size
        aligned = req.key.token_ids.shape[0] // p
        ins, dup_mask, tree_head, head0 = self._insert(req, chunked)
        node = ins.last_node
        root = self.tree.root
        if node is not root:
            # Everything just inserted is on the device: point the request at the tree's page
            # ids along the path (they differ from its own only where its pages were duplicates).
            if dup_mask is not None:
                dev = req.device_pages.copy()
                head = dev[head0 : head0 + tree_head.shape[0]]
                head[dup_mask] = tree_head[dup_mask]
                req.device_pages = dev
            if req.last_node is not None:
                self.callers.move(req.last_node, node)
            else:
                self.callers.take(node)
        elif req.last_node is not None:
            self.callers.release(req.last_node)
        req.last_node = node if node is not root else None
        req.cached_pages = aligned
        if self.own:
            self._reread_component_pages(req, node, aligned)
        if req.retain is not None and self.retention is not None and req.last_node is not None:
            self.retention.retain(root, req.last_node, req.retain)

    def finished(self, req: CacheRequest) -> None:
        key = req.key  # kept for the retention hint: the request is emptied below
        p = self.page_size
        aligned = key.token_ids.shape[0] // p
        tail = req.device_pages[aligned:]  # the partial last page, if any (``check``: one page per started page)
        res = self.res
        if tail.size:
            n_dev = res.device_allocator.num_pages
            if tail.min() < 0 or tail.max() >= n_dev:  # before indexing the bitmaps with them
                raise ValueError(f"req.device_pages: tail page ids out of range [0, {n_dev}): {tail.tolist()}")
            bad = tail[res.dev_owned[tail] | ~res.device_allocator.is_allocated(tail)]
            if bad.size:
                raise ValueError(f"req.device_pages: tail pages {bad.tolist()} are not the request's to free")
        comp_tails = []
        if self.own:
            cp = self._component_pages(req)
            for c in self.own:
                t = cp[c.name][aligned:]
                t = t[t >= 0].astype(np.intp)
                c.check_free(t, f"req.component_pages[{c.name!r}]")
                comp_tails.append((c, t))
        self._insert(req, False)
        self._release(req, tail, comp_tails)
        if self.component_steps is not None:
            self.component_steps.forget(req)
        if req.retain is not None and self.retention is not None:
            self._retain_key(key, req.retain)

    def _retain_key(self, key: RadixKey, hint) -> None:
        """Apply ``hint`` to the nodes wholly inside ``key``'s cached whole pages."""
        segs, _matched = self.tree.walk(key, aligned_len(len(key), self.page_size))
        while segs and segs[-1][1] < segs[-1][0].size:
            segs.pop()  # the walk ends inside this node: it holds more than the key
        if segs:
            self.retention.retain(self.tree.root, segs[-1][0], hint)

    def _release(self, req: CacheRequest, own: np.ndarray, comp_own: list) -> None:
        """Free the request's own pages (checked by the caller: in range, allocated, not the
        tree's, distinct), unlock its prefix, empty it."""
        if own.size:
            self.res.device_allocator.free_owned(own)
        for c, t in comp_own:
            if t.size:
                c.device_allocator.free(t)
        if req.last_node is not None:
            self.callers.release(req.last_node)
        req.last_node = None
        req.released = True
        req.device_pages = EMPTY_IDS.copy()
        req.cached_pages = 0
        if req.component_pages is not None:
            req.component_pages = {name: EMPTY_IDS.copy() for name in req.component_pages}

    def abort(self, req: object) -> None:
        """``abort_request``: a request that holds nothing (aborted or finished already, or
        begun on no match) is only marked released; otherwise checked, then aborted."""
        if (
            isinstance(req, CacheRequest)
            and req.last_node is None
            and not req.device_pages.size
            and req.owner in (None, self)
        ):
            req.released = True
            return
        self._abort(self.check(req, partial=True))
        if self.component_steps is not None:
            self.component_steps.forget(req)

    def slide(self, req: CacheRequest, written: int | None) -> None:
        """``slide_window`` (validated): slide every own-id component's window of ``req`` to
        ``written`` tokens (None: all of them); with several ranks, only note the length (the
        next step slides every rank to the MIN, ``component_steps``)."""
        n = req.num_tokens  # (the key itself is not built: a decode step's ``append`` stays O(1))
        if written is not None:
            n = min(written, n)
        if self.component_steps is not None:
            self.component_steps.note(req, n)
            return
        for comp in self.own:
            comp.slide_request(req, None if written is None else n)

    def _abort(self, req: CacheRequest) -> None:
        res = self.res
        own = req.device_pages[req.cached_pages :]
        if own.size:
            n_dev = res.device_allocator.num_pages
            if own.min() < 0 or own.max() >= n_dev:  # before indexing the bitmaps with them
                raise ValueError(
                    f"req.device_pages: the request's own page ids out of range [0, {n_dev}): {own.tolist()}"
                )
            if np.unique(own).shape[0] != own.shape[0]:
                raise ValueError(f"req.device_pages: the request's own pages repeat an id: {own.tolist()}")
            bad = own[res.dev_owned[own] | ~res.device_allocator.is_allocated(own)]
            if bad.size:
                raise ValueError(
                    f"req.device_pages: pages {bad.tolist()} are not the request's to free (free, or owned by the tree)"
                )
        comp_own = []
        if self.own and req.component_pages is not None:
            for c in self.own:
                ids = req.component_pages.get(c.name)
                if ids is None:
                    continue
                t = ids[req.cached_pages :]
                t = t[t >= 0].astype(np.intp)
                c.check_free(t, f"req.component_pages[{c.name!r}]")
                comp_own.append((c, t))
        self._release(req, own, comp_own)
