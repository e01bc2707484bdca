"""Differential replay: our HiRadixCache vs upstream sglang 0.5.18's, random branchy traces.

Issue 21 point 17's benchmark. The multiturn-64x10 trace (``bench_tree_multiturn.make_trace``) never evicts much and
never branches, so the two trees' aggregate hit rates match on it exactly; this replays random
traces that stress eviction through both trees in one process and reports the hit rates per
tier side by side, for every configuration:

    page size 1 and 16  x  host ratio 0.5 / 1 / 4  x  write_through / write_through_selective /
    write_back  x  eviction lru / lfu                                    (36 configurations)

Trace (``make_branchy_trace``, seeded): several tenants, each with its own shared system prompt;
each request either continues one of the tenant's live conversations (history + new user turn),
branches from an earlier turn of one (its history up to that turn + a new user turn: a new
conversation sharing that prefix), or starts a new conversation on the tenant's system prompt.
Turn and answer lengths are random (not page-aligned). The device pool is small (by default
6,000 tokens against prompts of up to ~3,000), so most requests evict.

Per request, both trees get the op order of the existing replays (``upstream_tree_replay.run``
and ``bench_tree_multiturn.run``; the scheduler's): match -> load-back (if host hit) -> lock ->
allocate the prompt's new tokens (evict when short) -> cache_unfinished_req -> allocate the
output (evict when short) -> cache_finished_req -> poll transfer events. L1 = device-matched /
prompt tokens, L2 = loaded-back / prompt tokens, summed over the trace.

Why this file has its own replay loops: ``upstream_tree_replay.run`` and
``bench_tree_multiturn.run`` fix page size 1, take no eviction policy, and upstream's reads its
device size and host ratio from module constants. So this file reuses upstream's shims
(``import_upstream``, ``init_process_group``, ``Req``) and our public cache API, and builds both
trees itself with the configuration's page size, eviction policy and pool sizes. Each tree is
driven one request at a time (``UpstreamReplay.step`` / ``OursReplay.step``), so
``tree_divergence.py`` can replay both in lockstep and compare what they hold after every
request (where a first divergence comes from):

* upstream: ``MHATokenToKVPool`` (2 layers x 1 head x 8 dims, as the baseline replay), the
  token allocator (page 1) or ``PagedTokenToKVPoolAllocator`` (page 16), ``CacheInitParams``
  with ``eviction_policy``; host ratio through the patched ``hiradix_cache.get_memory`` (set per
  build). With page 16 the harness allocates as the scheduler's ``alloc_extend`` /
  ``alloc_decode`` do: the new prompt tokens in fresh pages, the output first fills the last
  partial page, then fresh pages. Upstream's host pool is ``int(device * ratio) // page + 1``
  pages.
* ours: ``HiRadixCache`` over the numpy backend (manager geometry: one 8-wide bf16 latent with
  the configuration's page size), ``HiCacheConfig(page_size, write_policy, eviction_policy)``
  with defaults otherwise, device ``device_tokens // page`` pages and the same host page count
  as upstream's.

Also reported per configuration: the first request whose (L1, L2) hit differs between the
trees (``first_divergence``), how many requests differ, and each seed's hit rates
(``per_seed``). Hit rates only; no timing.

Why 4 seeds by default: the trees part within the first ~50 requests and never rejoin, so
from there a tier's hit rate is a chaotic function of every earlier decision. Under LFU with
a host smaller than the device, L1 differences between the trees swing by about +-0.005 from
seed to seed around a mean of +0.002 to +0.005 (page 16, seeds 0-5): two seeds cannot tell
which tree keeps more on the device, four mostly can.

    scripts/upstream_baseline_env.sh benchmarks/bench_tree_differential.py [--quick]
        [--requests 2000] [--seeds 0,1,2,3] [--device-tokens 6000] [--tree-decisions auto]
        [--only SUBSTRING] [--out PATH]
    .venv/bin/python benchmarks/bench_tree_differential.py --render A.json [B.json ...] [--out PATH]

Writes ``hicache-results/tree_differential.json`` (under the current directory) and, where
matplotlib is installed, ``tree_differential.png`` beside it: per configuration and tier, ours
minus upstream (all seeds pooled, and each seed). The upstream venv has no matplotlib, and
the full grid takes ~1.5 CPU hours (each replay pair 20-40 s), so the usual run is split with
``--only`` over processes (e.g. ``--only p1/`` and ``--only p16/``) and merged, table and PNG,
with ``--render`` in ``.venv``.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import json
import os
import random
import sys
import time
import types
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402

from benchmarks import upstream_tree_replay as upstream  # noqa: E402  (sets SGLANG_USE_CPU_ENGINE)
from hicache_jax import KVGeometry  # noqa: E402
from hicache_jax.backends.numpy_backend import make_numpy_backend  # noqa: E402
from hicache_jax.bench.report import machine_info, print_table, results_path, write_json  # noqa: E402
from hicache_jax.cache import CacheRequest, HiCacheConfig, HiRadixCache, RadixKey  # noqa: E402

POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTIONS = ("lru", "lfu")
PAGE_SIZES = (1, 16)
HOST_RATIOS = (0.5, 1.0, 4.0)
TOL = 1e-9  # "ours >= upstream's" allows only float noise


# --------------------------------------------------------------------------- trace


def make_branchy_trace(
    requests: int,
    seed: int,
    tenants: int = 4,
    system_len: tuple = (200, 700),
    user_len: tuple = (20, 300),
    answer_len: tuple = (16, 160),
    max_prompt: int = 3000,
    p_new: float = 0.15,
    p_branch: float = 0.3,
    live: int = 12,
) -> list[dict]:
    """Random multi-tenant, branching conversations (see the module docstring)."""
    rng = random.Random(seed)
    vocab = 32000
    systems = [[rng.randint(1, vocab) for _ in range(rng.randint(*system_len))] for _ in range(tenants)]
    # A conversation: tenant and the token history at each turn boundary (list of lengths).
    convs: list[dict] = []
    trace = []
    for _ in range(requests):
        tenant = rng.randrange(tenants)
        mine = [c for c in convs if c["tenant"] == tenant]
        r = rng.random()
        if not mine or r < p_new:
            conv = {"tenant": tenant, "tokens": list(systems[tenant]), "turns": [len(systems[tenant])]}
            convs.append(conv)
        elif r < p_new + p_branch:
            src = rng.choice(mine)
            cut = rng.choice(src["turns"])  # an earlier turn boundary (or the system prompt)
            conv = {"tenant": tenant, "tokens": src["tokens"][:cut], "turns": [t for t in src["turns"] if t <= cut]}
            convs.append(conv)
        else:
            conv = rng.choice(mine)
        user = [rng.randint(1, vocab) for _ in range(rng.randint(*user_len))]
        answer = [rng.randint(1, vocab) for _ in range(rng.randint(*answer_len))]
        if len(conv["tokens"]) + len(user) > max_prompt:  # too long: restart on the system prompt
            conv["tokens"] = list(systems[tenant])
            conv["turns"] = [len(systems[tenant])]
        prompt = conv["tokens"] + user
        trace.append({"tenant": tenant, "prompt": np.array(prompt, np.int64), "output": np.array(answer, np.int64)})
        conv["tokens"] = prompt + answer
        conv["turns"].append(len(conv["tokens"]))
        if len(convs) > live * tenants:  # forget the oldest conversations (they are never revisited)
            convs.pop(0)
    return trace


# --------------------------------------------------------------------------- upstream


def host_pages_for(device_tokens: int, ratio: float, page: int) -> int:
    """Upstream's host pool size in pages: ``int(device * ratio) // page + 1``."""
    return int(device_tokens * ratio) // page + 1


