import numpy as np
import pytest

from hicache_jax import HostLayout, KVGeometry
from hicache_jax.backends.numpy_backend import make_numpy_backend


GEOMS = [
    KVGeometry.mha(2, 3, 2, 4, "bfloat16"),
    KVGeometry.mha(2, 1, 1, 8, "bfloat16"),
    KVGeometry.mla(3, 1, 6, 2, "float32"),
    KVGeometry.mla(1, 2, 4, 0, "bfloat16"),
]


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{g.kind}-L{g.num_layers}-p{g.page_size}")
@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("deferred", [False, True])
def test_backup_then_load_roundtrip(geom, layout, deferred):
    """Bytes land in the host layout's own places (read back through the host pool, per layer),
    only in the named pages, and come back to the named device pages. Covers both copy paths:
    opaque page rows (page size 1, or layer_first / page_first_direct) and the 5-D fallback."""
    g = geom
    dev, host, eng = make_numpy_backend(g, 8, 6, layout, deferred=deferred)
    rng = np.random.default_rng(0)
    dt = g.container_dtype
    for c in g.components:
        dev.buffers[c][:] = rng.integers(1, np.iinfo(dt).max, dev.buffers[c].shape, dtype=dt)
        view = host.component_view(c)
        view[...] = rng.integers(1, np.iinfo(dt).max, view.shape, dtype=dt)  # poison
    host_before = {c: host.component_view(c).copy() for c in g.components}
    want = {c: dev.read(c, [5, 1]) for c in g.components}
    h = eng.backup([5, 1], [4, 0])
    assert h.done() is (not deferred)
    eng.complete_all()
    for c in g.components:
        for layer in range(g.num_layers):
            got = host.read_layer(c, [4, 0], layer).reshape(2, -1)
            np.testing.assert_array_equal(got, want[c][layer].reshape(2, -1))
        others = [1, 2, 3, 5]
        np.testing.assert_array_equal(host.read_pages(c, others), _pool_pages(host, c, host_before[c], others))
    dev_before = {c: dev.buffers[c].copy() for c in g.components}
    lh = eng.load([4, 0], [2, 3])
    lh.wait()
    assert lh.done() and all(lh.layer_done(l) for l in range(g.num_layers))
    for c in g.components:
        np.testing.assert_array_equal(dev.read(c, [2, 3]), want[c])
        untouched = [0, 1, 4, 5, 6, 7]
        np.testing.assert_array_equal(dev.buffers[c][:, untouched], dev_before[c][:, untouched])


def _pool_pages(host, component, saved_view, ids):
    """``host.read_pages(component, ids)`` as it read when the component's view was ``saved_view``."""
    view = host.component_view(component)
    now = view.copy()
    view[...] = saved_view
    try:
        return host.read_pages(component, ids)
    finally:
        view[...] = now


def test_validation_before_launch():
    g = KVGeometry.mla(1, 2, 4, 0, "float32")
    dev, host, eng = make_numpy_backend(g, 4, 4, deferred=True)
    with pytest.raises(ValueError, match="equal lengths"):
        eng.backup([0, 1], [0])
    with pytest.raises(ValueError, match="device_ids"):
        eng.backup([4], [0])
    with pytest.raises(ValueError, match="duplicate"):
        eng.load([0, 0], [1, 2])
    assert eng.pending == []
