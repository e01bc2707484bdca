"""Picks a page-copy implementation by platform and runs it on bucketed, precompiled shapes.

``PageCopier`` is what pools and transfer engines call. It

* validates page ids on the host (``common.check_page_ids``: range; destination duplicates)
  and raises ``ValueError`` before anything is launched;
* pads the ids to a bucket size and passes the live count as data, so every count inside a
  bucket reuses one compiled executable (``precompile`` builds them all at start-up; steady
  state never compiles);
* bitcasts KV to an unsigned container of the same width, so kernels copy bits, not floats;
* runs the kernel per shard under ``shard_map`` when the pool is sharded over a mesh axis
  (the KV-head axis), so sharded pools give the same bytes as unsharded ones.

Implementations (``impl``): ``tpu`` (scalar-prefetch DMA), ``mgpu`` (Mosaic GPU, TMA through
shared memory), ``gpu`` (Pallas Triton, deprecated by jax 0.11: kept until ``mgpu`` has replaced
it on hardware), ``xla`` (the pure-JAX reference: take / donated ``.at[].set``; on the CPU the
scatter runs as per-page ``dynamic_update_slice`` s, see ``reference``). ``auto`` picks
``tpu`` on TPU, ``xla`` on CPU (interpreted kernels are a correctness tool there, 10-100x slower
than XLA's native gather/scatter; ask for a kernel explicitly to run it interpreted) and
``AUTO_GPU_IMPL`` on GPU: whichever implementation was measured fastest on a GPU (see the note
at ``AUTO_GPU_IMPL``). Upstream's io backend names are accepted too: ``kernel`` = ``auto``,
``direct`` = ``xla``.

Threading: call from the thread that owns the pool (JAX dispatch is asynchronous; the
arrays returned are futures). Donation: ``scatter`` consumes the pool array passed in and
returns its replacement; ``gather(out=...)`` consumes ``out``.

Imports: the kernel modules (``tpu``, ``gpu``, ``gpu_mgpu``) are imported when a copier that
runs them is built, not with this module: Mosaic GPU needs packages (absl) and a jax the
Python 3.11 install (jax 0.10) may lack, and a copier running ``xla`` needs none of them.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import reference
from .common import bucket_for, buffer_shape, check_order, check_page_ids, default_buckets

Impl = Literal["auto", "tpu", "mgpu", "gpu", "xla"]
IMPLS = ("auto", "tpu", "mgpu", "gpu", "xla")

# What ``auto`` runs on a GPU: the implementation measured fastest there (``hicache-jax bench
# transfer --compare-impls`` measures xla, mgpu and the Triton gpu side by side).
#
# Why XLA. Measured on one NVIDIA H100 80GB HBM3 (jax 0.11.2, 2026-11-25), 8 layers of
# 1024 pages x 8 heads x 128 x bf16, npl order, executables called with device-resident ids:
#   page 64 (1 GiB): gather xla 1094 / mgpu 1126 / triton 1043 GB/s, scatter 1032 / 1115 / 1074,
#                    a raw device copy of the same bytes 1112: every one runs at copy speed;
#   page 16:         gather 706 / 711 / 644, scatter 518 / 620 / 609 (raw copy 655);
#   page 1:          gather 167 / 100 / 108, scatter 36 / 35 / 7 (raw copy 145).
# Through ``PageCopier`` (host-side validation and id upload on every call) the same sweep over
# page sizes 1 / 16 / 64, 16 / 256 / 1024 pages and all three orders showed no implementation
# ahead across cases. With no kernel clearly faster anywhere and XLA fastest for 1-token
# pages, XLA (no custom kernel to maintain) stays; ``mgpu`` is the kernel to pick explicitly,
# and replaces the deprecated Triton ``gpu`` once Triton is gone.
AUTO_GPU_IMPL = "xla"

_KERNEL_PLATFORMS = {"tpu": ("tpu",), "gpu": ("gpu", "cuda"), "mgpu": ("gpu", "cuda")}
_KERNEL_MODULES = {"tpu": "tpu", "gpu": "gpu", "mgpu": "gpu_mgpu"}


def kernel_module(impl: str):
    """The kernel module of ``impl`` (``tpu`` / ``gpu`` / ``mgpu``), imported now (see
    "Imports" above); ImportError naming the implementation and the way out otherwise."""
    import importlib

    name = _KERNEL_MODULES[impl]
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:
        raise ImportError(
            f"impl: the {impl!r} page-copy kernels could not be imported ({type(e).__name__}: {e}); they need "
            f"jax>=0.11 with its Pallas {'Mosaic GPU' if impl == 'mgpu' else impl.upper()} backend (pip install "
            f"'hicache-jax[jax]' on Python 3.12+; on Python 3.11 the [jax] extra allows jax 0.10, whose Mosaic GPU "
            f"also needs absl-py). PageCopyConfig(impl='xla'), the default on CPU and GPU, needs none of it."
        ) from e


_CONTAINERS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_IO_BACKEND_ALIASES = {"kernel": "auto", "direct": "xla"}
_GLOBAL_EXES: dict = {}
_GLOBAL_LOCK = threading.Lock()


def _to_bits(x: jax.Array, c) -> jax.Array:  # no-op when c is x's own dtype
    return x if x.dtype == c else jax.lax.bitcast_convert_type(x, c)


def _from_bits(x: jax.Array, dtype) -> jax.Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _check_layers(pools: Sequence[jax.Array]) -> jax.Array:
    """The first pool layer, after checking there is one and every layer has its shape and dtype."""
    if not pools:
        raise ValueError("pools: expected at least one pool layer")
    p0 = pools[0]
    for p in pools:
        if p.shape != p0.shape or p.dtype != p0.dtype:
            raise ValueError(
                f"pools: every layer must have shape {p0.shape} and dtype {p0.dtype}, got {p.shape} {p.dtype}"
            )
    return p0


def _shard_map(f, mesh, in_specs, out_specs):
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map as sm

        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@dataclass(frozen=True)
class PageCopyConfig:
    """How pages are copied. ``max_pages`` is the largest batch (the largest bucket)."""

    impl: Impl = "auto"
    max_pages: int = 4096
    buckets: tuple[int, ...] | None = None
    interpret: bool | None = None  # None: interpret exactly when not on the kernel's own platform
    platform: str | None = None  # None: jax.default_backend()

    def __post_init__(self) -> None:
        object.__setattr__(self, "impl", _IO_BACKEND_ALIASES.get(self.impl, self.impl))
        if self.impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS} (or io backend 'kernel' / 'direct'), got {self.impl!r}")
        if not isinstance(self.max_pages, int) or self.max_pages < 1:
            raise ValueError(f"max_pages: expected an int >= 1, got {self.max_pages!r}")
        if self.buckets is not None:
            b = tuple(int(x) for x in self.buckets)
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise ValueError(f"buckets: expected strictly increasing positive sizes, got {self.buckets!r}")
            object.__setattr__(self, "buckets", b)


@dataclass
class _Plan:
    impl: str
    interpret: bool
    buckets: tuple[int, ...]
    compiled: dict = field(default_factory=dict)


class PageCopier:
    """Bucketed, precompiled page gather/scatter for pools of shape ``(P, page, H, D)``."""

    def __init__(
        self,
        config: PageCopyConfig | None = None,
        mesh: jax.sharding.Mesh | None = None,
        kv_axis: str | None = None,
        device: jax.Device | None = None,
    ) -> None:
        """``mesh`` + ``kv_axis``: pools sharded on the head axis; ``mesh`` alone: replicated pools.
        ``device`` (no mesh): the one device the pools live on; executables are then built for it,
        so their outputs come back committed to it (an uncommitted output costs its owner a
        ``device_put`` per array to commit it before the next jitted step)."""
        self.config = config or PageCopyConfig()
        platform = self.config.platform or jax.default_backend()
        impl = self.config.impl
        if impl == "auto":
            # ROCm: nothing measured there and Mosaic GPU is CUDA only, so XLA.
            impl = {"tpu": "tpu", "gpu": AUTO_GPU_IMPL, "cuda": AUTO_GPU_IMPL}.get(platform, "xla")
        interpret = self.config.interpret
        if interpret is None:
            # A kernel compiles only for its own platform; anywhere else it runs interpreted
            # (a TPU kernel asked for on a GPU, a GPU kernel on the CPU).
            interpret = impl != "xla" and platform not in _KERNEL_PLATFORMS[impl]
        self.platform = platform
        if mesh is None and kv_axis is not None:
            raise ValueError("kv_axis: needs a mesh")
        if mesh is not None and kv_axis is not None and kv_axis not in mesh.axis_names:
            raise ValueError(f"kv_axis: {kv_axis!r} is not an axis of the mesh {mesh.axis_names}")
        self.mesh, self.kv_axis = mesh, kv_axis
        if device is not None and mesh is not None:
            raise ValueError("device: only without a mesh (a mesh names its devices)")
        if device is not None and not isinstance(device, jax.Device):
            raise TypeError(f"device: expected a jax.Device or None, got {type(device).__name__}")
        self.device = device
        if impl != "xla":
            kernel_module(impl)  # fail here, naming the fix, not at the first copy
        self._plan = _Plan(impl, interpret, self.config.buckets or default_buckets(self.config.max_pages))
        self.compile_count = 0  # executables this copier prepared (tests assert steady state adds none)
        self._layer_id_cache: dict = {}

    # ---- introspection --------------------------------------------------------------------
    @property
    def impl(self) -> str:
        return self._plan.impl

    @property
    def interpret(self) -> bool:
        return self._plan.interpret

    @property
    def buckets(self) -> tuple[int, ...]:
        return self._plan.buckets

    def bucket_for(self, n: int) -> int:
        return bucket_for(n, self._plan.buckets)

    # ---- building executables ------------------------------------------------------------
    def _fns(self):
        impl, interp = self._plan.impl, self._plan.interpret
        if impl == "xla":
            # XLA:CPU: per-page copies beat its element-wise scatter loop (see ``reference``).
            cpu = self.platform == "cpu"
            if cpu:
                return functools.partial(reference.gather_layers, branch_full=True), reference.scatter_layer_pages
            return reference.gather_layers, reference.scatter_layer
        mod = kernel_module(impl)
        g = lambda pools, ids, n, out, order: mod.gather_layers.__wrapped__(pools, ids, n, out, order, interp)
        s = lambda pool, ids, n, buf, layer, order: mod.scatter_layer.__wrapped__(
            pool, ids, n, buf, layer, order, interp
        )
        return g, s

    def _container(self, dtype):
        """The dtype kernels copy: an unsigned container for Pallas kernels, the KV dtype for XLA.

        XLA's take / scatter move elements bit for bit, and a bitcast around a donated
        scatter costs XLA its in-place update (a whole-pool copy: 5x slower on CPU).
        Pallas kernels get bits because interpreted masked float copies may flush subnormals.
        """
        return jnp.dtype(dtype) if self._plan.impl == "xla" else _CONTAINERS[jnp.dtype(dtype).itemsize]

    def _specs(self):
        """(pool spec, buffer spec): head-sharded with a kv_axis, replicated without one."""
        if self.mesh is None:
            return None, None
        if self.kv_axis is None:
            return PartitionSpec(), PartitionSpec()
        return PartitionSpec(None, None, self.kv_axis, None), PartitionSpec(*([None] * 3), self.kv_axis, None)

    def buffer_sharding(self) -> jax.sharding.Sharding | None:
        """Sharding transfer buffers must have for a mesh-resident pool (None: single device)."""
        return None if self.mesh is None else NamedSharding(self.mesh, self._specs()[1])

    def _build_gather(self, num_layers: int, pool_aval: jax.ShapeDtypeStruct, nb: int, order: str, with_out: bool):
        gather, _ = self._fns()
        pool_spec, buf_spec = self._specs()

        dtype = pool_aval.dtype
        c = self._container(dtype)

        def f(pools, ids, n, out):
            # Bitcasts to the unsigned container are free inside the executable (no copies).
            bits = tuple(_to_bits(p, c) for p in pools)
            return _from_bits(gather(bits, ids, n, None if out is None else _to_bits(out, c), order), dtype)

        if self.mesh is not None:
            f = _shard_map(
                f,
                self.mesh,
                in_specs=([pool_spec] * num_layers, PartitionSpec(), PartitionSpec(), buf_spec if with_out else None),
                out_specs=buf_spec,
            )
        donate = (3,) if with_out else ()
        shape = buffer_shape(order, nb, num_layers, pool_aval.shape[1:])
        args = (
            [self._aval(pool_aval.shape, pool_aval.dtype, pool_spec)] * num_layers,
            jax.ShapeDtypeStruct((nb,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
            self._aval(shape, pool_aval.dtype, buf_spec) if with_out else None,
        )
        return jax.jit(f, donate_argnums=donate).trace(*args).lower().compile()

    def _build_scatter(self, pool_aval: jax.ShapeDtypeStruct, buf_shape: tuple[int, ...], nb: int, order: str):
        _, scatter = self._fns()
        pool_spec, buf_spec = self._specs()

        dtype = pool_aval.dtype
        c = self._container(dtype)

        def f(pool, ids, n, buf, layer):
            return _from_bits(scatter(_to_bits(pool, c), ids, n, _to_bits(buf, c), layer, order), dtype)

        if self.mesh is not None:
            f = _shard_map(
                f,
                self.mesh,
                in_specs=(pool_spec, PartitionSpec(), PartitionSpec(), buf_spec, PartitionSpec()),
                out_specs=pool_spec,
            )
        args = (
            self._aval(pool_aval.shape, pool_aval.dtype, pool_spec),
            jax.ShapeDtypeStruct((nb,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
            self._aval(buf_shape, pool_aval.dtype, buf_spec),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        )
        return jax.jit(f, donate_argnums=(0,)).trace(*args).lower().compile()

    def _aval(self, shape, dtype, spec):
        if self.mesh is None:
            if self.device is None:
                return jax.ShapeDtypeStruct(shape, dtype)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(self.device))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec))

    def _get(self, key, build):
        exe = self._plan.compiled.get(key)
        if exe is None:
            # Executables are shared process-wide between copiers of the same plan, platform
            # (it picks the scatter's form) and mesh, so a second engine compiles nothing.
            gkey = (self._plan.impl, self._plan.interpret, self.platform, self.mesh, self.kv_axis, self.device) + key
            with _GLOBAL_LOCK:
                exe = _GLOBAL_EXES.get(gkey)
                if exe is None:
                    exe = _GLOBAL_EXES[gkey] = build()
            self._plan.compiled[key] = exe
            self.compile_count += 1
        return exe

    def precompile(
        self,
        pool_shape: tuple[int, ...],
        dtype,
        num_layers: int,
        orders: Sequence[str] = ("npl",),
        max_pages: int | None = None,
        with_out: bool = False,
    ) -> int:
        """Build every bucket's gather and scatter for these shapes; returns executables built."""
        before = self.compile_count
        for nb in self._plan.buckets:
            if max_pages is not None and nb > self.bucket_for(max_pages):
                break
            for order in orders:
                self._gather_exe(num_layers, pool_shape, dtype, nb, order, with_out)
                self._scatter_exe(pool_shape, dtype, buffer_shape(order, nb, num_layers, pool_shape[1:]), nb, order)
        return self.compile_count - before

    def precompile_scatter(self, pool_shape: tuple[int, ...], dtype, buf_shape: tuple[int, ...], nb: int, order: str):
        """Build the scatter for one transfer-buffer shape (e.g. a layer group's staging buffer);
        returns the compiled executable (``as_text()``: its optimized HLO)."""
        return self._scatter_exe(pool_shape, dtype, tuple(buf_shape), nb, check_order(order))

    def _gather_exe(self, num_layers, pool_shape, dtype, nb, order, with_out):
        aval = jax.ShapeDtypeStruct(tuple(pool_shape), jnp.dtype(dtype))
        key = ("gather", num_layers, aval.shape, aval.dtype, nb, order, with_out)
        return self._get(key, lambda: self._build_gather(num_layers, aval, nb, order, with_out))

    def _scatter_exe(self, pool_shape, dtype, buf_shape, nb, order):
        aval = jax.ShapeDtypeStruct(tuple(pool_shape), jnp.dtype(dtype))
        key = ("scatter", aval.shape, aval.dtype, tuple(buf_shape), nb, order)
        return self._get(key, lambda: self._build_scatter(aval, tuple(buf_shape), nb, order))

    # ---- running -------------------------------------------------------------------------
    def _pad(self, ids: np.ndarray) -> tuple[jax.Array, jax.Array, int]:
        nb = self.bucket_for(ids.size)
        padded = np.zeros(nb, np.int32)
        padded[: ids.size] = ids
        return padded, np.array([ids.size], np.int32), nb

    def gather(
        self, pools: Sequence[jax.Array], ids: object, order: str = "npl", out: jax.Array | None = None
    ) -> tuple[jax.Array, int]:
        """Gather pages ``ids`` of every layer in ``pools`` into a transfer buffer in ``order``.

        Returns ``(buffer, n)``: the buffer has the bucket size along its page axis; the
        first ``n`` page positions hold the pages. ``out`` (optional, donated) must have
        the bucket's shape; its positions >= n are left as they were.
        """
        check_order(order)
        p0 = _check_layers(pools)
        ids = check_page_ids(ids, p0.shape[0], "ids", unique=False)
        padded, n, nb = self._pad(ids)
        if out is not None:
            want = buffer_shape(order, nb, len(pools), p0.shape[1:])
            if out.shape != want or out.dtype != p0.dtype:
                raise ValueError(
                    f"out: expected {want} {p0.dtype} (bucket of {ids.size} pages), got {out.shape} {out.dtype}"
                )
        exe = self._gather_exe(len(pools), p0.shape, p0.dtype, nb, order, out is not None)
        return exe(list(pools), padded, n, out), ids.size

    def scatter_layers(
        self, pools: Sequence[jax.Array], ids: object, buf: jax.Array, order: str = "nlp"
    ) -> list[jax.Array]:
        """``scatter`` of every layer of ``buf`` (layer j into ``pools[j]``): validated, padded and
        uploaded once, then one executable per layer with device-resident ids. Every pool is
        donated; returns the new arrays in order. ``buf`` must have the bucket's page count."""
        check_order(order)
        layer_axis = {"nlp": 1, "npl": 2, "lnp": 0}[order]
        if len(pools) != buf.shape[layer_axis]:
            raise ValueError(
                f"pools: expected one pool layer per buffer layer ({buf.shape[layer_axis]}), got {len(pools)}"
            )
        p0 = _check_layers(pools)
        ids = check_page_ids(ids, p0.shape[0], "ids", unique=True)
        padded, n, nb = self._pad(ids)
        want = buffer_shape(order, nb, len(pools), p0.shape[1:])
        if buf.shape != want or buf.dtype != p0.dtype:
            raise ValueError(
                f"buf: expected {want} {p0.dtype} (the bucket of {ids.size} pages), got {buf.shape} {buf.dtype}"
            )
        exe = self._scatter_exe(p0.shape, p0.dtype, buf.shape, nb, order)
        if self.mesh is None:  # upload once; per-layer numpy ids would be uploaded per call
            dev = next(iter(p0.sharding.device_set))
            padded, n = jax.device_put((padded, n), dev)  # one batched transfer
            layer_ids = self._layer_ids(len(pools), dev)
        else:
            layer_ids = [np.array([l], np.int32) for l in range(len(pools))]
        return [exe(p, padded, n, buf, layer_ids[l]) for l, p in enumerate(pools)]

    def _layer_ids(self, num_layers: int, device) -> list[jax.Array]:
        key = (num_layers, device)
        cached = self._layer_id_cache.get(key)
        if cached is None:
            cached = self._layer_id_cache[key] = [
                jax.device_put(np.array([l], np.int32), device) for l in range(num_layers)
            ]
        return cached

    def scatter(self, pool: jax.Array, ids: object, buf: jax.Array, layer: int = 0, order: str = "nlp") -> jax.Array:
        """Write layer ``layer`` of transfer buffer ``buf`` into pool pages ``ids``; returns the new pool.

        ``buf`` holds ``len(ids)`` pages (or a bucket's worth) in ``order`` over any number of
        layers. ``pool`` is donated: the caller must use the returned array.
        """
        check_order(order)
        ids = check_page_ids(ids, pool.shape[0], "ids", unique=True)
        padded, n, nb = self._pad(ids)
        page_axis = 1 if order == "lnp" else 0
        layer_axis = {"nlp": 1, "npl": 2, "lnp": 0}[order]
        num_layers = buf.shape[layer_axis]
        if buf.dtype != pool.dtype:
            raise ValueError(f"buf: expected dtype {pool.dtype} like the pool, got {buf.dtype}")
        want = buffer_shape(order, buf.shape[page_axis], num_layers, pool.shape[1:])
        if buf.shape != want or buf.shape[page_axis] not in (ids.size, nb):
            raise ValueError(
                f"buf: expected {order} shape with {ids.size} (or {nb}) pages of {pool.shape[1:]}, got {buf.shape}"
            )
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {num_layers}, got {layer}")
        if buf.shape[page_axis] != nb:  # pad to the bucket so the compiled shape is reused
            pad = [(0, 0)] * buf.ndim
            pad[page_axis] = (0, nb - buf.shape[page_axis])
            buf = jnp.pad(buf, pad)
        exe = self._scatter_exe(pool.shape, pool.dtype, buf.shape, nb, order)
        return exe(pool, padded, n, buf, np.array([layer], np.int32))
