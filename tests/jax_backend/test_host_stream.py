"""The xla_stream host-copy path: pages move between the pinned host arena and the device pool
inside XLA executables, byte for byte, with no host-side copy of KV bytes.

Every test builds the host pool with ``pinned_host_pool`` (a ``PinnedHostArena``); the CPU
backend has a ``pinned_host`` memory kind, so these run in CI.
"""

from __future__ import annotations

import re
import threading

import jax
import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, KVGeometry, TransferError
from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine
from hicache_jax.backends.jax.host_stream import PinnedHostArena, default_group_layers, layer_groups
from hicache_jax.backends.jax.memory import pinned_host_pool
from pallas_kernels.page_copy import PageCopyConfig

DEVICE_PAGES, HOST_PAGES = 24, 16

GEOMS = {
    "mha-bf16-p16": KVGeometry.mha(3, 16, 4, 8, "bfloat16"),
    "mha-fp32-p1": KVGeometry.mha(2, 1, 4, 4, "float32"),
    "mha-fp16-p33": KVGeometry.mha(2, 33, 4, 4, "float16"),
    "mha-fp8-p8": KVGeometry.mha(4, 8, 2, 16, "float8_e4m3fn"),
    "mla-fp8-p16": KVGeometry.mla(2, 16, 24, 8, "float8_e4m3fn"),
    "mla-bf16-p4": KVGeometry.mla(3, 4, 16, 8, "bfloat16"),
}


def _pinned_or_skip(geom, layout, pages=HOST_PAGES):
    host = pinned_host_pool(geom, pages, layout)
    if host.memory_kind != "pinned_host":
        pytest.skip("this JAX runtime has no pinned_host memory kind")
    return host


def _engine(geom, layout, groups=None, **kw):
    dev = JaxDevicePool(geom, DEVICE_PAGES)
    host = _pinned_or_skip(geom, layout)
    eng = JaxTransferEngine(
        dev, host, copy_config=PageCopyConfig(max_pages=DEVICE_PAGES), load_group_layers=groups, **kw
    )
    return dev, host, eng


def _random_bits(geom, shape, rng):
    info = np.iinfo(geom.container_dtype)
    return rng.integers(1, info.max, shape, dtype=geom.container_dtype)


def _fill_device(dev, rng):
    g = dev.geom
    data = {}
    for c in g.components:
        data[c] = _random_bits(g, (g.num_layers, dev.num_pages) + g.page_shape, rng)
        dev.write_pages_host(c, np.arange(dev.num_pages), data[c])
    return data


def _poison_host(host, rng):
    """Every host byte random (never the device's bytes), so a page a copy missed is seen."""
    host.array[...] = _random_bits(host.geom, host.array.shape, rng)
    return host.array.copy()


def _host_pages(host, component, ids):
    """(L, n, page, H, D) bits of host pages, read through the numpy view (not the engine)."""
    view = host.component_view(component)
    order = host.layout.transfer_order
    if order == "lnp":
        return view[:, ids]
    pages = view[ids]
    return pages.transpose(1, 0, 2, 3, 4) if order == "nlp" else pages.transpose(2, 0, 1, 3, 4)


