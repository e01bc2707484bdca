"""FusedKVTransfer: eSurge-style fused per-layer KV pages <-> a HostKVPool, byte for byte.

Needs JAX only (no EasyDeL): the arrays here stand in for eSurge's ``kv_pages``."""

import concurrent.futures as cf

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from hicache_jax import HostLayout  # noqa: E402
from hicache_jax.host_pool import HostKVPool  # noqa: E402
from hicache_jax.integrations.easydel.fused_transfer import FusedKVTransfer, fused_geometry  # noqa: E402

SHAPE = (12, 4, 2, 2, 8)  # (num_pages, page_size, kv_groups, packing, head_dim)


def _arrays(seed=0, layers=3):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(SHAPE, np.float32), jnp.bfloat16) for _ in range(layers)]


class DeferredWorker:
    """A SerialWorker stand-in whose jobs run when ``run_all`` is called."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn):
        fut = cf.Future()
        self.jobs.append((fn, fut))
        return fut

    def run_all(self):
        for fn, fut in self.jobs:
            fut.set_result(fn())
        self.jobs.clear()

    def shutdown(self):
        self.run_all()


class Holder:
    def __init__(self, arrays):
        self.arrays = arrays

    def get(self):
        return self.arrays

    def set(self, arrays):
        self.arrays = list(arrays)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_backup_then_load_moves_exact_bytes(layout):
    src = Holder(_arrays(0))
    geom = fused_geometry(src.arrays)
    assert (geom.num_layers, geom.page_size, geom.width) == (3, 4, 32)
    pool = HostKVPool(geom, 6, layout)
    t = FusedKVTransfer(src.get, src.set, pool, num_slots=8)
    want = [np.asarray(a).copy() for a in src.arrays]
    t.map_slots(np.array([0, 1, 2]), [5, 9, 3])
    deferred = DeferredWorker()
    t._d2h.shutdown()
    t._d2h = deferred  # the host copy runs only when the test says so
    h = t.backup([0, 1, 2], [4, 0, 2])
    # The engine overwrites page 5 after the backup was issued and before its host copy ran:
    # the backup keeps the bytes of issue time.
    src.set([a.at[5].set(0) for a in src.arrays])
    assert not h.done()
    deferred.run_all()
    h.wait()
    dst = Holder([jnp.ones(SHAPE, jnp.bfloat16) for _ in range(3)])  # 3 pages: padded to 4, the pad dropped
    t2 = FusedKVTransfer(dst.get, dst.set, pool, num_slots=8)
    t2.load_pages([4, 0, 2], [1, 2, 11])
    for layer in range(3):
        got = np.asarray(dst.arrays[layer])
        for s, d in ((5, 1), (9, 2), (3, 11)):
            assert np.array_equal(got[d].view(np.uint16), want[layer][s].view(np.uint16)), (layer, s, d)
        untouched = [i for i in range(SHAPE[0]) if i not in (1, 2, 11)]
        assert (np.asarray(got[untouched], np.float32) == 1).all()
    t.close()
    t2.close()


def test_bad_input_is_refused_without_state_change():
    src = Holder(_arrays(1))
    pool = HostKVPool(fused_geometry(src.arrays), 4)
    t = FusedKVTransfer(src.get, src.set, pool, num_slots=4)
    with pytest.raises(ValueError, match="not mapped"):
        t.backup([0], [0])
    with pytest.raises(ValueError, match="page_ids"):
        t.map_slots([0], [99])
    with pytest.raises(ValueError, match="equal lengths"):
        t.load_pages([0, 1], [0])
    other = HostKVPool(fused_geometry(_arrays(0, layers=2)), 4)
    with pytest.raises(ValueError, match="geometry"):
        FusedKVTransfer(src.get, src.set, other, num_slots=4)
    with pytest.raises(ValueError, match="arrays"):
        fused_geometry([jnp.zeros((4, 4, 8)), jnp.zeros((4, 4, 4))])
    t.close()
