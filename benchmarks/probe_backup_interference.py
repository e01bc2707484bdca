"""How much a running D2H backup slows the model's steps, per way of copying device -> host.

    python -m benchmarks.probe_backup_interference [--quick] [--mib 64] [--steps 40]
        [--out hicache-results/backup_interference.json]

Issue 25's open GPU question: the project's backup (``JaxTransferEngine.backup`` on the
``xla_stream`` path) runs as XLA executables on the compute stream, so its bytes cost decode
time (1.26x on an H200); the older numpy path's ``device_put`` to host ran on PJRT's transfer
stream and cost nothing, but copies every byte on the CPU. This probe measures, on the same
bytes and in one process, the candidates a design could build on:

* ``engine-stream``: ``JaxTransferEngine.backup`` (``xla_stream``: pinned arena, no CPU pass);
* ``engine-numpy``: ``JaxTransferEngine.backup`` with ``host_copy="numpy"``;
* ``device_put-pinned``: ``jax.device_put`` of a contiguous device buffer to the pinned host
  memory kind (what a design that gathers on the device, then DMAs whole runs, would pay;
  it lands in a new host buffer, not in the pool);
* ``copy_to_host_async``: ``Array.copy_to_host_async()`` then ``np.asarray`` (PJRT's literal
  transfer into pageable memory).

For each, a background thread repeats the copy of ``--mib`` MiB while the main thread runs
``--steps`` model-like steps (a jitted chain of bf16 matmuls, sized to take a few ms on a
GPU); the table gives the step's median time against the same steps with nothing copying
(measured before and after every candidate, so a drift shows), and the copy's GB/s while
the steps ran. Absolute times mean something only on a GPU; on the CPU the probe checks
that every path runs (``tests/jax_backend/test_probe_backup_interference.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hicache_jax.bench.report import machine_info, print_table, results_path, write_json  # noqa: E402

METHODS = ("engine-stream", "engine-numpy", "device_put-pinned", "copy_to_host_async")


def _model_step(width: int, depth: int):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(x, w):
        for _ in range(depth):
            x = jnp.tanh(x @ w)
        return x

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (width, width), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (width, width), jnp.bfloat16) / np.sqrt(width)
    step(x, w).block_until_ready()
    return lambda: step(x, w).block_until_ready()


def _copiers(mib: int, layers: int):
    """Each method as (name, copy(): one copy of ``mib`` MiB waited for, bytes moved, close())."""
    import jax

    from hicache_jax import KVGeometry
    from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine, host_memory_kind
    from hicache_jax.backends.jax.memory import pinned_host_pool
    from pallas_kernels.page_copy import PageCopyConfig

    page = 16
    geom = KVGeometry.mha(page_size=page, num_layers=layers, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    n = max(1, (mib << 20) // geom.bytes_per_page)
    nbytes = n * geom.bytes_per_page
    dev_pool = JaxDevicePool(geom, 2 * n)
    rng = np.random.default_rng(0)
    src = rng.permutation(2 * n)[:n]
    out = {}
    for name, host_copy in (("engine-stream", "xla_stream"), ("engine-numpy", "numpy")):
        host = pinned_host_pool(geom, n, "page_first")
        try:
            eng = JaxTransferEngine(dev_pool, host, copy_config=PageCopyConfig(max_pages=2 * n), host_copy=host_copy)
        except ValueError as e:  # e.g. no pinned memory for the stream path on this platform
            print(f"[probe] {name}: not available here ({e})", file=sys.stderr)
            continue
        hst = np.arange(n)
        out[name] = (lambda eng=eng, hst=hst: eng.backup(src, hst).wait(), nbytes, eng.close, eng.host_copy)
    dev = jax.devices()[0]
    flat = jax.device_put(rng.integers(0, 256, nbytes, dtype=np.uint8), dev)
    kind = host_memory_kind(dev)
    if kind is not None:
        host_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
        out["device_put-pinned"] = (
            lambda: jax.device_put(flat, host_sharding).block_until_ready(),
            nbytes,
            lambda: None,
            kind,
        )

    def to_host():
        y = flat + 0  # a fresh array: copy_to_host_async caches the host copy of an array
        y.copy_to_host_async()
        np.asarray(y)

    out["copy_to_host_async"] = (to_host, nbytes, lambda: None, "pageable")
    return out


def _steps_ms(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def run(args) -> dict:
    import jax

    width, depth = (256, 2) if args.quick else (4096, 8)
    mib = 4 if args.quick else args.mib
    steps = 5 if args.quick else args.steps
    print(
        f"[probe] backend {jax.default_backend()}, model step {depth} x bf16 {width}x{width} matmuls, "
        f"backups of {mib} MiB, {steps} steps per measurement",
        file=sys.stderr,
        flush=True,
    )
    step = _model_step(width, depth)
    copiers = _copiers(mib, 2 if args.quick else 8)
    results, rows = {}, []
    for name in METHODS:
        if name not in copiers:
            continue
        copy, nbytes, close, path = copiers[name]
        copy()  # compiles
        before = statistics.median(_steps_ms(step, steps))
        stop = threading.Event()
        moved = [0, 0.0]

        def loop():
            t = time.perf_counter()
            while not stop.is_set():
                copy()
                moved[0] += nbytes
            moved[1] = time.perf_counter() - t

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        during = statistics.median(_steps_ms(step, steps))
        stop.set()
        th.join()
        after = statistics.median(_steps_ms(step, steps))
        close()
        idle = (before + after) / 2
        r = {
            "path": path,
            "step_ms_idle": idle,
            "step_ms_idle_before": before,
            "step_ms_idle_after": after,
            "step_ms_during": during,
            "step_ratio": during / idle,
            "copy_gbps_during": moved[0] / moved[1] / 1e9 if moved[1] else 0.0,
            "copies": moved[0] // nbytes,
        }
        results[name] = r
        rows.append([name, path, before, after, during, r["step_ratio"], r["copy_gbps_during"], r["copies"]])
        print(
            f"[probe] {name}: step x{r['step_ratio']:.2f}, {r['copy_gbps_during']:.1f} GB/s",
            file=sys.stderr,
            flush=True,
        )
    print_table(
        f"model steps while a backup of {mib} MiB repeats ({jax.default_backend()}; x = step time while "
        f"copying / idle)",
        [
            "method",
            "host memory",
            "idle ms (before)",
            "idle ms (after)",
            "ms while copying",
            "x idle",
            "copy GB/s",
            "copies",
        ],
        rows,
    )
    payload = {
        "benchmark": "backup_interference",
        "machine": machine_info(),
        "config": vars(args),
        "model_step": {"width": width, "depth": depth},
        "methods": results,
    }
    if args.out:
        write_json(args.out, payload)
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU-sized: tiny model step and backups (a smoke run)")
    p.add_argument("--mib", type=int, default=64, help="MiB per backup (default 64)")
    p.add_argument("--steps", type=int, default=40, help="model steps per measurement (default 40)")
    p.add_argument("--out", default=results_path("backup_interference.json"))
    args = p.parse_args(argv)
    for name in ("mib", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
