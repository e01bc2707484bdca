"""Same-run baseline: upstream SGLang's ``HiRadixCache`` replaying the multiturn-64x10 trace on CPU.

A *baseline only*. This VM's speed swings ~1.7x between runs, so absolute req/s are not
comparable across runs; run this beside ``bench_tree_multiturn.py`` and report our tree's req/s
as a ratio to upstream's, measured on the same machine at the same time. Nothing in
``hicache_jax`` imports this file, and no upstream source is copied: sglang is imported from
the installed wheel (sglang 0.5.18, ``sglang/srt/mem_cache/hiradix_cache.py``).

What it measures
    The trace is ``make_trace()`` from ``bench_tree_multiturn.py`` (64 clients x 10 rounds,
    ``random.Random(0)``; 640 requests, 1,925,120 prompt tokens). Upstream's tree is built with
    the multiturn-64x10 trace's configuration: MHA KV of 2 layers x 1 head x 8 dims (bf16, K and V), 60,000
    device tokens, page size 1, host ratio 4 (upstream sizes the host pool to 240,001 tokens),
    io backend ``direct`` with the ``layer_first`` host layout, no L3. Per request, in the same
    order as ``run()`` in ``bench_tree_multiturn.py`` (and the scheduler):
    ``match_prefix`` -> ``init_load_back`` + ``ready_to_load_host_cache`` (if host hit) ->
    ``inc_lock_ref`` -> allocate the prompt's new tokens (``evict`` on OOM) ->
    ``cache_unfinished_req`` (insert prompt, free duplicates, re-match, move lock) ->
    allocate the 128 output tokens (``evict`` on OOM) -> ``cache_finished_req`` (insert
    prompt+output, free duplicates and tail, unlock) -> ``check_hicache_events``.
    L1 = device-matched / prompt tokens, L2 = loaded-back / prompt tokens. Expected for
    write_through: L1 0.402, L2 0.501 (write_through_selective 0.402 / 0.481, write_back
    0.402 / 0.511).

    Timed: the replay loop only (trace generation, imports and construction are not), by
    process CPU time (``req_per_cpu_s``, steadier on a shared machine) and wall clock
    (``req_per_s``). The loop includes every upstream cache call and its D2H/H2D copies
    (``index_copy_``, 64 B/token) plus this harness's own bookkeeping (``RadixKey`` and request
    objects, ``req_to_token`` writes, per-op ``perf_counter`` samples). No model work: KV is not
    written in timed mode, so compare with our ``manager_req_per_cpu_s`` (which subtracts the
    simulated model's writes). torch runs single-threaded (``--threads``). Each replay builds a
    fresh cache; ``--warmup`` untimed replays come first (the first replay in a process is ~30%
    slower), then ``--repeats`` timed rounds go round-robin over the policies so a drift in the
    machine's speed hits every policy alike; the JSON keeps every run and the median/min/max.

    ``--check`` (untimed): writes K/V for every new token (a code of token id and position per
    layer), verifies after each match/load-back that every hit page holds its token's K and V
    (so KV round-trips through L2 via upstream's own backup/load paths), and checks tree
    invariants after every request. ``HiRadixCache`` in 0.5.18 has no ``sanity_check()`` (only
    the SWA/Mamba/Unified trees do), so the harness checks upstream's own counters against a
    walk of upstream's tree: ``evictable_size_``/``protected_size_`` vs the nodes' device
    values, device allocator free + tree tokens == pool size, host pool free + tree host tokens
    == host size, no leaked locks or pending transfers after ``check_hicache_events``, and
    ``evictable_leaves`` / ``evictable_host_leaves`` equal to the recomputed sets.

Shims (all installed by this script before or around ``import sglang``; none touches the tree)
    * Third-party modules the wheel imports at module level but that the tree never calls are
      replaced by permissive stub modules in ``sys.modules`` (a meta-path finder): triton,
      sgl_kernel, transformers, compressed_tensors, gguf, safetensors, huggingface_hub,
      sentencepiece, regex, xgrammar, openai, partial_json_parser, pydantic, aiohttp, zmq,
      starlette, PIL, torchvision, IPython. They are reached only through model, kernel,
      tokenizer and server modules (``memory_pool`` imports triton kernels and the quantization
      package, which pulls in model configs); none of their attributes is used by
      ``HiRadixCache``, ``HiCacheController``, the host pool or the allocators on this path.
      (They shadow real installs of those names too, so every venv runs the same code.)
    * ``torch.compile`` is the identity while sglang is imported (modules decorate kernels at
      import time, which would otherwise pull in inductor against the stub triton); restored
      right after import. Nothing compiled is called by the tree.
    * ``pool_host.mha.transfer_kv_direct`` (an ``sgl_kernel`` op, only imported on CUDA/ROCm)
      is provided as ``dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))`` per layer
      buffer: the same copies the kernel makes, on CPU tensors.
    * ``pool_host.common._cuda_host_register`` (pins the host pool with ``cudaHostRegister``)
      is a no-op: there is no CUDA; pinning does not change the pool's contents or indices.
    * ``hiradix_cache.get_memory`` returns ``hicache_ratio=4.0`` (upstream reads the ratio from
      the published server-args config bag; the harness does not build a full ``ServerArgs``).
      ``server_args`` passed to the constructor is a ``SimpleNamespace`` with the hicache
      fields it reads. The scheduler's ``Req`` is a minimal object with the fields
      ``cache_unfinished_req`` / ``cache_finished_req`` read.
    * ``SGLANG_USE_CPU_ENGINE=1``; a one-rank gloo process group (``tp_world_size`` 1, so
      upstream's all-reduces are skipped exactly as on a single GPU). On CPU,
      ``torch.get_device_module("cpu")`` streams and events are no-ops, so every transfer is
      synchronous and acknowledged at the next ``check_hicache_events``.

Environment (Python 3.11; never a CUDA torch; sglang without its dependency tree)
    scripts/upstream_baseline_env.sh            # creates .venv-upstream from the pins below
    scripts/upstream_baseline_env.sh benchmarks/upstream_tree_replay.py --repeats 3   # and runs
    # or by hand:
    python3.11 -m venv .venv-upstream
    .venv-upstream/bin/pip install --no-deps -r benchmarks/upstream_requirements.txt   # ~45 s
    .venv-upstream/bin/python benchmarks/upstream_tree_replay.py --repeats 3
    (the requirements file is the whole closure, sglang==0.5.18 and torch==2.13.0+cpu included;
    --no-deps keeps pip from pulling sglang's CUDA dependency tree.)

Usage
    python benchmarks/upstream_tree_replay.py [--policies write_through,write_through_selective,write_back]
        [--out benchmarks/results/upstream_tree_replay.json] [--repeats N] [--check]
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.abc
import importlib.machinery
import logging
import os
import platform
import sys
import tempfile
import time
import types
import warnings
from array import array

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

POLICIES = ("write_through", "write_through_selective", "write_back")
DEVICE_TOKENS = 60_000
HOST_RATIO = 4.0
LAYERS, HEADS, HEAD_DIM = 2, 1, 8

# --------------------------------------------------------------------------- stubs

STUBBED_MODULES = (
    "triton",
    "sgl_kernel",
    "transformers",
    "compressed_tensors",
    "gguf",
    "safetensors",
    "huggingface_hub",
    "sentencepiece",
    "regex",
    "xgrammar",
    "openai",
    "partial_json_parser",
    "pydantic",
    "aiohttp",
    "zmq",
    "starlette",
    "PIL",
    "torchvision",
    "IPython",
)


class _StubMeta(type):
    """Stub attributes are classes: usable as bases, decorators, isinstance targets, calls."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        v = _stub_class(name)
        type.__setattr__(cls, name, v)
        return v

    def __call__(cls, *args, **kwargs):
        if cls.__dict__.get("_stub"):
            if len(args) == 1 and not kwargs and callable(args[0]):
                return args[0]  # used as a decorator
            return _stub_class(cls.__name__ + "()")
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, key):
        return cls

    def __setitem__(cls, key, value):
        pass

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0


