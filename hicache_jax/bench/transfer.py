"""KV page-transfer benchmark: gather / scatter / D2H backup / H2D load vs raw copies.

For every (page size, page count, host layout) it measures, in one process:

* gather  (all layers of K, fused host-layout order)   vs a raw device-to-device copy
* scatter (layer by layer from a transfer buffer)      vs a raw device-to-device copy
* D2H     (``JaxTransferEngine.backup``, K and V)       vs a raw D2H copy of a contiguous array
                                                          (to the pinned memory kind where present)
                                                          and vs a host memcpy of the same bytes
* H2D     (``JaxTransferEngine.load``, K and V)         vs a raw H2D ``device_put`` of the same bytes

Ratios are op GB/s / baseline GB/s of the same bytes. Prints a table, writes JSON; both name
the page-copy implementation measured. On a GPU (or with ``--compare-impls``) a second table
measures gather / scatter of every GPU implementation (``xla``, ``mgpu`` = Mosaic GPU, ``gpu`` =
Pallas Triton) side by side, each with its ratio to a raw device copy of the same bytes: the
numbers behind the dispatcher's ``auto`` choice.
Usage: hicache-jax bench transfer [--quick] [--out PATH] [--impl auto|xla|tpu|mgpu|gpu] [--compare-impls]
(options: ``hicache_jax.bench.options.transfer_arguments``).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import numpy as np

from . import options
from .report import Progress, gbps, machine_info, median_seconds, print_table, write_json
from .. import HostLayout, KVGeometry
from ..backends.jax import JaxDevicePool, JaxTransferEngine, host_memory_kind
from ..backends.jax.memory import pinned_host_pool
from pallas_kernels.page_copy import PageCopyConfig
from pallas_kernels.page_copy.bench_page_copy import compare_impls, gather_scatter_seconds, raw_device_copy_seconds


def _raw_d2h_seconds(nbytes: int, reps: int) -> tuple[float, float]:
    """(device -> host memory kind or numpy, host memcpy) median seconds for ``nbytes``."""
    x = jax.device_put(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8))
    kind = host_memory_kind()

    def d2h():
        if kind is not None:
            np.asarray(jax.device_put(x, x.sharding.with_memory_kind(kind)))
        else:
            np.asarray(x + 0)

    src = np.asarray(x).copy()
    dst = np.empty_like(src)
    return median_seconds(d2h, reps), median_seconds(lambda: np.copyto(dst, src), reps)


def _raw_h2d_seconds(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    return median_seconds(lambda: jax.device_put(src).block_until_ready(), reps)


def run(args) -> dict:
    with Progress("transfer") as progress:
        return _run(args, progress)


def _run(args, progress: Progress) -> dict:
    if args.page_counts is None:
        args.page_counts = [16, 128] if jax.default_backend() == "cpu" else [16, 256, 1024]
    if args.compare_impls is None:
        args.compare_impls = jax.default_backend() == "gpu"
    geom_kw = dict(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    cases = list(itertools.product(args.page_sizes, args.page_counts, args.layouts))
    rows, results = [], []
    progress.phase("cases (page size x pages x layout; the first compiles)", len(cases))
    for page, n, layout in cases:
        geom = KVGeometry.mha(page_size=page, **geom_kw)
        device_pages = max(2 * n, 64)
        dev = JaxDevicePool(geom, device_pages)
        host = pinned_host_pool(geom, n, layout)  # plain numpy where there is no pinned memory
        eng = JaxTransferEngine(dev, host, copy_config=PageCopyConfig(impl=args.impl, max_pages=device_pages))
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
        g_s, s_s = gather_scatter_seconds(eng.copier, dev.layers("k"), src, dst, order, args.reps, median_seconds)
        raw_dd = raw_device_copy_seconds(one_comp, args.reps, median_seconds)
        d2h_s = median_seconds(lambda: eng.backup(src, hst).wait(), args.reps)
        h2d_s = median_seconds(lambda: eng.load(hst, dst).wait(), args.reps)
        raw_d2h, memcpy = _raw_d2h_seconds(both, args.reps)
        raw_h2d = _raw_h2d_seconds(both, args.reps)
        eng.close()
        r = dict(page_size=page, pages=n, layout=layout, mib_per_component=one_comp / 2**20,
                 gather_gbps=gbps(one_comp, g_s), scatter_gbps=gbps(one_comp, s_s),
                 raw_device_copy_gbps=gbps(one_comp, raw_dd),
                 d2h_gbps=gbps(both, d2h_s), raw_d2h_gbps=gbps(both, raw_d2h), host_memcpy_gbps=gbps(both, memcpy),
                 h2d_gbps=gbps(both, h2d_s), raw_h2d_gbps=gbps(both, raw_h2d))
        r.update(gather_vs_raw=r["gather_gbps"] / r["raw_device_copy_gbps"],
                 scatter_vs_raw=r["scatter_gbps"] / r["raw_device_copy_gbps"],
                 d2h_vs_raw=r["d2h_gbps"] / r["raw_d2h_gbps"], d2h_vs_memcpy=r["d2h_gbps"] / r["host_memcpy_gbps"],
                 h2d_vs_raw=r["h2d_gbps"] / r["raw_h2d_gbps"])
        results.append(r)
        rows.append([page, n, layout, r["mib_per_component"], r["gather_gbps"], r["gather_vs_raw"],
                     r["scatter_gbps"], r["scatter_vs_raw"], r["d2h_gbps"], r["d2h_vs_raw"], r["d2h_vs_memcpy"],
                     r["h2d_gbps"], r["h2d_vs_raw"]])
        progress.advance(1, f"page {page}, {n} pages, {layout}")
    impl = eng.copier.impl + (" (interpret)" if eng.copier.interpret else "")
    print_table(f"KV page transfers: {args.layers} layers x {args.heads} heads x {args.head_dim} {args.dtype}, "
                f"copy impl {impl}, backend {jax.default_backend()} (GB/s; x = ratio to raw copy of same bytes)",
                ["page", "pages", "layout", "MiB/comp", "gather", "x dev copy", "scatter", "x dev copy",
                 "D2H", "x raw D2H", "x memcpy", "H2D", "x raw H2D"], rows)
    payload = {"benchmark": "transfer", "machine": machine_info(), "copy_impl": impl,
               "host_pool_memory": getattr(host, "memory_kind", "numpy"),
               "config": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}
    if args.compare_impls:
        progress.phase("comparing gather / scatter implementations")
        payload["impl_comparison"] = _compare(args)
    return payload


def _compare(args) -> list[dict]:
    """Gather / scatter of each GPU implementation vs a raw device copy (one KV component)."""
    orders = sorted({HostLayout(l).transfer_order for l in args.layouts})
    rows = compare_impls(["xla", "mgpu", "gpu"], args.page_sizes, args.page_counts, orders, args.layers,
                         args.heads, args.head_dim, args.dtype, args.reps, median_seconds)
    table = [[r["impl"], r["page_size"], r["pages"], r["order"], r["mib"], r.get("gather_gbps", "-"),
              r.get("gather_vs_raw", "-"), r.get("scatter_gbps", "-"), r.get("scatter_vs_raw", "-"),
              r["raw_copy_gbps"], r.get("error", "")] for r in rows]
    print_table(f"Page gather / scatter by implementation, backend {jax.default_backend()} "
                f"(GB/s; x = ratio to a raw device copy of the same bytes)",
                ["impl", "page", "pages", "order", "MiB", "gather", "x dev copy", "scatter", "x dev copy",
                 "raw copy", "error"], table)
    return rows


def main(argv=None) -> int:
    """``python -m benchmarks.bench_transfer`` / tests: the same options as ``hicache-jax bench transfer``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.transfer_arguments(p)
    args = p.parse_args(argv)
    options.apply_quick(p, args, "transfer")
    payload = run(args)
    print(f"JSON written to {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
