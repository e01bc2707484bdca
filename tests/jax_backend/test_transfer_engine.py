"""JAX device pool + transfer engine: D2H backups and H2D loads, byte for byte."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from hicache_jax import HostKVPool, HostLayout, KVGeometry, TransferError
from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine
from hicache_jax.transfer import FutureHandle
from pallas_kernels.page_copy import PageCopyConfig

DEVICE_PAGES, HOST_PAGES = 24, 16

GEOMS = {
    "mha-bf16-p16": KVGeometry.mha(3, 16, 4, 8, "bfloat16"),
    "mha-fp32-p1": KVGeometry.mha(2, 1, 4, 4, "float32"),
    "mha-fp16-p33": KVGeometry.mha(2, 33, 4, 4, "float16"),
    "mla-fp8-p16": KVGeometry.mla(2, 16, 24, 8, "float8_e4m3fn"),
}


def _fill(pool: JaxDevicePool, rng) -> dict[str, np.ndarray]:
    g = pool.geom
    data = {}
    for c in g.components:
        info = np.iinfo(g.container_dtype)
        data[c] = rng.integers(1, info.max, (g.num_layers, pool.num_pages) + g.page_shape, dtype=g.container_dtype)
        pool.write_pages_host(c, np.arange(pool.num_pages), data[c])
    return data


def _engine(geom, layout, impl="tpu", mesh=None):
    dev = JaxDevicePool(geom, DEVICE_PAGES, mesh=mesh)
    host = HostKVPool(geom, HOST_PAGES, layout)
    return dev, host, JaxTransferEngine(dev, host, copy_config=PageCopyConfig(impl=impl, max_pages=DEVICE_PAGES))


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("name", list(GEOMS))
def test_backup_load_roundtrip(name, layout):
    geom = GEOMS[name]
    rng = np.random.default_rng(0)
    dev, host, eng = _engine(geom, layout)
    data = _fill(dev, rng)
    src, hst, dst = np.array([4, 19, 0, 7, 11]), np.array([15, 0, 3, 8, 9]), np.array([20, 21, 1, 2, 23])
    eng.backup(src, hst).wait()
    # the host pool holds exactly those pages, in its layout
    for c in geom.components:
        got = host.read_pages(c, hst)
        want = data[c][:, src]  # (L, n, page, H, D)
        want = {"lnp": want, "nlp": want.transpose(1, 0, 2, 3, 4), "npl": want.transpose(1, 2, 0, 3, 4)}[
            layout.transfer_order
        ]
        np.testing.assert_array_equal(got, want)
    handle = eng.load(hst, dst)
    handle.wait_layer(0)
    assert handle.layer_done(0)
    handle.wait()
    assert handle.done()
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, dst), data[c][:, src])
        others = np.setdiff1d(np.arange(DEVICE_PAGES), dst)
        np.testing.assert_array_equal(dev.read_pages_host(c, others), data[c][:, others])
    eng.close()


@pytest.mark.parametrize("impl", ["xla", "gpu"])
def test_other_copy_impls_roundtrip(impl):
    geom = GEOMS["mha-bf16-p16"]
    rng = np.random.default_rng(1)
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST, impl=impl)
    data = _fill(dev, rng)
    eng.backup([3, 5], [1, 2]).wait()
    eng.load([1, 2], [10, 11]).wait()
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, [10, 11]), data[c][:, [3, 5]])


@pytest.mark.parametrize("tp", [4, 8])
@pytest.mark.parametrize("name", ["mha-bf16-p16", "mla-fp8-p16"])
def test_sharded_pool_same_bytes_as_unsharded(name, tp):
    devices = jax.devices("cpu")
    if len(devices) < tp:
        pytest.skip(f"needs {tp} CPU devices, have {len(devices)}")
    geom = GEOMS[name] if name != "mha-bf16-p16" else KVGeometry.mha(2, 16, 8, 8, "bfloat16")
    mesh = Mesh(np.array(devices[:tp]), ("tp",))
    results = []
    for m in (None, mesh):
        rng = np.random.default_rng(2)
        dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST_DIRECT, mesh=m)
        _fill(dev, rng)
        eng.backup([1, 9, 17], [2, 4, 6]).wait()
        eng.load([2, 4, 6], [3, 5, 7]).wait()
        results.append(
            (host.array.copy(), {c: dev.read_pages_host(c, np.arange(DEVICE_PAGES)) for c in geom.components})
        )
        if m is not None and geom.kind == "mha":
            assert dev.layers("k")[0].sharding.spec[2] == "tp"
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for c in geom.components:
        np.testing.assert_array_equal(results[0][1][c], results[1][1][c])


def test_backup_does_not_block_the_caller():
    """backup() returns before the D2H worker has written the host pages."""
    geom = GEOMS["mha-fp32-p1"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST)
    _fill(dev, np.random.default_rng(3))
    gate = threading.Event()
    eng._d2h.submit(gate.wait)  # occupy the D2H worker
    handle = eng.backup([1, 2], [3, 4])
    assert isinstance(handle, FutureHandle) and not handle.done()
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    gate.set()
    handle.wait(timeout=30)
    assert handle.done()


def test_failed_backup_surfaces_as_transfer_error(monkeypatch):
    geom = GEOMS["mha-fp32-p1"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST)

    def broken(*a, **k):
        raise OSError("simulated host write failure")

    monkeypatch.setattr(host, "write_pages_unchecked", broken)
    handle = eng.backup([1], [2])
    with pytest.raises(TransferError, match="simulated"):
        handle.wait(timeout=30)


def test_bad_ids_rejected_before_launch():
    geom = GEOMS["mha-bf16-p16"]
    dev, host, eng = _engine(geom, HostLayout.PAGE_FIRST)
    layers_before = list(dev.layers("k"))
    with pytest.raises(ValueError, match="equal lengths"):
        eng.backup([1, 2], [3])
    with pytest.raises(ValueError, match="host_ids"):
        eng.backup([1], [HOST_PAGES])
    with pytest.raises(ValueError, match="duplicate"):
        eng.load([1, 2], [5, 5])
    with pytest.raises(TypeError, match="integer"):
        eng.load([1.0], [5])
    assert all(a is b and not a.is_deleted() for a, b in zip(dev.layers("k"), layers_before))


def test_zero_pages_is_a_completed_handle():
    dev, host, eng = _engine(GEOMS["mha-fp32-p1"], HostLayout.PAGE_FIRST)
    assert eng.backup([], []).done() and eng.load([], []).done()


def test_precompile_then_no_new_executables():
    dev, host, eng = _engine(GEOMS["mha-bf16-p16"], HostLayout.PAGE_FIRST)
    built = eng.precompile()
    assert built == 2 * len(eng.copier.buckets)
    before = eng.copier.compile_count
    _fill(dev, np.random.default_rng(4))
    for n in (1, 3, 7, 13, HOST_PAGES):
        eng.backup(np.arange(n), np.arange(n)).wait()
        eng.load(np.arange(n), np.arange(DEVICE_PAGES - n, DEVICE_PAGES)).wait()
    assert eng.copier.compile_count == before


def test_mismatched_geometry_rejected():
    dev = JaxDevicePool(GEOMS["mha-bf16-p16"], 4)
    host = HostKVPool(GEOMS["mha-fp32-p1"], 4)
    with pytest.raises(ValueError, match="geometry"):
        JaxTransferEngine(dev, host)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_pinned_host_pool_roundtrip_and_staging_reuse(layout):
    """Host pool in pinned memory (JAX memory kind) on the numpy path: pinned H2D staging reused
    across loads (the default xla_stream path is tested in test_host_stream.py)."""
    from hicache_jax.backends.jax.memory import pinned_host_pool

    geom = GEOMS["mha-bf16-p16"]
    dev = JaxDevicePool(geom, DEVICE_PAGES)
    host = pinned_host_pool(geom, HOST_PAGES, layout)
    if getattr(host, "memory_kind", None) != "pinned_host":
        pytest.skip("this JAX runtime has no pinned_host memory kind")
    eng = JaxTransferEngine(dev, host, copy_config=PageCopyConfig(max_pages=DEVICE_PAGES), host_copy="numpy")
    assert eng.h2d_staging == "pinned"
    data = _fill(dev, np.random.default_rng(5))
    eng.backup(np.arange(8), np.arange(8)).wait()
    # several loads of the same bucket shape in a row: staging buffers are recycled
    handles = [eng.load(np.arange(i, i + 3), np.arange(10 + 3 * i, 13 + 3 * i)) for i in range(4)]
    for h in handles:
        h.wait()
    for i in range(4):
        for c in geom.components:
            np.testing.assert_array_equal(
                dev.read_pages_host(c, np.arange(10 + 3 * i, 13 + 3 * i)), data[c][:, i : i + 3]
            )


class _FakeArray:
    """Stands in for a layer's pool array: ready only once the test says so."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.ready = log, name, False

    def is_ready(self) -> bool:
        return self.ready

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self):
        self.log.append(self.name)
        self.ready = True
        return self