def _check_round_trip(geom, layout, dev, host, eng, rng):
    """Back up 5 random device pages into poisoned host pages and load them into 5 other device
    pages: the named pages carry the bytes both ways; every other host and device page keeps its
    bytes (the host's poison, the device's data), byte for byte."""
    data = _fill_device(dev, rng)
    before_host = _poison_host(host, rng)
    src, hst, dst = np.array([4, 19, 0, 7, 11]), np.array([15, 0, 3, 8, 9]), np.array([20, 21, 1, 2, 23])
    eng.backup(src, hst).wait()
    poisoned = HostKVPool(geom, HOST_PAGES, layout, buffer=before_host)
    others = np.setdiff1d(np.arange(HOST_PAGES), hst)
    for c in geom.components:
        np.testing.assert_array_equal(_host_pages(host, c, hst), data[c][:, src])
        np.testing.assert_array_equal(_host_pages(host, c, others), _host_pages(poisoned, c, others))
    eng.load(hst, dst).wait()
    untouched = np.setdiff1d(np.arange(DEVICE_PAGES), dst)
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, dst), data[c][:, src])
        np.testing.assert_array_equal(dev.read_pages_host(c, untouched), data[c][:, untouched])


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("name", list(GEOMS))
def test_stream_roundtrip_is_byte_exact_and_touches_only_the_named_pages(name, layout):
    geom = GEOMS[name]
    rng = np.random.default_rng(0)
    dev, host, eng = _engine(geom, layout, groups=1)
    assert eng.host_copy == "xla_stream"
    _check_round_trip(geom, layout, dev, host, eng, rng)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_stream_makes_no_host_side_copy_of_kv_bytes(layout, monkeypatch):
    """Where pinned memory exists, a backup and a load never go through the host pool's
    read/write methods (each of which copies KV bytes on a CPU core). The same wrapper sees
    the numpy path's copies, so it can see them when they happen."""
    geom = GEOMS["mha-bf16-p16"]
    copied = []

    def watch(host):
        for name in ("read_pages", "write_pages", "write_pages_unchecked", "read_layer", "read_layer_unchecked"):
            original = getattr(host, name)
            monkeypatch.setattr(host, name, lambda *a, _o=original, _n=name, **k: (copied.append(_n), _o(*a, **k))[1])

    dev, host, eng = _engine(geom, layout)
    _fill_device(dev, np.random.default_rng(1))
    watch(host)
    eng.backup(np.arange(6), np.arange(6)).wait()
    eng.load(np.arange(6), np.arange(10, 16)).wait()
    assert copied == []
    np_eng = JaxTransferEngine(dev, host, copy_config=PageCopyConfig(max_pages=DEVICE_PAGES), host_copy="numpy")
    np_eng.backup(np.arange(6), np.arange(6)).wait()
    np_eng.load(np.arange(6), np.arange(10, 16)).wait()
    np_eng.close()
    assert "write_pages_unchecked" in copied and "read_pages" in copied


def test_arena_install_refuses_an_array_of_another_shape_or_dtype():
    """The arena only takes what a D2H executable returns for it: its own shape and dtype. A
    wrong shape with the right dtype (or the reverse) is refused and the arena keeps its array."""
    geom = GEOMS["mha-bf16-p16"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST_DIRECT)
    arena = host.buffer_owner
    before = arena.array
    wrong_shape = jax.numpy.zeros((arena.shape[0] + 1,) + arena.shape[1:], arena.dtype)
    wrong_dtype = jax.numpy.zeros(arena.shape, np.float32 if arena.dtype != np.float32 else np.float16)
    for bad in (wrong_shape, wrong_dtype):
        with pytest.raises(ValueError, match="new: expected"):
            arena.install(bad)
        assert arena.array is before
    eng.close()


def test_arena_keeps_its_address_and_the_d2h_never_copies_the_whole_arena():
    geom = GEOMS["mha-bf16-p16"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST_DIRECT)
    arena = host.buffer_owner
    assert isinstance(arena, PinnedHostArena) and np.shares_memory(host.array, arena.view)
    _fill_device(dev, np.random.default_rng(2))
    for i in range(5):
        h = eng.backup(np.arange(i, i + 4), np.arange(i, i + 4))
        h.wait()
        assert arena.array.unsafe_buffer_pointer() == arena.address
    eng.precompile(max_pages=8)
    # the compiled D2H copies pages, never the arena as a whole (that would overwrite pages
    # other threads write meanwhile, e.g. L3 reads)
    shape = ",".join(map(str, arena.shape))
    for key, exe in eng._stream_exes.items():
        whole = [l for l in exe.as_text().splitlines() if re.search(r"copy\(", l) and f"[{shape}]" in l]
        assert whole == [], (key, whole[:2])


