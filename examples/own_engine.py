"""Use hicache_jax from your own JAX serving engine: a complete, runnable example.

    pip install "hicache_jax-<version>-py3-none-any.whl[jax,storage,metrics]"
    python own_engine.py            # prints what it does; --out result.json for a machine-readable summary

Extras: ``[jax]`` the JAX backend, ``[storage]`` the orbax L3 backend (Python 3.12+; on 3.11 the
example falls back to the ``file`` backend, which needs no extra), ``[metrics]`` Prometheus.

Your engine keeps its model, scheduler and sampling; hicache_jax keeps the KV of prompt
prefixes across three tiers and tells you which pages already hold a prompt's KV:

* L1 ``JaxDevicePool``: per layer one JAX array of KV pages. Your jitted model step writes
  KV into it by page id; run the step through ``pool.apply`` (it installs the arrays the step
  returns, so donation is handled) or write whole pages with ``pool.write_pages``.
* L2 host pool + ``JaxTransferEngine``: backups device -> host and load-backs host -> device.
* L3 ``StorageController``: every backup is written through to storage (orbax segment log
  here); a request's prefix missing from L1/L2 is prefetched from L3 into host pages.
* ``HiRadixCache``: the radix tree over token pages. Per request: ``begin_request`` (match +
  load-back), your step on the uncached suffix, ``cache_finished_req`` (insert + unlock).
  Call ``check_events()`` once per scheduler step (acknowledges finished copies).
* ``CacheStack``: one ``close()`` at shutdown for the cache, the L3 controller and the transfer
  engine, in the order that loses no L3 write (also a context manager).

The "model" below is a toy: its KV for a token is a fixed function of the token and its
position, so the example can check that every cached page holds exactly the bytes the model
wrote. A real model writes its attention's K/V in the same place (the slot of position ``i``
is page ``page_table[i // page_size]``, offset ``i % page_size``).

The run: 4 conversations; round 1 is cold; round 2 re-sends them with a new turn and hits
L1; after simulated memory pressure (L1 evicted) round 3 hits L2; then the process state is
thrown away, as in a restart, and a fresh cache on the same L3 directory serves round 4 from
L3 (prefetch, then admission). It prints each request's hit and the Prometheus metrics.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import hicache_jax
from hicache_jax import CacheStack, HostLayout, KVGeometry
from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine
from hicache_jax.backends.jax.memory import pinned_host_pool
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey, register_prometheus
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

PAGE = 16  # tokens per KV page (also the L3 key granularity)
GEOM = KVGeometry.mha(num_layers=4, page_size=PAGE, num_kv_heads=2, head_dim=32, dtype="bfloat16")
VOCAB = 1000


# ---------------------------------------------------------------------------------------------
# Your model (a toy): the KV of token t at position i in layer l, component c.
def toy_kv(tokens: jax.Array, positions: jax.Array, layer: int, comp: int) -> jax.Array:
    # Integers below 256: exact in bfloat16, so the check below can compare bytes.
    h, d = GEOM.num_kv_heads, GEOM.head_dim
    base = tokens.astype(jnp.int32) * 7 + positions.astype(jnp.int32) * 3 + layer * 11 + comp * 13
    lanes = jnp.arange(h * d, dtype=jnp.int32).reshape(1, h, d)
    return ((base[:, None, None] + lanes) % 256).astype(jnp.float32) - 128.0


@functools.partial(jax.jit, donate_argnums=(0,))
def model_step(pools, tokens, positions, slot_page, slot_offset):
    """One prefill step: writes the KV of ``tokens`` into their slots (the pool arrays are
    donated: updated in place) and returns the new pool arrays. Padding tokens point at page
    ``num_pages`` (out of range) and are dropped, so a few padded shapes serve every length."""
    new = {}
    for ci, (comp, layers) in enumerate(sorted(pools.items())):
        new[comp] = [
            a.at[slot_page, slot_offset].set(toy_kv(tokens, positions, l, ci).astype(a.dtype), mode="drop")
            for l, a in enumerate(layers)
        ]
    return None, new


def bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def expected_pages(prompt: np.ndarray, first_page: int, npages: int) -> dict[str, np.ndarray]:
    """What the model wrote into pages [first_page, first_page + npages) of ``prompt`` (raw bits)."""
    pos = np.arange(first_page * PAGE, (first_page + npages) * PAGE)
    out = {}
    for ci, comp in enumerate(sorted(GEOM.components)):
        layers = [
            np.asarray(toy_kv(jnp.asarray(prompt[pos]), jnp.asarray(pos), l, ci).astype(jnp.bfloat16))
            for l in range(GEOM.num_layers)
        ]
        out[comp] = np.stack(layers).reshape((GEOM.num_layers, npages) + GEOM.page_shape).view(GEOM.container_dtype)
    return out


# ---------------------------------------------------------------------------------------------
class MyEngine:
    """The parts of a serving engine that talk to the cache."""

    def __init__(
        self, l3_dir: str, device_pages: int = 96, host_pages: int = 192, registry=None, labels: dict | None = None
    ) -> None:
        self.pool = JaxDevicePool(GEOM, device_pages)  # L1
        host = pinned_host_pool(GEOM, host_pages, HostLayout.PAGE_FIRST)  # L2 (pinned where the platform has it)
        self.transfer = JaxTransferEngine(self.pool, host)
        self.transfer.precompile()  # compile every copy shape now, not while serving
        # L3: the orbax segment log. prefetch_threshold_tokens: the shortest L3 read worth doing
        # (default 256; these prompts are short, so one page).
        storage = StorageConfig(
            backend=ARGS.storage_backend, path=l3_dir, prefetch_threshold_tokens=PAGE, prefetch_policy="timeout"
        )
        self.cache = HiRadixCache(
            HiCacheConfig(page_size=PAGE, write_policy="write_through", storage=storage, load_back_threshold=PAGE),
            self.transfer,
            self.pool.allocator,
        )
        # The model id (and revision, TP rank, ...) seeds every L3 key: another model never hits.
        self.l3 = StorageController(self.cache, model="my-model", weights_revision="v1")
        # One close() for the whole stack, in the order that loses nothing (see close below).
        self.stack = CacheStack(self.cache, storage=self.l3, transfers=[self.transfer])
        self.metrics = register_prometheus(self.cache, registry, labels=labels) if registry is not None else None

    def serve(self, prompt: list[int]) -> dict:
        """One request: prefetch on arrival, admit, match + load back, prefill the rest, insert."""
        tokens = np.asarray(prompt, np.int64)
        key = RadixKey(tokens[:-1])  # match at most len-1 tokens: the last one is always computed
        op = self.l3.prefetch(key)  # non-blocking: runs on the controller's threads
        # ... your scheduler would admit other requests here; poll until the prefetch is ready:
        while not self.l3.prefetch_ready(op):
            self.cache.check_events()
            time.sleep(0.001)
        storage_tokens = self.l3.finish_prefetch(op)  # L3 pages become host-only tree nodes
        req, load = self.cache.begin_request(key)  # match; host continuation loaded back; prefix locked
        if load is not None:
            for layer in range(GEOM.num_layers):  # before your step reads the loaded pages
                load.wait_layer(layer)
        cached = req.device_pages.shape[0] * PAGE
        loaded = load.num_tokens if load is not None else 0
        # Pages for the rest of the prompt (alloc_device evicts unlocked leaves when short).
        need = -(-len(tokens) // PAGE) - req.device_pages.shape[0]
        pages = self.cache.alloc_device(need)
        if pages is None:
            raise RuntimeError("device pool too small for this prompt")
        req.extend(RadixKey(tokens), pages)
        # Your model prefills the uncached suffix; apply() installs the donated pool arrays.
        table = req.device_pages
        n = len(tokens) - cached
        pos = np.full(bucket(n), len(tokens) - 1)
        pos[:n] = np.arange(cached, len(tokens))
        slot_page = np.where(np.arange(pos.size) < n, table[pos // PAGE], self.pool.num_pages)
        toks = np.zeros(pos.size, np.int64)
        toks[:n] = tokens[cached:]
        self.pool.apply(
            model_step, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(slot_page), jnp.asarray(pos % PAGE)
        )
        next_token = (int(tokens.sum()) + len(tokens)) % VOCAB  # your sampler's first output token
        # Check the cached prefix holds exactly the bytes the model wrote for it.
        if cached:
            got = {c: self.pool.read_pages_host(c, table[: cached // PAGE]) for c in GEOM.components}
            want = expected_pages(tokens, 0, cached // PAGE)
            assert all(np.array_equal(got[c], want[c]) for c in GEOM.components), "cached KV differs"
        self.cache.cache_finished_req(req)  # insert the prompt's pages, free the tail, unlock
        self.cache.check_events()  # every scheduler step: acknowledge finished copies
        storage = min(storage_tokens, loaded)
        return {
            "prompt_tokens": len(tokens),
            "device": cached - loaded,
            "host": loaded - storage,
            "storage": storage,
            "next_token": int(next_token),
        }

    def evict_device(self) -> None:
        """Memory pressure, simulated: everything unlocked leaves L1 (backed-up KV stays on L2)."""
        self.cache.flush()
        self.cache.evict(self.cache.evictable_tokens)

    def close(self) -> None:
        """Shutdown: stop admitting, finish the copies in flight, cancel prefetches, write and
        flush every pending L3 write, close the store, then the transfer engine. Idempotent.
        (A process that exits without it still flushes L3 where it can, or logs what it loses.)"""
        self.stack.close()
        if self.metrics is not None:
            self.metrics.unregister()
            self.metrics = None


def _have_storage_extra() -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("orbax.checkpoint", "tensorstore"))
    except ImportError:  # find_spec of a submodule imports its parent: no ``orbax`` at all
        return False


def main(argv: list[str] | None = None) -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--storage-backend",
        default="auto",
        choices=["auto", "orbax", "file"],
        help="L3 backend: orbax needs the [storage] extra (Python 3.12+); file needs none; auto: orbax "
        "when the [storage] extra is installed, else file",
    )
    p.add_argument("--out", default=None, help="write a JSON summary here")
    ARGS = p.parse_args(argv)
    if ARGS.storage_backend == "auto":
        ARGS.storage_backend = "orbax" if _have_storage_extra() else "file"
        if ARGS.storage_backend == "file":
            print(
                "note: the [storage] extra (orbax-checkpoint, tensorstore; Python 3.12+) is not installed: "
                "L3 uses the 'file' backend"
            )
    try:
        import prometheus_client
    except ImportError:
        print("error: this example exports Prometheus metrics: pip install 'hicache-jax[metrics]'", file=sys.stderr)
        return 2

    print(
        f"hicache_jax {hicache_jax.__version__} from {hicache_jax.__file__}; jax {jax.__version__} "
        f"({jax.default_backend()}); L3 backend {ARGS.storage_backend}"
    )
    rng = np.random.default_rng(0)
    convs = [rng.integers(0, VOCAB, 200 + 40 * i).tolist() for i in range(4)]
    l3_dir = tempfile.mkdtemp(prefix="hicache-example-l3-")
    registry = prometheus_client.CollectorRegistry()
    labels = {"cache": "main", "rank": "0", "model": "my-model"}
    log = []

    def round_(engine: MyEngine, name: str) -> None:
        for i, conv in enumerate(convs):
            r = engine.serve(conv)
            conv += [r["next_token"]] + rng.integers(0, VOCAB, 24).tolist()  # answer + the next question
            log.append({"round": name, "conversation": i, **r})
            print(
                f"  {name:28s} conv {i}: {r['prompt_tokens']:4d} tokens, cached: device {r['device']:4d}, "
                f"host {r['host']:4d}, storage {r['storage']:4d}"
            )

    try:
        engine = MyEngine(l3_dir, registry=registry, labels=labels)
        print("round 1 (cold), round 2 (L1 hits), L1 evicted, round 3 (L2 hits):")
        round_(engine, "1: cold")
        round_(engine, "2: next turn")
        engine.evict_device()
        round_(engine, "3: after L1 eviction")
        first = engine.cache.stats()["cached_tokens"]
        engine.close()
        print("restart: a new cache on the same L3 directory; round 4 comes back from L3:")
        engine = MyEngine(l3_dir, registry=registry, labels=labels)
        round_(engine, "4: after a restart")
        stats = engine.cache.stats()
        sample = registry.get_sample_value
        prom = {
            src: sample("hicache_cached_tokens_total", {**labels, "cache_source": src})
            for src in ("device", "host", "storage")
        }
        engine.close()
    finally:
        shutil.rmtree(l3_dir, ignore_errors=True)
    total = {src: first[src] + stats["cached_tokens"][src] for src in first}
    print(f"cached tokens by source (cache.stats()): before the restart {first}, after {stats['cached_tokens']}")
    print(f"Prometheus hicache_cached_tokens_total after the restart: {prom}")
    print(f"L3 store: {stats['storage_read_hit_pages']} pages read, {stats['storage_corrupt_pages']} corrupt")
    summary = {
        "hicache_jax_file": hicache_jax.__file__,
        "storage_backend": ARGS.storage_backend,
        "requests": log,
        "cached_tokens": total,
        "prometheus_cached_tokens_after_restart": prom,
        "kv_bytes_checked": True,
    }
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(summary, f, indent=2)
    ok = all(total[s] > 0 for s in ("device", "host", "storage"))
    print("device, host and storage hits: " + ("all seen" if ok else "MISSING"))
    return 0 if ok else 1


ARGS = argparse.Namespace(storage_backend="orbax")  # main() replaces it

if __name__ == "__main__":
    sys.exit(main())
