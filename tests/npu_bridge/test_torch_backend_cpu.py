"""Tier 1 (CPU): the torch backend on device='cpu', checked against the numpy reference backend.

Bit-exact round trips through every host layout (plus the Ascend MLA layout) for MHA and
MLA and every KV dtype, with the torch indexed copy and with the Ascend op's CPU reference.
"""

import threading

import numpy as np
import pytest
import torch

from hicache_jax import HostKVPool, HostLayout, KVGeometry, TransferError
from hicache_jax.backends.numpy_backend import make_numpy_backend
from npu_bridge import make_torch_backend
from npu_bridge.device_pool import TorchDevicePool
from npu_bridge.host_memory import torch_host_pool
from npu_bridge.parts import Part
from npu_bridge import transfer as npu_transfer
from npu_bridge.transfer import TorchTransferEngine, _runs

GEOMS = {
    "mha-bf16-p4": KVGeometry.mha(3, 4, 2, 8, "bfloat16"),
    "mha-fp16-p1": KVGeometry.mha(2, 1, 1, 4, "float16"),
    "mha-fp32-p3": KVGeometry.mha(2, 3, 2, 2, "float32"),
    "mla-fp8-p2": KVGeometry.mla(3, 2, 12, 4, "float8_e4m3fn"),
    "mla-bf16-norope": KVGeometry.mla(2, 4, 8, 0, "bfloat16"),
    "mha-fp8-p2": KVGeometry.mha(2, 2, 1, 8, "float8_e4m3fn"),
}
LAYOUTS = [l.value for l in HostLayout] + ["page_first_kv_split"]
ASCEND = {"mha": "page_first_direct", "mla": "page_first_kv_split"}


def cases():
    for gname, g in GEOMS.items():
        for layout in LAYOUTS:
            if layout == "page_first_kv_split" and g.kind != "mla":
                continue
            for impl in ("torch", "reference"):
                if impl == "reference" and layout != ASCEND[g.kind]:
                    continue
                yield pytest.param(g, layout, impl, id=f"{gname}-{layout}-{impl}")


def random_bits(g, shape, rng):
    # every bit pattern, NaNs and negative zeros included: copies must not look at values
    info = np.iinfo(g.container_dtype)
    return rng.integers(0, int(info.max) + 1, shape, dtype=np.uint64).astype(g.container_dtype)


def fill_both(g, dev_t, dev_n, rng):
    for c in g.components:
        data = random_bits(g, (g.num_layers, dev_t.num_pages) + g.page_shape, rng)
        dev_t.write(c, np.arange(dev_t.num_pages), data)
        dev_n.buffers[c][:] = data


@pytest.mark.parametrize("copy_mode", ["runs", "index"])
@pytest.mark.parametrize("deferred", [False, True], ids=["async", "deferred"])
@pytest.mark.parametrize("g, layout, impl", list(cases()))
def test_roundtrip_bit_exact_matches_numpy_oracle(g, layout, impl, deferred, copy_mode, monkeypatch):
    # both CPU copy strategies: one copy_ per run of consecutive pages, or torch index kernels
    monkeypatch.setattr(npu_transfer, "RUN_COPY_MIN_BYTES", 0 if copy_mode == "runs" else 1 << 60)
    rng = np.random.default_rng(7)
    dev, host, eng = make_torch_backend(g, 10, 8, layout, impl=impl, deferred=deferred)
    assert eng.impl == impl
    # the oracle: numpy backend; kv_split has the same nlp transfer order as page_first_direct
    ndev, nhost, neng = make_numpy_backend(g, 10, 8, "page_first_direct" if layout == "page_first_kv_split" else layout)
    fill_both(g, dev, ndev, rng)
    src, hst, dst = [7, 0, 1, 3], [5, 6, 7, 1], [9, 5, 6, 4]  # (0, 1) -> (6, 7) -> (5, 6) are runs
    hb = eng.backup(src, hst)
    neng.backup(src, hst)
    eng.complete_all()
    hb.wait(timeout=30)
    assert hb.done()
    for c in g.components:
        np.testing.assert_array_equal(host.read_pages(c, np.arange(8)), nhost.read_pages(c, np.arange(8)))
    if layout != "page_first_kv_split":  # same bytes in the same upstream layout
        np.testing.assert_array_equal(host.array, nhost.array)
    lh = eng.load(hst, dst)
    neng.load(hst, dst)
    eng.complete_all()
    for layer in range(g.num_layers):
        lh.wait_layer(layer, timeout=30)
        assert lh.layer_done(layer)
    for c in g.components:
        np.testing.assert_array_equal(dev.read(c, np.arange(10)), ndev.read(c, np.arange(10)))
        np.testing.assert_array_equal(dev.read(c, dst), dev.read(c, src))
    eng.close()


