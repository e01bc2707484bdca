"""KV page-transfer benchmark for the torch backend: D2H backup / H2D load vs raw torch copies.

Same table columns and JSON shape as ``hicache-jax bench transfer`` (the JAX one, ``hicache_jax/bench/transfer.py``). The
gather / scatter columns are N/A: this backend has no separate device gather kernel (the
torch copy gathers inside the transfer; the Ascend op copies pages directly).

* D2H (``TorchTransferEngine.backup``, all components) vs a raw device->host ``copy_`` of a
  contiguous tensor of the same bytes (into pinned memory where the device has it), and vs a
  host memcpy (numpy) of the same bytes.
* H2D (``TorchTransferEngine.load``) vs a raw host->device ``copy_`` of the same bytes.

On CPU the "device" is host memory too, so D2H/H2D are memory-to-memory copies plus the
worker-thread hop; numbers are indicative only.
Usage: python -m npu_bridge.bench_transfer_torch [--quick] [--device auto|cpu|cuda|npu] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys

import numpy as np

from hicache_jax import HostLayout, KVGeometry
from hicache_jax.bench import report as _report
from hicache_jax.bench.report import gbps, print_table

from . import _lazy
from .backend import make_torch_backend
from .devices import device_module, resolve_device, supports_pinned
from .kv_split_pool import KV_SPLIT_NAME

torch = _lazy.torch()


def median_seconds(run, reps: int, sync=None, warmup: int = 1) -> float:
    """``hicache_jax.bench.report.median_seconds`` with an optional device sync after each run."""
    return _report.median_seconds(run if sync is None else (lambda: (run(), sync())), reps, warmup)


def pick_device(name: str):
    if name != "auto":
        return resolve_device(name)
    try:
        import importlib.util

        if importlib.util.find_spec("torch_npu") is not None:
            dev = resolve_device("npu")
            if torch.npu.is_available():
                return dev
    except ImportError:
        pass
    return resolve_device("cuda" if torch.cuda.is_available() else "cpu")


def _raw_seconds(nbytes: int, device, reps: int, sync) -> tuple[float, float, float]:
    """(raw D2H, host memcpy, raw H2D) median seconds for ``nbytes``."""
    pin = supports_pinned(device)
    src_dev = torch.randint(0, 127, (nbytes,), dtype=torch.int8).to(device)
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=pin)
    d2h = median_seconds(lambda: host.copy_(src_dev, non_blocking=pin), reps, sync)
    h2d = median_seconds(lambda: src_dev.copy_(host, non_blocking=pin), reps, sync)
    a = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    return d2h, median_seconds(lambda: np.copyto(b, a), reps), h2d


def run(args) -> dict:
    device = pick_device(args.device)
    mod = device_module(device)
    sync = (lambda: mod.synchronize()) if device.type != "cpu" else None
    cases = list(itertools.product(args.page_sizes, args.page_counts, args.layouts))
    rows, results, impls = [], [], set()
    for page, n, layout in cases:
        if args.kind == "mha":
            geom = KVGeometry.mha(args.layers, page, args.heads, args.head_dim, args.dtype)
        else:
            geom = KVGeometry.mla(args.layers, page, args.kv_lora_rank, args.rope_dim, args.dtype)
        device_pages = max(2 * n, 64)
        dev, host, eng = make_torch_backend(geom, device_pages, n, layout, device=device, impl=args.impl)
        impls.add(eng.impl)
        rng = np.random.default_rng(0)
        for t in dev.buffers.values():  # random KV, never zeros
            t.view(dev.bits).copy_(torch.randint(-(2**7), 2**7 - 1, t.shape, dtype=dev.bits))
        src = rng.permutation(device_pages)[:n]
        dst = rng.permutation(device_pages)[:n]
        hst = rng.permutation(n)[:n]
        both = n * geom.bytes_per_page
        one_comp = both // len(geom.components)
        d2h_s = median_seconds(lambda: eng.backup(src, hst).wait(), args.reps)
        h2d_s = median_seconds(lambda: eng.load(hst, dst).wait(), args.reps)
        raw_d2h, memcpy, raw_h2d = _raw_seconds(both, device, args.reps, sync)
        eng.close()
        r = dict(
            page_size=page,
            pages=n,
            layout=layout,
            mib_per_component=one_comp / 2**20,
            transfer_impl=eng.impl,
            gather_gbps=None,
            scatter_gbps=None,
            raw_device_copy_gbps=None,
            d2h_gbps=gbps(both, d2h_s),
            raw_d2h_gbps=gbps(both, raw_d2h),
            host_memcpy_gbps=gbps(both, memcpy),
            h2d_gbps=gbps(both, h2d_s),
            raw_h2d_gbps=gbps(both, raw_h2d),
        )
        r.update(
            gather_vs_raw=None,
            scatter_vs_raw=None,
            d2h_vs_raw=r["d2h_gbps"] / r["raw_d2h_gbps"],
            d2h_vs_memcpy=r["d2h_gbps"] / r["host_memcpy_gbps"],
            h2d_vs_raw=r["h2d_gbps"] / r["raw_h2d_gbps"],
        )
        results.append(r)
        rows.append(
            [
                page,
                n,
                layout,
                r["mib_per_component"],
                None,
                None,
                None,
                None,
                r["d2h_gbps"],
                r["d2h_vs_raw"],
                r["d2h_vs_memcpy"],
                r["h2d_gbps"],
                r["h2d_vs_raw"],
            ]
        )
    shape = (
        f"{args.heads} heads x {args.head_dim}" if args.kind == "mha" else f"MLA {args.kv_lora_rank}+{args.rope_dim}"
    )
    print_table(
        f"KV page transfers (torch backend): {args.layers} layers x {shape} {args.dtype}, "
        f"transfer impl {'/'.join(sorted(impls))}, device {device} (GB/s; x = ratio to raw copy of same bytes)",
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
            "H2D",
            "x raw H2D",
        ],
        rows,
    )
    machine = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "node": platform.node(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "npu":
        machine["torch_npu"] = getattr(sys.modules.get("torch_npu"), "__version__", "?")
    return {
        "benchmark": "transfer",
        "backend": "torch",
        "machine": machine,
        "copy_impl": "/".join(sorted(impls)),
        "host_pool_memory": "pinned" if supports_pinned(device) else "pageable",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small sweep (seconds), e.g. for smoke tests")
    p.add_argument("--device", default="auto", help="auto (npu, else cuda, else cpu), cpu, cuda or npu")
    p.add_argument("--impl", default="auto", choices=["auto", "torch", "reference", "ascend"])
    p.add_argument("--kind", default="mha", choices=["mha", "mla"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-sizes", type=int, nargs="+", default=None, help="tokens per page (default: 1 16 128)")
    p.add_argument("--page-counts", type=int, nargs="+", default=None, help="pages per transfer (default: 16 128)")
    p.add_argument("--layouts", nargs="+", default=None, help=f"host layouts (default: all; MLA adds {KV_SPLIT_NAME})")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per op (median; default 5)")
    p.add_argument("--out", default="benchmarks/results/transfer_torch.json")
    args = p.parse_args(argv)
    if args.quick:  # small shapes; explicit sizes / counts / reps still win
        args.layers, args.heads, args.head_dim, args.kv_lora_rank, args.rope_dim = 2, 2, 64, 64, 16
        args.page_sizes = args.page_sizes or [1, 16]
        args.page_counts = args.page_counts or [8, 64]
        args.reps = args.reps or 2
    args.page_sizes = args.page_sizes or [1, 16, 128]
    args.page_counts = args.page_counts or [16, 128]
    args.reps = args.reps or 5
    args.layouts = args.layouts or [l.value for l in HostLayout] + ([KV_SPLIT_NAME] if args.kind == "mla" else [])
    payload = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"JSON written to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
