"""Torch transfer engine: D2H backups and H2D loads between a TorchDevicePool and a torch host pool.

Three ways to move bytes (``impl``), chosen once at construction:

* ``"ascend"``: the sgl-kernel-npu op, one keyword call per batch for all layers and parts
  (host layouts ``page_first_direct`` for MHA, ``page_first_kv_split`` for MLA, as upstream).
* ``"reference"``: the same calling convention into ``ascend_op``'s torch reference (CPU tests).
* ``"torch"``: indexed copies, any host layout.
* ``"auto"``: ``"ascend"`` on an NPU with the Ascend layout when the op is installed and its
  signature binds; otherwise ``"torch"``, with the reason in ``impl_reason``.

Ordering, accelerators (``npu``/``cuda``): copies are launched from the owner thread onto a
D2H or H2D side stream that first waits for the current (compute) stream, so they see the
model's writes and never overwrite pages still read by queued kernels. An event recorded
after each layer (torch impl) or after the one op call (all layers: the op moves every layer
at once, so there is no per-layer overlap on that path) gives ``layer_done``; a forward pass
calls ``handle.stream_wait_layer(l)`` to make its stream wait without blocking the host.
torch-impl backups gather on device into a pinned staging buffer (non-blocking D2H); a worker
thread waits for the event and scatters into the host pool, so ``backup`` never blocks.
torch-impl loads gather host pages into pinned staging on the owner thread, then one
non-blocking H2D and one ``index_copy_`` per layer.

Ordering, CPU: streams and events of ``torch.cpu`` are no-ops (torch 2.13's CPU device module), so each
direction runs on its own worker thread (``SerialWorker``) that plays the stream; per-layer
readiness is a ``threading.Event`` per layer.

``deferred=True`` (tests): nothing moves until ``complete(handle)`` / ``complete_all()``, as in
``NumpyTransferEngine``, so a manager that reuses pages early reads wrong bytes.

Threading: ``backup``/``load``/``complete`` are called from the owner thread. Workers touch only
pages the manager reserved for their transfer.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from hicache_jax.host_pool import HostKVPool
from hicache_jax.transfer import (
    CompletedHandle,
    FutureHandle,
    KVTransferEngine,
    LoadHandle,
    SerialWorker,
    TransferError,
    TransferHandle,
)

from . import _lazy
from .ascend_op import (
    D2H,
    FAST2D,
    H2D,
    OpSignatureError,
    bind_op,
    find_op,
    page_token_indices,
    transfer_kv_dim_exchange_reference,
)
from .device_pool import TorchDevicePool
from .devices import device_module, is_accelerator
from .parts import PAGE_AXIS

torch = _lazy.torch()
log = logging.getLogger(__name__)

IMPLS = ("auto", "ascend", "reference", "torch")
ASCEND_LAYOUT = {"mha": "page_first_direct", "mla": "page_first_kv_split"}


def _to_order(x, order: str):
    """(L, n, page, H, w) -> the host layout's transfer order (a view)."""
    return {"nlp": lambda: x.permute(1, 0, 2, 3, 4), "npl": lambda: x.permute(1, 2, 0, 3, 4), "lnp": lambda: x}[order]()


def _layer_of(t, order: str, layer: int):
    """Layer ``layer`` of a page-major tensor/buffer in ``order``: (pages, page, H, w) (a view)."""
    return {"nlp": lambda: t[:, layer], "npl": lambda: t[:, :, layer], "lnp": lambda: t[layer]}[order]()


# CPU copies: one ``copy_`` per run of consecutive pages beats torch's integer index kernels
# (measured ~0.3-1 GB/s for int16 index_select/index_copy_ vs 4-8 GB/s per-run on a 2-core
# CPU) unless each copy is tiny, where the per-call overhead wins; below this many bytes per
# copy the index kernels are used.
RUN_COPY_MIN_BYTES = 8192