def test_runs_coalesce_consecutive_pairs_only():
    d, h = np.array([4, 5, 6, 9, 10, 2]), np.array([0, 1, 2, 3, 7, 8])
    assert _runs(d, h) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert _runs(np.array([3]), np.array([0])) == [(3, 0, 1)]


@pytest.mark.parametrize(
    "dtype, tdtype",
    [
        ("bfloat16", torch.bfloat16),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("float16", torch.float16),
        ("float32", torch.float32),
    ],
)
def test_logical_dtype_values_survive(dtype, tdtype):
    """The model sees the logical dtype; special values come back bit for bit."""
    g = KVGeometry.mha(2, 2, 1, 4, dtype)
    dev, host, eng = make_torch_backend(g, 4, 4, "page_first")
    assert dev.buffers["k"].dtype == tdtype and dev.layer("k", 1)[0].shape == (4, 2, 1, 4)
    special = torch.tensor([0.0, -0.0, float("nan"), 1.5, -2.0, 0.125, 3.0, -0.5], dtype=torch.float32)
    dev.buffers["k"][:, 1] = special.to(tdtype).reshape(2, 1, 4)
    before = dev.buffers["k"][:, 1].clone()
    eng.backup([1], [3]).wait()
    eng.load([3], [2]).wait()
    after = dev.buffers["k"][:, 2]
    assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))
    assert torch.signbit(after.float()).tolist() == torch.signbit(before.float()).tolist()
    eng.close()


def test_backup_returns_without_waiting_for_the_copy():
    g = KVGeometry.mha(2, 2, 1, 4, "float32")
    dev, host, eng = make_torch_backend(g, 4, 4, "page_first")
    dev.write("k", [1], np.full((2, 1, 2, 1, 4), 9, np.uint32))
    gate = threading.Event()
    eng._d2h.submit(gate.wait)  # occupy the D2H "stream" (worker) with earlier work
    h = eng.backup([1], [2])  # must not block behind it
    assert not h.done() and not host.read_pages("k", [2]).any()
    gate.set()
    h.wait(timeout=30)
    assert (host.read_pages("k", [2]) == 9).all()
    eng.close()


def test_load_layers_become_ready_in_order_and_stream_wait_blocks_on_cpu():
    g = KVGeometry.mha(4, 2, 1, 4, "float32")
    dev, host, eng = make_torch_backend(g, 4, 4, "layer_first")
    host.write_pages("v", [3], np.arange(4 * 2 * 4, dtype=np.uint32).reshape(4, 1, 2, 1, 4) + 1)
    gate = threading.Event()
    eng._h2d.submit(gate.wait)
    lh = eng.load([3], [0])
    assert not any(lh.layer_done(l) for l in range(4))
    with pytest.raises(TimeoutError):
        lh.wait_layer(0, timeout=0.05)
    gate.set()
    lh.stream_wait_layer(3)  # CPU: no stream to order, so it blocks until the layer landed
    assert lh.layer_done(3)
    lh.wait()
    np.testing.assert_array_equal(dev.read("v", [0]), host.read_pages("v", [3]))  # lnp == (L, n, page, H, D)
    eng.close()


def test_deferred_copies_nothing_until_complete():
    g = KVGeometry.mla(2, 2, 4, 2, "bfloat16")
    dev, host, eng = make_torch_backend(g, 4, 4, "page_first_kv_split", deferred=True)
    dev.write("kv", [0], np.full((2, 1, 2, 1, 6), 5, np.uint16))
    h = eng.backup([0], [1])
    assert not h.done() and eng.pending == [h] and not host.read_pages("kv", [1]).any()
    dev.write("kv", [0], np.full((2, 1, 2, 1, 6), 6, np.uint16))  # a manager bug: page reused early
    eng.complete(h)
    assert h.done() and eng.pending == []
    assert (host.read_pages("kv", [1]) == 6).all()  # the late bytes show the bug, as in the numpy oracle
    lh = eng.load([1], [3])
    lh.wait_layer(0)  # waiting forces completion, like a stream sync
    assert lh.done() and (dev.read("kv", [3]) == 6).all()


def test_transfer_failure_surfaces_as_transfer_error():
    g = KVGeometry.mha(2, 2, 1, 4, "float32")
    dev, host, eng = make_torch_backend(g, 4, 4, "page_first")
    # break the copy (a host part of the wrong shape) to see how a failing copy is reported
    eng._pairs["k"] = [(eng._pairs["k"][0][0], Part("bad", torch.zeros(1, dtype=torch.int32), 0, 4))]
    with pytest.raises(TransferError):
        eng.backup([0], [0]).wait(timeout=30)
    lh = eng.load([0], [1])
    with pytest.raises(TransferError):
        lh.wait(timeout=30)
    eng.close()


