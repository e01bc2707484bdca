"""Tier 3: real accelerators. ``npu`` needs torch_npu + ``torch.npu.is_available()``; the same
checks run on CUDA under the ``gpu`` marker. Skipped otherwise, with the reason; a skip here
is never a pass (the CPU-only report reads "NPU tier: not run (no hardware)").

Checks: bit-exact parity with the CPU reference path, pinned host memory, per-layer events,
and which transfer implementation was chosen (the Ascend op when sgl_kernel_npu is present).
"""

import importlib
import importlib.util

import numpy as np
import pytest
import torch

from hicache_jax import KVGeometry
from npu_bridge import make_torch_backend


def _unavailable(kind: str) -> str | None:
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return "NPU tier: not run (torch_npu not installed; no Ascend hardware)"
        try:
            importlib.import_module("torch_npu")
        except Exception as e:  # noqa: BLE001 - e.g. CANN libraries missing
            return f"NPU tier: not run (torch_npu does not import: {e!r})"
        if not torch.npu.is_available():
            return "NPU tier: not run (torch.npu.is_available() is False)"
        return None
    if not torch.cuda.is_available():
        return "CUDA tier: not run (torch.cuda.is_available() is False in this torch build)"
    return None


DEVICES = [pytest.param("npu", marks=pytest.mark.npu), pytest.param("cuda", marks=pytest.mark.gpu)]
CASES = [
    ("mha", "page_first_direct"),
    ("mha", "page_first"),
    ("mha", "layer_first"),
    ("mla", "page_first_kv_split"),
    ("mla", "page_first"),
]


@pytest.fixture(params=DEVICES)
def device(request):
    reason = _unavailable(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def _geom(kind):
    if kind == "mha":
        return KVGeometry.mha(4, 128, 2, 64, "bfloat16")  # upstream's NPU page size
    return KVGeometry.mla(4, 128, 64, 16, "bfloat16")


@pytest.mark.parametrize("kind, layout", CASES)
def test_parity_with_cpu_reference(device, kind, layout):
    g = _geom(kind)
    rng = np.random.default_rng(3)
    data = {
        c: rng.integers(0, 2**16, (g.num_layers, 12) + g.page_shape, dtype=np.uint64).astype(np.uint16)
        for c in g.components
    }
    results = []
    for dev_name in ("cpu", device):
        dev, host, eng = make_torch_backend(g, 12, 10, layout, device=dev_name)
        for c in g.components:
            dev.write(c, np.arange(12), data[c])
        eng.backup([11, 3, 0, 7], [9, 2, 5, 0]).wait(timeout=60)
        lh = eng.load([9, 2, 5, 0], [1, 2, 4, 6])
        for layer in range(g.num_layers):
            lh.wait_layer(layer, timeout=60)
            assert lh.layer_done(layer)
        results.append(
            (
                {c: host.read_pages(c, np.arange(10)) for c in g.components},
                {c: dev.read(c, np.arange(12)) for c in g.components},
                eng.impl,
                host,
            )
        )
        eng.close()
    (h_cpu, d_cpu, _, _), (h_acc, d_acc, impl, host) = results
    for c in g.components:
        np.testing.assert_array_equal(h_acc[c], h_cpu[c])
        np.testing.assert_array_equal(d_acc[c], d_cpu[c])
    assert host.pinned and all(p.tensor.is_pinned() for parts in host.torch_parts.values() for p in parts)
    ascend_layout = layout in ("page_first_direct", "page_first_kv_split")
    if device == "npu" and ascend_layout and importlib.util.find_spec("sgl_kernel_npu") is not None:
        assert impl == "ascend"
    print(f"{device} {kind} {layout}: impl={impl}")


def test_stream_wait_layer_orders_compute_after_load(device):
    g = _geom("mha")
    dev, host, eng = make_torch_backend(g, 8, 8, "page_first", device=device)
    host.write_pages("k", [1], np.full((1, 128, 4, 2, 64), 0x3F80, np.uint16))  # bf16 1.0
    lh = eng.load([1], [5])
    lh.stream_wait_layer(2)  # the compute stream waits; the host does not
    total = dev.layer("k", 2)[0][5].float().sum()  # runs on the compute stream after the wait
    assert float(total) == 128 * 2 * 64
    lh.wait()
    eng.close()