def _runs(d: np.ndarray, h: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs in which device and host ids both step by one: [(d0, h0, length)]."""
    brk = np.flatnonzero((np.diff(d) != 1) | (np.diff(h) != 1)) + 1
    starts, ends = np.concatenate(([0], brk)), np.concatenate((brk, [d.size]))
    return [(int(d[a]), int(h[a]), int(b - a)) for a, b in zip(starts, ends)]


def _pages(t, order: str, start: int, count: int):
    """Pages [start, start+count) of a page-major host tensor (a view)."""
    return t[:, start : start + count] if order == "lnp" else t[start : start + count]


def _wait_poll(query, timeout: float | None, what: str) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while not query():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done after {timeout} s")
        time.sleep(0.0002)


class _EventHandle(TransferHandle):
    """Done when a device event has completed (accelerators)."""

    def __init__(self, event, keepalive: object = None) -> None:
        self._event, self._keep = event, keepalive

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout: float | None = None) -> None:
        try:
            if timeout is None:
                self._event.synchronize()
            else:
                _wait_poll(self._event.query, timeout, "transfer")
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - device errors surface at sync
            raise TransferError(f"transfer failed: {e!r}") from e


class TorchLoadHandle(LoadHandle):
    """Per-layer readiness of a load: device events (accelerators) or thread events (CPU)."""

    def __init__(self, num_layers: int, events=None, stream_module=None, keepalive: object = None) -> None:
        self.num_layers = num_layers
        self._dev_events, self._mod, self._keep = events, stream_module, keepalive
        self._thread_events = None if events is not None else [threading.Event() for _ in range(num_layers)]
        self.error: BaseException | None = None

    # CPU worker side
    def _mark(self, layer: int) -> None:
        self._thread_events[layer].set()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        for e in self._thread_events:
            e.set()

    def layer_done(self, layer: int) -> bool:
        if self._dev_events is not None:
            return bool(self._dev_events[layer].query())
        return self._thread_events[layer].is_set()

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        if self._dev_events is not None:
            try:
                if timeout is None:
                    self._dev_events[layer].synchronize()
                else:
                    _wait_poll(self._dev_events[layer].query, timeout, f"layer {layer}")
            except TimeoutError:
                raise
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"load failed: {e!r}") from e
            return
        if not self._thread_events[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} not loaded after {timeout} s")
        if self.error is not None:
            raise TransferError(f"load failed: {self.error!r}") from self.error

    def stream_wait_layer(self, layer: int, stream=None) -> None:
        """Order ``stream`` (default: current) after layer ``layer``'s copy without blocking the host.

        On CPU there is no stream to order, so this blocks until the layer has landed.
        """
        if self._dev_events is None:
            self.wait_layer(layer)
            return
        (stream or self._mod.current_stream()).wait_event(self._dev_events[layer])


class _DeferredHandle(TorchLoadHandle):
    """Test mode: the copy runs when the test completes the handle (or waits on it)."""

    def __init__(self, run, num_layers: int) -> None:
        super().__init__(num_layers)
        self._run = run
        self.completed = False

    def complete(self) -> None:
        if not self.completed:
            self.completed = True
            try:
                self._run()
            except Exception as e:  # noqa: BLE001
                self.error = e
                raise TransferError(f"transfer failed: {e!r}") from e
            finally:
                for e in self._thread_events:
                    e.set()

    def layer_done(self, layer: int) -> bool:
        return self.completed

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self.complete()  # like a blocking stream sync
        if self.error is not None:
            raise TransferError(f"transfer failed: {self.error!r}") from self.error

    def done(self) -> bool:
        return self.completed


class TorchTransferEngine(KVTransferEngine):
    def __init__(
        self, device_pool: TorchDevicePool, host_pool: HostKVPool, impl: str = "auto", deferred: bool = False, op=None
    ) -> None:
        if not isinstance(device_pool, TorchDevicePool):
            raise TypeError(f"device_pool: expected TorchDevicePool, got {type(device_pool).__name__}")
        if device_pool.geom != host_pool.geom:
            raise ValueError(f"host_pool: geometry {host_pool.geom} differs from the device pool's {device_pool.geom}")
        if not hasattr(host_pool, "torch_parts"):
            raise TypeError(
                "host_pool: expected a pool from npu_bridge.host_memory.torch_host_pool "
                "(the engine copies through its torch tensors)"
            )
        if impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
        self.geom = g = device_pool.geom
        self.device_pool, self.host_pool = device_pool, host_pool
        self.device_num_pages = device_pool.num_pages
        self.device = device_pool.device
        if host_pool.torch_device.type != self.device.type:
            raise ValueError(f"host_pool: allocated for {host_pool.torch_device}, device pool is on {self.device}")
        self.order = host_pool.layout.transfer_order
        self.layout_name = host_pool.layout.value
        self._pairs = {}
        for c in g.components:
            dparts, hparts = device_pool.parts(c), host_pool.torch_parts[c]
            if [(p.lo, p.hi) for p in dparts] != [(p.lo, p.hi) for p in hparts]:
                raise ValueError(
                    f"component {c!r}: device parts {[p.name for p in dparts]} and host parts "
                    f"{[p.name for p in hparts]} split the width differently (split_mla must match "
                    f"the {self.layout_name} layout)"
                )
            self._pairs[c] = list(zip(dparts, hparts))
        self.accelerator = is_accelerator(self.device)
        self.mod = device_module(self.device)
        self.impl, self.impl_reason, self._op = self._choose(impl, op)
        self.deferred = deferred
        self.pending: list[_DeferredHandle] = []
        if self.accelerator:
            self._d2h_stream = self.mod.Stream(device=self.device)
            self._h2d_stream = self.mod.Stream(device=self.device)
        self._d2h = SerialWorker("hicache-torch-d2h")
        self._h2d = SerialWorker("hicache-torch-h2d")

    # ---- impl choice ---------------------------------------------------------------------
    def _choose(self, impl: str, op):
        g = self.geom
        if impl == "torch":
            return "torch", "requested", None
        layout_ok = ASCEND_LAYOUT[g.kind] == self.layout_name
        need_v = g.kind == "mha" or g.qk_rope_head_dim > 0
        if impl in ("ascend", "reference"):
            if not layout_ok:
                raise ValueError(
                    f"impl={impl!r}: the Ascend op takes host layout {ASCEND_LAYOUT[g.kind]!r} for "
                    f"{g.kind}, got {self.layout_name!r}"
                )
            fn = op or (transfer_kv_dim_exchange_reference if impl == "reference" else find_op(required=True))
            return impl, "requested", bind_op(fn, need_v)
        # auto
        if self.device.type != "npu":
            return "torch", f"device {self.device.type} (the Ascend op runs on npu only)", None
        if not layout_ok:
            return "torch", f"host layout {self.layout_name} (the op takes {ASCEND_LAYOUT[g.kind]})", None
        fn = op or find_op(required=False)
        if fn is None:
            return "torch", f"{_lazy.KVCACHEIO_MODULE} is not installed", None
        try:
            return "ascend", "op found and its signature binds", bind_op(fn, need_v)
        except OpSignatureError as e:
            log.warning("npu_bridge: not using %s: %s; falling back to torch copies", _lazy.TRANSFER_OP_NAME, e)
            return "torch", f"op signature: {e}", None

    # ---- issue ---------------------------------------------------------------------------
    def backup(self, device_ids, host_ids) -> TransferHandle:
        d, h = self.validate(device_ids, host_ids)
        if not d.size:
            return CompletedHandle(self.geom.num_layers)
        if self.deferred:
            return self._defer(lambda: self._run_sync("d2h", d, h))
        if not self.accelerator:
            return FutureHandle(self._d2h.submit(lambda: self._backup_cpu(d, h)))
        event, finish, keep = self._backup_launch(d, h)
        if finish is None:
            return _EventHandle(event, keep)
        return FutureHandle(self._d2h.submit(lambda: (event.synchronize(), finish())))

    def load(self, host_ids, device_ids) -> LoadHandle:
        d, h = self.validate(device_ids, host_ids)
        L = self.geom.num_layers
        if not d.size:
            return CompletedHandle(L)
        if self.deferred:
            return self._defer(lambda: self._run_sync("h2d", d, h))
        if not self.accelerator:
            handle = TorchLoadHandle(L)
            self._h2d.submit(lambda: self._load_cpu(d, h, handle))
            return handle
        events, keep = self._load_launch(d, h)
        return TorchLoadHandle(L, events, self.mod, keep)

    def _defer(self, run) -> _DeferredHandle:
        handle = _DeferredHandle(run, self.geom.num_layers)
        self.pending.append(handle)
        return handle

    def _run_sync(self, direction: str, d, h) -> None:
        """Deferred completion: do the whole transfer now, on this thread."""
        if not self.accelerator:
            return self._backup_cpu(d, h) if direction == "d2h" else self._load_cpu(d, h, None)
        if direction == "d2h":
            event, finish, _ = self._backup_launch(d, h)
            event.synchronize()
            if finish is not None:
                finish()
        else:
            events, _ = self._load_launch(d, h)
            events[-1].synchronize()

    # ---- the Ascend op (and its reference): one call per batch, every layer and part --------
    def _op_kwargs(self, d: np.ndarray, h: np.ndarray, direction: int) -> dict:
        names = (("device_k", "host_k"), ("device_v", "host_v"))
        pairs = [pair for c in self.geom.components for pair in self._pairs[c]]
        core = {
            "device_indices": page_token_indices(d, self.geom.page_size),  # CPU: the op reads them on host
            "host_indices": page_token_indices(h, self.geom.page_size),
            "page_size": self.geom.page_size,
            "direction": direction,
            "flags": FAST2D,
        }
        for (dn, hn), (dp, hp) in zip(names, pairs):
            core[dn] = dp.tensor
            core[hn] = hp.tensor.view(dp.tensor.dtype)  # same bytes, the device's dtype
        return core

    def _call_op(self, d, h, direction) -> None:
        self._op.call(self._op_kwargs(d, h, direction), self.geom.num_layers)

    # ---- CPU: synchronous bodies run by the worker threads ------------------------------
    def _use_runs(self, runs, n: int, per_page_bytes: int) -> bool:
        return n / len(runs) * per_page_bytes >= RUN_COPY_MIN_BYTES

    def _part_page_bytes(self, dp) -> int:
        """Bytes of one page of one layer of a device part."""
        t = dp.tensor
        return t[0, 0].numel() * t.element_size()

    def _backup_cpu(self, d: np.ndarray, h: np.ndarray) -> None:
        if self._op is not None:
            return self._call_op(d, h, D2H)
        bits, axis, order, L = self.device_pool.bits, PAGE_AXIS[self.order], self.order, self.geom.num_layers
        runs = _runs(d, h)
        di, hi = torch.from_numpy(d.astype(np.int64)), torch.from_numpy(h.astype(np.int64))
        for c in self.geom.components:
            for dp, hp in self._pairs[c]:
                dev = dp.tensor.view(bits)
                if self._use_runs(runs, d.size, L * self._part_page_bytes(dp)):
                    for d0, h0, k in runs:  # one copy per run, all layers
                        _pages(hp.tensor, order, h0, k).copy_(_to_order(dev[:, d0 : d0 + k], order))
                else:
                    hp.tensor.index_copy_(axis, hi, _to_order(dev.index_select(1, di), order))

    def _load_cpu(self, d: np.ndarray, h: np.ndarray, handle: TorchLoadHandle | None) -> None:
        try:
            if self._op is not None:
                self._call_op(d, h, H2D)
                if handle is not None:
                    for layer in range(self.geom.num_layers):
                        handle._mark(layer)
                return
            bits, order = self.device_pool.bits, self.order
            runs = _runs(d, h)
            di, hi = torch.from_numpy(d.astype(np.int64)), torch.from_numpy(h.astype(np.int64))
            for layer in range(self.geom.num_layers):
                for c in self.geom.components:
                    for dp, hp in self._pairs[c]:
                        dev, host = dp.tensor[layer].view(bits), _layer_of(hp.tensor, order, layer)
                        if self._use_runs(runs, d.size, self._part_page_bytes(dp)):
                            for d0, h0, k in runs:
                                dev[d0 : d0 + k].copy_(host[h0 : h0 + k])
                        else:
                            dev.index_copy_(0, di, host.index_select(0, hi))
                if handle is not None:
                    handle._mark(layer)
        except BaseException as e:
            if handle is None:
                raise
            handle._fail(e)

    # ---- accelerators: launch on side streams from the owner thread ---------------------
    def _backup_launch(self, d: np.ndarray, h: np.ndarray):
        """Returns (finish event, host-side finish fn or None, tensors to keep alive)."""
        stream = self._d2h_stream
        stream.wait_stream(self.mod.current_stream(self.device))
        keep, staged = [], []
        with self.mod.stream(stream):
            if self._op is not None:
                kwargs = self._op_kwargs(d, h, D2H)
                self._op.call(kwargs, self.geom.num_layers)
                keep.append(kwargs)
            else:
                di = torch.from_numpy(d.astype(np.int64)).to(self.device, non_blocking=True)
                bits = self.device_pool.bits
                for c in self.geom.components:
                    for dp, hp in self._pairs[c]:
                        gathered = _to_order(dp.tensor.view(bits).index_select(1, di), self.order).contiguous()
                        st = torch.empty(gathered.shape, dtype=bits, pin_memory=True)
                        st.copy_(gathered, non_blocking=True)
                        staged.append((hp, st))
                keep.append(di)
            event = self.mod.Event()
            event.record(stream)
        if self._op is not None:
            return event, None, keep
        hi, axis = torch.from_numpy(h.astype(np.int64)), PAGE_AXIS[self.order]

        def finish() -> None:
            for hp, st in staged:
                hp.tensor.index_copy_(axis, hi, st)

        return event, finish, keep

    def _load_launch(self, d: np.ndarray, h: np.ndarray):
        """Returns (one event per layer, tensors to keep alive until done)."""
        stream, L = self._h2d_stream, self.geom.num_layers
        stream.wait_stream(self.mod.current_stream(self.device))
        keep = []
        with self.mod.stream(stream):
            if self._op is not None:
                kwargs = self._op_kwargs(d, h, H2D)
                self._op.call(kwargs, L)
                event = self.mod.Event()
                event.record(stream)
                return [event] * L, [kwargs]  # the op moves all layers in one call
            hi = torch.from_numpy(h.astype(np.int64))
            di = torch.from_numpy(d.astype(np.int64)).to(self.device, non_blocking=True)
            bits, axis = self.device_pool.bits, PAGE_AXIS[self.order]
            bufs = []
            for c in self.geom.components:
                for dp, hp in self._pairs[c]:
                    shape = list(hp.tensor.shape)
                    shape[axis] = h.size
                    st = torch.empty(shape, dtype=bits, pin_memory=True)
                    torch.index_select(hp.tensor, axis, hi, out=st)  # host gather into pinned staging
                    bufs.append((dp, st.to(self.device, non_blocking=True)))
                    keep.append(st)
            events = []
            for layer in range(L):
                for dp, buf in bufs:
                    dp.tensor[layer].view(bits).index_copy_(0, di, _layer_of(buf, self.order, layer))
                ev = self.mod.Event()
                ev.record(stream)
                events.append(ev)
            keep += [di, bufs]
        return events, keep

    # ---- test control --------------------------------------------------------------------
    def complete(self, handle: _DeferredHandle) -> None:
        if handle in self.pending:
            self.pending.remove(handle)
        handle.complete()

    def complete_all(self) -> None:
        for handle in list(self.pending):
            self.complete(handle)

    def close(self) -> None:
        self._d2h.shutdown()
        self._h2d.shutdown()
        if self.accelerator:
            self._d2h_stream.synchronize()
            self._h2d_stream.synchronize()