def test_validation_before_launch():
    g = KVGeometry.mha(2, 2, 1, 4, "float32")
    dev, host, eng = make_torch_backend(g, 4, 4, "page_first", deferred=True)
    with pytest.raises(ValueError, match="equal lengths"):
        eng.backup([0, 1], [0])
    with pytest.raises(ValueError, match="device_ids"):
        eng.backup([4], [0])
    with pytest.raises(ValueError, match="duplicate"):
        eng.load([0, 0], [1, 2])
    with pytest.raises(TypeError):
        eng.load([0.5], [1])
    assert eng.pending == []
    assert eng.backup([], []).done() and eng.load([], []).done()


def test_construction_errors():
    mha, mla = GEOMS["mha-bf16-p4"], GEOMS["mla-fp8-p2"]
    with pytest.raises(ValueError, match="MLA"):
        make_torch_backend(mha, 4, 4, "page_first_kv_split")
    with pytest.raises(ValueError, match="layout"):
        make_torch_backend(mha, 4, 4, "row_major")
    with pytest.raises(ValueError, match="page_first_direct"):
        make_torch_backend(mha, 4, 4, "page_first", impl="reference")
    with pytest.raises(ValueError, match="page_first_kv_split"):
        make_torch_backend(mla, 4, 4, "page_first_direct", impl="reference")
    with pytest.raises(ValueError, match="impl"):
        make_torch_backend(mha, 4, 4, "page_first", impl="fast")
    dev = TorchDevicePool(mha, 4)
    with pytest.raises(TypeError, match="torch_host_pool"):
        TorchTransferEngine(dev, HostKVPool(mha, 4))
    with pytest.raises(ValueError, match="split"):  # split device pool with a joined host layout
        TorchTransferEngine(TorchDevicePool(mla, 4, split_mla=True), torch_host_pool(mla, 4, "page_first_direct"))
    with pytest.raises(ValueError, match="geometry"):
        TorchTransferEngine(dev, torch_host_pool(mla, 4, "page_first"))
    with pytest.raises(ValueError, match="split_mla"):
        TorchDevicePool(mha, 4, split_mla=True)


def test_auto_on_cpu_uses_torch_copies_and_no_pinning():
    g = GEOMS["mha-bf16-p4"]
    dev, host, eng = make_torch_backend(g, 4, 4, "page_first_direct")
    assert eng.impl == "torch" and "cpu" in eng.impl_reason
    assert host.pinned is False and not host.torch_parts["k"][0].tensor.is_pinned()
    # the numpy pool and the torch parts share bytes
    assert np.shares_memory(host.array, host.torch_parts["k"][0].tensor.numpy())


def test_interface_mirrors_numpy_backend():
    g = GEOMS["mla-fp8-p2"]
    for layout in ("page_first", "page_first_kv_split"):
        dev, host, eng = make_torch_backend(g, 6, 5, layout)
        ndev, nhost, neng = make_numpy_backend(g, 6, 5, "page_first")
        assert dev.num_pages == ndev.num_pages == dev.allocator.num_pages
        assert host.num_pages == nhost.num_pages and host.allocator.num_pages == 5
        assert eng.device_num_pages == neng.device_num_pages and eng.host_pool is host
        assert host.layout.value == layout and host.layout.transfer_order in ("npl", "nlp")
        assert dev.read("kv", [1, 1]).shape == ndev.read("kv", [1, 1]).shape
        assert dev.read("kv", [1]).dtype == ndev.read("kv", [1]).dtype == g.container_dtype
        with pytest.raises(ValueError, match="shape"):
            dev.write("kv", [1], np.zeros((1, 1, 2, 1, 16), np.uint8))
        with pytest.raises(ValueError, match="component"):
            dev.read("k", [1])


def test_kv_split_pool_matches_page_first_direct_semantics():
    """KVSplitHostPool speaks the joined width in nlp order, like page_first_direct, and splits it."""
    from npu_bridge.kv_split_pool import KVSplitHostPool

    g = KVGeometry.mla(2, 3, 5, 2, "float16")
    split, direct = KVSplitHostPool(g, 6), HostKVPool(g, 6, "page_first_direct")
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 2**16, (2, 2, 3, 1, 7), dtype=np.uint64).astype(np.uint16)
    split.write_pages("kv", [4, 1], buf)
    direct.write_pages("kv", [4, 1], buf)
    np.testing.assert_array_equal(split.read_pages("kv", np.arange(6)), direct.read_pages("kv", np.arange(6)))
    for layer in range(2):
        np.testing.assert_array_equal(split.read_layer("kv", [1, 4], layer), direct.read_layer("kv", [1, 4], layer))
    np.testing.assert_array_equal(split.arrays["k"][4], buf[0, ..., :5])
    np.testing.assert_array_equal(split.arrays["v"][1], buf[1, ..., 5:])
    assert split.nbytes == direct.nbytes and split.layout.transfer_order == "nlp"
    with pytest.raises(ValueError, match="duplicate"):
        split.write_pages("kv", [2, 2], buf)
    with pytest.raises(ValueError, match="shape"):
        split.write_pages("kv", [2], buf)
    with pytest.raises(NotImplementedError):
        split.component_view("kv")