def test_numpy_writes_to_other_pages_survive_concurrent_stream_copies():
    """An L3 reader writes host pages through the numpy view while backups and loads stream
    other pages: neither side loses the other's bytes."""
    geom = GEOMS["mha-bf16-p16"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST)
    data = _fill_device(dev, np.random.default_rng(3))
    rng = np.random.default_rng(4)
    mine = {c: _random_bits(geom, (8, 16, geom.num_layers) + geom.page_shape[1:], rng) for c in geom.components}
    stop = threading.Event()
    rounds = [0]

    def writer():
        while not stop.is_set():
            for c in geom.components:
                host.component_view(c)[8:16] = mine[c]
            rounds[0] += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for i in range(30):
            src = np.arange(i % 8, i % 8 + 8) % DEVICE_PAGES
            eng.backup(src, np.arange(8)).wait()
            eng.load(np.arange(8), np.arange(16, 24)).wait()
    finally:
        stop.set()
        t.join()
    assert rounds[0] > 0
    for c in geom.components:
        np.testing.assert_array_equal(host.component_view(c)[8:16], mine[c])
        np.testing.assert_array_equal(_host_pages(host, c, np.arange(8)), data[c][:, src])
        np.testing.assert_array_equal(dev.read_pages_host(c, np.arange(16, 24)), data[c][:, src])


def test_copies_issued_back_to_back_keep_their_order():
    """No waits between dispatches: backup to host page X then load X gives the new bytes;
    load X then a backup overwriting X gives the old ones (donation orders after reads)."""
    geom = GEOMS["mha-bf16-p16"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST_DIRECT, groups=1)
    data = _fill_device(dev, np.random.default_rng(5))
    h1 = eng.backup([1, 2], [0, 1])
    l1 = eng.load([0, 1], [10, 11])  # must see pages 1, 2
    h2 = eng.backup([3, 4], [0, 1])  # overwrites host 0, 1 after l1 read them
    l2 = eng.load([0, 1], [12, 13])  # must see pages 3, 4
    h3 = eng.backup([5], [2])
    for h in (h1, l1, h2, l2, h3):
        h.wait()
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, [10, 11]), data[c][:, [1, 2]])
        np.testing.assert_array_equal(dev.read_pages_host(c, [12, 13]), data[c][:, [3, 4]])
        np.testing.assert_array_equal(_host_pages(host, c, [0, 1, 2]), data[c][:, [3, 4, 5]])


def test_load_lands_group_by_group_and_layer_arrays_are_the_pools():
    geom = KVGeometry.mha(4, 8, 2, 16, "bfloat16")
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST_DIRECT, groups=3)
    assert eng.load_groups == [(0, 3), (3, 1)]
    data = _fill_device(dev, np.random.default_rng(6))
    eng.backup([1, 2, 3], [4, 5, 6]).wait()
    h = eng.load([4, 5, 6], [20, 21, 22])
    for layer in range(geom.num_layers):
        h.wait_layer(layer)
        assert h.layer_done(layer)
        for c in geom.components:
            arr = dev.buffers[c][layer]
            assert arr.is_ready()
            np.testing.assert_array_equal(
                np.asarray(arr[np.array([20, 21, 22])]).view(geom.container_dtype), data[c][layer, [1, 2, 3]]
            )
    assert h.done()


def test_a_load_handle_waits_on_the_installed_layers_not_on_the_staging_buffer():
    """Each layer's readiness is the readiness of the arrays the load installed in the pool for
    that layer: a handle that held the group's staging buffer (or the donated layer it replaced)
    would say a layer landed once the host -> staging copy had, before the scatter into the
    layer, and would keep the staging buffer alive."""
    geom = KVGeometry.mha(4, 8, 2, 16, "bfloat16")
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST_DIRECT, groups=3)
    assert eng.host_copy == "xla_stream"
    _fill_device(dev, np.random.default_rng(8))
    eng.backup([1, 2, 3], [4, 5, 6]).wait()
    h = eng.load([4, 5, 6], [20, 21, 22])
    for layer in range(geom.num_layers):
        held = h._per_layer[layer]  # what layer_done / wait_layer poll
        assert len(held) == len(geom.components)
        assert all(a is dev.buffers[c][layer] for a, c in zip(held, geom.components)), layer
    h.wait()


@pytest.mark.parametrize("loop", ["dynamic", "static"])
def test_the_d2h_token_is_the_count_of_the_copies(loop):
    """A stream backup's token (what its handle polls) is the copy loop's count, so it depends on
    every copy: ``n`` pages with a dynamic loop, the bucket's ``nb`` with a static one (padding
    repeats the last page). A token that did not count the copies would not depend on them."""
    geom = GEOMS["mha-fp32-p1"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST, stream_loop=loop)
    data = _fill_device(dev, np.random.default_rng(9))
    h = eng.backup([1, 2, 3], [4, 5, 6])
    token = h._token  # (the handle drops it once done)
    h.wait()
    assert int(token) == (3 if loop == "dynamic" else eng.copier.bucket_for(3))
    for c in geom.components:
        np.testing.assert_array_equal(_host_pages(host, c, [4, 5, 6]), data[c][:, [1, 2, 3]])