def build_upstream(up, policy: str, eviction: str, page: int, device_tokens: int, ratio: float, max_context: int):
    torch = up.torch
    sys.modules["sglang.srt.mem_cache.hiradix_cache"].get_memory = lambda: types.SimpleNamespace(hicache_ratio=ratio)
    kv = up.MHATokenToKVPool(
        size=device_tokens,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=upstream.HEADS,
        head_dim=upstream.HEAD_DIM,
        layer_num=upstream.LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    if page == 1:
        alloc = up.TokenToKVPoolAllocator(device_tokens, torch.bfloat16, "cpu", kv, need_sort=False)
    else:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        alloc = PagedTokenToKVPoolAllocator(device_tokens, page, torch.bfloat16, "cpu", kv, need_sort=False)
    req_pool = up.ReqToTokenPool(size=2, max_context_len=max_context, device="cpu", enable_memory_saver=False)
    params = up.CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=alloc,
        page_size=page,
        tp_cache_group=torch.distributed.group.WORLD,
        eviction_policy=eviction,
    )
    server_args = types.SimpleNamespace(
        hicache_size=0,
        hicache_mem_layout="layer_first",
        hicache_io_backend="direct",
        hicache_write_policy=policy,
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="best_effort",
        served_model_name="tree-differential",
        extra_metric_labels=None,
    )
    cache = up.HiRadixCache(params, server_args)
    return cache, alloc, req_pool