class _StubBase(metaclass=_StubMeta):
    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, *args, **kwargs):
        pass


def _stub_class(name: str) -> type:
    return _StubMeta(name, (_StubBase,), {"_stub": True, "__module__": "upstream_stub"})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        v = _stub_class(name)
        setattr(self, name, v)
        return v


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path, target=None):
        if name.split(".", 1)[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def import_upstream():
    """Install the shims and import upstream's tree; returns a namespace of what the harness uses."""
    sys.meta_path.insert(0, _StubFinder(STUBBED_MODULES))
    import torch

    real_compile = torch.compile

    def _identity_compile(fn=None, *args, **kwargs):
        return fn if fn is not None else (lambda f: f)

    torch.compile = _identity_compile
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")  # "only CUDA supports AWQ", ...
    try:
        from sglang.srt.mem_cache import hiradix_cache
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InitLoadBackParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.pool_host import common as pool_host_common
        from sglang.srt.mem_cache.pool_host import mha as pool_host_mha
        from sglang.srt.mem_cache.radix_cache import RadixKey
    finally:
        torch.compile = real_compile

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        # sgl_kernel.kvcacheio.transfer_kv_direct: dst[dst_indices] = src[src_indices] per layer buffer.
        for src, dst in zip(src_layers, dst_layers):
            dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

    pool_host_mha.transfer_kv_direct = transfer_kv_direct
    pool_host_common._cuda_host_register = lambda buffer: None
    hiradix_cache.get_memory = lambda: types.SimpleNamespace(hicache_ratio=HOST_RATIO)

    import sglang

    return types.SimpleNamespace(
        torch=torch,
        HiRadixCache=hiradix_cache.HiRadixCache,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        EvictParams=EvictParams,
        InitLoadBackParams=InitLoadBackParams,
        MatchPrefixParams=MatchPrefixParams,
        CacheInitParams=CacheInitParams,
        MHATokenToKVPool=MHATokenToKVPool,
        ReqToTokenPool=ReqToTokenPool,
        RadixKey=RadixKey,
        version=getattr(sglang, "__version__", "?"),
    )


def quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING)
    # "torch.cpu.Event does not support timing": expected on CPU, said once per cache.
    logging.getLogger("sglang.srt.mem_cache.l2_transfer").setLevel(logging.ERROR)


