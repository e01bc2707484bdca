import numpy as np
import pytest

from hicache_jax import HostLayout, KVGeometry
from hicache_jax.backends.numpy_backend import make_numpy_backend


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("deferred", [False, True])
def test_backup_then_load_roundtrip(layout, deferred):
    g = KVGeometry.mha(2, 3, 2, 4, "bfloat16")
    dev, host, eng = make_numpy_backend(g, 8, 6, layout, deferred=deferred)
    rng = np.random.default_rng(0)
    for c in g.components:
        dev.buffers[c][:] = rng.integers(1, 2**16, dev.buffers[c].shape, dtype=np.uint16)
    want = {c: dev.read(c, [5, 1]) for c in g.components}
    h = eng.backup([5, 1], [4, 0])
    assert h.done() is (not deferred)
    eng.complete_all()
    lh = eng.load([4, 0], [2, 3])
    lh.wait()
    assert lh.done() and all(lh.layer_done(l) for l in range(g.num_layers))
    for c in g.components:
        np.testing.assert_array_equal(dev.read(c, [2, 3]), want[c])


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