def test_load_handle_readiness_is_per_layer():
    """``JaxLoadHandle`` reports and waits for each layer on that layer's arrays only (a
    handle that answered for every layer from layer 0's arrays, or waited for all at once,
    would let a forward read layers that have not landed)."""
    from hicache_jax.backends.jax.transfer_engine import JaxLoadHandle

    log = []
    layers = [[_FakeArray(log, f"{c}{l}") for c in "kv"] for l in range(3)]
    h = JaxLoadHandle(layers)
    assert h.num_layers == 3 and not any(h.layer_done(l) for l in range(3)) and not h.done()
    layers[1][0].ready = layers[1][1].ready = True  # layer 1 landed first
    assert [h.layer_done(l) for l in range(3)] == [False, True, False]
    layers[0][0].ready = True  # half of layer 0
    assert not h.layer_done(0)
    h.wait_layer(0)
    assert log == ["k0", "v0"] and [h.layer_done(l) for l in range(3)] == [True, True, False]
    h.wait_layer(2)
    assert log == ["k0", "v0", "k2", "v2"] and h.done()


def test_pinned_staging_that_fails_its_probe_falls_back_to_numpy_staging(monkeypatch, caplog):
    """A runtime whose pinned staging buffers cannot be moved to the device (jax 0.12's CPU client
    refused jit-made ones): the engine warns once, stages in numpy, and moves the right bytes."""
    from hicache_jax.backends.jax import memory
    from hicache_jax.backends.jax.memory import pinned_host_pool, staging_works

    geom = GEOMS["mha-bf16-p16"]
    dev = JaxDevicePool(geom, DEVICE_PAGES)
    host = pinned_host_pool(geom, HOST_PAGES, HostLayout.PAGE_FIRST)
    if getattr(host, "memory_kind", None) != "pinned_host":
        pytest.skip("this JAX runtime has no pinned_host memory kind")
    assert staging_works(dev.local_device) == ""

    def refused(*a, **k):
        raise RuntimeError("UNIMPLEMENTED: Unsupported layout used for PjRt CPU buffers")

    monkeypatch.setattr(memory, "host_buffer", refused)
    assert "Unsupported layout" in staging_works(dev.local_device)
    with caplog.at_level("WARNING"):
        eng = JaxTransferEngine(dev, host, copy_config=PageCopyConfig(max_pages=DEVICE_PAGES), host_copy="numpy")
    assert eng.h2d_staging == "numpy" and caplog.text.count("Unsupported layout") == 1
    data = _fill(dev, np.random.default_rng(6))
    eng.backup(np.arange(4), np.arange(4)).wait()
    eng.load(np.arange(4), np.arange(20, 24)).wait()
    for c in geom.components:
        np.testing.assert_array_equal(dev.read_pages_host(c, np.arange(20, 24)), data[c][:, :4])


def test_staging_probe_sees_a_device_copy_that_aliases_its_buffer(monkeypatch):
    """If the device array a staging buffer was moved into shared its memory, the ring would
    overwrite a load still in flight: the probe must say so."""
    import jax

    from hicache_jax.backends.jax import memory

    dev = jax.devices()[0]
    if memory.host_memory_kind(dev) != "pinned_host":
        pytest.skip("this JAX runtime has no pinned_host memory kind")

    class Aliasing:  # what an aliasing device_put would give back: the staging bytes themselves
        def __init__(self, view):
            self.view = view

        def block_until_ready(self):
            return self

        def __array__(self, dtype=None, copy=None):
            return self.view.copy() if copy else self.view

    made = []
    real_buffer, real_put = memory.host_buffer, jax.device_put
    monkeypatch.setattr(memory, "host_buffer", lambda *a, **k: made.append(real_buffer(*a, **k)) or made[-1])
    # allocations (to pinned host) stay real; the move to the device hands back the staging bytes
    monkeypatch.setattr(
        memory.jax,
        "device_put",
        lambda x, s: real_put(x, s) if s.memory_kind == "pinned_host" else Aliasing(made[-1][0]),
    )
    assert "aliases" in memory.staging_works(dev)