def init_process_group(torch) -> None:
    if not torch.distributed.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="upstream_tree_"), "pg")
        torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


# --------------------------------------------------------------------------- harness


class Req:
    """The fields of the scheduler's ``Req`` that ``cache_(un)finished_req`` read and write."""

    __slots__ = (
        "origin_input_ids",
        "output_ids",
        "req_pool_idx",
        "last_node",
        "prefix_indices",
        "cache_protected_len",
        "extra_key",
        "cache_salt",
        "priority",
    )

    def __init__(self, prompt: array, pool_idx: int, prefix_indices, last_node) -> None:
        self.origin_input_ids = prompt
        self.output_ids = array("q")
        self.req_pool_idx = pool_idx
        self.last_node = last_node
        self.prefix_indices = prefix_indices
        self.cache_protected_len = len(prefix_indices)
        self.extra_key = None
        self.cache_salt = None
        self.priority = 0

    def get_fill_ids(self) -> array:
        return self.origin_input_ids + self.output_ids


class KVCode:
    """--check only: K/V content per (token, position, layer), exact in bf16 (integers < 256)."""

    def __init__(self, torch, kv) -> None:
        self.torch, self.kv = torch, kv

    def _code(self, tokens, start: int, layer: int, v: bool):
        torch = self.torch
        t = torch.as_tensor(tokens, dtype=torch.int64)
        pos = torch.arange(start, start + t.shape[0], dtype=torch.int64)
        code = torch.stack(
            [
                t % 256,
                (t // 256) % 256,
                pos % 256,
                (pos // 256) % 256,
                torch.full_like(t, layer),
                torch.full_like(t, int(v)),
                (t * 7 + pos) % 251,
                (t + pos * 3) % 241,
            ],
            dim=1,
        )
        return code.to(torch.bfloat16).view(-1, HEADS, HEAD_DIM)

    def write(self, idx, tokens, start: int) -> None:
        if idx.numel():
            for layer in range(LAYERS):
                self.kv.k_buffer[layer][idx] = self._code(tokens, start, layer, False)
                self.kv.v_buffer[layer][idx] = self._code(tokens, start, layer, True)

    def verify(self, idx, tokens, what: str) -> None:
        if idx.numel():
            n = idx.numel()
            for layer in range(LAYERS):
                for buf, v in ((self.kv.k_buffer, False), (self.kv.v_buffer, True)):
                    if not self.torch.equal(buf[layer][idx], self._code(tokens[:n], 0, layer, v)):
                        raise AssertionError(f"{what}: KV mismatch in layer {layer} ({'V' if v else 'K'})")


def check_tree(cache, alloc, host_pool, device_tokens: int) -> None:
    """Upstream's counters vs a walk of upstream's tree (HiRadixCache has no sanity_check())."""
    root = cache.root_node
    dev = host = evictable = protected = 0
    leaves, host_leaves = set(), set()
    stack = list(root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        assert n.parent is not None and n.parent.children.get(n.key.child_key(cache.page_size)) is n
        if n.value is not None:
            assert len(n.value) == len(n.key), f"node {n.id}: value/key length"
            dev += len(n.value)
            if n.lock_ref > 0:
                protected += len(n.value)
            else:
                evictable += len(n.value)
        if n.host_value is not None:
            assert len(n.host_value) == len(n.key), f"node {n.id}: host_value/key length"
            host += len(n.host_value)
        if n.value is None:
            assert n.host_value is not None, f"node {n.id}: evicted without a host copy"
            assert all(c.value is None for c in n.children.values()), f"node {n.id}: device child under evicted node"
        assert n.lock_ref == 0, f"node {n.id}: lock_ref {n.lock_ref} leaked after the request finished"
        if n.value is not None and n.lock_ref == 0 and all(c.value is None for c in n.children.values()):
            leaves.add(n)
        if n.value is None and n.lock_ref == 0 and not any(c.host_value is not None for c in n.children.values()):
            host_leaves.add(n)
    assert cache.evictable_size_ == evictable, (cache.evictable_size_, evictable)
    assert cache.protected_size_ == protected == 0, (cache.protected_size_, protected)
    assert alloc.available_size() + dev == device_tokens, (alloc.available_size(), dev, device_tokens)
    assert host_pool.available_size() + host == host_pool.size, (host_pool.available_size(), host, host_pool.size)
    assert cache.evictable_leaves == leaves, "evictable_leaves differs from the recomputed set"
    assert cache.evictable_host_leaves == host_leaves, "evictable_host_leaves differs from the recomputed set"
    cc = cache.cache_controller
    assert not cache.ongoing_write_through and not cache.ongoing_load_back, "transfers still pending"
    assert not cc.write_queue and not cc.load_queue and not cc.ack_write_queue and not cc.ack_load_queue


def build(up, policy: str):
    torch = up.torch
    kv = up.MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    alloc = up.TokenToKVPoolAllocator(DEVICE_TOKENS, torch.bfloat16, "cpu", kv, need_sort=False)
    req_pool = up.ReqToTokenPool(size=2, max_context_len=8192, device="cpu", enable_memory_saver=False)
    params = up.CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=alloc,
        page_size=1,
        tp_cache_group=torch.distributed.group.WORLD,
    )
    server_args = types.SimpleNamespace(
        hicache_size=0,
        hicache_mem_layout="layer_first",
        hicache_io_backend="direct",
        hicache_write_policy=policy,
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="best_effort",
        served_model_name="upstream-tree-replay",
        extra_metric_labels=None,
    )
    cache = up.HiRadixCache(params, server_args)
    return cache, kv, alloc, req_pool


def run(up, trace, policy: str, check: bool) -> dict:
    torch = up.torch
    cache, kv, alloc, req_pool = build(up, policy)
    host_pool = cache.token_to_kv_pool_host
    RadixKey, MatchPrefixParams = up.RadixKey, up.MatchPrefixParams
    InitLoadBackParams, EvictParams = up.InitLoadBackParams, up.EvictParams
    code = KVCode(torch, kv) if check else None
    # Token ids as the scheduler keeps them (array('q')); built before the timed loop.
    reqs = [(array("q", rec["prompt"].tolist()), array("q", rec["output"].tolist())) for rec in trace]
    samples = {k: [] for k in ("match", "load_back", "insert", "evict")}
    pc, cpt = time.perf_counter, time.process_time
    prompt_tokens = l1 = l2 = 0
    pool_idx = 1

    def alloc_tokens(n: int):
        if alloc.available_size() < n:
            t = pc()
            cache.evict(EvictParams(num_tokens=n - alloc.available_size()))
            samples["evict"].append(pc() - t)
        ids = alloc.alloc(n)
        if ids is None:
            raise RuntimeError(f"{policy}: out of device memory for {n} tokens")
        return ids

    t_wall, t_cpu = pc(), cpt()
    for prompt, output in reqs:
        t = pc()
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
        samples["match"].append(pc() - t)
        prefix, last = m.device_indices, m.last_device_node
        loaded = 0
        if m.host_hit_length > 0:
            t = pc()
            new, last = cache.init_load_back(
                InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
            cache.ready_to_load_host_cache()  # the forward pass starts the H2D copy (synchronous on CPU)
            samples["load_back"].append(pc() - t)
            if len(new):
                prefix = torch.cat([prefix, new])
                loaded = len(new)
        cache.inc_lock_ref(last)
        n_prompt = len(prompt)
        prompt_tokens += n_prompt
        l1 += len(m.device_indices)
        l2 += loaded
        if check:
            code.verify(prefix, prompt, "hit")
        req = Req(prompt, pool_idx, prefix, last)
        n_prefix = len(prefix)
        new_ids = alloc_tokens(n_prompt - n_prefix)
        req_pool.write((pool_idx, slice(0, n_prompt)), torch.cat([prefix, new_ids]))
        if check:
            code.write(new_ids, prompt[n_prefix:], n_prefix)  # prefill
        t = pc()
        cache.cache_unfinished_req(req)
        samples["insert"].append(pc() - t)
        out_ids = alloc_tokens(len(output))
        req_pool.write((pool_idx, slice(n_prompt, n_prompt + len(output))), out_ids)
        if check:
            code.write(out_ids, output, n_prompt)  # decode
        req.output_ids = output
        t = pc()
        cache.cache_finished_req(req, kv_len_to_handle=n_prompt + len(output))
        samples["insert"].append(pc() - t)
        cache.check_hicache_events()
        if check:
            check_tree(cache, alloc, host_pool, DEVICE_TOKENS)
    wall, cpu = pc() - t_wall, cpt() - t_cpu

    if check:
        for prompt, _ in reqs[-8:]:
            mm = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
            code.verify(mm.device_indices, prompt, "final")
    host_pool_tokens = host_pool.size
    ops = {}
    for k, v in samples.items():
        s = sorted(v)
        ops[k] = (
            {
                "count": len(s),
                "ops_per_s": len(s) / sum(s) if sum(s) else None,
                "p50_us": s[len(s) // 2] * 1e6,
                "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
                "total_s": sum(s),
            }
            if s
            else {"count": 0}
        )
    n = len(reqs)
    # Upstream registers atexit(cache.shutdown), which would keep every replay's tree alive.
    atexit.unregister(cache.shutdown)
    cache = kv = alloc = req_pool = host_pool = code = None  # drop the replay's tree before gc
    gc.collect()
    return {
        "policy": policy,
        "requests": n,
        "wall_s": wall,
        "cpu_s": cpu,
        "req_per_s": n / wall,
        "req_per_cpu_s": n / cpu,
        "checked": check,
        "prompt_tokens": prompt_tokens,
        "hit_rate": {"L1": l1 / prompt_tokens, "L2": l2 / prompt_tokens, "total": (l1 + l2) / prompt_tokens},
        "host_pool_tokens": host_pool_tokens,
        "ops": ops,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--quick", action="store_true", help="one timed replay, no warm-up (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="timed replays per policy (fresh cache each)")
    ap.add_argument(
        "--check", action="store_true", help="untimed: KV round-trip and tree-invariant checks after every request"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed replays (of the first policy) before the timed ones; the first replay "
        "in a process runs ~30%% slower",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--out",
        default=os.path.join("hicache-results", "upstream_tree_replay.json"),
        help="JSON result (under the current directory)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 1, 0
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown policy {p!r}")

    quiet_logs()
    t0 = time.perf_counter()
    up = import_upstream()
    import_s = time.perf_counter() - t0
    up.torch.set_num_threads(args.threads)
    init_process_group(up.torch)
    from benchmarks.bench_tree_multiturn import make_trace  # the multiturn-64x10 trace, not duplicated

    trace = make_trace()
    # Repeats round-robin over the policies, so a drift in the machine's speed hits all alike.
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for _ in range(0 if args.check else args.warmup):
        run(up, trace, policies[0], check=False)
    for _ in range(1 if args.check else max(1, args.repeats)):
        for policy in policies:
            runs[policy].append(run(up, trace, policy, check=args.check))
    results = []
    for policy in policies:
        rs = runs[policy]
        cpu = sorted(r["req_per_cpu_s"] for r in rs)
        wall = sorted(r["req_per_s"] for r in rs)
        hits = rs[0]["hit_rate"]
        assert all(r["hit_rate"] == hits for r in rs), "hit rates differ between repeats"
        res = {
            "policy": policy,
            "repeats": len(rs),
            "checked": args.check,
            "hit_rate": hits,
            "req_per_cpu_s": {"median": cpu[len(cpu) // 2], "min": cpu[0], "max": cpu[-1]},
            "req_per_s": {"median": wall[len(wall) // 2], "min": wall[0], "max": wall[-1]},
            "runs": rs,
        }
        results.append(res)
        head = f"{policy:24s} L1 {hits['L1']:.4f} L2 {hits['L2']:.4f}  "
        if args.check:
            print(head + "checked: KV round-trip + tree invariants after every request OK (untimed)", flush=True)
        else:
            print(
                head + f"req/s by CPU time: median {res['req_per_cpu_s']['median']:.0f} [{cpu[0]:.0f}-{cpu[-1]:.0f}]"
                f"  wall: median {res['req_per_s']['median']:.0f} [{wall[0]:.0f}-{wall[-1]:.0f}]"
                f"  ({len(rs)} runs)",
                flush=True,
            )
    doc = {
        "benchmark": "upstream_tree_replay",
        "tree": "sglang HiRadixCache",
        "sglang": up.version,
        "torch": up.torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": args.threads,
        "warmup": args.warmup,
        "import_s": import_s,
        "config": {
            "device_tokens": DEVICE_TOKENS,
            "host_ratio": HOST_RATIO,
            "page_size": 1,
            "kv": f"{LAYERS} layers x {HEADS} head x {HEAD_DIM} dims bf16, K+V",
            "io_backend": "direct",
            "host_layout": "layer_first",
            "requests": len(trace),
        },
        "stubbed_modules": list(STUBBED_MODULES),
        "results": results,
    }
    from hicache_jax.bench.report import write_json

    print(f"wrote {write_json(args.out, doc)}")
    return doc


if __name__ == "__main__":
    main()