def page_ids(kb: bytes, page: int, parent_id: int) -> list[int]:
    """Identities of a node's pages: each page's id hashes its tokens with the id of the page
    before it, so a page's id names its whole prefix (the same in both trees, however each
    splits its nodes)."""
    pb = 8 * page
    out = []
    h = parent_id
    for i in range(0, len(kb), pb):
        h = hash((h, kb[i : i + pb]))
        out.append(h)
    return out


class UpstreamReplay:
    """Upstream's tree, one request at a time (``step``); see the module docstring."""

    def __init__(
        self, up, policy: str, eviction: str, page: int, device_tokens: int, ratio: float, max_context: int
    ) -> None:
        self.up, self.page = up, page
        self.label = f"upstream {policy}/{eviction}/p{page}/r{ratio:g}"
        self.cache, self.alloc, self.req_pool = build_upstream(
            up, policy, eviction, page, device_tokens, ratio, max_context
        )
        self.host_size = self.cache.token_to_kv_pool_host.size
        self.evicted = False  # the last step evicted on the device

    def _alloc_pages(self, n_tokens: int):
        """``n_tokens`` rounded up to whole pages, evicting the shortfall first (as the scheduler)."""
        torch, page, alloc = self.up.torch, self.page, self.alloc
        need = -(-n_tokens // page) * page
        if need == 0:
            return torch.zeros(0, dtype=torch.int64)
        if alloc.available_size() < need:
            self.evicted = True
            self.cache.evict(self.up.EvictParams(num_tokens=need - alloc.available_size()))
        ids = alloc.alloc(need)
        if ids is None:
            raise RuntimeError(f"{self.label}: out of device memory for {need}")
        return ids

    def step(self, rec: dict) -> tuple[int, int]:
        """One request; returns (device-matched tokens, loaded-back tokens)."""
        up, cache, req_pool = self.up, self.cache, self.req_pool
        torch = up.torch
        self.evicted = False
        pool_idx = 1
        prompt = array("q", rec["prompt"].tolist())
        output = array("q", rec["output"].tolist())
        m = cache.match_prefix(up.MatchPrefixParams(key=up.RadixKey(prompt)))
        prefix, last = m.device_indices, m.last_device_node
        loaded = 0
        if m.host_hit_length > 0:
            new, last = cache.init_load_back(
                up.InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
            cache.ready_to_load_host_cache()
            if len(new):
                prefix = torch.cat([prefix, new])
                loaded = len(new)
        cache.inc_lock_ref(last)
        n_prompt, n_prefix = len(prompt), len(prefix)
        req = upstream.Req(prompt, pool_idx, prefix, last)
        # alloc_extend: the prompt's new tokens in fresh pages (the prefix is page-aligned).
        fresh = self._alloc_pages(n_prompt - n_prefix)
        req_pool.write((pool_idx, slice(0, n_prompt)), torch.cat([prefix, fresh[: n_prompt - n_prefix]]))
        cache.cache_unfinished_req(req)
        # alloc_decode: the output fills the last partial page, then fresh pages.
        spare = fresh[n_prompt - n_prefix :]  # the rest of the prompt's partial last page (none if aligned)
        n_out = len(output)
        more = self._alloc_pages(max(0, n_out - len(spare)))
        out_ids = torch.cat([spare, more])[:n_out]
        req_pool.write((pool_idx, slice(n_prompt, n_prompt + n_out)), out_ids)
        req.output_ids = output
        cache.cache_finished_req(req, kv_len_to_handle=n_prompt + n_out)
        cache.check_hicache_events()
        return len(m.device_indices), loaded

    def residency(self) -> tuple[set, set]:
        """(page ids on the device, page ids on the host); see ``page_ids``."""
        dev, host = set(), set()
        stack = [(c, 0) for c in self.cache.root_node.children.values()]
        while stack:
            n, pid = stack.pop()
            ids = page_ids(bytes(n.key.token_ids), self.page, pid)
            if n.value is not None:
                dev.update(ids)
            if n.host_value is not None:
                host.update(ids)
            stack.extend((c, ids[-1]) for c in n.children.values())
        return dev, host

    def close(self) -> None:
        atexit.unregister(self.cache.shutdown)  # upstream's atexit hook would keep every tree alive
        self.cache = self.alloc = self.req_pool = None
        gc.collect()


class OursReplay:
    """Our tree, one request at a time (``step``); see the module docstring."""

    def __init__(
        self, policy: str, eviction: str, page: int, device_tokens: int, ratio: float, tree_decisions: str = "auto"
    ) -> None:
        geom = KVGeometry.mla(1, page, 6, 2, "bfloat16")  # the manager mode's geometry, this page size
        self.page = page
        self.label = f"ours {policy}/{eviction}/p{page}/r{ratio:g}"
        self.host_pages = host_pages_for(device_tokens, ratio, page)
        device, _host, engine = make_numpy_backend(geom, device_tokens // page, self.host_pages)
        self.cache = HiRadixCache(
            HiCacheConfig(page_size=page, write_policy=policy, eviction_policy=eviction, tree_decisions=tree_decisions),
            engine,
            device.allocator,
        )
        self.alloc = device.allocator
        self.evicted = False

    def _alloc_pages(self, n: int) -> np.ndarray:
        if self.alloc.available < n:
            self.evicted = True
            ids = self.cache.alloc_device(n)
        else:
            ids = self.alloc.alloc(n)
        if ids is None:
            raise RuntimeError(f"{self.label}: out of device memory for {n} pages")
        return ids

    def step(self, rec: dict) -> tuple[int, int]:
        """One request; returns (device-matched tokens, loaded-back tokens)."""
        cache, page = self.cache, self.page
        self.evicted = False
        prompt, output = rec["prompt"], rec["output"]
        key = RadixKey(prompt)
        m = cache.match_prefix(key)
        pages, last = m.device_indices, m.last_device_node
        loaded = 0
        if m.host_hit_length:
            lb = cache.load_back(m.last_host_node)
            if lb is not None:
                lb.handle.wait()
                pages = np.concatenate([pages, lb.device_pages])
                last = lb.node
                loaded = lb.num_tokens
        if last is not cache.root:
            cache.inc_lock_ref(last)
        req = CacheRequest(key, page, pages, last if last is not cache.root else None, pages.shape[0])
        n_prompt = prompt.shape[0]
        req.extend(key, self._alloc_pages(-(-n_prompt // page) - pages.shape[0]))
        cache.cache_unfinished_req(req)
        full = np.concatenate([prompt, output])
        req.extend(RadixKey(full), self._alloc_pages(-(-full.shape[0] // page) - req.device_pages.shape[0]))
        cache.cache_finished_req(req)
        cache.check_events()
        return m.device_hit_length, loaded

    def residency(self) -> tuple[set, set]:
        """(page ids on the device, page ids on the host); see ``page_ids``."""
        dev, host = set(), set()
        stack = [(c, 0) for c in self.cache.root.children.values()]
        while stack:
            n, pid = stack.pop()
            ids = page_ids(n.kb, self.page, pid)
            if n.value is not None:
                dev.update(ids)
            if n.host_value is not None:
                host.update(ids)
            stack.extend((c, ids[-1]) for c in n.children.values())
        return dev, host

    def close(self) -> None:
        self.cache.flush()
        self.cache.sanity_check(0)


def _replay(side, trace) -> dict:
    per_req = []
    prompt_tokens = l1 = l2 = 0
    evicting = 0  # requests that evicted on the device
    for rec in trace:
        d1, loaded = side.step(rec)
        prompt_tokens += rec["prompt"].shape[0]
        l1 += d1
        l2 += loaded
        per_req.append((d1, loaded))
        evicting += side.evicted
    return {
        "L1": l1 / prompt_tokens,
        "L2": l2 / prompt_tokens,
        "prompt_tokens": prompt_tokens,
        "per_req": per_req,
        "evicting_requests": evicting,
    }


def config_name(page: int, ratio: float, policy: str, eviction: str) -> str:
    """A configuration's name for ``--only``: ``p<page>/r<ratio>/<write policy>/<eviction>``."""
    return f"p{page}/r{ratio:g}/{policy}/{eviction}"


def max_context_for(trace, page: int) -> int:
    return max(len(r["prompt"]) + len(r["output"]) for r in trace) + 2 * page


def run_upstream(up, trace, policy: str, eviction: str, page: int, device_tokens: int, ratio: float) -> dict:
    side = UpstreamReplay(up, policy, eviction, page, device_tokens, ratio, max_context_for(trace, page))
    out = _replay(side, trace)
    out["host_pool_tokens"] = side.host_size
    side.close()
    return out


def run_ours(
    trace, policy: str, eviction: str, page: int, device_tokens: int, ratio: float, tree_decisions: str = "auto"
) -> dict:
    side = OursReplay(policy, eviction, page, device_tokens, ratio, tree_decisions)
    out = _replay(side, trace)
    out["host_pool_tokens"] = side.host_pages * page
    side.close()
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 12 configurations (host ratios 0.5 and 4, LRU), 300 requests, one seed",
    )
    ap.add_argument("--requests", type=int, default=None, help="requests per trace (default 2000; quick 300)")
    ap.add_argument(
        "--seeds", default=None, help="trace seeds, comma-separated, each a fresh trace (default 0,1,2,3; quick 0)"
    )
    ap.add_argument("--device-tokens", type=int, default=6000)
    ap.add_argument(
        "--tree-decisions",
        default="auto",
        choices=("auto", "upstream", "own"),
        help="our tree's HiCacheConfig.tree_decisions (docs/deviations-from-upstream.md)",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="run the configurations whose name contains each '+'-separated part, e.g. "
        "'p16/r1/+/lfu' (names: p<page>/r<ratio>/<write policy>/<eviction>)",
    )
    ap.add_argument(
        "--out",
        default=results_path("tree_differential"),
        help="JSON result (under the current directory); the PNG goes beside it",
    )
    ap.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        default=None,
        help="replay nothing: merge these results (runs split with --only) into --out, print the "
        "table and draw the PNG (needs no upstream sglang; matplotlib for the PNG)",
    )
    args = ap.parse_args(argv)
    if args.render:
        return finish(merge(args.render), args.out)
    n_req = args.requests or (300 if args.quick else 2000)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2,3")).split(",") if s]
    ratios = (0.5, 4.0) if args.quick else HOST_RATIOS
    evictions = ("lru",) if args.quick else EVICTIONS
    configs = [
        c
        for c in itertools.product(PAGE_SIZES, ratios, POLICIES, evictions)
        if not args.only or all(o in config_name(*c) for o in args.only.split("+"))
    ]
    if not configs:
        ap.error(
            f"--only {args.only!r} matches no configuration (names look like {config_name(16, 1.0, 'write_through', 'lfu')!r})"
        )

    upstream.quiet_logs()
    up = upstream.import_upstream()
    up.torch.set_num_threads(1)
    upstream.init_process_group(up.torch)
    import logging

    logging.getLogger("sglang.srt.mem_cache.pool_host").setLevel(logging.ERROR)  # "host pool smaller" warning
    logging.getLogger("sglang.srt.mem_cache.hiradix_cache").setLevel(logging.ERROR)  # "dropped without backup"

    traces = {s: make_branchy_trace(n_req, s) for s in seeds}
    max_len = max(len(r["prompt"]) + len(r["output"]) for t in traces.values() for r in t)
    if max_len + 64 > args.device_tokens:
        ap.error(f"--device-tokens {args.device_tokens} too small for a {max_len}-token request")
    t0 = time.perf_counter()
    results = []
    total = len(configs) * len(seeds)
    print(f"[tree_differential] {total} replays of {n_req} requests, ours and upstream; a line after each", flush=True)
    k = 0
    for page, ratio, policy, eviction in configs:
        agg = {"ours": [0, 0, 0], "upstream": [0, 0, 0]}  # L1 tokens, L2 tokens, prompt tokens
        div_first, div_count = [], 0
        per_seed = []
        ev = {"ours": 0, "upstream": 0}
        for s in seeds:
            k += 1
            tr = traces[s]
            o = run_ours(tr, policy, eviction, page, args.device_tokens, ratio, args.tree_decisions)
            u = run_upstream(up, tr, policy, eviction, page, args.device_tokens, ratio)
            for side, r in (("ours", o), ("upstream", u)):
                agg[side][0] += round(r["L1"] * r["prompt_tokens"])
                agg[side][1] += round(r["L2"] * r["prompt_tokens"])
                agg[side][2] += r["prompt_tokens"]
                ev[side] += r["evicting_requests"]
            per_seed.append(
                {
                    "seed": s,
                    "ours": {"L1": o["L1"], "L2": o["L2"]},
                    "upstream": {"L1": u["L1"], "L2": u["L2"]},
                    "prompt_tokens": o["prompt_tokens"],
                }
            )
            diff = [i for i, (a, b) in enumerate(zip(o["per_req"], u["per_req"])) if a != b]
            div_first.append(diff[0] if diff else None)
            div_count += len(diff)
            print(
                f"[{k}/{total} {time.perf_counter() - t0:6.1f}s] page {page:2d} ratio {ratio:g} {policy:24s} "
                f"{eviction} seed {s}: ours L1 {o['L1']:.4f} L2 {o['L2']:.4f} | upstream L1 {u['L1']:.4f} "
                f"L2 {u['L2']:.4f} | first divergence at request {diff[0] if diff else '-'}",
                flush=True,
            )
        ours = {"L1": agg["ours"][0] / agg["ours"][2], "L2": agg["ours"][1] / agg["ours"][2]}
        ups = {"L1": agg["upstream"][0] / agg["upstream"][2], "L2": agg["upstream"][1] / agg["upstream"][2]}
        ours["total"] = ours["L1"] + ours["L2"]
        ups["total"] = ups["L1"] + ups["L2"]
        ge = {t: ours[t] >= ups[t] - TOL for t in ("L1", "L2", "total")}
        results.append(
            {
                "page_size": page,
                "host_ratio": ratio,
                "write_policy": policy,
                "eviction": eviction,
                "hit_rate_ours": ours,
                "hit_rate_upstream": ups,
                "ours_ge_upstream": ge,
                "first_divergence": div_first,
                "diverging_requests": div_count,
                "evicting_requests": ev,
                "per_seed": per_seed,
                "requests": n_req * len(seeds),
            }
        )
    seconds = time.perf_counter() - t0
    doc = {
        "benchmark": "tree_differential",
        **machine_info(),
        "sglang": up.version,
        "torch": up.torch.__version__,
        "quick": args.quick,
        "seconds": seconds,
        "config": {
            "device_tokens": args.device_tokens,
            "requests_per_trace": n_req,
            "seeds": seeds,
            "tree_decisions": args.tree_decisions,
            "only": args.only,
            "page_sizes": list(PAGE_SIZES),
            "host_ratios": list(ratios),
            "write_policies": list(POLICIES),
            "evictions": list(evictions),
            "trace": "make_branchy_trace: 4 tenants (system prompts 200-700 tokens), new conversation "
            "p=0.15, branch from an earlier turn p=0.3, else continue; user turns 20-300, "
            "answers 16-160 tokens; prompts <= 3000 tokens",
            "upstream_kv": f"{upstream.LAYERS} layers x {upstream.HEADS} head x {upstream.HEAD_DIM} dims bf16, K+V",
            "ours_kv": "1 layer, one 8-wide bf16 latent",
            "host_pool": "int(device_tokens * ratio) // page + 1 pages on both sides",
        },
        "all_ge": all(r["ours_ge_upstream"]["L1"] and r["ours_ge_upstream"]["L2"] for r in results),
        "results": results,
    }
    return finish(doc, args.out)


# --------------------------------------------------------------------------- report


def _sort_key(r: dict) -> tuple:
    return (r["page_size"], r["host_ratio"], POLICIES.index(r["write_policy"]), EVICTIONS.index(r["eviction"]))


def report(doc: dict) -> list[dict]:
    """Prints the table and the verdict line; returns the configurations lower on some tier."""
    results = sorted(doc["results"], key=_sort_key)
    c = doc["config"]
    rows = []
    for r in results:
        o, u, ge = r["hit_rate_ours"], r["hit_rate_upstream"], r["ours_ge_upstream"]
        n = r["requests"]
        rows.append(
            [
                r["page_size"],
                f"{r['host_ratio']:g}",
                r["write_policy"],
                r["eviction"],
                f"{o['L1']:.4f}",
                f"{u['L1']:.4f}",
                "yes" if ge["L1"] else "NO",
                f"{o['L2']:.4f}",
                f"{u['L2']:.4f}",
                "yes" if ge["L2"] else "NO",
                f"{o['total']:.4f}",
                f"{u['total']:.4f}",
                "yes" if ge["total"] else "NO",
                ",".join("-" if d is None else str(d) for d in r["first_divergence"]),
                r["diverging_requests"],
                f"{r['evicting_requests']['ours'] / n:.0%}/{r['evicting_requests']['upstream'] / n:.0%}",
            ]
        )
    print_table(
        f"Differential replay: ours (tree_decisions={c['tree_decisions']}) vs upstream sglang "
        f"{doc['sglang']} HiRadixCache ({c['requests_per_trace']} requests x {len(c['seeds'])} seed(s), "
        f"{c['device_tokens']} device tokens)",
        [
            "page",
            "host ratio",
            "write policy",
            "evict",
            "L1 ours",
            "L1 upstream",
            "L1 ours>=",
            "L2 ours",
            "L2 upstream",
            "L2 ours>=",
            "total ours",
            "total upstream",
            "total ours>=",
            "1st diverging req",
            "diverging reqs",
            "evicting reqs ours/up",
        ],
        rows,
    )
    lower = [r for r in results if not (r["ours_ge_upstream"]["L1"] and r["ours_ge_upstream"]["L2"])]
    print(
        f"{len(results) - len(lower)}/{len(results)} configurations: ours >= upstream on both tiers"
        + (
            "; lower on some tier: "
            + "; ".join(
                f"p{r['page_size']} r{r['host_ratio']:g} {r['write_policy']} {r['eviction']} "
                f"({', '.join(t for t in ('L1', 'L2') if not r['ours_ge_upstream'][t])})"
                for r in lower
            )
            if lower
            else ""
        )
    )
    return lower


def plot(doc: dict, path: str) -> str | None:
    """Ours minus upstream per configuration and tier (bars: all seeds pooled; dots: each
    seed), so a configuration where ours is lower is a bar below zero. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = sorted(doc["results"], key=_sort_key)
    c = doc["config"]
    labels = [
        f"p{r['page_size']} r{r['host_ratio']:g}\n"
        f"{ {'write_through': 'wt', 'write_through_selective': 'wts', 'write_back': 'wb'}[r['write_policy']] }"
        f" {r['eviction']}"
        for r in results
    ]
    x = np.arange(len(results))
    fig, axes = plt.subplots(3, 1, figsize=(max(10.0, 0.55 * len(results) + 2), 11), sharex=True)
    for ax, tier, name in zip(axes, ("L1", "L2", "total"), ("L1 (device)", "L2 (host, loaded back)", "L1 + L2")):
        d = np.array([r["hit_rate_ours"][tier] - r["hit_rate_upstream"][tier] for r in results])
        ax.bar(x, d, color=np.where(d >= -TOL, "#2ca02c", "#d62728"), alpha=0.6, width=0.7, label="all seeds pooled")
        for i, r in enumerate(results):
            ps = r.get("per_seed", [])
            vals = [
                s["ours"][tier] - s["upstream"][tier]
                if tier != "total"
                else (s["ours"]["L1"] + s["ours"]["L2"]) - (s["upstream"]["L1"] + s["upstream"]["L2"])
                for s in ps
            ]
            ax.scatter(
                np.full(len(vals), i, float) + np.linspace(-0.2, 0.2, len(vals))
                if len(vals) > 1
                else np.full(len(vals), i, float),
                vals,
                s=10,
                color="black",
                zorder=3,
                label="one seed" if i == 0 else None,
            )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel(f"{name}\nhit rate, ours - upstream")
        ax.grid(axis="y", alpha=0.25)
        ax.legend(fontsize=8, loc="upper left")
    for b in range(1, len(results)):  # separate the page sizes
        if results[b]["page_size"] != results[b - 1]["page_size"]:
            for ax in axes:
                ax.axvline(b - 0.5, color="#888888", lw=1, ls="--")
    axes[-1].set_xticks(x)
    axes[-1].set_xticklabels(labels, fontsize=7, rotation=90)
    lower = sum(not (r["ours_ge_upstream"]["L1"] and r["ours_ge_upstream"]["L2"]) for r in results)
    fig.suptitle(
        f"Hit rate per tier, our tree minus upstream sglang {doc['sglang']}'s HiRadixCache: "
        f"{len(results) - lower}/{len(results)} configurations not lower on either tier",
        fontsize=12,
        fontweight="bold",
    )
    fig.text(
        0.5,
        0.955,
        f"random branchy traces, {c['requests_per_trace']} requests x seeds "
        f"{','.join(map(str, c['seeds']))}, device {c['device_tokens']} tokens, host pool = ratio x device; "
        f"ours with tree_decisions={c['tree_decisions']}; wt/wts/wb = write_through/_selective/write_back",
        ha="center",
        fontsize=8.5,
        color="#444444",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.abspath(path)


def finish(doc: dict, out: str) -> dict:
    """Table, verdict, JSON at ``out`` and the PNG beside it (``.png``)."""
    report(doc)
    png = plot(doc, os.path.splitext(out)[0] + ".png")
    doc["png"] = png
    print(f"wrote {write_json(out, doc)}  ({doc['seconds']:.0f} s)")
    if png:
        print(f"wrote {png}")
    else:
        print(
            f"no PNG (matplotlib is not installed here); draw it with: .venv/bin/python "
            f"benchmarks/bench_tree_differential.py --render {out}"
        )
    return doc


def merge(paths: list[str]) -> dict:
    """One result document from runs split with ``--only`` (same trace settings and tree
    decisions; a configuration present in several files is an error)."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    keys = ("device_tokens", "requests_per_trace", "seeds", "tree_decisions")
    first = docs[0]
    for p, d in zip(paths, docs):
        if d.get("benchmark") != "tree_differential":
            raise ValueError(f"--render: {p} is not a tree_differential result")
        diff = [k for k in keys if d["config"][k] != first["config"][k]]
        if diff:
            raise ValueError(f"--render: {p} differs from {paths[0]} in {', '.join(diff)}")
    results, seen = [], set()
    for p, d in zip(paths, docs):
        for r in d["results"]:
            name = config_name(r["page_size"], r["host_ratio"], r["write_policy"], r["eviction"])
            if name in seen:
                raise ValueError(f"--render: configuration {name} appears twice ({p})")
            seen.add(name)
            results.append(r)
    doc = dict(first)
    doc["config"] = dict(
        first["config"],
        only=None,
        host_ratios=sorted({r["host_ratio"] for r in results}),
        evictions=sorted({r["eviction"] for r in results}),
    )
    doc["merged_from"] = [
        {"path": p, "seconds": d["seconds"], "load_average_1_5_15": d.get("load_average_1_5_15")}
        for p, d in zip(paths, docs)
    ]
    doc["seconds"] = sum(d["seconds"] for d in docs)
    doc["quick"] = any(d["quick"] for d in docs)
    doc["results"] = sorted(results, key=_sort_key)
    doc["all_ge"] = all(r["ours_ge_upstream"]["L1"] and r["ours_ge_upstream"]["L2"] for r in results)
    return doc


if __name__ == "__main__":
    main()
