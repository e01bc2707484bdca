"""The reference engine: request queue, prefix match, load-back, chunked prefill, batched
greedy decode, eviction under memory pressure, per-request results.

L3: with ``storage`` configured, a request starts an L3 prefetch when it arrives; at
admission the prefetch is finished (per its policy) before the prefix match, so pages that
came from storage are host-only nodes that the load-back brings to the device. Every
acknowledged D2H backup is written through to storage by the controller.

Scheduling (one thread, the owner of the device pool): admit waiting requests FIFO while
the batch has room and device pages can be had (``alloc_device`` evicts unlocked leaves). A
request that could not get its pages even by evicting every unlocked page waits, without
touching its L3 prefetch; with nothing running, the scheduler first waits for the D2H copies
in flight (they lock their nodes), so that a host hit can still be loaded back. A waiting
request whose prefix leaves the host (evicted meanwhile) prefetches it from L3 again.
each admitted request matches its prompt (at most ``len - 1`` tokens, so the last prompt
token is always computed and yields the first output token), loads its host-only
continuation back, prefills the rest in chunks and emits its first token (TTFT is taken
then); running requests decode together, one token per step, allocating a page when they
cross a page boundary. Finished requests are inserted into the tree (``cache_finished_req``)
and their locks released. Transfer events are polled every step.

Ordering: loads and model steps update the same per-layer pool arrays functionally (every
step consumes the arrays the previous operation produced), so with the JAX transfer engine a
prefill that reads loaded pages is ordered after the load by data dependence. The engine does
not rely on that: before the first step of a request with a load-back it waits for each layer
of the load in order (``wait_layer``; the model step is one fused program over every layer,
so it reads each layer only after all of them landed), which is what a backend whose layers
land asynchronously needs. A load that failed is acknowledged there and then, so the cache
retries it into the same pages before anything reads them (or latches ``CacheFailedError``).

Hybrid models (``ModelConfig.is_hybrid``: sliding-window layers): the SWA layers' KV lives in
its own device pool (``swa_pool``, ``swa_device_pages`` pages) with its own host pool and
transfer engine, registered in the cache as an ``SWAComponent`` (window ``sliding_window``). The
cache call sequence per request (``HiRadixCache``'s "Sliding-window (SWA) requests"):

1. admission: ``begin_request(prompt[:-1])`` matches a prefix usable for the window (its full
   pages and the SWA pages of the ``W - 1`` tokens before its end), loads back its host / L3
   continuation (full pages and only the window's SWA pages) and locks it (the lock holds only
   the window's SWA pages). The full pages of the whole request are reserved then, as for any
   model; SWA pages are not: they are allocated step by step.
2. before each prefill chunk and each decode step that starts a page: ``alloc_component("swa",
   n)`` (evicts SWA by the component's rules: tombstones, unlocked leaves whole; if short, the
   engine flushes in-flight copies, whose holds pin SWA pages, and retries) and
   ``req.extend(key, full_pages, {"swa": swa_pages})`` (a decode step: ``req.append([token],
   full_pages, {"swa": swa_pages})``); the prefill waits for every layer of
   the load-back of both pools (``wait_layer(i)``, ``wait_layer(j, component="swa")``).
3. after each step: ``slide_window(req)``: the request's own SWA pages wholly before the next
   step's window go back to the SWA pool (entries -1) and the lock's hold on the tree's window
   pages is released once the window has moved past all of them. So a request never holds
   more than ``swa_table_width(W, chunk)`` SWA pages of its own plus one tree window
   (``swa_pages_needed``), however long it gets.
4. after the prefill ``cache_unfinished_req(req)`` (SWA pages out of the window are
   tombstones, the window's pages go to the tree); at the end ``cache_finished_req(req)``.
   Without the cache (``use_cache=False``) the request's remaining SWA pages are freed.

``metrics.peak_device_pages`` / ``peak_swa_device_pages``: the most distinct pages of each pool
the requests being served referenced at once (their page tables, the tree's pages among them,
and the full pool's decode reserve), sampled before every model step: the memory serving needs,
whatever the cache keeps besides.

Several processes (``ranks``: a ``multiprocess.RankContext``): the engine is one tensor-parallel
rank. Its device pool is sharded over the ranks' mesh on the KV-head axis (replicated on every
rank for MLA or a model with fewer KV heads than ranks), its host pool holds its own heads, the model's weights are replicated, and the cache agrees with the other ranks
once per step; arrivals are admitted by the agreed clock and a waited load-back is always
acknowledged through the agreement (``multiprocess``). Every rank gives the same tokens.
A hybrid (SWA) model runs over ranks too: its SWA pool is sharded like the full pool, window
slides go to the length every rank reached (``slide_window(req, written=)``: up to a step
late, so ``swa_pages_needed`` adds a step of slack and an SWA allocation that finds no page
first runs ``cache.agree_step()``), and SWA backups are agreed. With L3 storage the
controller agrees the SWA windows too: an L3 hit's window pages are reserved beside its full
pages and read in a second phase, before the agreed end of the full read, so every rank
attaches the same pages with the same window (``l3.rank_steps``). So does speculative decoding
(the draft pool sharded, or replicated where it has fewer KV heads than ranks), of a hybrid
target too (a verify step moves the window by up to ``k + 1`` tokens, so the slack per decoding
request is ``ceil((k + 1) / page)`` pages). Every combination of {full, hybrid} x {spec off,
on} runs over ranks.

Failures: a copy that still fails after the cache's retries latches ``CacheFailedError``. The
engine recovers: every request it holds (running, or being admitted or finished) is
abandoned - its own device pages freed, its state dropped -, the cache is ``reset()``, and
the requests go back to the front of the queue in arrival order. Their prefixes then come
back from L3 or are recomputed; greedy decoding is deterministic, so their tokens are those
of an undisturbed run. Results already returned by finished requests are kept. Each recovery
counts in ``metrics.cache_failures_recovered``; after ``MAX_FAILURES_WITHOUT_PROGRESS``
failures in a row with no request finishing in between, the error is raised.

Speculative decoding (``spec=SpecConfig(...)``): the prefill and the decode step are the
``SpecDecoder``'s (``hicache_jax.engine.speculative``: an EAGLE-style draft head whose KV pool
is the cache's ``draft`` sidecar, verification of ``k`` chained proposals in one target step,
the same tokens as plain greedy decoding). Its hooks here: the tree keys, the pages a request
reserves, the prefill, the decode step and the per-request results. With a hybrid target the
decoder takes the SWA pool, this engine's SWA allocation (``_alloc_swa``) and window slide
(``speculative``: "Hybrid (sliding-window) targets"); a request's look-ahead SWA pages are
freed at its finish and by a recovery.

Deterministic mode (``EngineCacheConfig.deterministic``): the runner runs every prefill chunk
and decode step in one fixed shape (``PagedRunner``'s deterministic mode), so a position's KV
and logits depend only on the tokens before it: the tokens with and without the cache, from
any tier, are identical on any platform, and so are the bytes of every page (a cached page
equals the page a cold prefill computes). The default mode gives the cache's own contract
only: a hit serves the bytes that were stored. ``enable_page_audit`` checks that in the engine
(``page_audit``): every page a hit serves is compared with the bytes computed for its prefix.

The last cached position (the rule): the draft's KV entry at position ``j`` is computed from
token ``j + 1``, so with speculative decoding the tree is keyed by token *pairs* (position
``j``'s key is ``(t_j, t_{j+1})``) and a request inserts only positions whose successor it has
committed: a hit at ``j`` implies the successor the entry was computed with, on every tier
and for every page size; the uncached tail (a partial page, or a page whose last successor
differs) is recomputed in both models, as without speculation. A prompt of ``L`` tokens still
matches at most ``L - 1`` positions; see the ``speculative`` module for what follows.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..allocator import ID_DTYPE
from ..backends.jax import JaxDevicePool, JaxTransferEngine
from ..backends.jax.memory import pinned_host_pool
from ..cache import CacheFailedError, CacheRequest, HiRadixCache, LoadBackResult, RadixKey
from ..cache.components import SWAComponent
from ..l3 import PrefetchOperation, StorageController
from ..stack import CacheStack
from ..reference_model import ModelConfig, PagedRunner, swa_table_width
from ..reference_model.weights import ModelWeights
from .config import EngineCacheConfig
from .multiprocess import AgreedClock
from .page_audit import PageAudit
from .speculative import SpecConfig, SpecDecoder, SpecState

log = logging.getLogger(__name__)


@dataclass
class RequestResult:
    """What one request produced and where its prefix came from."""

    prompt_len: int
    tokens: list[int]
    cached_tokens: dict[str, int]  # {"device", "host", "storage"}: prefix tokens served per tier
    ttft_s: float
    latency_s: float
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from the cache)
    queue_s: float = 0.0  # arrival -> admission (waiting for a batch slot, device room or other prefills)
    # Speculative decoding (empty / None without it): accepted proposals + 1 per verify step,
    # their mean, and the k proposals each verify step checked.
    accept_lengths: list[int] = field(default_factory=list)
    accept_length: float | None = None
    draft_proposals: list[list[int]] = field(default_factory=list)

    @property
    def service_s(self) -> float:
        """Admission -> first token: match, load-back and prefill (``ttft_s - queue_s``)."""
        return self.ttft_s - self.queue_s

    @property
    def cached_total(self) -> int:
        return sum(self.cached_tokens.values())


@dataclass
class EngineMetrics:
    """What the engine itself counts (the cache's counters are ``cache.metrics``)."""

    cache_failures_recovered: int = 0  # CacheFailedError latched, cache reset, requests re-admitted
    requests_readmitted: int = 0  # requests abandoned by those recoveries and queued again
    # Most pages of each device pool held at once by running requests (not evictable by the
    # cache), sampled before every model step; the SWA pool's is 0 for a non-hybrid model.
    peak_device_pages: int = 0
    peak_swa_device_pages: int = 0
    # Several ranks: SWA allocations that found the pool short and succeeded after one
    # agreement step applied the pending (agreed, lagging) window slides.
    swa_allocs_after_agreed_slides: int = 0


@dataclass(eq=False)
class _Seq:
    index: int
    prompt: np.ndarray
    max_new: int
    arrival: float
    req: CacheRequest | None = None
    out: list[int] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    ttft: float = 0.0
    admitted: float = 0.0  # perf_counter() when the admission that succeeded started
    computed: int = 0
    reserve: np.ndarray | None = None  # device pages allocated at admission for the decode steps
    prefetch: PrefetchOperation | None = None
    storage_tokens: int = 0  # tokens attached from L3 by this request's prefetches so far
    load: LoadBackResult | None = None  # the admission's load-back, until the prefill waited for it
    spec: SpecState | None = None  # speculative decoding only
    audited: int = 0  # pages of its own the page audit has recorded
    audit_s: float = 0.0  # time the page audit spent on it (left out of its TTFT and latency)
    stop: frozenset = frozenset()  # token ids that end it early (emitted, then it finishes)

    @property
    def finished(self) -> bool:
        return len(self.out) >= self.max_new or (bool(self.out) and self.out[-1] in self.stop)

    def abandon(self) -> None:
        """Forget everything admission and serving produced (the request is queued again)."""
        self.req, self.reserve, self.prefetch, self.load, self.spec = None, None, None, None, None
        self.out = []
        self.cached = {"device": 0, "host": 0, "storage": 0}
        self.ttft, self.computed, self.storage_tokens, self.audited, self.audit_s = 0.0, 0, 0, 0, 0.0

    @property
    def all_tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.out, np.int64)])


