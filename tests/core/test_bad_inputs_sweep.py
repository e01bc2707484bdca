"""Bad inputs to the public constructors and calls, one table: each is a ``ValueError`` or
``TypeError`` whose message names the argument and says what was expected, and changes no
state (the object a method was called on, or the cache a constructor would attach to, is the
same after). Floats must be finite, sizes bounded (a size no machine can hold is refused before
any allocation). The CLI's options have their own table (``test_cli_bad_inputs_sweep``).

Runs without JAX (the torch env) except the eSurge adapter's cases."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest

from hicache_jax import CacheStack, HostKVPool, HostPoolConfig, KVGeometry, PageAllocator
from hicache_jax.backends.numpy_backend import make_numpy_backend
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.cache.event_source import KVEventSource
from hicache_jax.cache.events import EventBatch, KVEvent, TierContents
from hicache_jax.routing import PrefixRouter, TierWeights, tier_costs_from_stats
from hicache_jax.storage import StorageConfig
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.mooncake.server import MooncakeMaster

NAN, INF = float("nan"), float("inf")
K = [bytes([i]) * 32 for i in range(4)]
G = KVGeometry.mha(2, 4, 1, 8, "float32")


def make_cache():
    device, _host, engine = make_numpy_backend(G, 16, 32, "page_first", False)
    return HiRadixCache(HiCacheConfig(page_size=4), engine, device.allocator)


def _backend():
    device, _host, engine = make_numpy_backend(G, 16, 32, "page_first", False)
    return engine, device.allocator


def _controller(cache, config=None, **kw):
    from hicache_jax.l3 import StorageController

    return StorageController(
        cache, StorageConfig(backend="memory") if config is None else config, **{"model": "m", **kw}
    )


def router():
    r = PrefixRouter(["a", "b"])
    r.apply(EventBatch("a", 0, (KVEvent("stored", "device", tuple(K[:2]), None, 8),)))
    return r


def router_state(r):
    return (
        {e: copy.deepcopy(v.tiers) for e, v in r.views.items()},
        {e: v.last_seq for e, v in r.views.items()},
        dict(r.decisions),
        r.weights,
    )


def source():
    src = KVEventSource(make_cache(), model="m", engine="a")
    src.subscribe(print)
    return src


def source_state(src):
    return src.subscribers, src.stats(), src.cache.debug_view().watch is src


# (id, builds the object a call changes or None, the call, exception, message regex)
CASES = [
    # ---------------------------------------------------------------- routing (the list)
    ("PrefixRouter('ab')", None, lambda _: PrefixRouter("ab"), TypeError, "engines: expected a sequence"),
    ("PrefixRouter(b'ab')", None, lambda _: PrefixRouter(b"ab"), TypeError, "engines"),
    ("PrefixRouter(None)", None, lambda _: PrefixRouter(None), TypeError, "engines"),
    ("PrefixRouter([])", None, lambda _: PrefixRouter([]), ValueError, "engines"),
    ("PrefixRouter(['a', ''])", None, lambda _: PrefixRouter(["a", ""]), ValueError, "engines"),
    ("PrefixRouter(['a', 1])", None, lambda _: PrefixRouter(["a", 1]), ValueError, "engines"),
    ("PrefixRouter(['a', 'a'])", None, lambda _: PrefixRouter(["a", "a"]), ValueError, "engines"),
    ("PrefixRouter(weights=dict)", None, lambda _: PrefixRouter(["a"], {"device": 1}), TypeError, "weights"),
    ("shared_storage='no'", None, lambda _: PrefixRouter(["a"], shared_storage="no"), TypeError, "shared_storage"),
    ("shared_storage=1", None, lambda _: PrefixRouter(["a"], shared_storage=1), TypeError, "shared_storage"),
    (
        "balance_abs=nan",
        None,
        lambda _: PrefixRouter(["a"], balance_abs=NAN),
        ValueError,
        "balance_abs: expected a finite",
    ),
    ("balance_abs=inf", None, lambda _: PrefixRouter(["a"], balance_abs=INF), ValueError, "balance_abs"),
    ("balance_abs=-1", None, lambda _: PrefixRouter(["a"], balance_abs=-1), ValueError, "balance_abs"),
    ("balance_abs='32'", None, lambda _: PrefixRouter(["a"], balance_abs="32"), ValueError, "balance_abs"),
    ("balance_rel=nan", None, lambda _: PrefixRouter(["a"], balance_rel=NAN), ValueError, "balance_rel"),
    ("balance_rel=True", None, lambda _: PrefixRouter(["a"], balance_rel=True), ValueError, "balance_rel"),
    ("route(iter(keys))", router, lambda r: r.route(iter(K)), TypeError, "keys: expected a sequence"),
    ("route(generator)", router, lambda r: r.route(k for k in K), TypeError, "keys"),
    ("route(b'..')", router, lambda r: r.route(b"abc"), TypeError, "keys"),
    ("route(['str'])", router, lambda r: r.route(["x"]), TypeError, "keys"),
    ("route(None)", router, lambda r: r.route(None), TypeError, "keys"),
    ("route(loads nan)", router, lambda r: r.route(K, {"a": NAN, "b": 1}), ValueError, "loads: expected a finite"),
    ("route(loads inf)", router, lambda r: r.route(K, {"a": INF}), ValueError, "loads"),
    ("route(loads -1)", router, lambda r: r.route(K, {"a": -1, "b": 0}), ValueError, "loads"),
    ("route(loads '3')", router, lambda r: r.route(K, {"a": "3"}), ValueError, "loads"),
    ("route(loads True)", router, lambda r: r.route(K, {"a": True}), ValueError, "loads"),
    ("route(loads unknown)", router, lambda r: r.route(K, {"z": 1}), ValueError, "loads: unknown"),
    ("route(loads list)", router, lambda r: r.route(K, [1, 2]), TypeError, "loads"),
    ("score('zzz')", router, lambda r: r.score("zzz", K), ValueError, "engine: expected one of"),
    ("score(iter)", router, lambda r: r.score("a", iter(K)), TypeError, "keys"),
    ("apply(dict)", router, lambda r: r.apply({"engine": "a"}), TypeError, "batch"),
    ("apply(unknown engine)", router, lambda r: r.apply(EventBatch("z", 1)), ValueError, "batch: engine"),
    ("apply(replayed)", router, lambda r: r.apply(EventBatch("a", 0)), ValueError, "batch: seq"),
    ("TierWeights(host=nan)", None, lambda _: TierWeights(host=NAN), ValueError, "host"),
    ("TierWeights(storage=2)", None, lambda _: TierWeights(storage=2), ValueError, "storage"),
    ("TierWeights(device='1')", None, lambda _: TierWeights(device="1"), ValueError, "device"),
    ("TierWeights order", None, lambda _: TierWeights(device=0.5, host=0.7), ValueError, "weights"),
    ("from_load_cost(nan)", None, lambda _: TierWeights.from_load_cost(NAN), ValueError, "prefill_s_per_token"),
    ("from_load_cost(0)", None, lambda _: TierWeights.from_load_cost(0), ValueError, "prefill_s_per_token"),
    ("from_load_cost(host inf)", None, lambda _: TierWeights.from_load_cost(1, INF), ValueError, "host_s_per_token"),
    (
        "from_load_cost(storage -1)",
        None,
        lambda _: TierWeights.from_load_cost(1, None, -1),
        ValueError,
        "storage_s_per_token",
    ),
    ("from_load_cost(base)", None, lambda _: TierWeights.from_load_cost(1, base={}), TypeError, "base"),
    ("tier_costs_from_stats('x')", None, lambda _: tier_costs_from_stats("x"), TypeError, "stats"),
    ("set_measured_weights(nan)", router, lambda r: r.set_measured_weights({}, NAN), ValueError, "prefill_s_per_token"),
    # ---------------------------------------------------------------- events
    ("KVEvent(kind)", None, lambda _: KVEvent("added", "device"), ValueError, "kind"),
    ("KVEvent(tier)", None, lambda _: KVEvent("stored", "disk"), ValueError, "tier"),
    ("KVEvent(keys str)", None, lambda _: KVEvent("stored", "device", "ab"), TypeError, "keys"),
    ("KVEvent(keys ints)", None, lambda _: KVEvent("stored", "device", (1, 2)), TypeError, "keys"),
    ("KVEvent(cleared with keys)", None, lambda _: KVEvent("cleared", "device", (K[0],)), ValueError, "keys"),
    ("KVEvent(parent_key str)", None, lambda _: KVEvent("stored", "device", (K[0],), "ab"), TypeError, "parent_key"),
    (
        "KVEvent(token_count -1)",
        None,
        lambda _: KVEvent("stored", "device", (K[0],), None, -1),
        ValueError,
        "token_count",
    ),
    (
        "KVEvent(token_count 1.5)",
        None,
        lambda _: KVEvent("stored", "device", (K[0],), None, 1.5),
        ValueError,
        "token_count",
    ),
    ("KVEvent(model None)", None, lambda _: KVEvent("stored", "device", (), None, 0, None), TypeError, "model"),
    ("KVEvent(namespace 1)", None, lambda _: KVEvent("stored", "device", (), None, 0, "m", 1), TypeError, "namespace"),
    ("EventBatch(engine 1)", None, lambda _: EventBatch(1, 0), TypeError, "engine"),
    ("EventBatch(seq -1)", None, lambda _: EventBatch("a", -1), ValueError, "seq"),
    ("EventBatch(seq 1.0)", None, lambda _: EventBatch("a", 1.0), ValueError, "seq"),
    ("EventBatch(events dicts)", None, lambda _: EventBatch("a", 0, ({},)), TypeError, "events"),
    ("EventBatch(resync 'no')", None, lambda _: EventBatch("a", 0, (), "no"), TypeError, "resync"),
    ("KVEvent.from_dict(schema 2)", None, lambda _: KVEvent.from_dict({"schema": 2}), ValueError, "schema"),
    (
        "TierContents.apply(replay)",
        TierContents,
        lambda v: (v.apply(EventBatch("a", 3)), v.apply(EventBatch("a", 3))),
        ValueError,
        "batch: seq",
    ),
    # ---------------------------------------------------------------- event source
    (
        "KVEventSource(None)",
        None,
        lambda _: KVEventSource(None, model="m"),
        TypeError,
        "cache: expected a HiRadixCache",
    ),
    ("KVEventSource(model='')", make_cache, lambda c: KVEventSource(c, model=""), ValueError, "model"),
    ("KVEventSource(model=None)", make_cache, lambda c: KVEventSource(c, model=None), ValueError, "model"),
    ("KVEventSource(engine=1)", make_cache, lambda c: KVEventSource(c, model="m", engine=1), TypeError, "engine"),
    ("KVEventSource(salt=1)", make_cache, lambda c: KVEventSource(c, model="m", salt=1), TypeError, "salt"),
    (
        "KVEventSource(weights_revision=1)",
        make_cache,
        lambda c: KVEventSource(c, model="m", weights_revision=1),
        TypeError,
        "weights_revision",
    ),
    (
        "KVEventSource(max_pending=0)",
        make_cache,
        lambda c: KVEventSource(c, model="m", max_pending=0),
        ValueError,
        "max_pending",
    ),
    (
        "KVEventSource(max_pending=1.5)",
        make_cache,
        lambda c: KVEventSource(c, model="m", max_pending=1.5),
        ValueError,
        "max_pending",
    ),
    (
        "KVEventSource(tp_rank=5)",
        make_cache,
        lambda c: KVEventSource(c, model="m", tp_size=2, tp_rank=5),
        ValueError,
        "tp_rank",
    ),
    ("subscribe(twice)", source, lambda s: s.subscribe(print), ValueError, "fn: .*already subscribed"),
    ("subscribe(42)", source, lambda s: s.subscribe(42), TypeError, "fn"),
    ("unsubscribe(unknown)", source, lambda s: s.unsubscribe(len), ValueError, "fn: .*not subscribed"),
    ("observe_storage(object)", source, lambda s: s.observe_storage(object()), TypeError, "storage"),
    ("request_keys('abc')", source, lambda s: s.request_keys("abc"), TypeError, "key"),
    # ---------------------------------------------------------------- geometry, pools, allocator
    ("KVGeometry.mla(2, 16, 8, 1.5)", None, lambda _: KVGeometry.mla(2, 16, 8, 1.5), TypeError, "qk_rope_head_dim"),
    ("KVGeometry.mla(rope -1)", None, lambda _: KVGeometry.mla(2, 16, 8, -1), ValueError, "qk_rope_head_dim"),
    ("KVGeometry.mla(rank 0)", None, lambda _: KVGeometry.mla(2, 16, 0, 8), ValueError, "kv_lora_rank"),
    ("KVGeometry.mha(layers nan)", None, lambda _: KVGeometry.mha(NAN, 4, 1, 8), TypeError, "num_layers"),
    ("KVGeometry.mha(page 2**70)", None, lambda _: KVGeometry.mha(2, 2**70, 1, 8), ValueError, "page_size"),
    ("KVGeometry.mha(heads 0)", None, lambda _: KVGeometry.mha(2, 4, 0, 8), ValueError, "num_kv_heads"),
    ("KVGeometry.mha(head_dim 2**40)", None, lambda _: KVGeometry.mha(2, 4, 1, 2**40), ValueError, "head_dim"),
    ("KVGeometry(dtype int3)", None, lambda _: KVGeometry.mha(2, 4, 1, 8, "int3"), ValueError, "dtype"),
    ("KVGeometry(kind gqa)", None, lambda _: KVGeometry("gqa", 2, 4), ValueError, "kind"),
    ("HostKVPool(geom dict)", None, lambda _: HostKVPool({}, 4), TypeError, "geom"),
    ("HostKVPool(pages -1)", None, lambda _: HostKVPool(G, -1), ValueError, "num_pages"),
    ("HostKVPool(pages 1.5)", None, lambda _: HostKVPool(G, 1.5), TypeError, "num_pages"),
    # One page of a geometry whose page cannot fit any machine: refused before numpy is asked
    # (without the check numpy raises MemoryError at once: safe to run as a mutant).
    (
        "HostKVPool(1 page of 2**56 bytes)",
        None,
        lambda _: HostKVPool(KVGeometry.mha(1024, 4096, 1024, 8192), 1),
        ValueError,
        "num_pages: expected a pool that fits",
    ),
    ("HostKVPool(pages 2**40)", None, lambda _: HostKVPool(G, 2**40), ValueError, "num_pages"),
    ("HostKVPool(layout)", None, lambda _: HostKVPool(G, 4, "bogus"), ValueError, "layout"),
    ("HostKVPool(buffer list)", None, lambda _: HostKVPool(G, 4, buffer=[0]), TypeError, "buffer"),
    ("HostPoolConfig(ratio inf)", None, lambda _: HostPoolConfig(ratio=INF), ValueError, "ratio: expected a finite"),
    ("HostPoolConfig(ratio nan)", None, lambda _: HostPoolConfig(ratio=NAN), ValueError, "ratio"),
    ("HostPoolConfig(ratio 0)", None, lambda _: HostPoolConfig(ratio=0), ValueError, "ratio"),
    ("HostPoolConfig(size_bytes -1)", None, lambda _: HostPoolConfig(size_bytes=-1), ValueError, "size_bytes"),
    ("HostPoolConfig(layout)", None, lambda _: HostPoolConfig(layout="x"), ValueError, "layout"),
    ("PageAllocator(-1)", None, lambda _: PageAllocator(-1), ValueError, "num_pages"),
    ("PageAllocator(2**40)", None, lambda _: PageAllocator(2**40), ValueError, "num_pages"),
    ("PageAllocator(2**31 + 1)", None, lambda _: PageAllocator(2**31 + 1), ValueError, "num_pages: .*int32"),
    ("PageAllocator('4')", None, lambda _: PageAllocator("4"), TypeError, "num_pages"),
    ("PageAllocator(name 5)", None, lambda _: PageAllocator(4, name=5), TypeError, "name"),
    (
        "Namespace(tp_size 0)",
        None,
        lambda _: Namespace("m", "", "bfloat16", 4, "page_first", tp_size=0),
        ValueError,
        "tp_size",
    ),
    ("Namespace(page 0)", None, lambda _: Namespace("m", "", "bfloat16", 0, "page_first"), ValueError, "page_size"),
    ("Namespace(model '')", None, lambda _: Namespace("", "", "bfloat16", 4, "page_first"), ValueError, "model"),
    # ---------------------------------------------------------------- configs (hardened before: a sample)
    ("HiCacheConfig(page_size 0)", None, lambda _: HiCacheConfig(page_size=0), ValueError, "page_size"),
    (
        "StorageConfig(worker_nice 100)",
        None,
        lambda _: StorageConfig(backend="memory", worker_nice=100),
        ValueError,
        "worker_nice",
    ),
    (
        "StorageConfig(capacity nan)",
        None,
        lambda _: StorageConfig(backend="memory", capacity_bytes=NAN),
        TypeError,
        "capacity_bytes",
    ),
    ("RadixKey(floats)", None, lambda _: RadixKey(np.array([1.5, 2.0])), TypeError, "token"),
    # ---------------------------------------------------------------- the cache, its L3 controller, the stack
    ("HiRadixCache(config dict)", None, lambda _: HiRadixCache({}, *_backend()), TypeError, "config"),
    (
        "HiRadixCache(engine None)",
        None,
        lambda _: HiRadixCache(HiCacheConfig(page_size=4), None, _backend()[1]),
        TypeError,
        "engine",
    ),
    (
        "HiRadixCache(allocator None)",
        None,
        lambda _: HiRadixCache(HiCacheConfig(page_size=4), _backend()[0], None),
        TypeError,
        "device_allocator",
    ),
    (
        "HiRadixCache(page_size 8 != 4)",
        None,
        lambda _: HiRadixCache(HiCacheConfig(page_size=8), *_backend()),
        ValueError,
        "config: page_size",
    ),
    ("StorageController(model '')", make_cache, lambda c: _controller(c, model=""), ValueError, "model"),
    (
        "StorageController(weights_revision 1)",
        make_cache,
        lambda c: _controller(c, weights_revision=1),
        TypeError,
        "weights_revision",
    ),
    ("StorageController(salt 1)", make_cache, lambda c: _controller(c, salt=1), TypeError, "salt"),
    (
        "StorageController(batch_pages 0)",
        make_cache,
        lambda c: _controller(c, batch_pages=0),
        ValueError,
        "batch_pages",
    ),
    (
        "StorageController(max_inflight_fraction nan)",
        make_cache,
        lambda c: _controller(c, max_inflight_fraction=NAN),
        ValueError,
        "max_inflight_fraction",
    ),
    (
        "StorageController(tp_rank 3 of 2)",
        make_cache,
        lambda c: _controller(c, tp_size=2, tp_rank=3),
        ValueError,
        "tp_rank",
    ),
    ("StorageController(config dict)", make_cache, lambda c: _controller(c, config={}), TypeError, "storage_config"),
    ("CacheStack(None)", None, lambda _: CacheStack(None), TypeError, "cache: expected a HiRadixCache"),
    ("CacheStack(storage object)", make_cache, lambda c: CacheStack(c, storage=object()), TypeError, "storage"),
    (
        "CacheStack(transfers without close)",
        make_cache,
        lambda c: CacheStack(c, transfers=[object()]),
        TypeError,
        "transfers",
    ),
    ("CacheStack(closers str)", make_cache, lambda c: CacheStack(c, closers="ab"), TypeError, "closers"),
    # ---------------------------------------------------------------- the local Mooncake Store
    (
        "MooncakeMaster(max_lifetime_s -5)",
        None,
        lambda _: MooncakeMaster(max_lifetime_s=-5),
        ValueError,
        "max_lifetime_s: expected finite seconds >= 0",
    ),
    (
        "MooncakeMaster(max_lifetime_s nan)",
        None,
        lambda _: MooncakeMaster(max_lifetime_s=NAN),
        ValueError,
        "max_lifetime_s",
    ),
    (
        "MooncakeMaster(max_lifetime_s inf)",
        None,
        lambda _: MooncakeMaster(max_lifetime_s=INF),
        ValueError,
        "max_lifetime_s",
    ),
    (
        "MooncakeMaster(start_timeout_s 0)",
        None,
        lambda _: MooncakeMaster(start_timeout_s=0),
        ValueError,
        "start_timeout_s",
    ),
    (
        "MooncakeMaster(start_timeout_s nan)",
        None,
        lambda _: MooncakeMaster(start_timeout_s=NAN),
        ValueError,
        "start_timeout_s",
    ),
    ("MooncakeMaster(rpc_port 70000)", None, lambda _: MooncakeMaster(rpc_port=70000), ValueError, "rpc_port"),
    ("MooncakeMaster(metadata_port -1)", None, lambda _: MooncakeMaster(metadata_port=-1), ValueError, "metadata_port"),
    ("MooncakeMaster(lease_ttl_ms 1.5)", None, lambda _: MooncakeMaster(lease_ttl_ms=1.5), ValueError, "lease_ttl_ms"),
    (
        "MooncakeMaster(store_node_bytes 1)",
        None,
        lambda _: MooncakeMaster(store_node_bytes=1),
        ValueError,
        "store_node_bytes",
    ),
    (
        "MooncakeMaster(watermark nan)",
        None,
        lambda _: MooncakeMaster(eviction_high_watermark=NAN),
        ValueError,
        "eviction_high_watermark",
    ),
    (
        "MooncakeMaster(watermark True)",
        None,
        lambda _: MooncakeMaster(eviction_high_watermark=True),
        ValueError,
        "eviction_high_watermark",
    ),
    ("MooncakeMaster(host '')", None, lambda _: MooncakeMaster(host=""), ValueError, "host"),
    ("MooncakeMaster(log_level)", None, lambda _: MooncakeMaster(log_level="loud"), ValueError, "log_level"),
    ("MooncakeMaster(extra_args str)", None, lambda _: MooncakeMaster(extra_args="--x"), TypeError, "extra_args"),
    ("MooncakeMaster(log_dir 5)", None, lambda _: MooncakeMaster(log_dir=5), TypeError, "log_dir"),
]


@pytest.mark.parametrize("name,make,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error_with_no_state_change(name, make, call, exc, match):
    obj = make() if make is not None else None
    state = {router: router_state, source: source_state}.get(make)
    if make is make_cache:  # a refused source / controller / stack attaches nothing
        before = (obj.debug_view().watch, obj.storage_hook)
    elif state is not None:
        before = state(obj)
    with pytest.raises(exc, match=match) as e:
        call(obj)
    msg = str(e.value)
    assert (
        "expected" in msg
        or "already" in msg
        or "not subscribed" in msg
        or "unknown" in msg
        or "not after" in msg
        or "not one of" in msg
        or "schema" in msg
        or "!=" in msg
    ), msg
    if make is make_cache:
        assert (obj.debug_view().watch, obj.storage_hook) == before
    elif state is not None:
        assert state(obj) == before


ADAPTER_CASES = [("nan", NAN), ("inf", INF), ("-1", -1), ("0", 0), ("'5'", "5"), ("True", True)]


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="the eSurge adapter's module imports JAX")
@pytest.mark.parametrize("value", [v for _n, v in ADAPTER_CASES], ids=[n for n, _v in ADAPTER_CASES])
def test_attach_prefetch_timeout_must_be_finite_positive_seconds(value):
    """``attach(prefetch_timeout_s=nan)`` meant no timeout and ``-1`` cancelled every prefetch; the
    check comes before the engine is looked at (an object that is no eSurge engine here)."""
    from hicache_jax.integrations.easydel.adapter import attach

    config = HiCacheConfig(page_size=16, write_through_threshold=1)
    engine = object()
    with pytest.raises(ValueError, match="prefetch_timeout_s: expected finite seconds > 0"):
        attach(engine, config, model="m", prefetch_timeout_s=value)


def test_case_ids_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)