def test_precompile_covers_every_stream_shape():
    geom = GEOMS["mha-bf16-p16"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST, groups=2)
    eng.precompile()
    built, copier_built = eng.stream_executables, eng.copier.compile_count
    assert built == len(eng.copier.buckets) * (1 + len(eng.load_groups))
    _fill_device(dev, np.random.default_rng(7))
    for n in (1, 3, 7, 13, HOST_PAGES):
        eng.backup(np.arange(n), np.arange(n)).wait()
        eng.load(np.arange(n), np.arange(DEVICE_PAGES - n, DEVICE_PAGES)).wait()
    assert (eng.stream_executables, eng.copier.compile_count) == (built, copier_built)


def test_a_second_engine_of_the_same_shapes_compiles_nothing_and_copies_its_own_arena():
    """Stream executables are shared process-wide (their arena is an argument): a second
    engine's precompile lowers and compiles nothing (JAX's compile events counted), and its
    copies still land in its own arena, not the first engine's."""
    from jax import monitoring

    geom = GEOMS["mha-bf16-p16"]
    dev1, host1, eng1 = _engine(geom, HostLayout.PAGE_FIRST, groups=2)
    eng1.precompile()
    compiles = []
    listener = lambda event, *a, **k: compiles.append(event) if "compile" in event else None  # noqa: E731
    dev2, host2, eng2 = _engine(geom, HostLayout.PAGE_FIRST, groups=2)  # (its arena's zeros compile)
    monitoring.register_event_duration_secs_listener(listener)
    try:
        eng2.precompile()
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert eng2.stream_executables == eng1.stream_executables > 0
    assert [e for e in compiles if "backend_compile" in e] == [], compiles
    rng = np.random.default_rng(11)
    before = _poison_host(host1, rng)
    _check_round_trip(geom, HostLayout.PAGE_FIRST, dev2, host2, eng2, rng)  # byte-exact on engine 2
    np.testing.assert_array_equal(host1.array, before)  # engine 1's arena untouched


def test_an_arena_moved_by_xla_fails_the_backup_instead_of_serving_a_stale_view():
    """An external reference to the arena array (np.asarray of it) stops XLA from updating it
    in place; the backup must fail rather than leave the numpy view (the pool) behind."""
    geom = GEOMS["mha-fp32-p1"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST)
    _fill_device(dev, np.random.default_rng(8))
    external = np.asarray(host.buffer_owner.array)  # noqa: F841 - held on purpose
    h = eng.backup([1], [2])
    with pytest.raises(TransferError, match="arena"):
        h.wait()


def test_bad_configuration_is_refused_with_what_is_needed():
    geom = GEOMS["mha-bf16-p16"]
    dev = JaxDevicePool(geom, DEVICE_PAGES)
    with pytest.raises(ValueError, match="host_copy"):
        JaxTransferEngine(dev, HostKVPool(geom, 4), host_copy="dma")
    with pytest.raises(ValueError, match="pinned host memory"):
        JaxTransferEngine(dev, HostKVPool(geom, 4), host_copy="xla_stream")
    assert JaxTransferEngine(dev, HostKVPool(geom, 4)).host_copy == "numpy"
    host = _pinned_or_skip(geom, HostLayout.PAGE_FIRST)
    with pytest.raises(ValueError, match="use_host_memory_kind"):
        JaxTransferEngine(dev, host, host_copy="xla_stream", use_host_memory_kind=False)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="group_layers"):
            JaxTransferEngine(dev, host, load_group_layers=bad)
    if len(jax.devices()) >= 2:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
        sharded = JaxDevicePool(geom, DEVICE_PAGES, mesh=mesh)
        with pytest.raises(ValueError, match="one device"):
            JaxTransferEngine(sharded, host, host_copy="xla_stream")
        assert JaxTransferEngine(sharded, host).host_copy == "numpy"