_NO_PAGES = np.zeros(0, ID_DTYPE)


class OutOfDeviceMemory(RuntimeError):
    """A request cannot fit in the device pool even with everything evictable evicted."""


# The latest arrival ``generate`` accepts (seconds after the call): the engine sleeps until
# then, so an offset far in the future (or infinite) would hang the call.
MAX_ARRIVAL_S = 24 * 3600.0
# Copy failures (each latching CacheFailedError) the engine recovers from in a row, with no
# request finishing in between, before it gives up and raises the error.
MAX_FAILURES_WITHOUT_PROGRESS = 3


def _check_arrivals(arrivals: object, n: int) -> list[float]:
    if isinstance(arrivals, (str, bytes)) or not isinstance(arrivals, (list, tuple, np.ndarray)):
        raise TypeError(f"arrivals: expected a list of seconds, got {type(arrivals).__name__}")
    out = []
    for a in arrivals:
        if isinstance(a, bool) or not isinstance(a, (int, float, np.integer, np.floating)):
            raise TypeError(f"arrivals: expected numbers (seconds), got {type(a).__name__} {a!r}")
        a = float(a)
        if not 0 <= a <= MAX_ARRIVAL_S:  # False for NaN too
            raise ValueError(f"arrivals: each offset must be finite, in [0, {MAX_ARRIVAL_S:g}] seconds, got {a!r}")
        out.append(a)
    if len(out) != n:
        raise ValueError(f"arrivals: expected one offset per prompt ({n}), got {len(out)}")
    return out


