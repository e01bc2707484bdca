"""JAX transfer engine: D2H backups and H2D loads between a JaxDevicePool and a HostKVPool.

Two ways to move the bytes (``host_copy``), chosen at construction:

``xla_stream`` (default where the host pool is a ``PinnedHostArena``, i.e. built by
``pinned_host_pool`` on a platform with pinned host memory, and the device pool is on one
device): no host thread touches a KV byte. The host pool is a ``pinned_host`` jax.Array that
XLA copies from and into directly (``host_stream``):

* Backup (D2H): one all-layer gather per component into a device transfer buffer in the host
  layout's order (``page_copy``), then one executable that ``device_put``s each page to host
  memory and writes it into its host page of the donated arena (same address: the numpy view
  stays the pool). Both are asynchronous dispatches; the handle completes when the executable
  has (a token it returns), then checks the arena's address.
* Load (H2D), per layer group (``load_group_layers``; by default the fewest layers whose run of
  one page is >= 256 KiB): one executable streams each host page's group into a device staging
  buffer (reused: donated by the next load of the same shape), then one scatter per layer
  writes it into the layer's pool array (donated, in place) with device-resident ids. Each
  layer's new array is installed in the pool at once, so later model steps are ordered after it
  by dataflow; group g lands before group g+1; ``LoadHandle.layer_done(l)`` reports layer l.

``numpy`` (the fallback: no pinned memory, a pool sharded over a mesh, several processes):
  backup = the same gather, ``device_put`` to the host memory kind, and a worker that copies
  the first n pages into the host pool with one fancy-index copy; load = one numpy gather of
  the host pages into a staging buffer (pinned and reused through a ``StagingRing`` where the
  platform has pinned memory), one ``device_put``, one scatter per layer. Every byte crosses a
  CPU core once each way.

Several processes (a pool whose mesh spans ``jax.distributed`` processes, numpy path): the host
pool holds this process's KV heads only (``JaxDevicePool.local_geom``). A backup's worker copies
this process's shards of the transfer buffer (``local_numpy``); a load builds the global
staging buffer from every process's own host pages
(``jax.make_array_from_process_local_data``). Every process must issue the same copies in the
same order (the cache's agreed protocol does).

Threading: ``backup``/``load`` are called from the owner thread (the one that donates the
pool arrays to model steps; multi-host JAX also needs every ``device_put`` issued there), which
also owns the host arena array. The numpy path's D2H worker only converts finished host
buffers to numpy and writes host pages the manager has reserved for this backup; it runs
``worker_nice`` above the owner's priority (``hicache_jax.workers``), so its memcpy never takes
a core the model step wants.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np

from pallas_kernels.page_copy.dispatch import PageCopier, PageCopyConfig

from ...host_pool import HostKVPool
from ...transfer import (
    CompletedHandle,
    FutureHandle,
    KVTransferEngine,
    LoadHandle,
    SerialWorker,
    TransferError,
    TransferHandle,
)
from ...workers import DEFAULT_WORKER_NICE, check_nice
from .device_pool import JaxDevicePool
from .host_stream import (
    HostArenaMovedError,
    PinnedHostArena,
    StreamPlan,
    default_group_layers,
    default_stream_loop,
    layer_groups,
)
from .memory import StagingRing, host_memory_kind, staging_works

HOST_COPIES = ("auto", "xla_stream", "numpy")
log = logging.getLogger(__name__)

_PAGE_AXIS = {"nlp": 0, "npl": 0, "lnp": 1}
# Stream executables shared by every engine of the process: one depends only on its plan, its
# arena's shape, dtype and device and its bucket, not on which arena it is given (an argument),
# so a second engine of the same shapes traces, lowers and compiles none of them.
_SHARED_STREAM_EXES: dict = {}
_SHARED_STREAM_LOCK = threading.Lock()
_HEAD_AXIS = 3  # of a transfer buffer, in every order: (n | L, L | n, page, heads, width)


def local_numpy(arr: jax.Array) -> np.ndarray:
    """``arr`` as numpy, or, when it spans other processes, this process's part of it: its
    shards along the head axis (replicated copies once), in head order."""
    if arr.is_fully_addressable:
        return np.asarray(arr)
    parts = {}
    for sh in arr.addressable_shards:
        parts.setdefault(sh.index[_HEAD_AXIS].start or 0, sh.data)
    if len(parts) == 1:
        return np.asarray(next(iter(parts.values())))
    return np.concatenate([np.asarray(parts[k]) for k in sorted(parts)], axis=_HEAD_AXIS)


class JaxLoadHandle(LoadHandle):
    """Per-layer readiness of an H2D load: layer l is done when its pool arrays are ready.

    ``completed_at`` is stamped by the first ``wait_layer`` / ``layer_done`` / ``done`` that
    finds the last layer landed (JAX offers no completion callback): exact when the caller
    waits for the load before its step reads it, as the reference engine does."""

    def __init__(self, per_layer: list[list[jax.Array]]) -> None:
        self._per_layer = per_layer
        self.num_layers = len(per_layer)
        self._t_done: float | None = None

    @property
    def completed_at(self) -> float | None:
        return self._t_done

    @staticmethod
    def _ready(a: jax.Array) -> bool:
        # A consumed (donated) array was used by a later step, which ran after the load.
        return a.is_deleted() or a.is_ready()

    def layer_done(self, layer: int) -> bool:
        ok = all(self._ready(a) for a in self._per_layer[layer])
        if (
            ok
            and self._t_done is None
            and layer == self.num_layers - 1
            and all(self._ready(a) for arrays in self._per_layer for a in arrays)
        ):
            self._t_done = time.perf_counter()
        return ok

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        for a in self._per_layer[layer]:
            if not a.is_deleted():
                a.block_until_ready()
        if self._t_done is None and layer == self.num_layers - 1:
            self.layer_done(layer)  # stamps completed_at once every layer has landed

    def done(self) -> bool:
        return all(self.layer_done(l) for l in range(self.num_layers))


class StreamBackupHandle(TransferHandle):
    """A D2H stream backup: done when its executable's token is ready; then the arena's address
    is checked (a moved arena fails the copy instead of leaving the numpy view stale)."""

    def __init__(self, token: jax.Array, arena_array: jax.Array, arena: PinnedHostArena) -> None:
        self._token, self._arena_array, self._arena = token, arena_array, arena
        self._t_done: float | None = None
        self._error: Exception | None = None

    @property
    def completed_at(self) -> float | None:
        return self._t_done

    def _finish(self) -> None:
        if self._t_done is not None:
            return
        try:
            self._token.block_until_ready()
            self._arena.check(self._arena_array)  # HostArenaMovedError
        except Exception as e:  # noqa: BLE001 - a moved arena or an XLA runtime failure of the copy
            self._error = e
        self._t_done = time.perf_counter()
        self._token = self._arena_array = None  # drop references: the arena array may be donated later

    def done(self) -> bool:
        if self._t_done is None and self._token.is_ready():
            self._finish()
        return self._t_done is not None

    def wait(self, timeout: float | None = None) -> None:
        self._finish()
        if self._error is not None:
            raise TransferError(f"D2H backup failed: {self._error}") from self._error


class JaxTransferEngine(KVTransferEngine):
    """Moves whole KV pages between a ``JaxDevicePool`` (L1) and a ``HostKVPool`` (L2): the
    ``engine`` a ``HiRadixCache`` is built on (``HiRadixCache(config, engine, pool.allocator)``).

    Build it with the device pool and a host pool of the same geometry (``pinned_host_pool``
    gives the fastest path where the platform has pinned host memory), then call
    ``precompile()`` once so serving never compiles a copy. The cache calls ``backup``
    (device -> host, returns a handle it polls) and ``load`` (host -> device, a handle with
    per-layer readiness: a model step waits on ``wait_layer(l)`` before reading loaded pages);
    your code does not need to call them. ``close()`` stops its worker thread (after the
    cache's ``flush()``).

    Ownership and threads: the cache owns the host pool's pages; ``backup`` / ``load`` run on
    the cache's owner thread (they donate the device pool's arrays and install the results).
    The numpy path's D2H worker thread only writes host pages reserved for its backup.

    ``copier`` / ``copy_config``: the page gather/scatter implementation (``PageCopyConfig``;
    XLA by default). ``host_copy``: ``"auto"`` streams through the pinned host arena where the host pool has one
    (see the module docstring), ``"xla_stream"`` requires it (``ValueError`` naming what is
    missing), ``"numpy"`` forces the CPU-copy path. ``load_group_layers``: layers per H2D
    executable on the stream path (None: ``default_group_layers``). ``stream_loop`` /
    ``stream_unroll``: how the stream executables loop over pages (``host_stream``: ``dynamic``
    over the live count, or ``static`` over the bucket, unrolled; None: what measured best on
    the pool's platform, ``default_stream_loop``). ``self.host_copy`` says which path runs,
    ``self.stream_loop`` / ``self.stream_unroll`` which loop."""

    def __init__(
        self,
        device_pool: JaxDevicePool,
        host_pool: HostKVPool,
        copier: PageCopier | None = None,
        copy_config: PageCopyConfig | None = None,
        use_host_memory_kind: bool = True,
        worker_nice: int = DEFAULT_WORKER_NICE,
        host_copy: str = "auto",
        load_group_layers: int | None = None,
        stream_loop: str | None = None,
        stream_unroll: int | None = None,
    ) -> None:
        if host_copy not in HOST_COPIES:
            raise ValueError(f"host_copy: expected one of {HOST_COPIES}, got {host_copy!r}")
        if stream_loop is None:
            stream_loop, auto_unroll = default_stream_loop(device_pool.local_device.platform)
            stream_unroll = auto_unroll if stream_unroll is None else stream_unroll
        elif stream_unroll is None:
            stream_unroll = 1
        self.stream_loop, self.stream_unroll = stream_loop, stream_unroll
        if device_pool.local_geom != host_pool.geom:
            raise ValueError(
                f"host_pool: geometry {host_pool.geom} differs from this process's share of the device "
                f"pool {device_pool.local_geom}"
            )
        self.multiprocess = device_pool.multiprocess
        self.geom = host_pool.geom
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device_num_pages = device_pool.num_pages
        if copier is None:
            mesh, axis = device_pool.copier_sharding
            copier = PageCopier(
                copy_config or PageCopyConfig(max_pages=device_pool.num_pages),
                mesh=mesh,
                kv_axis=axis,
                device=device_pool.local_device if mesh is None else None,
            )
        self.copier = copier
        self.order = host_pool.layout.transfer_order
        # Memory kind D2H buffers land in (pinned where the platform has it); None: plain copies.
        self.host_memory_kind = host_memory_kind(device_pool.local_device) if use_host_memory_kind else None
        # Pinned H2D staging for single-device pools (sharded pools take numpy -> device_put).
        self._ring = None
        if self.host_memory_kind == "pinned_host" and device_pool.mesh is None:
            ring_device = next(iter(device_pool.sharding.device_set))
            failed = staging_works(ring_device, "pinned_host")
            if failed:
                log.warning(
                    "H2D staging falls back to pageable numpy buffers (pinned staging failed on this runtime): %s",
                    failed,
                )
            else:
                self._ring = StagingRing(ring_device, "pinned_host")
        self._d2h = SerialWorker("hicache-d2h", check_nice(worker_nice))
        why_not = self._why_no_stream(use_host_memory_kind)
        if host_copy == "xla_stream" and why_not:
            raise ValueError(f"host_copy: 'xla_stream' needs {why_not}")
        self.host_copy = "xla_stream" if host_copy != "numpy" and not why_not else "numpy"
        if self.host_copy == "xla_stream":
            self._arena: PinnedHostArena = host_pool.buffer_owner
            self._plan = StreamPlan(
                self.order,
                self.geom.num_layers,
                self.device_pool.geom.page_shape,
                self.device_pool.dtype,
                stream_loop,
                stream_unroll,
            )
            group = default_group_layers(self.geom) if load_group_layers is None else load_group_layers
            self.load_groups = layer_groups(self.geom.num_layers, group)
            self._stream_exes: dict = {}
            self._staging: dict = {}
            self._device = next(iter(device_pool.sharding.device_set))
            failed = self._probe_stream()
            if failed:
                if host_copy == "xla_stream":
                    raise ValueError(f"host_copy: 'xla_stream' does not work on this runtime: {failed}")
                log.warning(
                    "host copies fall back to numpy (streaming pinned host pages failed on this runtime): %s", failed
                )
                self.host_copy = "numpy"
        else:  # validated even where unused
            if load_group_layers is not None:
                layer_groups(self.geom.num_layers, load_group_layers)
            StreamPlan(self.order, 1, (1, 1, 1), self.device_pool.dtype, stream_loop, stream_unroll)

    def _probe_stream(self) -> str:
        """'' if the stream copies work on this runtime, else what went wrong.

        Compiles and runs one D2H and one H2D on a one-page arena of the same kind (never on the
        pool's own: had XLA moved the pool's arena, its numpy view would point at freed memory):
        XLA must update the donated arena in place and both directions must carry the bytes."""
        try:
            probe = PinnedHostArena(self.geom, self.host_pool.layout, 1, self._device)
            shape = self._plan.staging_shape(1, self.geom.num_layers)
            pattern = np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape) % 61 + 1
            pattern = pattern.astype(np.float32).astype(self.device_pool.dtype)
            bufs = tuple(jax.device_put(pattern, self._device) for _ in self.geom.components)
            ids, n = self._pad_ids(np.zeros(1, np.int32), 1)
            new, token = self._jit_d2h(probe)(probe.array, bufs, ids, n)
            probe.install(new, check_address=False)
            token.block_until_ready()
            probe.check(new)
            pages = probe.view.view(self.device_pool.dtype).reshape(probe.shape)  # (C, page-major of 1 page)
            if not all((page == pattern).all() for page in pages):
                return "a probe page written by the D2H copy does not hold the bytes sent"
            zeros = tuple(jax.device_put(np.zeros(shape, self.device_pool.dtype), self._device) for _ in bufs)
            back = self._jit_h2d(probe, 1, 0, self.geom.num_layers)(probe.array, ids, n, zeros)
            if not all((np.asarray(b) == pattern).all() for b in back):
                return "a probe page read by the H2D copy does not hold the host page's bytes"
        except HostArenaMovedError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a runtime that cannot compile or run host streaming
            return f"{type(e).__name__}: {e}"
        return ""

    @property
    def replicated(self) -> bool:
        """The device pool's ``replicated``: every rank holds every head of its pages."""
        return self.device_pool.replicated

    @property
    def h2d_staging(self) -> str:
        """What the numpy path's loads stage host pages in: ``pinned`` (a ring of reused pinned
        buffers) or ``numpy`` (fresh pageable arrays: no pinned memory, or its probe failed)."""
        return "pinned" if self._ring is not None else "numpy"

    @property
    def stream_executables(self) -> int:
        """Stream copy executables built so far (0 on the numpy path); precompile builds them all."""
        return len(self._stream_exes) if self.host_copy == "xla_stream" else 0

    def _why_no_stream(self, use_host_memory_kind: bool) -> str:
        """'' if the stream path can run, else what it needs (for the error / the fallback)."""
        arena = self.host_pool.buffer_owner
        if not use_host_memory_kind:
            return "use_host_memory_kind=True"
        if not isinstance(arena, PinnedHostArena):
            return "a host pool in pinned host memory (hicache_jax.backends.jax.memory.pinned_host_pool)"
        if self.device_pool.mesh is not None or self.multiprocess:
            return "a device pool on one device (sharded pools use the numpy path)"
        if arena.device not in self.device_pool.sharding.device_set:
            return f"the host arena to belong to the pool's device (it belongs to {arena.device})"
        if arena.dtype != self.device_pool.dtype:
            return f"the host arena's dtype {arena.dtype} to equal the pool's {self.device_pool.dtype}"
        return ""

    def precompile(self, max_pages: int | None = None) -> int:
        """Compile every bucket's gather, scatter (and stream copies) now, so serving never compiles."""
        shape = (self.device_num_pages,) + self.device_pool.geom.page_shape
        built = self.copier.precompile(
            shape, self.device_pool.dtype, self.geom.num_layers, (self.order,), max_pages=max_pages
        )
        if self.host_copy == "xla_stream":
            for nb in self.copier.buckets:
                if max_pages is not None and nb > self.copier.bucket_for(max_pages):
                    break
                self._d2h_exe(nb)
                for l0, g in self.load_groups:
                    self._h2d_exe(nb, l0, g)
                    # group-sized scatter shapes (the copier's precompile covers all-layer buffers)
                    self.copier.precompile_scatter(
                        shape, self.device_pool.dtype, self._plan.staging_shape(nb, g), nb, self.order
                    )
                built += 1 + len(self.load_groups)
        return built

    # ---- stream executables ---------------------------------------------------------------
    def _jit_h2d(self, arena: PinnedHostArena, nb: int, l0: int, g: int):
        """The jitted H2D stream copy of ``arena``'s pages (layers [l0, l0+g)) into staging."""
        dev = (jax.sharding.SingleDeviceSharding(self._device),) * len(self.geom.components)
        return jax.jit(
            self._plan.h2d(nb, l0, g),
            donate_argnums=(3,),
            in_shardings=(arena.sharding, dev[0], dev[0], dev),
            out_shardings=dev,
        )

    def _jit_d2h(self, arena: PinnedHostArena):
        """The jitted D2H stream copy of transfer buffers into ``arena`` (donated)."""
        dev = jax.sharding.SingleDeviceSharding(self._device)
        return jax.jit(
            self._plan.d2h(),
            donate_argnums=(0,),
            in_shardings=(arena.sharding, (dev,) * len(self.geom.components), dev, dev),
            out_shardings=(arena.sharding, dev),
        )

    def _compiled(self, key, build):
        # ``build() -> (jitted, example args)`` only on a miss: building a ``jax.jit`` and its
        # avals costs ~1 ms of Python, and this runs on every load and backup.
        exe = self._stream_exes.get(key)
        if exe is None:
            arena = self._arena
            shared_key = (self._plan, arena.shape, arena.dtype, self._device) + key
            with _SHARED_STREAM_LOCK:
                exe = _SHARED_STREAM_EXES.get(shared_key)
                if exe is None:
                    jitted, args = build()
                    exe = _SHARED_STREAM_EXES[shared_key] = jitted.trace(*args).lower().compile()
            self._stream_exes[key] = exe
        return exe

    def _aval(self, shape):
        return jax.ShapeDtypeStruct(
            tuple(shape), self.device_pool.dtype, sharding=jax.sharding.SingleDeviceSharding(self._device)
        )

    def _ids_aval(self, n):
        return jax.ShapeDtypeStruct((n,), np.int32, sharding=jax.sharding.SingleDeviceSharding(self._device))

    def _h2d_exe(self, nb: int, l0: int, g: int):
        def build():
            staging = tuple(self._aval(self._plan.staging_shape(nb, g)) for _ in self.geom.components)
            # the arena itself, not an aval: a ShapeDtypeStruct does not carry the host memory space
            return (
                self._jit_h2d(self._arena, nb, l0, g),
                (self._arena.array, self._ids_aval(nb), self._ids_aval(1), staging),
            )

        return self._compiled(("h2d", nb, l0, g), build)

    def _d2h_exe(self, nb: int):
        def build():
            bufs = tuple(self._aval(self._plan.staging_shape(nb, self.geom.num_layers)) for _ in self.geom.components)
            return self._jit_d2h(self._arena), (self._arena.array, bufs, self._ids_aval(nb), self._ids_aval(1))

        return self._compiled(("d2h", nb), build)  # see _h2d_exe

    def _pad_ids(self, ids: np.ndarray, nb: int) -> tuple[jax.Array, jax.Array]:
        padded = np.zeros(nb, np.int32)
        padded[: ids.size] = ids
        ids_dev, n_dev = jax.device_put((padded, np.array([ids.size], np.int32)), self._device)  # one batched call
        return ids_dev, n_dev

    # ---- D2H ---------------------------------------------------------------------------
    def backup(self, device_ids, host_ids) -> FutureHandle | CompletedHandle:
        d, h = self.validate(device_ids, host_ids)
        if not d.size:
            return CompletedHandle(self.geom.num_layers)
        if self.host_copy == "xla_stream":
            return self._backup_stream(d, h)
        staged = []
        for c in self.geom.components:
            buf, n = self.copier.gather(self.device_pool.layers(c), d, self.order)
            if self.host_memory_kind is not None:
                buf = jax.device_put(buf, buf.sharding.with_memory_kind(self.host_memory_kind))
            staged.append((c, buf))
        axis, host, view_dtype = _PAGE_AXIS[self.order], self.host_pool, self.geom.container_dtype

        def finish() -> None:
            for c, buf in staged:
                arr = local_numpy(buf).view(view_dtype)
                arr = arr[:, :n] if axis == 1 else arr[:n]
                host.write_pages_unchecked(c, h, arr)

        return FutureHandle(self._d2h.submit(finish))

    def _backup_stream(self, d: np.ndarray, h: np.ndarray) -> StreamBackupHandle:
        nb = self.copier.bucket_for(d.size)
        if self._plan.loop == "static":  # padding repeats the last page (host_stream's docstring)
            d, h = (np.concatenate([x, np.full(nb - x.size, x[-1], x.dtype)]) for x in (d, h))
        bufs = tuple(self.copier.gather(self.device_pool.layers(c), d, self.order)[0] for c in self.geom.components)
        ids, n = self._pad_ids(h, nb)
        new_arena, token = self._d2h_exe(nb)(self._arena.array, bufs, ids, n)
        self._arena.install(new_arena, check_address=False)  # checked when the handle completes
        return StreamBackupHandle(token, new_arena, self._arena)

    # ---- H2D ---------------------------------------------------------------------------
    def load(self, host_ids, device_ids) -> JaxLoadHandle | CompletedHandle:
        d, h = self.validate(device_ids, host_ids)
        if not d.size:
            return CompletedHandle(self.geom.num_layers)
        if self.host_copy == "xla_stream":
            return self._load_stream(d, h)
        nb = self.copier.bucket_for(h.size)
        padded = np.zeros(nb, np.int32)
        padded[: h.size] = h  # padding reads host page 0; the scatter skips those positions
        per_layer: list[list[jax.Array]] = [[] for _ in range(self.geom.num_layers)]
        for c in self.geom.components:
            layers = self.device_pool.layers(c)  # checked once (StaleDevicePoolError); updated in place below
            dev_buf = self._stage_h2d(c, padded)
            for layer in range(self.geom.num_layers):
                new = self.copier.scatter(layers[layer], d, dev_buf, layer, self.order)
                self.device_pool.set_layer(c, layer, new)
                per_layer[layer].append(layers[layer])  # the installed (committed) array
        return JaxLoadHandle(per_layer)

    def _load_stream(self, d: np.ndarray, h: np.ndarray) -> JaxLoadHandle:
        nb = self.copier.bucket_for(h.size)
        ids, n = self._pad_ids(h, nb)
        per_layer: list[list[jax.Array]] = [[] for _ in range(self.geom.num_layers)]
        layers = {c: self.device_pool.layers(c) for c in self.geom.components}  # checked (StaleDevicePoolError)
        for l0, g in self.load_groups:
            key = (nb, l0, g)
            staging = self._staging.pop(key, None)
            if staging is None:
                shape = self._plan.staging_shape(nb, g)
                staging = tuple(
                    jax.device_put(np.zeros(shape, self.device_pool.dtype), self._device) for _ in self.geom.components
                )
            staging = self._h2d_exe(nb, l0, g)(self._arena.array, ids, n, staging)
            self._staging[key] = staging  # donated by the next load of this shape
            for c, buf in zip(self.geom.components, staging):
                new = self.copier.scatter_layers(layers[c][l0 : l0 + g], d, buf, self.order)
                for j, arr in enumerate(new):
                    self.device_pool.set_layer(c, l0 + j, arr)
                    per_layer[l0 + j].append(self.device_pool.buffers[c][l0 + j])  # the installed array
        return JaxLoadHandle(per_layer)

    def _stage_h2d(self, component: str, padded_ids: np.ndarray) -> jax.Array:
        """Host pages -> contiguous staging buffer -> device transfer buffer (async)."""
        if self._ring is None:
            staging = self.host_pool.read_pages(component, padded_ids).view(self.device_pool.dtype)
            sharding = self.copier.buffer_sharding() or self.device_pool.sharding
            if self.multiprocess:  # every process contributes its own heads
                shape = list(staging.shape)
                shape[_HEAD_AXIS] = self.device_pool.geom.heads
                return jax.make_array_from_process_local_data(sharding, staging, tuple(shape))
            return jax.device_put(staging, sharding)
        shape = self.host_pool.component_view(component).shape
        shape = (shape[0], padded_ids.size) + shape[2:] if self.order == "lnp" else (padded_ids.size,) + shape[1:]
        view, owner = buf = self._ring.acquire(shape, self.device_pool.dtype)
        self.host_pool.read_pages(component, padded_ids, out=view.view(self.geom.container_dtype))
        dev_buf = jax.device_put(owner, self.device_pool.sharding)
        self._ring.release(buf, dev_buf)
        return dev_buf

    def close(self) -> None:
        self._d2h.shutdown()