def test_layer_groups():
    assert layer_groups(5, 2) == [(0, 2), (2, 2), (4, 1)]
    assert layer_groups(3, 8) == [(0, 3)]
    # 32 KiB per layer-page (page 16, 8 heads x 128, bf16): 8 layers make a 256 KiB run
    assert default_group_layers(KVGeometry.mha(32, 16, 8, 128, "bfloat16")) == 8
    assert default_group_layers(KVGeometry.mha(4, 16, 8, 128, "bfloat16")) == 4
    assert default_group_layers(KVGeometry.mha(32, 64, 8, 128, "bfloat16")) == 2


def test_a_runtime_that_cannot_stream_falls_back_to_numpy(monkeypatch, caplog):
    """Where XLA cannot compile or run the stream copies (an untested GPU runtime), ``auto``
    falls back to the numpy path with a warning, and still moves the right bytes; an explicit
    ``xla_stream`` is refused with the reason."""
    from hicache_jax.backends.jax import host_stream

    def broken_h2d(self, nb, l0, layers):
        def f(arena, ids, n, staging):
            raise RuntimeError("host memory space not supported by this compiler")

        return f

    monkeypatch.setattr(host_stream.StreamPlan, "h2d", broken_h2d)
    geom = GEOMS["mha-bf16-p16"]
    with caplog.at_level("WARNING"):
        dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST)
    assert eng.host_copy == "numpy" and "not supported by this compiler" in caplog.text
    data = _fill_device(dev, np.random.default_rng(9))
    eng.backup([1, 2], [3, 4]).wait()
    eng.load([3, 4], [10, 11]).wait()
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, [10, 11]), data[c][:, [1, 2]])
    with pytest.raises(ValueError, match="not supported by this compiler"):
        _engine(geom, HostLayout.PAGE_FIRST, host_copy="xla_stream")


def test_the_probe_sees_a_stream_copy_that_carries_the_wrong_bytes(monkeypatch):
    from hicache_jax.backends.jax import host_stream

    original = host_stream.StreamPlan.d2h

    def zeroing_d2h(self):
        f = original(self)
        return lambda arena, bufs, ids, n: f(arena, tuple(b * 0 for b in bufs), ids, n)

    monkeypatch.setattr(host_stream.StreamPlan, "d2h", zeroing_d2h)
    with pytest.raises(ValueError, match="does not hold the bytes"):
        _engine(GEOMS["mha-fp32-p1"], HostLayout.PAGE_FIRST_DIRECT, host_copy="xla_stream")


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="no CUDA GPU visible to JAX")
@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("name", ["mha-bf16-p16", "mla-fp8-p16"])
def test_gpu_streams_pinned_pages_byte_exact(name, layout, monkeypatch):
    """On a GPU the stream path must be the one chosen (the probe passed: XLA compiled the host
    streaming and kept the donated arena in place), move the right bytes both ways, and make
    no host-side copy. A failure names the probe's reason."""
    geom = GEOMS[name]
    dev_ = _gpus()[0]
    dev = JaxDevicePool(geom, DEVICE_PAGES, device=dev_)
    host = pinned_host_pool(geom, HOST_PAGES, layout, device=dev_)
    assert host.memory_kind == "pinned_host"
    eng = JaxTransferEngine(
        dev, host, copy_config=PageCopyConfig(max_pages=DEVICE_PAGES), host_copy="xla_stream", load_group_layers=1
    )
    for name_ in ("read_pages", "write_pages", "write_pages_unchecked", "read_layer", "read_layer_unchecked"):
        monkeypatch.setattr(host, name_, lambda *a, _n=name_, **k: pytest.fail(f"host-side copy through {_n}"))
    rng = np.random.default_rng(10)
    data = _fill_device(dev, rng)
    src, hst, dst = np.array([4, 19, 0, 7, 11]), np.array([15, 0, 3, 8, 9]), np.array([20, 21, 1, 2, 23])
    eng.backup(src, hst).wait()
    for c in geom.components:
        np.testing.assert_array_equal(_host_pages(host, c, hst), data[c][:, src])
    eng.load(hst, dst).wait()
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, dst), data[c][:, src])
        rest = np.setdiff1d(np.arange(DEVICE_PAGES), dst)
        np.testing.assert_array_equal(dev.read_pages_host(c, rest), data[c][:, rest])


