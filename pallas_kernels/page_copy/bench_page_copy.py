"""Benchmark pieces for the page-copy kernels (driven by ``hicache-jax bench transfer``, ``hicache_jax/bench/transfer.py``).

Each measurement is paired with a raw device-to-device copy of the same number of bytes
measured in the same process, so the reported ratio is hardware-independent.

Every copy measured writes into memory it wrote before: the gather into a donated staging
buffer, the scatter into the donated pools, the raw copy into a donated buffer of its own. A
copy into a fresh output measures the allocator, not the copy: on XLA:CPU each fresh 256 MiB -
1 GiB output is new ``mmap`` memory, so every call takes one page fault per 4 KiB (262,144 per
GiB, more system time than the copy itself), and the same gather read 0.18x or 1.1x a
freshly allocating raw copy from run to run (a GPU's caching allocator hands back mapped
memory, so there the two agree).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from .dispatch import PageCopier, PageCopyConfig

# Reads every byte of ``x`` and writes it over ``out`` (donated: the same memory every call).
_raw_copy_into = jax.jit(lambda x, out: jax.lax.dynamic_update_slice(out, x, (0,)), donate_argnums=1)


def _raw_copy_run(nbytes: int):
    """A plain device copy of ``nbytes`` into a buffer it reuses (see the module docstring)."""
    x = jnp.asarray(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    state = {"out": jnp.zeros(nbytes, jnp.uint8)}

    def run():
        state["out"] = _raw_copy_into(x, state["out"])
        state["out"].block_until_ready()

    return run


def gather_scatter_seconds(
    copier: PageCopier,
    pools: list[jax.Array],
    ids: np.ndarray,
    dest: np.ndarray,
    order: str,
    reps: int,
    raw_nbytes: int,
) -> tuple[float, float, float]:
    """(gather, scatter, raw copy) median seconds: all layers gathered once into a reused staging
    buffer; each layer scattered back; a plain device copy of ``raw_nbytes`` into a reused
    buffer (each writes memory it wrote before: see the module docstring).

    The three run in alternating rounds (one of each per round, after one warm-up each), so a
    slow spell of a shared machine (another process, the kernel reclaiming memory) lands on the
    measurement and its baseline alike instead of skewing their ratio."""
    buf, _ = copier.gather(pools, ids, order)
    jax.block_until_ready(buf)
    staging = {"buf": jnp.copy(buf)}

    def gather():  # into the donated staging buffer, as a transfer engine that keeps one would
        staging["buf"] = copier.gather(pools, ids, order, out=staging["buf"])[0]
        jax.block_until_ready(staging["buf"])

    state = {"pools": [jnp.copy(p) for p in pools]}

    def scatter():  # the transfer engine's path: ids validated and uploaded once per call
        new = copier.scatter_layers(state["pools"], dest, buf, order)
        jax.block_until_ready(new)
        state["pools"] = new  # donated: keep the replacements

    runs = (gather, scatter, _raw_copy_run(raw_nbytes))
    for run in runs:  # warm-up (compiles)
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, t in zip(runs, times):
            t0 = time.perf_counter()
            run()
            t.append(time.perf_counter() - t0)
    g, s, raw = (float(np.median(t)) for t in times)
    return g, s, raw


def compare_impls(
    impls,
    page_sizes,
    page_counts,
    orders,
    num_layers: int = 8,
    heads: int = 8,
    head_dim: int = 128,
    dtype="bfloat16",
    reps: int = 10,
) -> list[dict]:
    """Gather / scatter GB/s of each implementation in ``impls`` and its ratio to a raw device copy.

    One K (or V) component: ``num_layers`` pool layers of ``(pool pages, page, heads, head_dim)``;
    gather moves every layer of ``n`` pages, scatter writes every layer back (one call per layer).
    An implementation that fails (e.g. not supported here) gets its error instead of numbers.
    """
    rows = []
    rng = np.random.default_rng(0)
    for page in page_sizes:
        for n in page_counts:
            pool_pages = max(2 * n, 64)
            pools = [
                jnp.asarray(rng.integers(0, 2**16, (pool_pages, page, heads, head_dim), dtype=np.uint16)).view(dtype)
                for _ in range(num_layers)
            ]
            ids, dest = rng.permutation(pool_pages)[:n], rng.permutation(pool_pages)[:n]
            nbytes = n * num_layers * page * heads * head_dim * jnp.dtype(dtype).itemsize
            for order in orders:
                for impl in impls:
                    row = dict(impl=impl, page_size=page, pages=n, order=order, mib=nbytes / 2**20)
                    try:
                        copier = PageCopier(PageCopyConfig(impl=impl, max_pages=pool_pages))
                        row["impl"] = copier.impl + (" (interpret)" if copier.interpret else "")
                        g, s, raw = gather_scatter_seconds(copier, pools, ids, dest, order, reps, nbytes)
                        row.update(
                            raw_copy_gbps=nbytes / raw / 1e9,
                            gather_gbps=nbytes / g / 1e9,
                            scatter_gbps=nbytes / s / 1e9,
                        )
                        row.update(
                            gather_vs_raw=row["gather_gbps"] / row["raw_copy_gbps"],
                            scatter_vs_raw=row["scatter_gbps"] / row["raw_copy_gbps"],
                        )
                    except Exception as e:  # noqa: BLE001 - reported per row
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows.append(row)
    return rows


def main(argv=None) -> int:
    """``python -m pallas_kernels.page_copy.bench_page_copy``: compare implementations, print JSON lines."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=compare_impls.__doc__)
    p.add_argument("--impls", nargs="+", default=["xla", "mgpu", "gpu"])
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--page-counts", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--orders", nargs="+", default=["nlp", "npl", "lnp"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args(argv)
    print(
        json.dumps(
            {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
        )
    )
    for r in compare_impls(a.impls, a.page_sizes, a.page_counts, a.orders, a.layers, reps=a.reps):
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
