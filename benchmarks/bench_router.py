"""Several engines sharing one L3, routed round robin or by their KV events (issue 31 part 2).

N reference caches in one process (numpy backend, a tiny KV so the managers dominate: one
layer, one 8-wide bf16 latent), each with its own L2 and an L3 controller over one shared
store (``--l3 file``: one directory, pages written by one engine visible to the others at
once; ``--l3 mooncake``: a local Mooncake master and store node, one client per engine),
each emitting KV events (``KVEventSource``) into one ``PrefixRouter``. A multi-turn trace
(C conversations over S system prompts, T turns, a round barrier as in SGLang's
bench_multiturn) is replayed once per routing policy on fresh engines and a fresh store:

* ``round_robin``: request i goes to engine i mod N;
* ``prefix``: ``PrefixRouter.route`` on the request's page keys, with the engines' requests
  of the current round as their loads.

Per request: L3 prefetch (``wait_complete``), ``begin_request`` (match + load-back), prefill
of the rest, decode of the answer, ``cache_finished_req``; every engine's ``check_events``
after each request; at each round's end every controller flushes its L3 writes.

Reported per policy: prompt tokens served from device / host / storage and the hit rate;
TTFT is *modeled*: the measured wall time of routing (the router's keys and scoring) and of
the cache's work up to the prefill (prefetch, match, load-back, allocation), plus the
prefill of the tokens no tier served at ``--prefill-tok-s`` (no model runs here). The same tokens are served under both policies.

    python benchmarks/bench_router.py [--engines 4] [--conversations 64] [--turns 4] [--l3 file|mooncake]
        [--quick]

Writes ``hicache-results/router.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

import numpy as np

from hicache_jax import KVGeometry
from hicache_jax.backends.numpy_backend import make_numpy_backend
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.cache.event_source import KVEventSource
from hicache_jax.l3 import StorageController
from hicache_jax.routing import PrefixRouter
from hicache_jax.storage import StorageConfig

PAGE = 16
POLICIES = ("round_robin", "prefix")


def make_trace(
    conversations: int, turns: int, systems: int, system_len: int, user_len: int, answer_len: int, seed: int = 0
) -> list[list[tuple[int, list[int], list[int]]]]:
    """Rounds of (conversation, prompt tokens, answer tokens); a prompt is the conversation's
    whole history (system prompt, earlier turns and answers) plus the new user turn."""
    rng = random.Random(seed)
    sys_prompts = [[rng.randrange(1, 2**31) for _ in range(system_len)] for _ in range(systems)]
    history = [list(sys_prompts[c % systems]) for c in range(conversations)]
    rounds = []
    for _t in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        rnd = []
        for c in order:
            prompt = history[c] + [rng.randrange(1, 2**31) for _ in range(user_len)]
            answer = [rng.randrange(1, 2**31) for _ in range(answer_len)]
            rnd.append((c, prompt, answer))
            history[c] = prompt + answer
        rounds.append(rnd)
    return rounds


class Engine:
    def __init__(self, name: str, device_tokens: int, host_ratio: float, cfg: StorageConfig, router: PrefixRouter):
        geom = KVGeometry.mla(1, PAGE, 6, 2, "bfloat16")
        dev_pages = device_tokens // PAGE
        device, host, engine = make_numpy_backend(geom, dev_pages, int(dev_pages * host_ratio))
        self.cache = HiRadixCache(HiCacheConfig(page_size=PAGE), engine, device.allocator)
        self.ctl = StorageController(self.cache, cfg, model="bench-router")
        self.events = KVEventSource(self.cache, model="bench-router", engine=name)
        self.events.observe_storage(self.ctl.storage)
        self.events.subscribe(router.apply)

    def serve(self, prompt: list[int], answer: list[int]) -> dict:
        c = self.cache
        key = RadixKey(np.array(prompt, np.int64))
        t0 = time.perf_counter()
        op = self.ctl.prefetch(key)
        self.ctl.finish_prefetch(op)
        req, lb = c.begin_request(key)
        hit = req.hit_tokens
        new = -(-len(prompt) // PAGE) - req.device_pages.shape[0]
        pages = c.alloc_device(new)
        if pages is None:
            raise RuntimeError("device pool too small for one request")
        req.extend(key, pages)
        cache_s = time.perf_counter() - t0
        full = RadixKey(np.array(prompt + answer, np.int64))
        more = -(-len(full) // PAGE) - req.device_pages.shape[0]
        pages = c.alloc_device(more) if more else np.zeros(0, np.int32)
        if pages is None:
            raise RuntimeError("device pool too small for one request")
        req.extend(full, pages)
        c.cache_finished_req(req)
        return {"cache_s": cache_s, **hit}

    def close(self) -> None:
        self.events.close()
        self.ctl.close()


def run(policy: str, trace, args) -> dict:
    store = tempfile.mkdtemp(prefix="bench-router-")
    master = None
    common = {"prefetch_policy": "wait_complete", "prefetch_threshold_tokens": PAGE}
    if args.l3 == "mooncake":
        from hicache_jax.storage.mooncake import MooncakeMaster

        master = MooncakeMaster().start()  # a fresh store per policy
        cfg = master.storage_config(mooncake_op_timeout_s=60.0, **common)
    else:
        cfg = StorageConfig(backend="file", path=store, **common)
    names = [f"e{i}" for i in range(args.engines)]
    router = PrefixRouter(names)
    engines = {n: Engine(n, args.device_tokens, args.host_ratio, cfg, router) for n in names}
    keyer = engines[names[0]].events
    served = {"device": 0, "host": 0, "storage": 0}
    prompt_tokens = 0
    ttft, cache_s, route_times = [], [], []
    i = 0
    try:
        for rnd in trace:
            loads = {n: 0 for n in names}
            for _conv, prompt, answer in rnd:
                t0 = time.perf_counter()
                if policy == "round_robin":
                    name = names[i % len(names)]
                else:
                    name = router.route(keyer.request_keys(RadixKey(np.array(prompt, np.int64))), loads).engine
                route_s = time.perf_counter() - t0
                i += 1
                loads[name] += 1
                out = engines[name].serve(prompt, answer)
                for e in engines.values():
                    e.cache.check_events()
                for t in served:
                    served[t] += out[t]
                prompt_tokens += len(prompt)
                hit = out["device"] + out["host"] + out["storage"]
                ttft.append(route_s + out["cache_s"] + (len(prompt) - hit) / args.prefill_tok_s)
                cache_s.append(route_s + out["cache_s"])
                route_times.append(route_s)
            for e in engines.values():
                e.cache.flush()
                e.ctl.flush(60)
                e.cache.check_events()
    finally:
        for e in engines.values():
            e.close()
        if master is not None:
            master.stop()
        shutil.rmtree(store, ignore_errors=True)
    hits = sum(served.values())
    return {
        "policy": policy,
        "l3": args.l3,
        "prompt_tokens": prompt_tokens,
        "served_tokens": served,
        "hit_rate": hits / prompt_tokens,
        "ttft_model_mean_s": statistics.fmean(ttft),
        "ttft_model_p50_s": statistics.median(ttft),
        "route_and_cache_mean_s": statistics.fmean(cache_s),
        "route_mean_s": statistics.fmean(route_times),
        "route_and_cache_p50_s": statistics.median(cache_s),
        "router_decisions": dict(router.decisions),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=256)
    ap.add_argument("--answer-len", type=int, default=128)
    ap.add_argument("--device-tokens", type=int, default=16_384, help="per engine")
    ap.add_argument("--host-ratio", type=float, default=2.0)
    ap.add_argument("--prefill-tok-s", type=float, default=20_000.0, help="modeled prefill speed")
    ap.add_argument("--l3", choices=("file", "mooncake"), default="file")
    ap.add_argument("--quick", action="store_true", help="16 conversations x 3 turns, shorter prompts")
    ap.add_argument("--out", default=os.path.join("hicache-results", "router.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.system_len, args.user_len, args.answer_len = 16, 3, 256, 64, 32
        args.device_tokens = 4096
    trace = make_trace(args.conversations, args.turns, args.systems, args.system_len, args.user_len, args.answer_len)
    results = [run(p, trace, args) for p in POLICIES]
    rr, px = results
    assert rr["prompt_tokens"] == px["prompt_tokens"]
    print(
        f"{'policy':12} {'hit rate':>9} {'device':>9} {'host':>9} {'storage':>9} {'route+cache ms':>15} "
        f"{'TTFT model mean ms':>19}"
    )
    for r in results:
        s = r["served_tokens"]
        print(
            f"{r['policy']:12} {r['hit_rate']:9.3f} {s['device']:9d} {s['host']:9d} {s['storage']:9d} "
            f"{1e3 * r['route_and_cache_mean_s']:15.2f} {1e3 * r['ttft_model_mean_s']:19.2f}"
        )
    ratio = {
        "hit_rate": px["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None,
        "ttft_model_mean": px["ttft_model_mean_s"] / rr["ttft_model_mean_s"],
    }
    load = os.getloadavg()
    print(
        f"prefix / round_robin: hit rate x{ratio['hit_rate']:.3f}, modeled TTFT mean x{ratio['ttft_model_mean']:.3f}"
        f"  (loadavg {load[0]:.1f})"
    )
    doc = {
        "benchmark": "router",
        "args": vars(args),
        "loadavg": load,
        "results": results,
        "prefix_over_round_robin": ratio,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {os.path.abspath(args.out)}")
    return doc


if __name__ == "__main__":
    main()