def test_pinned_host_pool_falls_back_to_numpy_where_pinned_arrays_cannot_be_made(monkeypatch, caplog):
    """jax 0.9 lists pinned_host on the CPU but cannot place arrays there: the pool must still
    come up (plain numpy, the numpy copy path) instead of failing the engine's start."""
    from hicache_jax.backends.jax import memory

    class Unplaceable:
        def __init__(self, *a, **k):
            raise RuntimeError("No registered implementation for untyped custom call to annotate_device_placement")

    monkeypatch.setattr(memory, "PinnedHostArena", Unplaceable)
    geom = GEOMS["mha-fp32-p1"]
    with caplog.at_level("WARNING"):
        host = pinned_host_pool(geom, 4, HostLayout.PAGE_FIRST)
    assert host.memory_kind == "numpy" and host.buffer_owner is None and "annotate_device_placement" in caplog.text
    assert JaxTransferEngine(JaxDevicePool(geom, 8), host).host_copy == "numpy"


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("loop,unroll", [("static", 1), ("static", 4)])
def test_static_page_loops_pad_harmlessly(layout, loop, unroll):
    """A static loop copies the whole bucket (5 pages -> 8): the padding must neither reach a
    device page nor change any host page but the named ones."""
    geom = GEOMS["mha-bf16-p16"]
    rng = np.random.default_rng(11)
    dev, host, eng = _engine(geom, layout, groups=2, stream_loop=loop, stream_unroll=unroll)
    assert eng.copier.bucket_for(5) == 8
    _check_round_trip(geom, layout, dev, host, eng, rng)


def test_stream_loop_options_are_validated():
    geom = GEOMS["mha-bf16-p16"]
    dev = JaxDevicePool(geom, DEVICE_PAGES)
    host = _pinned_or_skip(geom, HostLayout.PAGE_FIRST)
    with pytest.raises(ValueError, match="stream_loop"):
        JaxTransferEngine(dev, host, stream_loop="unrolled")
    with pytest.raises(ValueError, match="stream_unroll"):
        JaxTransferEngine(dev, host, stream_loop="static", stream_unroll=0)
    with pytest.raises(ValueError, match="stream_unroll"):
        JaxTransferEngine(dev, host, stream_unroll=4)  # a dynamic bound cannot be unrolled
    with pytest.raises(ValueError, match="stream_loop"):
        JaxTransferEngine(dev, HostKVPool(geom, 4), stream_loop="x")  # checked on the numpy path too


def test_stream_loop_defaults_by_platform():
    """GPUs get the static loop unrolled 8 times (measured ~2x the dynamic loop on an H200), the
    CPU the dynamic one; an explicit choice wins, and the engine says which loop it runs."""
    from hicache_jax.backends.jax.host_stream import default_stream_loop

    assert default_stream_loop("gpu") == default_stream_loop("cuda") == ("static", 8)
    assert default_stream_loop("cpu") == default_stream_loop("tpu") == ("dynamic", 1)
    geom = KVGeometry.mha(2, 4, 2, 8, "bfloat16")
    dev = JaxDevicePool(geom, 8)
    eng = JaxTransferEngine(dev, pinned_host_pool(geom, 4, "page_first"))
    assert (eng.stream_loop, eng.stream_unroll) == default_stream_loop(dev.local_device.platform) == ("dynamic", 1)
    eng.close()
    eng = JaxTransferEngine(dev, pinned_host_pool(geom, 4, "page_first"), stream_loop="static")
    assert (eng.stream_loop, eng.stream_unroll) == ("static", 1)
    eng.close()


@pytest.mark.skipif(not hasattr(getattr(jax, "memory", None), "Space"), reason="jax < 0.7: no jax.memory.Space")
def test_the_stream_moves_between_memory_spaces_named_by_the_public_api():
    """On a jax that has ``jax.memory.Space`` the copies inside ``jit`` name it, not the private
    ``TransferToMemoryKind`` an older jax needed (which a later jax may drop without notice)."""
    from hicache_jax.backends.jax import host_stream

    assert host_stream._space("device") is jax.memory.Space.Device
    assert host_stream._space("host") is jax.memory.Space.Host
