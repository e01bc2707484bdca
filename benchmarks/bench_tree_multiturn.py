"""Multi-turn replay through HiRadixCache on the multiturn-64x10 trace.

The multiturn-64x10 trace (``make_trace``; the trace the tree benchmarks and the comparison
with upstream sglang replay): 64 clients x 10 rounds from random.Random(0): 4 system prompts of 1,024 tokens, each turn
appends 256 user tokens, the answer is 128 tokens. Page size 1, 60k device tokens, host
ratio 4. Per request, in upstream's order: match -> load-back (if any) -> lock -> alloc
(``alloc_device``, which evicts when short) -> prefill writes KV -> insert prompt, re-match, move lock
(cache_unfinished_req) -> decode writes KV -> insert prompt+output, free tail, unlock
(cache_finished_req) -> poll transfer events.

Two modes, both moving real KV bytes through the numpy backend:
* manager: a tiny 1-layer KV (one MLA-style latent of 8 bf16: 16 B/token) so the tree dominates;
* realistic: full-size attention layers (8 KV heads x 128 dims, bf16; --real-layers of them).

Reports req/s, ops/s and p50/p99 latency of match / insert / evict / load-back, and hit
rates per tier (L1 = device-matched / prompt tokens, L2 = loaded-back / prompt tokens).

What is timed: the whole replay loop, wall clock (``req_per_s``) and process CPU time
(``req_per_cpu_s``; steadier on a shared machine), from the first request to the final
``flush`` (every transfer acknowledged). That covers every cache call (match, load-back and
its eviction, locks, allocation with eviction, both inserts with their backups, event
polls), the engine's copies (real bytes through the numpy backend), building the requests'
keys and ``CacheRequest``s, and this harness's own bookkeeping. ``manager_req_per_s`` /
``manager_req_per_cpu_s`` subtract only the simulated model's work, timed around it: the
KV writes of prefill and decode (``KVWriter.write``), plus ``--verify`` reads and
``--check-every`` sanity checks when enabled. The table's req/s column is the manager
CPU-time figure. Trace generation, cache construction and the final sanity check are not
timed.

    python benchmarks/bench_tree_multiturn.py [--quick] [--modes manager,realistic]
        [--policies write_through,...] [--out benchmarks/results/tree_multiturn.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hicache_jax import KVGeometry  # noqa: E402
from hicache_jax.backends.numpy_backend import make_numpy_backend  # noqa: E402
from hicache_jax.cache import CacheRequest, HiCacheConfig, HiRadixCache, RadixKey  # noqa: E402

POLICIES = ("write_through", "write_through_selective", "write_back")


def make_trace(
    clients: int = 64,
    rounds: int = 10,
    system_len: int = 1024,
    user_len: int = 256,
    answer_len: int = 128,
    seed: int = 0,
) -> list[dict]:
    """The multiturn-64x10 trace (module docstring); draw order matters for reproducing its hit rates."""
    rng = random.Random(seed)
    systems = [[rng.randint(1, 32000) for _ in range(system_len)] for _ in range(4)]
    history = [list(systems[c % 4]) for c in range(clients)]
    trace = []
    for r in range(rounds):
        order = list(range(clients))
        rng.shuffle(order)
        for c in order:
            history[c].extend(rng.randint(1, 32000) for _ in range(user_len))
            prompt = list(history[c])
            output = [rng.randint(1, 32000) for _ in range(answer_len)]
            trace.append(
                {"client": c, "round": r, "prompt": np.array(prompt, np.int64), "output": np.array(output, np.int64)}
            )
            history[c].extend(output)
    return trace


class KVWriter:
    """Writes KV for new tokens into device pages (what prefill/decode would do).

    Channel 0 of each page holds the token id and channel 1 its position, so ``verify`` can
    check that a hit maps to pages holding those tokens' KV.
    """

    def __init__(self, geom: KVGeometry, device) -> None:
        self.geom, self.device = geom, device
        self.dtype = geom.container_dtype
        self.maxval = np.iinfo(self.dtype).max

    def _pages(self, tokens: np.ndarray, start: int) -> np.ndarray:
        g = self.geom
        n = tokens.shape[0]
        buf = np.zeros((g.num_layers, n, 1, g.heads, g.width), self.dtype)
        buf[:, :, 0, :, 0] = (tokens % self.maxval).astype(self.dtype)[None, :, None]
        if g.width > 1:
            buf[:, :, 0, :, 1] = (np.arange(start, start + n) % self.maxval).astype(self.dtype)[None, :, None]
        return buf

    def write(self, ids: np.ndarray, tokens: np.ndarray, start: int) -> None:
        if ids.shape[0]:
            buf = self._pages(tokens, start)
            for c in self.geom.components:
                self.device.write(c, ids, buf)

    def verify(self, ids: np.ndarray, tokens: np.ndarray) -> None:
        if ids.shape[0]:
            exp = self._pages(tokens[: ids.shape[0]], 0)
            for c in self.geom.components:
                got = self.device.read(c, ids)
                if not np.array_equal(got[..., :2], exp[..., :2]):
                    raise AssertionError(f"KV mismatch in component {c}")


def geometry(mode: str, real_layers: int) -> KVGeometry:
    if mode == "manager":
        return KVGeometry.mla(1, 1, 6, 2, "bfloat16")  # one layer, one 8-wide latent: 16 B/token
    return KVGeometry.mha(real_layers, 1, 8, 128, "bfloat16")


class Timer:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {k: [] for k in ("match", "load_back", "insert", "evict")}

    def summary(self) -> dict:
        out = {}
        for k, v in self.samples.items():
            if not v:
                out[k] = {"count": 0}
                continue
            a = np.array(v)
            out[k] = {
                "count": int(a.size),
                "ops_per_s": float(a.size / a.sum()) if a.sum() else None,
                "p50_us": float(np.percentile(a, 50) * 1e6),
                "p99_us": float(np.percentile(a, 99) * 1e6),
                "total_s": float(a.sum()),
            }
        return out


def run(
    trace: list[dict],
    policy: str,
    mode: str,
    device_tokens: int,
    host_ratio: float,
    real_layers: int,
    verify: bool,
    check_every: int,
    progress: bool,
    geom: KVGeometry | None = None,
) -> dict:
    """One replay with a fresh cache; ``geom`` overrides the mode's KV geometry."""
    geom = geometry(mode, real_layers) if geom is None else geom
    host_pages = int(device_tokens * host_ratio)
    device, host, engine = make_numpy_backend(geom, device_tokens, host_pages)
    cache = HiRadixCache(HiCacheConfig(page_size=1, write_policy=policy), engine, device.allocator)
    kv = KVWriter(geom, device)
    timer = Timer()
    pc = time.perf_counter
    prompt_tokens = l1 = l2 = 0
    alloc = device.allocator

    def alloc_pages(n: int) -> np.ndarray:
        if alloc.available < n:
            # Short: alloc_device evicts and hands the evicted pages over (what the reference
            # engine calls); timed as an eviction.
            t = pc()
            ids = cache.alloc_device(n)
            timer.samples["evict"].append(pc() - t)
        else:
            ids = alloc.alloc(n)
        if ids is None:
            raise RuntimeError(f"{policy}/{mode}: out of device memory for {n} tokens")
        return ids

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(trace), desc=f"{mode:9s} {policy}", leave=False, mininterval=0.5)
        except ImportError:
            bar = None
    cpt = time.process_time
    side_wall = side_cpu = 0.0  # the simulated model's work inside the loop (see the docstring)
    t_start, c_start = pc(), cpt()
    for i, rec in enumerate(trace):
        prompt, output = rec["prompt"], rec["output"]
        key = RadixKey(prompt)
        t = pc()
        m = cache.match_prefix(key)
        timer.samples["match"].append(pc() - t)
        pages, last = m.device_indices, m.last_device_node
        loaded = 0
        if m.host_hit_length:
            t = pc()
            lb = cache.load_back(m.last_host_node)
            timer.samples["load_back"].append(pc() - t)
            if lb is not None:
                lb.handle.wait()  # the forward pass waits for its layers
                pages = np.concatenate([pages, lb.device_pages])
                last = lb.node
                loaded = lb.num_tokens
        if last is not cache.root:
            cache.inc_lock_ref(last)
        prefix = pages.shape[0]
        prompt_tokens += prompt.shape[0]
        l1 += m.device_hit_length
        l2 += loaded
        req = CacheRequest(key, 1, pages, last if last is not cache.root else None, prefix)
        new = alloc_pages(prompt.shape[0] - prefix)
        s0, c0 = pc(), cpt()
        if verify:
            kv.verify(pages, prompt)
        kv.write(new, prompt[prefix:], prefix)  # prefill
        side_wall += pc() - s0
        side_cpu += cpt() - c0
        req.extend(key, new)
        t = pc()
        cache.cache_unfinished_req(req)
        timer.samples["insert"].append(pc() - t)
        out_ids = alloc_pages(output.shape[0])
        s0, c0 = pc(), cpt()
        kv.write(out_ids, output, prompt.shape[0])  # decode
        side_wall += pc() - s0
        side_cpu += cpt() - c0
        full = np.concatenate([prompt, output])
        req.extend(RadixKey(full), out_ids)
        t = pc()
        cache.cache_finished_req(req)
        timer.samples["insert"].append(pc() - t)
        cache.check_events()
        if check_every and (i + 1) % check_every == 0 or bar is not None:
            s0, c0 = pc(), cpt()
            if check_every and (i + 1) % check_every == 0:
                cache.sanity_check(0)
            if bar is not None:
                bar.update(1)
            side_wall += pc() - s0
            side_cpu += cpt() - c0
    cache.flush()
    wall = pc() - t_start
    cpu = cpt() - c_start
    if bar is not None:
        bar.close()
    cache.sanity_check(0)
    if verify:
        # Every cached prefix still maps to its own tokens' KV.
        for rec in trace[-8:]:
            mm = cache.match_prefix(RadixKey(rec["prompt"]))
            kv.verify(mm.device_indices, rec["prompt"])
    ops = timer.summary()
    total_ops = sum(v["count"] for v in ops.values())
    met = cache.metrics
    return {
        "policy": policy,
        "mode": mode,
        "requests": len(trace),
        "wall_s": wall,
        "cpu_s": cpu,
        "model_wall_s": side_wall,
        "model_cpu_s": side_cpu,
        "req_per_s": len(trace) / wall,
        "req_per_cpu_s": len(trace) / cpu,
        "manager_req_per_s": len(trace) / (wall - side_wall),
        "manager_req_per_cpu_s": len(trace) / (cpu - side_cpu),
        "ops_per_s": total_ops / wall,
        "ops": ops,
        "hit_rate": {"L1": l1 / prompt_tokens, "L2": l2 / prompt_tokens, "total": (l1 + l2) / prompt_tokens},
        "prompt_tokens": prompt_tokens,
        "kv_bytes_per_token": geom.bytes_per_token,
        "bytes": {"backed_up": met.backup_bytes, "loaded": met.loaded_bytes},
        "tokens": {
            "backed_up": met.backup_tokens,
            "loaded": met.loaded_tokens,
            "evicted_device": met.evicted_device_tokens,
            "evicted_host": met.evicted_host_tokens,
            "dropped": met.dropped_tokens,
            "backup_failed": met.backup_failed_tokens,
        },
    }


