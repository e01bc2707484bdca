"""One engine's KV event stream (``events`` schema 1): a residency watch that turns pages
arriving on / leaving the device and host tiers, and what its L3 store reports of its own
contents, into ``KVEvent`` batches.

Usage::

    source = KVEventSource(cache, engine="engine-0")   # attaches itself; keyed as the cache's L3 controller
    source = KVEventSource(cache, model="llama-3-8b", engine="engine-0")   # a cache without L3
    source.observe_storage(controller.storage)     # optional: L3 stores / removals become storage events
    source.subscribe(router.apply)                  # delivered once per cache.check_events()
    batch = source.drain()                          # or drain by hand, once per step

Cost: nothing is attached to the cache until a source is built (``Residency.watch`` stays
None: one test per hook site). While attached, every stored / removed node costs its page
keys (one SHA-256 per page, computed once per node and kept until the node is deleted).

Keys: the L3 controller's own chain (``storage.keys.page_keys`` under the ``target`` pool's
``Namespace``, built from the same fields as ``hicache_jax.l3.StorageController``'s: model
identity with the KV geometry folded in, ``weights_revision``, KV dtype, page size, host
layout, TP size / rank (none for a KV the same on every rank, an MLA latent: as the controller
keys its replicated pools) and the tenant via ``encode_namespace(salt, namespace)``), so pages
line up across engines and with what L3 holds. With a ``StorageController`` attached to the
cache (its ``storage_hook``) the source takes ``model``, ``weights_revision`` and ``salt`` from
it (``model``, ``weights_revision``, ``salt`` left out); one given that differs from the
controller's is refused (``ValueError`` naming it: its keys would never match the L3's), as is
a ``tp_size`` / ``tp_rank`` that keys the ``target`` pool otherwise than the controller
(``key_namespace``). Without a controller ``model`` is required. A source built before the
controller is checked the same way when it observes that controller's store. A split changes no page's key; the source divides the
node's cached keys at each split (``split`` hook).

Storage: the cache never learns what L3 holds. ``observe_storage(storage)`` registers a
contents listener with that store (``HiCacheStorage.add_listener``): the store reports, from
whichever thread makes the change (the controller's backup thread writing, a prefetch thread
dropping a corrupt page, orbax's writer thread evicting) and under the lock that makes it
visible, the pages that became readable and the pages it evicted or dropped; the ``target``
pool's are queued (a short leaf lock) in that order and become ``stored`` / ``removed``
storage events at the next drain, after that step's device / host events. What a backend
cannot see (another process evicting, Mooncake's own evictions) it cannot report; with
``probe_pages`` the source asks the store, at most every ``probe_interval_s`` at a drain,
whether the ``probe_pages`` pages it last reported stored are still there (one
``exists_each`` call on the owner thread) and reports the missing ones as removed. The storage
queue is bounded by ``max_pending`` too: past it the queued storage events are dropped and the
next batch carries ``cleared(storage)`` where they were (the receiver forgets this engine's
storage pages until they are written again: it under-reports, never over-reports). A cache
``reset`` clears device and host only (L3 outlives it).

Bounded queue: at most ``max_pending`` device / host events wait for a drain; beyond that
they are dropped and the next batch is a resync (``cleared`` device and host, then their
whole contents, ``resync=True``), counted in ``stats()["resyncs"]``. A source's first batch
(``seq`` 0) is such a snapshot too: it may attach to a cache that holds pages already, and a
receiver that followed an earlier source of the same engine (a restart) starts over.

Subscribers: ``subscribe(fn)`` delivers each ``check_events``'s batch to every subscriber, in
subscription order; subscribing the same callable twice (``==``: one bound method of one
object) is refused (``ValueError``), ``unsubscribe(fn)`` ends a delivery. A subscriber that
raises (an ``Exception``) does not stop the others: the error is logged and counted
(``stats()["subscriber_errors"]``), and that subscriber alone is sent a resync at the next
``check_events`` (``cleared`` device and host, their whole contents, then, when stores are
observed, ``cleared(storage)`` and the step's storage events: the storage events it may have
lost are forgotten, so it under-reports L3, never over-reports), with the same ``seq`` as the
others' batch. A subscriber that raises on ``MAX_SUBSCRIBER_FAILURES`` batches in a row is
detached (logged as an error, ``stats()["subscribers_detached"]``). A subscriber added after
the source's first batch starts with such a resync too (it missed the earlier batches).

Threading: owner thread (the cache's), except the storage listener (any thread; it only
appends to the storage queue under ``_storage_lock``, a leaf lock).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from .._checks import check_int
from ..storage.keys import TOKEN_DTYPE as KEY_TOKEN_DTYPE, Namespace, encoded_page_keys, page_keys
from .components import FULL
from .events import EventBatch, KVEvent
from .hiradix_cache import HiRadixCache
from .radix_key import DEFAULT_NAMESPACE, as_radix_key, encode_namespace
from .residency_watch import ResidencyWatch
from .tree_node import TreeNode

TARGET_POOL = "target"  # the L3 controller's pool name for the full component
# A subscriber raising on this many batches in a row is detached (the module docstring).
MAX_SUBSCRIBER_FAILURES = 3

log = logging.getLogger(__name__)


def target_namespace(
    cache, model: str, weights_revision: str = "", tp_size: int | None = None, tp_rank: int | None = None
) -> Namespace:
    """The ``target`` pool's key namespace as ``StorageController`` builds it (before the
    tenant's ``extra_key``)."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model: expected a non-empty str (the model identity in every page key), got {model!r}")
    eng = cache.components.engines[FULL]
    g = eng.geom
    agreement = cache.agreement
    tp_size = agreement.num_processes if tp_size is None else tp_size
    tp_rank = agreement.rank if tp_rank is None else tp_rank
    tp_size = check_int("tp_size", tp_size, 1)
    tp_rank = check_int("tp_rank", tp_rank, 0, tp_size - 1)
    if tp_size > 1 and (g.kind == "mla" or bool(getattr(eng, "replicated", False))):
        tp_size, tp_rank = 1, 0  # the same KV on every rank: keyed rank-independently (l3.pools, ``replicated``)
    ident = f"{model}#{g.kind}:L{g.num_layers}:H{g.heads}:D{g.width}"
    return Namespace.from_geometry(
        g,
        eng.host_pool.layout,
        model=ident,
        weights_revision=weights_revision,
        pool=TARGET_POOL,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


class KVEventSource(ResidencyWatch):
    """See the module docstring."""

    def __init__(
        self,
        cache,
        *,
        model: str | None = None,
        engine: str = "",
        weights_revision: str | None = None,
        salt: str | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        max_pending: int = 1 << 16,
    ) -> None:
        if not isinstance(cache, HiRadixCache):
            raise TypeError(f"cache: expected a HiRadixCache, got {type(cache).__name__}")
        if not isinstance(engine, str):
            raise TypeError(f"engine: expected a str, got {type(engine).__name__}")
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"salt: expected a str, got {type(salt).__name__}")
        if weights_revision is not None and not isinstance(weights_revision, str):
            raise TypeError(f"weights_revision: expected a str, got {type(weights_revision).__name__}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending: expected an int >= 1, got {max_pending!r}")
        ctl = _controller(cache)
        if ctl is not None:  # the identity is the controller's; a different one given here is refused
            for name, given, have in (
                ("model", model, ctl.model),
                ("weights_revision", weights_revision, ctl.weights_revision),
                ("salt", salt, ctl.salt),
            ):
                if given is not None and given != have:
                    raise ValueError(
                        f"{name}: {given!r} differs from the attached StorageController's {have!r} (the "
                        f"events' page keys would never match the L3's); leave it out to use the "
                        f"controller's"
                    )
            model, weights_revision, salt = ctl.model, ctl.weights_revision, ctl.salt
        elif model is None:
            raise ValueError(
                "model: expected a non-empty str (the model identity in every page key; required when no "
                "StorageController is attached to the cache), got None"
            )
        weights_revision = "" if weights_revision is None else weights_revision
        salt = "" if salt is None else salt
        self._base = target_namespace(cache, model, weights_revision, tp_size, tp_rank)
        self.cache = cache
        self.model = model
        self.weights_revision = weights_revision
        self.engine = engine
        self.salt = salt
        self._checked = None  # the controller whose keys were found equal to the source's
        if ctl is not None:
            self._check_controller(ctl)
        self.page_size = cache.page_size
        self.max_pending = max_pending
        self._ns: dict[tuple, tuple[Namespace, str]] = {}
        self._keys: dict[TreeNode, tuple[bytes, ...]] = {}
        self._pending: list[KVEvent] = []
        # The first batch is a snapshot (resync): the cache may hold pages already, and a
        # receiver that followed an earlier source of this engine starts over.
        self._overflowed = True
        # (tap, kind, keys) in the order the stores reported them; appended by any thread.
        self._storage_q: list = []
        self._storage_lock = threading.Lock()
        self._subscribers: list[_Subscriber] = []
        self._seq = 0
        self.emitted = 0
        self.resyncs = 0
        self.subscriber_errors = 0
        self.subscribers_detached = 0
        self._taps: list = []
        cache.add_watch(self)

    # ------------------------------------------------------------------ public
    def subscribe(self, fn: Callable[[EventBatch], None]) -> None:
        """Deliver every batch to ``fn`` at each ``check_events`` (owner thread); see the module
        docstring for a subscriber that raises, and for one added after the first batch."""
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        if any(s.fn == fn for s in self._subscribers):
            raise ValueError(
                f"fn: {fn!r} is already subscribed to this source (each batch is delivered to it once; "
                f"unsubscribe it first)"
            )
        self._subscribers.append(_Subscriber(fn, resync=self._seq > 0))

    def unsubscribe(self, fn: Callable[[EventBatch], None]) -> None:
        """Stop delivering batches to ``fn`` (owner thread)."""
        for i, s in enumerate(self._subscribers):
            if s.fn == fn:
                del self._subscribers[i]
                return
        raise ValueError(f"fn: {fn!r} is not subscribed to this source")

    @property
    def subscribers(self) -> tuple:
        """The subscribed callables, in delivery order."""
        return tuple(s.fn for s in self._subscribers)

    def drain(self) -> EventBatch:
        """The events since the last drain, in the order they took effect (see the module
        docstring for storage events and resyncs)."""
        events = self._pending
        resync = self._overflowed
        if resync:
            events = self._snapshot()
            self._overflowed = False
            self.resyncs += self._seq > 0  # the first batch's snapshot is no overflow
        self._pending = []
        if self._taps:
            events += self._storage_events()
        batch = EventBatch(self.engine, self._seq, tuple(events), resync)
        self._seq += 1
        self.emitted += len(events)
        return batch

    def observe_storage(self, storage, *, probe_pages: int = 0, probe_interval_s: float = 1.0) -> None:
        """Turn what ``storage`` (the L3 controller's store) reports of its ``target`` pool's
        contents into storage events; with ``probe_pages`` > 0, also look for pages it cannot
        report leaving (see the module docstring)."""
        if not callable(getattr(storage, "add_listener", None)):
            raise TypeError(f"storage: expected a HiCacheStorage (with add_listener), got {type(storage).__name__}")
        if isinstance(probe_pages, bool) or not isinstance(probe_pages, int) or probe_pages < 0:
            raise ValueError(f"probe_pages: expected an int >= 0, got {probe_pages!r}")
        if (
            isinstance(probe_interval_s, bool)
            or not isinstance(probe_interval_s, (int, float))
            or not probe_interval_s >= 0
            or probe_interval_s == float("inf")
        ):
            raise ValueError(f"probe_interval_s: expected finite seconds >= 0, got {probe_interval_s!r}")
        if any(t.storage is storage for t in self._taps):
            raise ValueError("storage: already observed by this source")
        ctl = _controller(self.cache)
        if ctl is not None and ctl.storage is storage:  # a controller attached after the source was built
            self._check_controller(ctl)
        tap = _StorageTap(storage, probe_pages, probe_interval_s)
        q, lock, bound = self._storage_q, self._storage_lock, self.max_pending

        def listener(kind: str, pool: str, keys: list[bytes]) -> None:  # any thread, under the store's lock
            if pool != TARGET_POOL:
                return
            with lock:
                if len(q) >= bound:  # nobody drains: forget them, the receiver forgets too
                    q.clear()
                    q.append((None, "cleared", ()))
                q.append((tap, kind, tuple(keys)))

        tap.listener = listener
        storage.add_listener(listener)
        self._taps.append(tap)

    def close(self) -> None:
        """Detach from the cache and from the observed stores."""
        self.cache.remove_watch(self)
        for tap in self._taps:
            tap.storage.remove_listener(tap.listener)
        self._taps.clear()

    def probed_pages(self, storage) -> tuple:
        """The page keys a probe of ``storage`` checks next (the last ``probe_pages`` reported
        stored there), oldest first; () for a store observed without probes."""
        for t in self._taps:
            if t.storage is storage:
                return tuple(t.believed)
        raise ValueError("storage: not observed by this source")

    def stats(self) -> dict:
        with self._storage_lock:
            queued = len(self._storage_q)
        return {
            "events_emitted": self.emitted,
            "events_pending": len(self._pending),
            "resyncs": self.resyncs,
            "subscriber_errors": self.subscriber_errors,
            "subscribers_detached": self.subscribers_detached,
            "keyed_nodes": len(self._keys),
            "storage_probes": sum(t.probes for t in self._taps),
            "storage_probe_removed_pages": sum(t.probe_removed for t in self._taps),
            "storage_changes_queued": queued,
        }

    def request_keys(self, key: object) -> list[bytes]:
        """The page keys of a request's whole pages (what a router matches against the
        events; the same on every engine serving this model)."""
        key = as_radix_key(key)
        return page_keys(self._namespace(key.namespace)[0], key.token_ids)

    def node_keys(self, node: TreeNode) -> tuple[bytes, ...]:
        """``node``'s page keys (computed and kept; its ancestors' too)."""
        keys = self._keys
        ks = keys.get(node)
        if ks is not None:
            return ks
        root = self.cache.root
        path = []
        n = node
        while n is not root and n not in keys:
            path.append(n)
            n = n.parent
        prev = None if n is root else keys[n][-1]
        for n in reversed(path):
            # The tree's tokens are in [0, 2**32) (``RadixKey`` checked them): encoded as they are.
            data = np.frombuffer(n.kb, np.int64).astype(KEY_TOKEN_DTYPE).tobytes()
            ks = tuple(encoded_page_keys(self._namespace(n.namespace)[0], data, prev))
            keys[n] = ks
            prev = ks[-1]
        return keys[node]

    # ------------------------------------------------------------------ watch hooks
    def stored(self, tier: str, node: TreeNode) -> None:
        self._emit("stored", tier, node)

    def removed(self, tier: str, node: TreeNode) -> None:
        self._emit("removed", tier, node)
        if node.value is None and node.host_value is None:
            self._keys.pop(node, None)  # deleted next: its keys are no one's ancestors' any more

    def split(self, upper: TreeNode, lower: TreeNode, k: int) -> None:
        ks = self._keys.pop(lower, None)
        if ks is not None:
            self._keys[upper] = ks[:k]
            self._keys[lower] = ks[k:]

    def cleared(self) -> None:
        self._keys.clear()
        if not self._overflowed:
            self._pending += [
                KVEvent("cleared", "device", model=self.model),
                KVEvent("cleared", "host", model=self.model),
            ]

    def step(self) -> None:
        if not self._subscribers:
            return
        batch = self.drain()
        resync = None  # built once, for the subscribers that need one
        for sub in tuple(self._subscribers):
            b = batch
            if sub.resync and (self._taps or not batch.resync):
                if resync is None:
                    resync = self._resync_batch(batch)
                b = resync
            try:
                sub.fn(b)
            except Exception:
                self.subscriber_errors += 1
                sub.failures += 1
                if sub.failures >= MAX_SUBSCRIBER_FAILURES:
                    if sub in self._subscribers:  # (it may have unsubscribed itself)
                        self._subscribers.remove(sub)
                    self.subscribers_detached += 1
                    log.error(
                        "KV events %r: subscriber %r raised on %d batches in a row; detached",
                        self.engine,
                        sub.fn,
                        sub.failures,
                        exc_info=True,
                    )
                else:
                    sub.resync = True
                    log.warning(
                        "KV events %r: subscriber %r raised on batch %d; it gets a resync next",
                        self.engine,
                        sub.fn,
                        b.seq,
                        exc_info=True,
                    )
            else:
                sub.failures = 0
                sub.resync = False

    # ------------------------------------------------------------------ internals
    def _check_controller(self, ctl) -> None:
        """Refuse (``ValueError`` naming the argument) an identity whose page keys differ from
        the L3 controller's ``target`` keys."""
        if ctl is self._checked:
            return
        for name in ("model", "weights_revision", "salt"):
            mine, have = getattr(self, name), getattr(ctl, name)
            if mine != have:
                raise ValueError(
                    f"{name}: the source was built with {mine!r}, the StorageController attached to its "
                    f"cache with {have!r} (the events' page keys would never match the L3's)"
                )
        want = replace(ctl.key_namespace(TARGET_POOL, DEFAULT_NAMESPACE), extra_key=self._base.extra_key)
        if self._base != want:
            diff = [
                f
                for f in ("tp_size", "tp_rank", "model", "weights_revision", "kv_dtype", "page_size", "layout")
                if getattr(self._base, f) != getattr(want, f)
            ]
            raise ValueError(
                f"{'/'.join(diff) or 'namespace'}: the source's page keys would differ from the attached "
                f"StorageController's ({self._base} != {want}); leave tp_size/tp_rank out to use the "
                f"cache's"
            )
        self._checked = ctl

    def _namespace(self, radix_ns: tuple) -> tuple[Namespace, str]:
        out = self._ns.get(radix_ns)
        if out is None:
            out = self._ns[radix_ns] = (
                replace(self._base, extra_key=encode_namespace(self.salt, radix_ns)),
                encode_namespace("", radix_ns),
            )
        return out

    def _emit(self, kind: str, tier: str, node: TreeNode) -> None:
        if self._overflowed:
            return  # the next drain is a resync (a snapshot): nothing to queue
        # One event per node changing tier (hundreds a busy step): the kept keys and
        # namespaces are looked up inline, computed on a miss.
        keys = self._keys
        ks = keys.get(node)
        if ks is None:
            ks = self.node_keys(node)
        parent = node.parent
        if parent is self.cache.root:
            prev = None
        else:
            pk = keys.get(parent)
            prev = (pk if pk is not None else self.node_keys(parent))[-1]
        ns = self._ns.get(node.namespace)
        if ns is None:
            ns = self._namespace(node.namespace)
        pending = self._pending
        # Fields built here from the tree (a tuple of this source's keys): not checked again.
        pending.append(KVEvent.unchecked(kind, tier, ks, prev, node.size, self.model, ns[1]))
        if len(pending) > self.max_pending:
            self._pending = []
            self._overflowed = True

    def _storage_events(self) -> list[KVEvent]:
        """The queued storage changes as events, then what the due probes found missing."""
        with self._storage_lock:
            got = self._storage_q[:]
            self._storage_q.clear()
        out = []
        P, model = self.page_size, self.model
        for tap, kind, keys in got:
            if tap is None:  # the queue overflowed here
                out.append(KVEvent("cleared", "storage", model=model))
                for t in self._taps:
                    t.believed.clear()
                continue
            out.append(KVEvent(kind, "storage", keys, None, len(keys) * P, model))
            tap.saw(kind, keys)
        for tap in self._taps:
            gone = tap.probe()
            if gone:
                out.append(KVEvent("removed", "storage", gone, None, len(gone) * P, model))
        return out

    def _resync_batch(self, batch: EventBatch) -> EventBatch:
        """``batch`` for a subscriber that missed earlier batches: the device / host snapshot
        (it reflects ``batch``'s events), then, with stores observed, ``cleared(storage)`` and
        ``batch``'s storage events."""
        events = [e for e in batch.events if e.tier != "storage"] if batch.resync else self._snapshot()
        if self._taps:
            events.append(KVEvent("cleared", "storage", model=self.model))
            events += [e for e in batch.events if e.tier == "storage"]
        return EventBatch(batch.engine, batch.seq, tuple(events), True)

    def _snapshot(self) -> list[KVEvent]:
        """``cleared`` device and host, then every node's pages on each tier (parents first)."""
        out = [KVEvent("cleared", "device", model=self.model), KVEvent("cleared", "host", model=self.model)]
        root = self.cache.root
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            ks = self.node_keys(node)
            prev = None if node.parent is root else self.node_keys(node.parent)[-1]
            ns = self._namespace(node.namespace)[1]
            if node.value is not None:
                out.append(KVEvent.unchecked("stored", "device", ks, prev, node.size, self.model, ns))
            if node.host_value is not None:
                out.append(KVEvent.unchecked("stored", "host", ks, prev, node.size, self.model, ns))
            stack.extend(node.children.values())
        return out