class Engine:
    """``spec``: speculative decoding options (None: plain greedy decoding). ``weights``:
    trained weights for ``model_config`` (``reference_model.weights.ModelWeights``: a target +
    draft pair from ``load_pair``, or a real checkpoint such as
    ``models.gemma3.load_model()``, which a config of another family than ``reference``
    requires); None builds the reference model and draft from ``model_config.seed``. ``ranks``: a ``multiprocess.RankContext`` to
    run as one of N tensor-parallel ranks (None: one process). Every device pool (full, SWA,
    draft) is built on the ranks' mesh."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: EngineCacheConfig | None = None,
        *,
        spec: SpecConfig | None = None,
        weights: ModelWeights | None = None,
        ranks=None,
    ) -> None:
        if not isinstance(model_config, ModelConfig):
            raise TypeError(f"model_config: expected a ModelConfig, got {type(model_config).__name__}")
        cache_config = cache_config or EngineCacheConfig()
        if not isinstance(cache_config, EngineCacheConfig):
            raise TypeError(f"cache_config: expected an EngineCacheConfig, got {type(cache_config).__name__}")
        if spec is not None and not isinstance(spec, SpecConfig):
            raise TypeError(f"spec: expected a SpecConfig or None, got {type(spec).__name__}")
        if model_config.max_positions is not None and cache_config.max_context > model_config.max_positions:
            raise ValueError(
                f"cache_config: max_context {cache_config.max_context} exceeds the model's context of "
                f"{model_config.max_positions} positions"
            )
        if spec is not None and 2 + spec.extra_positions > cache_config.max_context:
            # The shortest request (1 prompt token, 1 new) writes 2 * k - 1 positions past its end.
            raise ValueError(
                f"spec: num_draft_tokens {spec.num_draft_tokens} needs max_context >= "
                f"{2 + spec.extra_positions} (1 prompt token + 1 new + 2 * k - 1 verify positions), "
                f"cache_config.max_context is {cache_config.max_context}"
            )
        if weights is not None:
            if not isinstance(weights, ModelWeights):
                raise TypeError(
                    f"weights: expected ModelWeights (e.g. PairWeights, Gemma3Weights) or None, got "
                    f"{type(weights).__name__}"
                )
            if weights.config != model_config:
                raise ValueError(f"weights: trained for {weights.config}, not for model_config {model_config}")
        elif model_config.family != "reference":
            raise ValueError(
                f"weights: required for model family {model_config.family!r} (a checkpoint, e.g. "
                "hicache_jax.models.gemma3.load_model())"
            )
        from pallas_kernels.page_copy import PageCopyConfig

        self.model_config, self.cache_config = model_config, cache_config
        page = cache_config.page_size
        self.geom = model_config.kv_geometry(page)
        self.ranks = ranks
        mesh = None if ranks is None else ranks.mesh
        # Fewer KV heads than ranks (e.g. 8 KV heads on 16 ranks): every rank holds every head,
        # as an MLA pool does; its L3 pages are then written by rank 0 under rank-independent keys.
        self.device_pool = JaxDevicePool(self.geom, cache_config.device_pages, mesh=mesh, replicate_fewer_heads=True)
        host_pages = cache_config.host.num_pages(self.geom, cache_config.device_pages)  # equal on every rank
        self.host_pool = pinned_host_pool(
            self.device_pool.local_geom, host_pages, cache_config.host.layout, device=self.device_pool.local_device
        )
        self.transfer = JaxTransferEngine(
            self.device_pool,
            self.host_pool,
            copy_config=PageCopyConfig(impl=cache_config.copy_impl, max_pages=cache_config.device_pages),
            worker_nice=cache_config.worker_nice,
        )
        self.transfer.precompile()
        if (
            spec is not None
            and cache_config.deterministic
            and spec.num_draft_tokens + 1 > cache_config.deterministic_step_tokens
        ):
            raise ValueError(
                f"cache_config: deterministic_step_tokens {cache_config.deterministic_step_tokens} must "
                f"hold a verify step of num_draft_tokens + 1 = {spec.num_draft_tokens + 1} tokens"
            )
        draft = weights.draft() if weights is not None else None
        if spec is not None and weights is not None and draft is None:
            raise ValueError(
                f"spec: speculative decoding needs a draft head, and these weights have none ({type(weights).__name__})"
            )
        self.runner = PagedRunner(
            model_config,
            page,
            max_pages_per_seq=-(-cache_config.max_context // page),
            model=weights.target() if weights is not None else None,
            fixed_shape=cache_config.fixed_step_shape,
        )
        if ranks is not None:
            self.runner.state = ranks.replicate(self.runner.state)
        self.spec = (
            None
            if spec is None
            else SpecDecoder(
                spec, self.runner, self.device_pool, cache_config, host_pages, self.transfer.copier.config, head=draft
            )
        )
        if self.spec is not None:
            self.spec.before_target_step = self._sample_peaks
        self.hybrid = model_config.is_hybrid
        self.swa_pool = self.swa_transfer = self.swa = None
        components = []
        if self.hybrid:
            self.swa_pool, self.swa_transfer, self.swa = self._swa_component(host_pages)
            components.append(self.swa)
            if self.spec is not None:  # its target steps take the SWA pool (``speculative``)
                self.spec.attach_swa(self.swa_pool, self._alloc_swa, self._slide)
        self.cache = HiRadixCache(
            cache_config.tree_config(),
            self.transfer,
            self.device_pool.allocator,
            self.spec.sidecars if self.spec is not None else None,
            components=components,
            agreement=None if ranks is None else ranks.agreement,
        )
        self._clock = None if ranks is None else AgreedClock(self.cache)
        self.storage = None
        # The model identity of the L3 keys (also what a ``KVEventSource`` of this cache takes,
        # so its events' keys equal the L3's).
        self.storage_model_id = f"hicache-jax-reference:{model_config!r}" + (":pair-keys" if spec is not None else "")
        if cache_config.deterministic:  # other numerics: KV of another shape or width never hits
            self.storage_model_id += f":deterministic{self.runner.fixed_shape}x{self.runner.max_pages_per_seq}"
        self.storage_weights_revision = weights.digest if weights is not None else ""
        if cache_config.storage is not None:
            # The model id seeds every L3 key: another model, seed, shape or weights never hits;
            # a speculative engine's tree keys are token pairs, so its pages are apart too.
            self.storage = StorageController(
                self.cache, model=self.storage_model_id, weights_revision=self.storage_weights_revision
            )
        # Shutdown order (cache copies, L3 writes, store, transfer engines, drafter): close().
        self._stack = CacheStack(self.cache, self.storage, [self.transfer, self.swa_transfer], closers=[self.spec])
        self.page_size = page
        # Instrumentation: called with "start" / "end" around every batched decode step (on the
        # scheduler thread, outside the timed work of the step itself); None = off.
        self.on_decode_step = None
        self.metrics = EngineMetrics()
        self._serving: list[_Seq] = []  # the scheduler's running list (peak sampling only)
        self.audit: PageAudit | None = None  # enable_page_audit()

    @staticmethod
    def swa_pages_needed(
        model_config: ModelConfig, cache_config: EngineCacheConfig, spec: SpecConfig | None = None, ranks: bool = False
    ) -> int:
        """SWA device pages the running requests of a hybrid model can hold at once: one
        prefilling (its chunk and the window before it) and ``max_batch - 1`` decoding, each
        also holding, until its window has moved past them, the tree's window pages its lock
        holds (one window, ``ceil((W - 1) / page)`` pages: the tree holds whole nodes).

        With speculative decoding (``spec``) a decoding request's step is a verify of ``k + 1``
        positions from the end of its key: it holds the pages from its key's window (the
        slide keeps whole pages from ``floor(key / page) * page - (W - 1)``) to the page of
        its last verify position, at most ``ceil((W - 1) / page) + 1 + ceil(k / page)``.

        With several ranks (``ranks``) a window slide is agreed at the next agreement step
        (``slide_window(req, written=)``), so it lags up to a step: a prefilling request keeps
        up to one chunk's pages more (``ceil(chunk / page) + 1``, the chunk need not start on
        a page boundary) and each decoding request the pages one step moves its window over:
        ``ceil(step / page)`` for a step of ``step`` tokens (1 plain, ``k + 1`` for a verify
        step with ``spec``: its key grows by up to ``k + 1`` per round). Where the lag is
        longer (prefill chunks run back to back), ``_alloc_swa`` runs an agreement step and
        retries."""
        w, p = model_config.sliding_window, cache_config.page_size
        chunk = min(cache_config.prefill_chunk, cache_config.max_context)
        tree_window = -(-max(1, w - 1) // p)
        decode = swa_table_width(w, 1, p)
        step = 1
        if spec is not None:
            decode = tree_window + 1 + -(-spec.num_draft_tokens // p)
            step = spec.num_draft_tokens + 1
        lag = (-(-chunk // p) + 1 + (cache_config.max_batch - 1) * -(-step // p)) if ranks else 0
        return (
            swa_table_width(w, chunk, p)
            + (cache_config.max_batch - 1) * decode
            + cache_config.max_batch * tree_window
            + lag
        )

    def _swa_component(self, host_pages: int):
        """The SWA pool, its host pool and transfer engine, and the cache component over them."""
        from pallas_kernels.page_copy import PageCopyConfig

        cfg, model = self.cache_config, self.model_config
        need = self.swa_pages_needed(
            model, cfg, None if self.spec is None else self.spec.config, ranks=self.ranks is not None
        )
        pages = cfg.swa_device_pages if cfg.swa_device_pages is not None else need + cfg.device_pages // 4
        if pages < need:
            raise ValueError(
                f"swa_device_pages: {pages} pages; {cfg.max_batch} running requests with window "
                f"{model.sliding_window} and prefill chunks of {cfg.prefill_chunk} tokens can hold "
                f"{need} at once"
            )
        geom = model.swa_kv_geometry(cfg.page_size)
        # On the full pool's mesh, sharded on the KV heads as it is (its host pool: this rank's heads).
        full = self.device_pool
        pool = JaxDevicePool(geom, pages, mesh=full.mesh, kv_axis=full.kv_axis or "tp", replicate_fewer_heads=True)
        host = pinned_host_pool(
            pool.local_geom, max(1, host_pages * pages // cfg.device_pages), cfg.host.layout, device=pool.local_device
        )
        transfer = JaxTransferEngine(
            pool, host, copy_config=PageCopyConfig(impl=cfg.copy_impl, max_pages=pages), worker_nice=cfg.worker_nice
        )
        transfer.precompile()
        return pool, transfer, SWAComponent(transfer, pool.allocator, model.sliding_window)

    # ---- public API ----------------------------------------------------------------------
    def enable_page_audit(self, audit: PageAudit | None = None) -> PageAudit:
        """Check from now on that every page a hit serves holds bytes computed for its prefix
        (``page_audit``): pass another engine's audit to compare with what that engine
        computed (a restarted engine reading its L3 pages). Returns the audit. Reads pages back
        from the device: for tests and benchmarks. The engine only dispatches the reads while
        serving (``PageAudit.submit_*``); hashing and comparing wait for ``audit.settle()`` (or
        ``stats()``), so the audit stays out of the serving loop; the dispatch time is left out
        of the audited request's TTFT and latency (``audit.counts.seconds`` is the total,
        settling included). One process only (not with ``ranks``)."""
        if self.ranks is not None:
            raise ValueError("enable_page_audit: reads whole pages from the device; not with ranks (sharded pools)")
        if audit is None:
            audit = PageAudit(self.page_size)
        elif not isinstance(audit, PageAudit):
            raise TypeError(f"audit: expected a PageAudit or None, got {type(audit).__name__}")
        elif audit.page_size != self.page_size:
            raise ValueError(f"audit: made for page size {audit.page_size}, this engine's is {self.page_size}")
        audit.warm(self._audit_pools(), self.device_pool.num_pages)
        self.audit = audit
        return audit

    def _audit_pools(self) -> list:
        return [self.device_pool] + ([self.spec.device_pool] if self.spec is not None else [])

    def _audit_served(self, seq: _Seq) -> None:
        """The pages the cache served ``seq`` (its prefix, every tier), once landed."""
        t0 = time.perf_counter()
        p, c = self.page_size, seq.cached
        hit = sum(c.values())
        tiers = [
            "device" if j * p < c["device"] else "host" if j * p < c["device"] + c["host"] else "storage"
            for j in range(hit // p)
        ]
        self.audit.submit_check(
            self._audit_pools(), self._key(seq.prompt, hit).token_ids, seq.req.device_pages, tiers, seq.index
        )
        dt = time.perf_counter() - t0
        seq.audit_s += dt
        self.audit.add_seconds(dt)

    def _audit_computed(self, seq: _Seq) -> None:
        """The full pages ``seq`` computed so far (after its cached prefix): they enter the tree."""
        t0 = time.perf_counter()
        req = seq.req
        first = max(seq.audited, sum(seq.cached.values()) // self.page_size)
        seq.audited = len(req.key) // self.page_size
        self.audit.submit_record(self._audit_pools(), req.key.token_ids, req.device_pages, first, seq.audited)
        dt = time.perf_counter() - t0
        seq.audit_s += dt
        self.audit.add_seconds(dt)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        use_cache: bool = True,
        arrivals: list[float] | None = None,
        stop_tokens=(),
    ) -> list[RequestResult]:
        """Greedy-decode every prompt; results in prompt order.

        ``use_cache=False``: no prefix reuse (every prompt prefilled from scratch, nothing
        inserted) - the baseline. ``arrivals``: per prompt, seconds after the call at which
        the request arrives (it is not admitted earlier; TTFT and latency count from it).
        ``stop_tokens``: token ids that end a request early (e.g. a chat model's end of turn):
        the stop token is the last one returned, and the cache keeps the sequence up to it.
        Not with speculative decoding (a verify step emits several tokens at once).
        """
        # Everything is validated before anything runs: a bad prompt fails the call before any
        # match touches the tree and before any other prompt is served (no lost results).
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if not isinstance(use_cache, bool):
            raise TypeError(f"use_cache: expected a bool, got {type(use_cache).__name__}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
        if arrivals is not None:
            arrivals = _check_arrivals(arrivals, len(prompts))
        stop = self._check_stop_tokens(stop_tokens)
        seqs = []
        now = time.perf_counter() if self._clock is None else self._clock.restart()
        device_pages = self.cache_config.device_pages
        extra = self._extra_positions
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple, np.ndarray)):
                raise TypeError(f"prompts[{i}]: expected a list of int token ids, got {type(p).__name__}")
            arr = np.asarray(p)
            if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
                raise ValueError(f"prompts[{i}]: expected a non-empty list of int token ids")
            if arr.min() < 0 or arr.max() >= self.model_config.vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {self.model_config.vocab_size})")
            if arr.size + max_new_tokens + extra > self.cache_config.max_context:
                spec = f" + {extra} written ahead by speculative decoding" if extra else ""
                raise ValueError(
                    f"prompts[{i}]: {arr.size} tokens + {max_new_tokens} new{spec} exceed max_context "
                    f"{self.cache_config.max_context}"
                )
            need = self._pages_for(arr.size + max_new_tokens - 1 + extra)
            if need > device_pages:
                raise ValueError(
                    f"prompts[{i}]: {arr.size} tokens + {max_new_tokens} new need {need} device pages, "
                    f"the pool has {device_pages}"
                )
            seqs.append(
                _Seq(i, arr.astype(np.int64), max_new_tokens, now + (arrivals[i] if arrivals else 0.0), stop=stop)
            )
        waiting, running, done = deque(sorted(seqs, key=lambda s: s.arrival)), [], {}
        if self.cache.failure is not None:  # latched by an earlier call (flush, eviction...)
            self._recover([], waiting)
        removed_seen = -1
        failures = 0  # recoveries since a request last finished
        while waiting or running:
            try:
                removed_seen, finished = self._schedule(waiting, running, done, use_cache, removed_seen)
                failures = 0 if finished else failures
            except CacheFailedError:
                failures += 1
                if failures > MAX_FAILURES_WITHOUT_PROGRESS:
                    raise
                queued = set(map(id, waiting))
                # Running requests, and one that was being admitted, prefilled or finished.
                self._recover([s for s in seqs if s.index not in done and id(s) not in queued], waiting)
                running.clear()
                removed_seen = -1
        return [done[i] for i in range(len(seqs))]

    def _check_stop_tokens(self, stop_tokens) -> frozenset:
        if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (list, tuple, set, frozenset)):
            raise TypeError(f"stop_tokens: expected a list of int token ids, got {type(stop_tokens).__name__}")
        vocab = self.model_config.vocab_size
        for t in stop_tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"stop_tokens: expected token ids in [0, {vocab}), got {t!r}")
        if stop_tokens and self.spec is not None:
            raise ValueError(
                "stop_tokens: not supported with speculative decoding (a verify step emits several tokens at once)"
            )
        return frozenset(int(t) for t in stop_tokens)

    def _schedule(
        self, waiting: deque, running: list, done: dict, use_cache: bool, removed_seen: int
    ) -> tuple[int, bool]:
        """One scheduler round: prefetches, admissions (each prefilled at once), one batched
        decode step, finished requests retired, transfer events polled. Returns the eviction
        count seen by the prefetches and whether a request finished."""
        n_done = len(done)
        self._serving = running
        if use_cache and self.storage is not None:
            removed_seen = self._start_prefetches(waiting, removed_seen)
        if not running and waiting and waiting[0].arrival > self._now():
            time.sleep(max(0.0, waiting[0].arrival - time.perf_counter()))  # idle until the next arrival
        while waiting and len(running) < self.cache_config.max_batch and waiting[0].arrival <= self._now():
            seq = waiting[0]
            t_admit = time.perf_counter()
            if not self._admit(seq, use_cache, have_running=bool(running)):
                break
            seq.admitted = t_admit
            waiting.popleft()
            self._prefill(seq)
            if use_cache and self.audit is not None:
                self._audit_computed(seq)
            if use_cache:  # the prompt's pages become shareable (and backed up) right away
                self.cache.cache_unfinished_req(seq.req)
            if seq.finished:
                done[seq.index] = self._finish(seq, use_cache)
            else:
                running.append(seq)
        if running:
            hook = self.on_decode_step
            if hook is not None:
                hook("start")
            if self.spec is not None:
                self.spec.decode_round(running)
            else:
                self._decode_step(running)
            if hook is not None:
                hook("end")
            for seq in [s for s in running if s.finished]:
                done[seq.index] = self._finish(seq, use_cache)
                running.remove(seq)  # after the finish: a failed one is abandoned with the others
        self.cache.check_events()
        return removed_seen, len(done) > n_done

    def _now(self) -> float:
        """The clock arrivals are admitted by: this process's, or with several ranks the
        agreed one (``multiprocess.AgreedClock``), which only moves at agreement steps."""
        return time.perf_counter() if self._clock is None else self._clock.now()

    def _recover(self, lost: list[_Seq], waiting: deque) -> None:
        """After ``CacheFailedError``: abandon ``lost`` (the requests holding pages or locks),
        reset the cache, free the requests' own device pages and queue them again, first, in
        arrival order. Waiting requests only lose their L3 prefetches (started again)."""
        error = self.cache.failure
        alloc = self.device_pool.allocator
        own = []  # request-owned pages: after the tree's prefix, and the decode reserve
        swa_own = []  # the requests' own SWA pages (after the tree's prefix, ids >= 0)
        for s in lost:
            if s.req is not None:
                own.append(s.req.device_pages[s.req.cached_pages :])
                if self.hybrid and s.req.component_pages:
                    ids = s.req.component_pages["swa"][s.req.cached_pages :]
                    swa_own.append(ids[ids >= 0])
            if s.spec is not None and s.spec.swa_ahead.size:  # speculative look-ahead SWA pages
                swa_own.append(s.spec.swa_ahead)
            if s.reserve is not None:
                own.append(s.reserve)
        self.cache.reset()  # frees every page the tree owned, drops every lock
        if self.storage is not None:
            for s in (*lost, *waiting):
                if s.prefetch is not None:
                    self.storage.cancel(s.prefetch)
        # A page a torn insert had handed to the tree was freed by the reset: free only the
        # rest. No request is left and the tree is empty, so nothing else may stay allocated.
        ids = np.unique(np.concatenate(own)) if own else np.zeros(0, np.int64)
        ids = ids[alloc.is_allocated(ids)] if ids.size else ids
        alloc.free(ids)
        if alloc.used:
            left = np.flatnonzero(alloc.is_allocated(np.arange(alloc.num_pages)))
            log.warning("engine: %d device pages still allocated after a cache reset (freed)", left.size)
            alloc.free(left)
        if self.hybrid:
            swa = self.swa_pool.allocator
            ids = np.unique(np.concatenate(swa_own)) if swa_own else np.zeros(0, np.int64)
            ids = ids[swa.is_allocated(ids)] if ids.size else ids
            swa.free(ids)
            if swa.used:
                left = np.flatnonzero(swa.is_allocated(np.arange(swa.num_pages)))
                log.warning("engine: %d SWA pages still allocated after a cache reset (freed)", left.size)
                swa.free(left)
        for s in waiting:
            s.prefetch, s.storage_tokens = None, 0  # their attached L3 pages left with the tree
        for s in sorted(lost, key=lambda s: (s.arrival, s.index), reverse=True):
            s.abandon()
            waiting.appendleft(s)
        self.metrics.cache_failures_recovered += 1
        self.metrics.requests_readmitted += len(lost)
        log.warning("engine: recovered from %r: cache reset, %d requests queued again", error, len(lost))

    def warmup(self) -> None:
        """Compile every model-step shape now (prefill chunks and decode batch sizes), so
        measured TTFTs contain no compilation. The cache contents are unchanged."""
        cfg = self.cache_config
        if self.spec is not None:
            self.spec.warmup(cfg.max_batch, cfg.prefill_chunk)
            return
        if not self.hybrid:
            self.device_pool.apply(lambda pools: (None, self.runner.warmup(pools, cfg.max_batch, cfg.prefill_chunk)))
            return

        def both(pools):
            def swa(swa_pools):
                pools2, swa2 = self.runner.warmup(pools, cfg.max_batch, cfg.prefill_chunk, swa_pools=swa_pools)
                return pools2, swa2

            return None, self.swa_pool.apply(swa)

        self.device_pool.apply(both)

    def evict_device_cache(self) -> int:
        """Evict every unlocked device page of the tree (backed-up nodes stay on the host).

        Waits for in-flight backups first so write-through copies are not lost. Returns the
        tokens evicted. Used to force L2 hits in tests and benchmarks.
        """
        self.cache.flush()
        return self.cache.evict(self.cache.evictable_tokens)

    def evict_host_cache(self) -> int:
        """Evict the device tier, then every unlocked host page (after L3 writes finished), so
        the next requests can only hit storage. Returns host tokens evicted.

        The device eviction can itself back nodes up (write_back), and their L3 writes pin the
        host copies until stored: so the flush comes between the two evictions too."""
        self.flush()
        self.cache.evict(self.cache.evictable_tokens)
        self.flush()
        return self.cache.evict_host(self.cache.host_tokens)

    def stats(self) -> dict:
        """The cache's stats plus the engine's own counters (``metrics``) and, with speculative
        decoding, its counters and mean accept lengths (``spec_*``)."""
        spec = self.spec.metrics.stats() if self.spec is not None else {}
        return {**self.cache.stats(), **vars(self.metrics), **spec}

    def flush(self) -> None:
        """Wait until every backup has reached its last tier (host, and storage if configured)."""
        self.cache.flush()
        if self.storage is not None:
            self.storage.flush()

    def close(self) -> None:
        """Finish every transfer (L3 writes included) and release workers, in ``CacheStack``'s
        order. A latched copy failure resets the cache first (its copies are waited for, their
        errors ignored). Idempotent."""
        self._stack.close()

    # ---- scheduling steps ----------------------------------------------------------------
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def _extra_positions(self) -> int:
        """KV positions a request writes past ``prompt + max_new - 1`` (speculative decoding)."""
        return self.spec.config.extra_positions if self.spec is not None else 0

    def _key(self, tokens: np.ndarray, n: int) -> RadixKey:
        """The tree key of the first ``n`` positions of ``tokens`` (token pairs with
        speculative decoding: ``speculative`` module docstring)."""
        return RadixKey(tokens[:n]) if self.spec is None else self.spec.key(tokens, n)

    def _start_prefetches(self, waiting: deque, removed_seen: int) -> int:
        """Arrived requests start their L3 prefetch right away. A waiting request whose
        prefetch ended without a read (skipped: the tree held its prefix; revoked) gets a new
        one when the tree has since lost part of that prefix (host eviction while it waited),
        so the pages come back from L3 instead of being recomputed. The re-check walks the
        tree only after something left a tier. Returns the eviction count it has seen."""
        m = self.cache.metrics
        removed = m.evicted_device_tokens + m.evicted_host_tokens
        now = self._now()
        for seq in waiting:
            if seq.arrival > now:
                break
            op = seq.prefetch
            if op is None:
                seq.prefetch = self.storage.prefetch(self._key(seq.prompt, seq.prompt.shape[0] - 1))
            elif (
                removed != removed_seen
                and op.status in ("skipped", "revoked")
                and sum(self.cache.peek_prefix(op.key)) < op.start
            ):
                self.storage.cancel(op)
                seq.prefetch = self.storage.prefetch(op.key)
        return removed

    def _admit(self, seq: _Seq, use_cache: bool, have_running: bool) -> bool:
        prompt = seq.prompt
        p = self.page_size
        # Every page the request will write (prompt + max_new - 1 tokens of KV) is allocated
        # now, so a running request never runs out of device memory mid-decode.
        total = self._pages_for(prompt.shape[0] + seq.max_new - 1 + self._extra_positions)
        if use_cache:
            # Whatever its prefix's tier, the request needs device pages for everything after
            # its on-device prefix (a host or L3 hit is loaded into new pages).
            on_device, _ = self.cache.peek_prefix(self._key(prompt, prompt.shape[0] - 1))
            if total - on_device // p > self.device_pool.allocator.available + self.cache.evictable_tokens // p:
                if have_running:
                    return False  # wait for room; an L3 prefetch keeps running meanwhile
                # Nodes under a D2H backup stay locked until acknowledged: wait for the copies
                # before the match, so that the load-back of a host hit can evict them too.
                self.cache.flush()
            req = self._match(seq, 0)
        else:
            req = CacheRequest(self._key(prompt, 0), p)
        pages = self.cache.alloc_device(total - req.device_pages.shape[0])
        if pages is None and not have_running:
            # Rare after the flush above (the request's own prefix counted as evictable there).
            # Wait for every copy, then match again, so a host hit is not recomputed.
            if req.last_node is not None:
                self.cache.dec_lock_ref(req.last_node)
            self.cache.flush()
            if use_cache:
                req = self._match(seq, seq.cached["host"] + seq.cached["storage"])
            pages = self.cache.alloc_device(total - req.device_pages.shape[0])
        if pages is None:
            if req.last_node is not None:
                self.cache.dec_lock_ref(req.last_node)
            if not have_running:
                raise OutOfDeviceMemory(
                    f"prompt of {prompt.shape[0]} tokens needs "
                    f"{total - req.device_pages.shape[0]} free device pages; "
                    f"{self.device_pool.allocator.available} free after eviction"
                )
            return False
        seq.req = req
        if self.hybrid:  # the prefill extends the request chunk by chunk, with SWA pages
            seq.reserve = pages
            return True
        prompt_pages = 0  # with speculative decoding the key grows as the draft KV becomes final
        if self.spec is None:
            prompt_pages = self._pages_for(prompt.shape[0]) - req.device_pages.shape[0]
            req.extend(RadixKey(prompt), pages[:prompt_pages])
        seq.reserve = pages[prompt_pages:]
        return True

    def _match(self, seq: _Seq, loaded_before: int) -> CacheRequest:
        """Attach the L3 prefetch, match the prompt and load its host continuation back; sets
        ``seq.cached``. ``loaded_before``: tokens an earlier attempt loaded back (on the device
        now, but they came from the host or L3)."""
        prompt = seq.prompt
        if seq.prefetch is not None:  # L3 pages become host-only nodes before the match
            seq.storage_tokens += self.storage.finish_prefetch(seq.prefetch)
            seq.prefetch = None
        # Match at most len-1 tokens: the last prompt token is always computed.
        req, lb = self.cache.begin_request(self._key(prompt, prompt.shape[0] - 1))
        seq.load = lb  # the prefill waits for it, layer by layer
        hit = req.device_pages.shape[0] * self.page_size
        req.key = self._key(prompt, hit)
        loaded = min(hit, loaded_before + (lb.num_tokens if lb is not None else 0))
        # Pages attached from L3 (by this or an earlier, failed admission attempt) are the tail
        # of the host-only chain the load-back brings in.
        storage = min(seq.storage_tokens, loaded)
        seq.cached = {"device": hit - loaded, "host": loaded - storage, "storage": storage}
        return req

    def _run(self, token_lists, starts, seqs: list[_Seq]) -> np.ndarray:
        # The step donates the pool arrays; apply installs the ones it returns.
        self._sample_peaks(seqs)
        reqs = [s.req for s in seqs]
        tables = [r.device_pages for r in reqs]
        if not self.hybrid:
            return self.device_pool.apply(self.runner.step, token_lists, starts, tables)
        swa_tables = [r.component_pages["swa"] for r in reqs]

        def both(pools):
            def swa(swa_pools):
                logits, new, new_swa = self.runner.step(
                    pools, token_lists, starts, tables, swa_pools=swa_pools, swa_page_tables=swa_tables
                )
                return (logits, new), new_swa

            return self.swa_pool.apply(swa)

        return self.device_pool.apply(both)

    def _sample_peaks(self, stepping: list[_Seq]) -> None:
        seqs = {id(s): s for s in (*self._serving, *stepping) if s.req is not None}.values()
        reqs = [s.req for s in seqs]
        full = [r.device_pages for r in reqs] + [s.reserve for s in seqs if s.reserve is not None]
        m = self.metrics
        m.peak_device_pages = max(m.peak_device_pages, np.unique(np.concatenate(full)).size)
        if self.hybrid:  # a request's own SWA pages, and a speculative one's look-ahead pages
            swa = [r.component_pages["swa"] for r in reqs if r.component_pages]
            swa += [s.spec.swa_ahead for s in seqs if s.spec is not None]
            swa = np.concatenate(swa) if swa else np.zeros(0, ID_DTYPE)
            m.peak_swa_device_pages = max(m.peak_swa_device_pages, np.unique(swa[swa >= 0]).size)

    def _grow(self, seq: _Seq, tokens: np.ndarray) -> None:
        """Hybrid models: extend the request to ``tokens``, with full pages from its reserve
        and new SWA pages, before the step that writes their KV."""
        req = seq.req
        need = self._pages_for(tokens.shape[0]) - req.device_pages.shape[0]
        pages, seq.reserve = seq.reserve[:need], seq.reserve[need:]
        req.extend(RadixKey(tokens), pages, {"swa": self._alloc_swa(need)})

    def _alloc_swa(self, need: int) -> np.ndarray:
        """``need`` SWA device pages for a running request (evicting cached windows)."""
        swa = self.cache.alloc_component("swa", need)
        if swa is None and self.ranks is not None:
            # Several ranks: the slides noted since the last agreement step have not freed
            # their pages yet (agreed slides lag); one step applies them. The device SWA pool's
            # state is agreed, so every rank sees this None and runs the same step.
            self.cache.agree_step()
            swa = self.cache.alloc_component("swa", need)
            self.metrics.swa_allocs_after_agreed_slides += swa is not None
        if swa is None:
            # Copies in flight hold SWA pages (a backup its source, a load-back its window):
            # wait for them; what the running requests hold fits (``swa_pages_needed``).
            self.cache.flush()
            swa = self.cache.alloc_component("swa", need)
            if swa is None:
                raise OutOfDeviceMemory(
                    f"SWA pool: {need} pages wanted, {self.swa_pool.allocator.available} free after eviction"
                )
        return swa

    def _slide(self, reqs) -> None:
        if self.hybrid:
            for req in reqs:  # the step just run wrote the KV of the whole key (on this rank)
                self.cache.slide_window(req, written=req.num_tokens)

    def _prefill(self, seq: _Seq) -> None:
        req = seq.req
        self._wait_load(seq)
        if self.audit is not None and sum(seq.cached.values()):
            self._audit_served(seq)
        start = sum(seq.cached.values())  # the cached prefix (from any tier) is not recomputed
        seq.computed = seq.prompt.shape[0] - start
        if self.spec is not None:
            seq.out.append(self.spec.prefill(seq, start, self.cache_config.prefill_chunk))
            self.spec.sync_key(seq)
            seq.ttft = time.perf_counter() - seq.arrival - seq.audit_s
            return
        n = seq.prompt.shape[0]
        chunk = self.cache_config.prefill_chunk
        logits = None
        while start < n:
            end = min(n, start + chunk)
            if self.hybrid:
                self._grow(seq, seq.prompt[:end])
            logits = self._run([seq.prompt[start:end].tolist()], [start], [seq])
            self._slide([req])
            start = end
        seq.out.append(int(np.argmax(logits[0])))
        seq.ttft = time.perf_counter() - seq.arrival - seq.audit_s

    def _wait_load(self, seq: _Seq) -> None:
        """Wait for each layer of the request's load-back, in order, before a step reads it.

        A layer already reported done is waited on too: that costs nothing and is where a
        failed copy surfaces. Then the cache acknowledges the loads at once, retrying the
        failed one into the same pages (nothing has read them yet), or latches
        ``CacheFailedError`` (the engine recovers)."""
        lb, seq.load = seq.load, None
        if lb is None:
            return
        layers = [(i, None) for i in range(self.geom.num_layers)]
        if self.hybrid:
            layers += [(j, "swa") for j in range(self.swa_pool.geom.num_layers)]
        for layer, component in layers:
            try:
                if component is None:
                    lb.wait_layer(layer)
                else:
                    lb.handle.wait_layer(layer, component=component)
            except Exception:  # noqa: BLE001 - TransferError, or a backend's own error type
                self.cache.loading_check(block=True)
                return
        if self.spec is not None:
            try:
                self.spec.wait_load(lb)  # the draft pages of the same load
            except Exception:  # noqa: BLE001
                self.cache.loading_check(block=True)
                return
        if self.ranks is not None:  # every rank acknowledges: a failure on one is seen by all
            self.cache.loading_check(block=True)

    def _decode_step(self, running: list[_Seq]) -> None:
        for seq in running:
            # The newest token enters the KV now: ``append`` adds it to the request's key in
            # O(1) (``extend`` with the whole grown key would copy and compare every token).
            req = seq.req
            total = seq.prompt.shape[0] + len(seq.out)
            need = self._pages_for(total) - req.device_pages.shape[0]
            pages = _NO_PAGES
            if need:
                pages, seq.reserve = seq.reserve[:need], seq.reserve[need:]
            if self.hybrid:
                req.append([seq.out[-1]], pages, {"swa": self._alloc_swa(need)})
            else:
                req.append([seq.out[-1]], pages)
        logits = self._run(
            [[s.out[-1]] for s in running], [s.prompt.shape[0] + len(s.out) - 1 for s in running], running
        )
        self._slide([s.req for s in running])
        for seq, lg in zip(running, logits):
            seq.out.append(int(np.argmax(lg)))

    def _finish(self, seq: _Seq, use_cache: bool) -> RequestResult:
        req = seq.req
        if use_cache:
            if self.audit is not None:
                self._audit_computed(seq)
            self.cache.cache_finished_req(req)
        else:
            self.device_pool.allocator.free(req.device_pages)
            if self.hybrid and req.component_pages:
                ids = req.component_pages["swa"]
                self.swa_pool.allocator.free(ids[ids >= 0])
        if seq.reserve is not None and seq.reserve.size:
            self.device_pool.allocator.free(seq.reserve)
        spec = self.spec.finish(seq) if self.spec is not None else {}
        return RequestResult(
            int(seq.prompt.shape[0]),
            list(seq.out),
            dict(seq.cached),
            seq.ttft,
            time.perf_counter() - seq.arrival - seq.audit_s,
            seq.computed,
            max(0.0, seq.admitted - seq.arrival),
            **spec,
        )