def print_table(results: list[dict]) -> None:
    headers = [
        "mode",
        "policy",
        "L1",
        "L2",
        "req/s (mgr cpu)",
        "loop req/s (wall)",
        "ops/s",
        "match p50/p99 us",
        "insert p50/p99 us",
        "evict p50/p99 us",
        "load_back p50/p99 us",
        "MB moved",
    ]
    rows = []
    for r in results:
        o = r["ops"]

        def lat(k):
            return f"{o[k]['p50_us']:.0f}/{o[k]['p99_us']:.0f}" if o[k]["count"] else "-"

        moved = (r["bytes"]["backed_up"] + r["bytes"]["loaded"]) / 1e6
        rows.append(
            [
                r["mode"],
                r["policy"],
                f"{r['hit_rate']['L1']:.3f}",
                f"{r['hit_rate']['L2']:.3f}",
                f"{r['manager_req_per_cpu_s']:.0f}",
                f"{r['req_per_s']:.0f}",
                f"{r['ops_per_s']:.0f}",
                lat("match"),
                lat("insert"),
                lat("evict"),
                lat("load_back"),
                f"{moved:.0f}",
            ]
        )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="HiRadixCache multi-turn replay")
        for h in headers:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=200).print(table)
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run (8 clients x 3 rounds, small pools)")
    ap.add_argument("--modes", default="manager,realistic")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--device-tokens", type=int, default=60_000)
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--real-layers", type=int, default=1, help="full-size layers in realistic mode")
    ap.add_argument("--verify", action="store_true", help="check KV bytes of every hit")
    ap.add_argument("--check-every", type=int, default=0, help="sanity_check every N requests")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--out",
        default=os.path.join("hicache-results", "tree_multiturn.json"),
        help="JSON result (under the current directory)",
    )
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    policies = [p for p in args.policies.split(",") if p]
    for m in modes:
        if m not in ("manager", "realistic"):
            ap.error(f"--modes: unknown mode {m!r}")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown policy {p!r}")
    if args.quick:
        trace = make_trace(clients=8, rounds=3)
        device_tokens = min(args.device_tokens, 6_000)
    else:
        trace = make_trace()
        device_tokens = args.device_tokens
    results = []
    for mode in modes:
        for policy in policies:
            results.append(
                run(
                    trace,
                    policy,
                    mode,
                    device_tokens,
                    args.host_ratio,
                    args.real_layers,
                    args.verify,
                    args.check_every,
                    not args.no_progress,
                )
            )
    print_table(results)
    doc = {
        "benchmark": "tree_multiturn",
        "quick": args.quick,
        "device_tokens": device_tokens,
        "host_ratio": args.host_ratio,
        "page_size": 1,
        "clients": 8 if args.quick else 64,
        "rounds": 3 if args.quick else 10,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {os.path.abspath(args.out)}")
    return results


if __name__ == "__main__":
    main()