def _controller(cache):
    """The L3 controller attached to ``cache`` (its ``storage_hook``, when it tells its page
    keys' identity: ``key_namespace``, ``model``, ``weights_revision``, ``salt``), or None."""
    hook = cache.storage_hook
    return hook if hook is not None and callable(getattr(hook, "key_namespace", None)) else None


class _Subscriber:
    """One subscriber: its callable, whether its next batch must be a resync, and how many
    batches in a row it raised on. Owner thread."""

    __slots__ = ("fn", "resync", "failures")

    def __init__(self, fn, resync: bool) -> None:
        self.fn = fn
        self.resync = resync
        self.failures = 0


class _StorageTap:
    """One observed store: its listener and, with ``probe_pages``, the pages last reported
    stored there (at most ``probe_pages``, oldest forgotten first) that a probe checks. Owner
    thread, except ``listener`` (any thread)."""

    def __init__(self, storage, probe_pages: int, probe_interval_s: float) -> None:
        self.storage = storage
        self.listener = None
        self.probe_pages = probe_pages
        self.interval = probe_interval_s
        self.believed: collections.OrderedDict = collections.OrderedDict()
        self.last_probe = time.monotonic()
        self.probes = 0
        self.probe_removed = 0

    def saw(self, kind: str, keys: tuple) -> None:
        if not self.probe_pages:
            return
        b = self.believed
        if kind == "stored":
            for k in keys:
                b[k] = None
                b.move_to_end(k)
            while len(b) > self.probe_pages:
                b.popitem(last=False)
        else:
            for k in keys:
                b.pop(k, None)

    def probe(self) -> tuple:
        """The believed pages the store no longer holds (forgotten here), when a probe is due;
        nothing when the store cannot answer."""
        if not self.probe_pages or not self.believed:
            return ()
        now = time.monotonic()
        if now - self.last_probe < self.interval:
            return ()
        self.last_probe = now
        self.probes += 1
        keys = list(self.believed)
        there = self.storage.exists_each(keys, TARGET_POOL)
        if there is None:
            return ()
        gone = tuple(k for k, t in zip(keys, there) if not t)
        for k in gone:
            del self.believed[k]
        self.probe_removed += len(gone)
        return gone
