"""KV page-transfer benchmark: gather / scatter / D2H backup / H2D load vs raw copies.

For every (page size, page count, host layout) it measures, in one process:

* gather  (all layers of K, fused host-layout order)   vs a raw device-to-device copy
* scatter (layer by layer from a transfer buffer)      vs a raw device-to-device copy
* D2H     (``JaxTransferEngine.backup``, K and V)       vs ``device_put`` of a contiguous device array
                                                          to the pinned host memory kind
* H2D     (``JaxTransferEngine.load``, K and V)         vs ``device_put`` of a contiguous pinned-host
                                                          array to the device
  (numpy ``device_put`` / ``np.asarray`` where the platform has no pinned memory)

Ratios are op GB/s / baseline GB/s of the same bytes. ``CPU B/B``: KV bytes that host code
copied (through the host pool's read/write methods, counted by wrapping them) per byte moved:
0 on the ``xla_stream`` path, 1 on the ``numpy`` path. By default each page size moves the
smallest power-of-two page count that is >= 64 MiB. Prints a table, writes JSON; both name
the page-copy implementation and the host-copy path measured. On a GPU (or with ``--compare-impls``) a second table
measures gather / scatter of every GPU implementation (``xla``, ``mgpu`` = Mosaic GPU, ``gpu`` =
Pallas Triton) side by side, each with its ratio to a raw device copy of the same bytes: the
numbers behind the dispatcher's ``auto`` choice.
Usage: hicache-jax bench transfer [--quick] [--out PATH] [--impl auto|xla|tpu|mgpu|gpu] [--compare-impls]
(options: ``hicache_jax.bench.options.transfer_arguments``).
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from . import options
from .options import default_page_count
from .report import Progress, gbps, machine_info, median_seconds, print_table, write_json
from .. import HostLayout, KVGeometry
from ..backends.jax import JaxDevicePool, JaxTransferEngine, host_memory_kind
from ..backends.jax.memory import pinned_host_pool
from pallas_kernels.page_copy import PageCopyConfig
from pallas_kernels.page_copy.bench_page_copy import compare_impls, gather_scatter_seconds


def _raw_seconds(nbytes: int, reps: int) -> dict[str, float]:
    """Median seconds of the best host<->device copies the platform offers for ``nbytes``:
    JAX ``device_put`` between a pinned-host array and device memory, both ways (numpy
    ``device_put`` / ``np.asarray`` where there is no pinned memory), and a host memcpy."""
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dev = jax.devices()[0]
    on_device = jax.device_put(src, dev)
    kind = host_memory_kind(dev)
    if kind is not None:
        host_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
        dev_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        on_host = jax.device_put(src, host_sharding)
        h2d = lambda: jax.device_put(on_host, dev_sharding).block_until_ready()
        d2h = lambda: jax.device_put(on_device, host_sharding).block_until_ready()
    else:
        h2d = lambda: jax.device_put(src, dev).block_until_ready()
        d2h = lambda: np.asarray(on_device + 0)
    dst = np.empty_like(src)
    return {
        "h2d": median_seconds(h2d, reps),
        "d2h": median_seconds(d2h, reps),
        "memcpy": median_seconds(lambda: np.copyto(dst, src), reps),
        "kind": kind or "numpy",
    }


class HostCopyCounter:
    """Counts the KV bytes host code copies through a host pool's read/write methods.

    Wraps the pool instance's methods (the engine under test is not involved in counting): a
    transfer path that moves pages without a CPU pass calls none of them."""

    _METHODS = ("read_pages", "write_pages", "write_pages_unchecked", "read_layer", "read_layer_unchecked")

    def __init__(self, pool) -> None:
        self.bytes = 0
        for name in self._METHODS:
            original = getattr(pool, name)

            def counted(*a, _original=original, _name=name, **kw):
                out = _original(*a, **kw)
                if _name.startswith("read"):
                    self.bytes += out.nbytes
                else:
                    self.bytes += np.asarray(a[2] if len(a) > 2 else kw["buf"]).nbytes
                return out

            setattr(pool, name, counted)

    def take(self) -> int:
        n, self.bytes = self.bytes, 0
        return n


def run(args) -> dict:
    with Progress("transfer") as progress:
        return _run(args, progress)


def _run(args, progress: Progress) -> dict:
    if args.compare_impls is None:
        args.compare_impls = jax.default_backend() == "gpu"
    geom_kw = dict(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    cases = []
    for page in args.page_sizes:
        geom = KVGeometry.mha(page_size=page, **geom_kw)
        counts = args.page_counts or [default_page_count(geom.bytes_per_page)]
        cases += [(page, n, layout) for n in counts for layout in args.layouts]
    rows, results = [], []
    raw_cache: dict[int, dict] = {}
    progress.phase("cases (page size x pages x layout; the first compiles)", len(cases))
    for page, n, layout in cases:
        geom = KVGeometry.mha(page_size=page, **geom_kw)
        device_pages = max(2 * n, 64)
        dev = JaxDevicePool(geom, device_pages)
        host = pinned_host_pool(geom, n, layout)  # plain numpy where there is no pinned memory
        eng = JaxTransferEngine(
            dev,
            host,
            copy_config=PageCopyConfig(impl=args.impl, max_pages=device_pages),
            host_copy=args.host_copy,
            stream_loop=args.stream_loop,
            stream_unroll=args.stream_unroll,
        )
        counter = HostCopyCounter(host)
        rng = np.random.default_rng(0)
        for c in geom.components:  # random KV, never zeros
            for l in range(geom.num_layers):
                raw = rng.integers(1, 2**16, (device_pages,) + geom.page_shape, dtype=np.uint16)
                dev.set_layer(c, l, jax.device_put(raw.view(dev.dtype), dev.sharding))
        src = rng.permutation(device_pages)[:n]
        dst = rng.permutation(device_pages)[:n]
        hst = rng.permutation(n)[:n]
        one_comp = n * geom.bytes_per_page // len(geom.components)
        both = n * geom.bytes_per_page
        order = HostLayout(layout).transfer_order
        g_s, s_s, raw_dd = gather_scatter_seconds(eng.copier, dev.layers("k"), src, dst, order, args.reps, one_comp)
        counter.take()
        d2h_s = median_seconds(lambda: eng.backup(src, hst).wait(), args.reps)
        d2h_cpu = counter.take() / (both * (args.reps + 1))  # + 1: the warm-up call
        h2d_s = median_seconds(lambda: eng.load(hst, dst).wait(), args.reps)
        h2d_cpu = counter.take() / (both * (args.reps + 1))
        raw = raw_cache.get(both) or raw_cache.setdefault(both, _raw_seconds(both, args.reps))
        eng.close()
        r = dict(
            page_size=page,
            pages=n,
            layout=layout,
            mib_per_component=one_comp / 2**20,
            host_copy=eng.host_copy,
            gather_gbps=gbps(one_comp, g_s),
            scatter_gbps=gbps(one_comp, s_s),
            raw_device_copy_gbps=gbps(one_comp, raw_dd),
            d2h_gbps=gbps(both, d2h_s),
            raw_d2h_gbps=gbps(both, raw["d2h"]),
            host_memcpy_gbps=gbps(both, raw["memcpy"]),
            h2d_gbps=gbps(both, h2d_s),
            raw_h2d_gbps=gbps(both, raw["h2d"]),
            raw_host_memory=raw["kind"],
            d2h_cpu_bytes_per_byte=d2h_cpu,
            h2d_cpu_bytes_per_byte=h2d_cpu,
        )
        r.update(
            gather_vs_raw=r["gather_gbps"] / r["raw_device_copy_gbps"],
            scatter_vs_raw=r["scatter_gbps"] / r["raw_device_copy_gbps"],
            d2h_vs_raw=r["d2h_gbps"] / r["raw_d2h_gbps"],
            d2h_vs_memcpy=r["d2h_gbps"] / r["host_memcpy_gbps"],
            h2d_vs_raw=r["h2d_gbps"] / r["raw_h2d_gbps"],
            h2d_vs_memcpy=r["h2d_gbps"] / r["host_memcpy_gbps"],
        )
        results.append(r)
        rows.append(
            [
                page,
                n,
                layout,
                r["mib_per_component"],
                r["gather_gbps"],
                r["gather_vs_raw"],
                r["scatter_gbps"],
                r["scatter_vs_raw"],
                r["d2h_gbps"],
                r["d2h_vs_raw"],
                r["d2h_vs_memcpy"],
                d2h_cpu,
                r["h2d_gbps"],
                r["h2d_vs_raw"],
                r["h2d_vs_memcpy"],
                h2d_cpu,
            ]
        )
        progress.advance(1, f"page {page}, {n} pages, {layout}")
        if getattr(args, "out", None) and len(results) < len(cases):  # a run cut short keeps the cases it finished
            write_json(args.out, _payload(args, eng, host, results) | {"partial": True})
    impl = eng.copier.impl + (" (interpret)" if eng.copier.interpret else "")
    raw_kind = results[-1]["raw_host_memory"] if results else "-"
    print_table(
        f"KV page transfers: {args.layers} layers x {args.heads} heads x {args.head_dim} {args.dtype}, "
        f"copy impl {impl}, host copies {eng.host_copy}"
        f"{f' ({eng.stream_loop} loops x{eng.stream_unroll})' if eng.host_copy == 'xla_stream' else ''}, "
        f"backend {jax.default_backend()} "
        f"(GB/s; x = ratio to the raw copy of the same bytes: a device copy into a reused buffer for "
        f"gather/scatter, device_put to/from {raw_kind} for D2H/H2D and, the hardware's best there, a "
        f"host memcpy into a reused buffer; CPU B/B = bytes host code copied per byte moved)",
        [
            "page",
            "pages",
            "layout",
            "MiB/comp",
            "gather",
            "x dev copy",
            "scatter",
            "x dev copy",
            "D2H",
            "x raw D2H",
            "x memcpy",
            "CPU B/B",
            "H2D",
            "x raw H2D",
            "x memcpy",
            "CPU B/B",
        ],
        rows,
    )
    payload = _payload(args, eng, host, results)
    if args.compare_impls:
        progress.phase("comparing gather / scatter implementations")
        payload["impl_comparison"] = _compare(args)
    return payload


def _payload(args, eng, host, results: list[dict]) -> dict:
    impl = eng.copier.impl + (" (interpret)" if eng.copier.interpret else "")
    return {
        "benchmark": "transfer",
        "machine": machine_info(),
        "copy_impl": impl,
        "host_copy": eng.host_copy,
        "stream_loop": [eng.stream_loop, eng.stream_unroll],
        "host_pool_memory": host.memory_kind,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }


def _compare(args) -> list[dict]:
    """Gather / scatter of each GPU implementation vs a raw device copy (one KV component)."""
    orders = sorted({HostLayout(l).transfer_order for l in args.layouts})
    rows = compare_impls(
        ["xla", "mgpu", "gpu"],
        args.page_sizes,
        args.page_counts or [16, 256, 1024],
        orders,
        args.layers,
        args.heads,
        args.head_dim,
        args.dtype,
        args.reps,
    )
    table = [
        [
            r["impl"],
            r["page_size"],
            r["pages"],
            r["order"],
            r["mib"],
            r.get("gather_gbps", "-"),
            r.get("gather_vs_raw", "-"),
            r.get("scatter_gbps", "-"),
            r.get("scatter_vs_raw", "-"),
            r.get("raw_copy_gbps", "-"),
            r.get("error", ""),
        ]
        for r in rows
    ]
    print_table(
        f"Page gather / scatter by implementation, backend {jax.default_backend()} "
        f"(GB/s; x = ratio to a raw device copy of the same bytes)",
        ["impl", "page", "pages", "order", "MiB", "gather", "x dev copy", "scatter", "x dev copy", "raw copy", "error"],
        table,
    )
    return rows


def main(argv=None) -> int:
    """Tests and scripts: the same options as ``hicache-jax bench transfer``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.transfer_arguments(p)
    args = p.parse_args(argv)
    options.apply_quick(p, args, "transfer")
    payload = run(args)
    print(f"JSON written to {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
