"""hicache_jax's host (L2) and storage (L3) tiers behind a running EasyDeL eSurge engine.

eSurge's own page pool and prefix cache stay L1. The adapter wraps methods on the engine's
live objects (no fork of eSurge), keyed by tokens (eSurge's page hashes are random per
process):

* admission: ``CacheManager.get_computed_pages``. After eSurge's own L1 hit of ``n`` tokens,
  the pages that follow are looked up in the host tier (after an L3 prefetch into it); the L1
  hit is pinned (``touch``) before new pages are taken (else eSurge may evict them), the host
  pages are scattered into eSurge's KV arrays, registered under eSurge's own page hashes for
  that request and released, so eSurge's lookup (called again) counts them as its own hits.
  The hit counts are committed when ``allocate_slots`` admits the request (eSurge retries
  the lookup on every pass while a request waits for room).
* finish / preemption: ``CacheManager.free`` backs up the request's full computed pages that
  the host tier does not hold yet, before eSurge frees them.
* eviction: ``PagePool._maybe_evict_cached_page`` (the page's KV is still in the array) backs
  up a cached page the host tier lost since, when its prefix is still there.
* once per scheduler step (``Scheduler.schedule``): ``HiRadixCache.check_events``.
* ``resume()`` after a pause that destroyed the KV arrays: eSurge's prefix cache is reset (it
  would otherwise "hit" zeroed pages); nothing is backed up from destroyed pages.
* ``update_model_weights``: eSurge builds a new scheduler: the hooks move to it, the host
  tier is dropped and L3 continues under a new ``weights_revision``.
* requests with prompt logprobs: eSurge never caches them; they pass through untouched.

How the pieces map: a ``HiRadixCache`` indexes the host pages by tokens; its device tier is a
set of *slots* that exist only for the moment of a backup: a slot stands for an eSurge page
(``FusedKVTransfer.map_slots``), the insert backs it up (write-through, and through the
``StorageController`` to L3), and the adapter evicts the slots again at once. The
``StorageController`` puts ``model``, ``weights_revision`` and the fused page geometry (layers,
page size, bytes per page) into every L3 key.

Threading: every hook runs on eSurge's scheduler thread under ``engine._scheduler_lock``; the
handle's public methods take that lock too. One data-parallel replica.

Models: full attention (one KV cache group), or hybrid full / sliding-window models such as
Gemma 3. For those eSurge 0.3.0 makes one full-attention group and sliding-window groups
(``HybridCacheCoordinator``), but its runner reads and writes every layer's KV through the
full-attention group's page table (``eSurgeRunner._get_full_attention_page_table_index``): the
full group's pages hold every layer's full KV and are what the adapter copies; the window
groups' pages hold no KV, and a host hit registers fresh ones for the last pages of the hit only
so that eSurge's sliding-window lookup counts it (``KVLayout``). A runner that does not read
every layer through the full group's pages is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ...cache import HiCacheConfig, HiRadixCache, RadixKey
from ...cache.config import WritePolicy
from ...host_layout import HostLayout
from ...host_pool import HostKVPool
from ...allocator import PageAllocator
from .fused_transfer import FusedKVTransfer, fused_geometry

_SOURCES = ("device", "host", "storage")
log = logging.getLogger(__name__)
ESURGE_EVICT_HOOK = "_maybe_evict_cached_page"  # eSurge's PagePool method the eviction hook wraps


class UnsupportedEngineError(ValueError):
    """The eSurge setup is one the adapter does not support (it says which are)."""


@dataclass
class Admission:
    """One admitted request: where its cached prompt tokens came from."""

    request_id: str
    prompt_tokens: int
    device: int = 0
    host: int = 0
    storage: int = 0
    scheduled: int | None = None  # prefill tokens eSurge scheduled in its first step

    @property
    def cached(self) -> int:
        return self.device + self.host + self.storage


@dataclass
class _Counters:
    cached_tokens: dict = field(default_factory=lambda: dict.fromkeys(_SOURCES, 0))
    prompt_tokens: int = 0
    requests: int = 0
    passthrough_requests: int = 0  # prompt logprobs: never cached by eSurge
    loaded_pages: int = 0
    backed_up_pages: int = 0
    evictions_seen: int = 0  # cached eSurge pages evicted (the hook fired)
    eviction_backups: int = 0  # of those, backed up at eviction
    load_failures: int = 0
    hook_failures: int = 0  # a hook raised: served as a miss / the copy skipped (logged)
    resets: int = 0
    # Seconds eSurge's scheduler thread spent in the adapter's copies (it schedules nothing
    # meanwhile): "prefetch" waiting for L3 reads, "load" copying host pages into eSurge's KV,
    # "backup" copying eSurge pages to the host at finish / preemption / eviction.
    blocked_seconds: dict = field(default_factory=lambda: dict.fromkeys(("prefetch", "load", "backup"), 0.0))


def _kv_views(engine):
    kv = engine.runner.executor_manager.kv_pages
    return kv, list(kv.views)


def _get_arrays(engine):
    return [v.kv_pages for v in _kv_views(engine)[1]]


def _set_arrays(engine, arrays) -> None:
    kv, views = _kv_views(engine)
    engine.runner.executor_manager.kv_pages = kv.replace(views=[v.replace(kv_pages=a) for v, a in zip(views, arrays)])


@dataclass(frozen=True)
class KVLayout:
    """Where eSurge keeps a request's KV (``_check_supported``'s answer).

    ``kv_group``: the KV cache group whose pages hold every layer's K/V (eSurge's page ids that
    the adapter copies). ``window_groups``: ``(group id, pages)`` of each sliding-window group of
    a hybrid model: eSurge 0.3.0 gives those groups pages of their own for prefix-cache
    bookkeeping, but its runner reads and writes every layer, sliding ones included, through the
    full-attention group's page table, so their pages never hold KV; a prefix hit still needs
    the last ``pages`` of the hit (or all of it, when shorter) registered in each such group."""

    kv_group: int = 0
    window_groups: tuple[tuple[int, int], ...] = ()


def _check_supported(engine) -> KVLayout:
    sched = getattr(engine, "scheduler", None)
    kvm = getattr(sched, "kv_cache_manager", None)
    if kvm is None or not hasattr(engine, "runner"):
        raise TypeError(f"engine: expected an easydel eSurge engine, got {type(engine).__name__}")
    supported = (
        "supported: full-attention models (one KV cache group), or one full-attention group plus "
        "sliding-window groups whose KV eSurge keeps in the full-attention group's pages; one "
        "data-parallel replica, prefix caching on"
    )
    dp = int(getattr(sched, "data_parallel_size", 1) or 1)
    if dp != 1:
        raise UnsupportedEngineError(f"engine: {dp} data-parallel replicas; {supported}")
    if not kvm.enable_caching:
        raise UnsupportedEngineError(f"engine: prefix caching is off; {supported}")
    groups = kvm.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    full = [i for i, k in enumerate(kinds) if k == "FullAttentionSpec"]
    if len(full) != 1 or any(k not in ("FullAttentionSpec", "SlidingWindowSpec") for k in kinds):
        raise UnsupportedEngineError(f"engine: KV cache groups {kinds}; {supported}")
    layout = KVLayout(kv_group=full[0])
    if len(groups) > 1:
        # eSurge 0.3.0's runner (eSurgeRunner._get_full_attention_page_table_index) hands the
        # full-attention group's page table to every layer: sliding layers' KV lives in those
        # pages too. A runner without it may keep sliding KV in the sliding groups' pages.
        pick = getattr(engine.runner, "_get_full_attention_page_table_index", None)
        where = pick() if callable(pick) else None
        if where != full[0]:
            raise UnsupportedEngineError(
                f"engine: KV cache groups {kinds}, but its runner does not read every layer's KV through the "
                f"full-attention group's page table (group {full[0]}; got {where!r}); {supported}"
            )
        page = kvm.page_size
        eagle = 1 if getattr(kvm, "use_eagle", False) else 0
        wins = []
        for i, g in enumerate(groups):
            spec = g.kv_cache_spec
            if spec.page_size != page:
                raise UnsupportedEngineError(
                    f"engine: KV cache group {i} has page_size {spec.page_size}, group {full[0]} {page}; {supported}"
                )
            if i != full[0]:  # eSurge's SlidingWindowManager.find_longest_cache_hit: contiguous pages
                wins.append((i, -(-(int(spec.sliding_window) - 1) // page) + eagle))
        layout = KVLayout(kv_group=full[0], window_groups=tuple(wins))
    views = _kv_views(engine)[1]
    if any(v is None or getattr(v, "kv_pages", None) is None for v in views):
        raise UnsupportedEngineError(f"engine: a layer without ragged KV pages; {supported}")
    return layout


class EsurgeHiCache:
    """The handle ``attach`` returns. See the module docstring."""

    def __init__(
        self,
        engine,
        config: HiCacheConfig,
        *,
        model: str,
        weights_revision: str,
        host_pages: int | None = None,
        host_layout: HostLayout | str = HostLayout.PAGE_FIRST,
        prefetch_timeout_s: float = 5.0,
    ) -> None:
        if not isinstance(config, HiCacheConfig):
            raise TypeError(f"config: expected a HiCacheConfig, got {type(config).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected a non-empty str, got {model!r}")
        if not isinstance(weights_revision, str):
            raise TypeError(f"weights_revision: expected a str, got {type(weights_revision).__name__}")
        if (
            isinstance(prefetch_timeout_s, bool)
            or not isinstance(prefetch_timeout_s, (int, float))
            or not math.isfinite(prefetch_timeout_s)
            or prefetch_timeout_s <= 0
        ):
            raise ValueError(
                f"prefetch_timeout_s: expected finite seconds > 0 (how long an admission waits for its "
                f"L3 prefetch), got {prefetch_timeout_s!r}"
            )
        if config.write_policy is not WritePolicy.WRITE_THROUGH or config.write_through_threshold != 1:
            raise ValueError(
                f"config: expected write_policy='write_through' with write_through_threshold=1 "
                f"(pages are backed up when eSurge frees them), got {config.write_policy.value} "
                f"threshold {config.write_through_threshold}"
            )
        self.layout = _check_supported(engine)
        kvm = engine.scheduler.kv_cache_manager
        if config.page_size != kvm.page_size:
            raise ValueError(f"config: page_size {config.page_size} != eSurge's page_size {kvm.page_size}")
        if host_pages is not None and (
            isinstance(host_pages, bool) or not isinstance(host_pages, int) or host_pages < 1
        ):
            raise ValueError(f"host_pages: expected an int >= 1 or None, got {host_pages!r}")
        self.engine = engine
        self.config = config
        self.model = model
        self.weights_revision = weights_revision
        self.page_size = config.page_size
        self.prefetch_timeout_s = float(prefetch_timeout_s)
        self.counters = _Counters()
        self.admissions: list[Admission] = []
        self._pending: dict[str, Admission] = {}
        self._passthrough: set[str] = set()
        self._page_keys: dict[int, np.ndarray] = {}  # eSurge page id -> tokens up to its end (cached pages)
        self._patches: list[tuple[object, str]] = []
        self._next_revision: str | None = None
        self._lock = getattr(engine, "_scheduler_lock", None) or threading.RLock()
        geom = fused_geometry(_get_arrays(engine))
        self.geometry = geom
        n_engine = int(_get_arrays(engine)[0].shape[0])
        self.host_pool = HostKVPool(geom, host_pages or 2 * n_engine, host_layout)
        self.transfer = FusedKVTransfer(
            lambda: _get_arrays(engine), lambda a: _set_arrays(engine, a), self.host_pool, num_slots=n_engine
        )
        self._build_cache()
        self._metrics = []
        self._install(engine)
        self._attached = True

    # ------------------------------------------------------------------ setup
    def _build_cache(self) -> None:
        # The hooks run on eSurge's scheduler thread, the handle's calls on the caller's; both hold
        # eSurge's scheduler lock, which serialises every cache call: the owner-thread check is off.
        config = dataclasses.replace(self.config, check_owner_thread=False)
        self.cache = HiRadixCache(
            config, self.transfer, PageAllocator(self.transfer.device_num_pages, name="esurge-slots")
        )
        self.l3 = None
        if self.config.storage is not None:
            from ...l3 import StorageController

            self.l3 = StorageController(self.cache, model=self.model, weights_revision=self.weights_revision)

    def _patch(self, obj, name: str, fn) -> None:
        if name in vars(obj):
            raise RuntimeError(f"{type(obj).__name__}.{name} is already wrapped (another adapter attached?)")
        setattr(obj, name, fn)
        self._patches.append((obj, name))

    def _unpatch(self, objs: tuple | None = None) -> None:
        keep = []
        for obj, name in self._patches:
            if objs is None or any(obj is o for o in objs):
                vars(obj).pop(name, None)
            else:
                keep.append((obj, name))
        self._patches = keep

    def _install(self, engine) -> None:
        sched = engine.scheduler
        kvm = sched.kv_cache_manager
        pool = kvm.page_pool
        orig_gcp, orig_alloc, orig_free = kvm.get_computed_pages, kvm.allocate_slots, kvm.free
        # eSurge 0.3.0 (pinned) has no public eviction callback: its page pool's private
        # per-page eviction method is the one place a cached page's KV is still in the array.
        orig_evict, orig_schedule = getattr(pool, ESURGE_EVICT_HOOK), sched.schedule

        def get_computed_pages(request, **kw):
            try:
                return self._on_lookup(kvm, orig_gcp, request, kw)
            except Exception:  # noqa: BLE001 - never take eSurge's scheduler down: a miss instead
                self.counters.hook_failures += 1
                log.exception("hicache lookup failed for %s; served as a miss", request.request_id)
                return orig_gcp(request, **kw)

        def allocate_slots(request, *a, **kw):
            out = orig_alloc(request, *a, **kw)
            if out is not None:
                adm = self._pending.pop(request.request_id, None)
                if adm is not None:
                    self._commit(adm)
            return out

        def free(request):
            try:
                self._on_free(kvm, request)
            except Exception:  # noqa: BLE001 - a backup that failed is only a lost copy
                self.counters.hook_failures += 1
                log.exception("hicache backup failed for %s", request.request_id)
            return orig_free(request)

        def maybe_evict(page):
            if page.page_hash is not None:
                try:
                    self._on_evict(page)
                except Exception:  # noqa: BLE001 - as above
                    self.counters.hook_failures += 1
                    log.exception("hicache backup at eviction failed for page %s", page.page_id)
            return orig_evict(page)

        def schedule():
            self.cache.check_events()
            out = orig_schedule()
            for nr in getattr(out, "scheduled_new_reqs", ()) or ():
                adm = self._by_id.get(nr.req_id)
                if adm is not None and adm.scheduled is None:
                    adm.scheduled = int(out.num_scheduled_tokens.get(nr.req_id, 0))
            return out

        self._by_id: dict[str, Admission] = getattr(self, "_by_id", {})
        self._patch(kvm, "get_computed_pages", get_computed_pages)
        self._patch(kvm, "allocate_slots", allocate_slots)
        self._patch(kvm, "free", free)
        self._patch(pool, ESURGE_EVICT_HOOK, maybe_evict)
        self._patch(sched, "schedule", schedule)
        self._sched_objs = (kvm, pool, sched)
        if not getattr(self, "_engine_patched", False):
            orig_pause, orig_resume, orig_update = engine.pause, engine.resume, engine.update_model_weights

            def pause():
                with self._lock:
                    self._page_keys.clear()  # the arrays may be destroyed: never back those pages up
                return orig_pause()

            def resume():
                destroyed = not getattr(engine, "_kv_cache_valid", True)
                out = orig_resume()
                if destroyed:
                    with self._lock:
                        # eSurge keeps the prefix-cache hashes of the destroyed (now zeroed) pages.
                        engine.scheduler.kv_cache_manager.reset_prefix_cache()
                        self._page_keys.clear()
                        self.counters.resets += 1
                return out

            def update_model_weights(*a, **kw):
                out = orig_update(*a, **kw)
                self._after_weight_update()
                return out

            self._patch(engine, "pause", pause)
            self._patch(engine, "resume", resume)
            self._patch(engine, "update_model_weights", update_model_weights)
            self._engine_patched = True

    # ------------------------------------------------------------------ hooks
    def _prompt_key(self, request) -> np.ndarray:
        toks = np.asarray(list(request.all_token_ids), np.int64)
        limit = len(toks) - 1  # eSurge always computes the last prompt token
        return toks[: (limit // self.page_size) * self.page_size]

    def _host_path(self, key: np.ndarray) -> tuple[object, int, np.ndarray]:
        """(deepest backed-up node, tokens backed up, host page ids of those tokens)."""
        node, matched, _ = self.cache.backed_up_prefix(RadixKey(key))
        chain = []
        n = node
        while n is not None and n is not self.cache.root:
            if n.host_value is None:
                return self.cache.root, 0, np.zeros(0, np.int32)
            chain.append(n.host_value)
            n = n.parent
        ids = np.concatenate(chain[::-1]) if chain else np.zeros(0, np.int32)
        return node, matched, ids[: matched // self.page_size]

    def _on_lookup(self, kvm, orig, request, kw):
        pages, n = orig(request, **kw)
        sp = getattr(request, "sampling_params", None)
        rid = request.request_id
        if sp is not None and getattr(sp, "prompt_logprobs", None) is not None:
            if rid not in self._passthrough:
                self._passthrough.add(rid)
                self.counters.passthrough_requests += 1
            return pages, n
        adm = self._pending.get(rid) or Admission(rid, int(request.num_tokens))
        adm.device = n
        self._pending[rid] = adm
        key = self._prompt_key(request)
        p = self.page_size
        if n >= len(key):
            return pages, n
        _, host0, _ = self._host_path(key)
        if host0 < len(key) and self.l3 is not None:
            t0 = time.perf_counter()
            self._prefetch(key)
            self.counters.blocked_seconds["prefetch"] += time.perf_counter() - t0
        node, matched, host_ids = self._host_path(key)
        if matched <= n:
            return pages, n
        first, last = n // p, matched // p
        want = last - first
        pool = kvm.page_pool
        pin = self.cache.pin_host(node)
        l1 = pages.pages
        pool.touch(l1)  # else get_new_pages may evict the L1 hit itself
        try:
            # Leave eSurge a page per group for the uncached tail; a hybrid model's window groups
            # need their own (KV-less) pages for the last pages of the hit (KVLayout).
            room = pool.get_num_free_pages() - 1 - len(self.layout.window_groups)
            want = min(want, room)
            while want > 0 and want + sum(min(want, w) for _, w in self.layout.window_groups) > room:
                want -= 1
            if want <= 0:
                return pages, n
            new = pool.get_new_pages(want)
            marks = [(g, pool.get_new_pages(min(want, w))) for g, w in self.layout.window_groups]
            t0 = time.perf_counter()
            try:
                self.transfer.load_pages(host_ids[first : first + want], [pg.page_id for pg in new])
            except Exception:  # noqa: BLE001 - a failed load is a miss, never wrong KV
                self.counters.load_failures += 1
                pool.free_pages(new)
                for _, got in marks:
                    pool.free_pages(got)
                return pages, n
            finally:
                self.counters.blocked_seconds["load"] += time.perf_counter() - t0
            hashes = kvm.req_to_page_hashes[rid]
            from easydel.inference.esurge.core.utils import PageHashWithGroupId  # noqa: PLC0415

            def register(pg, i, group):
                h = PageHashWithGroupId(hashes[i], group)
                pg.page_hash = h
                pool.cached_page_hash_to_page[h][pg.page_id] = pg

            for group, got in marks:  # the window's last pages, never read (no KV, no _page_keys)
                for j, pg in enumerate(got):
                    register(pg, first + want - len(got) + j, group)
                pool.free_pages(got[::-1])
            for i, pg in enumerate(new):
                register(pg, first + i, self.layout.kv_group)
                self._page_keys[pg.page_id] = key[: (first + i + 1) * p]
            pool.free_pages(new[::-1])  # tail first in eSurge's LRU, as its own free does
            self.counters.loaded_pages += want
        finally:
            for group in l1:
                pool.free_pages(group[::-1])
            self.cache.unpin_host(pin)
        pages2, n2 = orig(request, **kw)
        loaded = max(0, n2 - n)
        storage_part = max(0, min(loaded, matched - max(host0, n)))
        adm.host, adm.storage = loaded - storage_part, storage_part
        return pages2, n2

    def _prefetch(self, key: np.ndarray) -> None:
        op = self.l3.prefetch(RadixKey(key))
        deadline = time.monotonic() + self.prefetch_timeout_s
        while not self.l3.prefetch_ready(op):
            if time.monotonic() > deadline:
                self.l3.cancel(op)
                return
            self.cache.check_events()
            time.sleep(0.0005)
        self.l3.finish_prefetch(op)

    def _commit(self, adm: Admission) -> None:
        c = self.counters
        c.requests += 1
        c.prompt_tokens += adm.prompt_tokens
        for s in _SOURCES:
            c.cached_tokens[s] += getattr(adm, s)
        self.admissions.append(adm)
        self._by_id[adm.request_id] = adm
        if len(self._by_id) > 4096:
            self._by_id.pop(next(iter(self._by_id)))

    def _back_up(self, key: np.ndarray, page_ids: list[int]) -> int:
        """Back up the pages of ``key`` (one eSurge page id per whole page; -1: none) that the
        host tier lacks; returns pages backed up."""
        p = self.page_size
        _, matched, _ = self._host_path(key)
        npages = len(key) // p
        first = matched // p
        if first >= npages or any(pid < 0 for pid in page_ids[first:npages]):
            return 0
        slots = self.cache.alloc_device(npages)
        if slots is None:
            return 0
        t0 = time.perf_counter()
        # Slots of the backed-up prefix are never copied (the tree has them): map them to the
        # null page; the new ones to their eSurge pages.
        ids = [0] * first + list(page_ids[first:npages])
        self.transfer.map_slots(slots, ids)
        self.cache.insert(RadixKey(key[: npages * p]), slots)
        self.cache.flush()  # the gather was dispatched at issue; wait for the host copy
        self.cache.evict(self.cache.evictable_tokens)  # the slots only stood in for eSurge's pages
        self.counters.blocked_seconds["backup"] += time.perf_counter() - t0
        _, now, _ = self._host_path(key)
        done = max(0, now // p - first)
        self.counters.backed_up_pages += done
        return done

    def _on_free(self, kvm, request) -> None:
        if not self._attached:
            return
        self._pending.pop(request.request_id, None)
        self._passthrough.discard(request.request_id)
        p = self.page_size
        full = int(request.num_computed_tokens) // p
        if full <= 0:
            return
        toks = np.asarray(list(request.all_token_ids)[: full * p], np.int64)
        if len(toks) < full * p:
            return
        page_ids = list(kvm.get_page_ids(request.request_id)[self.layout.kv_group][:full])
        if len(page_ids) < full:
            return
        for i, pid in enumerate(page_ids):
            self._page_keys[pid] = toks[: (i + 1) * p]
        self._back_up(toks, page_ids)

    def _on_evict(self, page) -> None:
        self.counters.evictions_seen += 1
        key = self._page_keys.pop(page.page_id, None)
        if key is None or getattr(page.page_hash, "group_id", self.layout.kv_group) != self.layout.kv_group:
            return  # a window group's page holds no KV (KVLayout), whatever it held before
        _, matched, _ = self._host_path(key)
        p = self.page_size
        if matched >= len(key) or matched < len(key) - p:
            return  # already backed up, or its prefix is gone from the host tier
        ids = [-1] * (len(key) // p)
        ids[-1] = page.page_id
        ids[: len(ids) - 1] = [0] * (len(ids) - 1)
        if self._back_up(key, ids):
            self.counters.eviction_backups += 1

    def _after_weight_update(self) -> None:
        with self._lock:
            self._unpatch(self._sched_objs)
            self._pending.clear()
            self._page_keys.clear()
            if self.l3 is not None:
                self.l3.close()
            self.cache.reset()
            self.weights_revision = self._next_revision or f"{self.weights_revision}+{uuid.uuid4().hex[:12]}"
            self._next_revision = None
            self.transfer.close()
            self.transfer = FusedKVTransfer(
                lambda: _get_arrays(self.engine),
                lambda a: _set_arrays(self.engine, a),
                self.host_pool,
                num_slots=self.transfer.device_num_pages,
            )
            for m in self._metrics:
                m.unregister()
            self._metrics = []
            self._build_cache()
            self.counters.resets += 1
            self._install(self.engine)

    # ------------------------------------------------------------------ public
    def update_model_weights(self, *args, weights_revision: str, **kwargs) -> None:
        """``engine.update_model_weights`` with the new weights' revision (the L3 key changes)."""
        if not isinstance(weights_revision, str) or weights_revision == self.weights_revision:
            raise ValueError(f"weights_revision: expected a new str, got {weights_revision!r}")
        self._next_revision = weights_revision
        self.engine.update_model_weights(*args, **kwargs)

    def host_pages(self, tokens) -> np.ndarray:
        """Host pool page ids holding the backed-up whole pages at the start of ``tokens`` (one id
        per page, in order; empty when the host tier has none of them)."""
        key = np.asarray(tokens, np.int64)
        if key.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D sequence of token ids, got shape {key.shape}")
        with self._lock:
            return self._host_path(key[: (len(key) // self.page_size) * self.page_size])[2].copy()

    def stats(self) -> dict:
        """Per-tier cached prompt tokens and the adapter's counters (a copy)."""
        with self._lock:
            c = self.counters
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(c).items()}
            out["cache"] = self.cache.stats()
            if self.l3 is not None:
                out["storage"] = self.l3.stats()
            return out

    def register_prometheus(self, registry, labels: dict | None = None):
        """Export the cache's metrics (``hicache_*``) and the adapter's per-tier hits
        (``hicache_esurge_cached_tokens_total{cache_source}``) into ``registry``."""
        from prometheus_client.core import CounterMetricFamily

        from ...cache import register_prometheus

        labels = dict(labels or {})
        handle = self

        class _Collector:
            def collect(self):
                fam = CounterMetricFamily(
                    "hicache_esurge_cached_tokens",
                    "Prompt tokens eSurge did not recompute, by the tier that held them",
                    labels=[*labels, "cache_source"],
                )
                for s in _SOURCES:
                    fam.add_metric([*labels.values(), s], handle.counters.cached_tokens[s])
                yield fam
                fam = CounterMetricFamily("hicache_esurge_prompt_tokens", "Prompt tokens admitted", labels=list(labels))
                fam.add_metric(list(labels.values()), handle.counters.prompt_tokens)
                yield fam

        col = _Collector()
        registry.register(col)
        cache_metrics = register_prometheus(self.cache, registry, labels=labels)

        class _Registration:
            def unregister(self_inner):
                registry.unregister(col)
                cache_metrics.unregister()

        reg = _Registration()
        self._metrics.append(reg)
        return reg

    def detach(self) -> None:
        """Remove every hook (eSurge runs as before), finish L3 writes, release the tiers."""
        with self._lock:
            if not self._attached:
                return
            self._attached = False
            self._unpatch()
            self.cache.flush()
            if self.l3 is not None:
                self.l3.close()
            for m in self._metrics:
                m.unregister()
            self._metrics = []
            self.transfer.close()


def attach(
    engine,
    config: HiCacheConfig,
    *,
    model: str,
    weights_revision: str = "",
    host_pages: int | None = None,
    host_layout: HostLayout | str = HostLayout.PAGE_FIRST,
    prefetch_timeout_s: float = 5.0,
) -> EsurgeHiCache:
    """Put hicache_jax's host tier (``host_pages`` pages, default twice eSurge's pool) and, when
    ``config.storage`` is set, its L3 tier behind a running eSurge ``engine``. ``model`` and
    ``weights_revision`` go into every L3 key. Returns the handle (``stats``,
    ``register_prometheus``, ``update_model_weights``, ``detach``)."""
    with getattr(engine, "_scheduler_lock", None) or threading.RLock():
        return EsurgeHiCache(
            engine,
            config,
            model=model,
            weights_revision=weights_revision,
            host_pages=host_pages,
            host_layout=host_layout,
            prefetch_timeout_s=prefetch_timeout_s,
        )
