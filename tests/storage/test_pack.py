"""``PageCodec.pack`` (host pages -> page bytes, the write path of every backend) against an
independent oracle built from ``HostKVPool.read_pages``: every layout and dtype, random and
repeated ids, pages around the packed ones poisoned; bad arguments raise before anything is
written."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax import HostKVPool, KVGeometry
from hicache_jax.storage import PageCodec

GEOMS = {
    "mha_bf16": KVGeometry.mha(3, 4, 2, 16, "bfloat16"),
    "mha_fp8": KVGeometry.mha(2, 4, 2, 32, "float8_e4m3fn"),
    "mla_bf16": KVGeometry.mla(2, 4, 32, 16, "bfloat16"),
}
LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def _pool(geom, layout, pages=12, seed=0) -> HostKVPool:
    pool = HostKVPool(geom, pages, layout)
    raw = pool.array.view(np.uint8)
    raw[...] = np.random.default_rng(seed).integers(0, 256, raw.shape, dtype=np.uint8)
    return pool


def _oracle(pool: HostKVPool, ids) -> np.ndarray:
    """Page bytes: per page, each component's slab in page-first order, concatenated."""
    parts = []
    for c in pool.geom.components:
        slab = pool.read_pages(c, np.asarray(ids))
        if pool.layout.value == "layer_first":  # (L, n, ...) -> (n, L, ...)
            slab = np.moveaxis(slab, 1, 0)
        parts.append(np.ascontiguousarray(slab).reshape(len(ids), -1).view(np.uint8))
    return np.concatenate(parts, axis=1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geom", sorted(GEOMS))
def test_pack_matches_the_oracle(geom, layout):
    pool = _pool(GEOMS[geom], layout)
    codec = PageCodec(pool)
    for ids in ([3], [0, 11, 5, 5, 7], list(range(12))[::-1]):
        want = _oracle(pool, ids)
        np.testing.assert_array_equal(codec.pack(np.array(ids)), want)
        # into a larger buffer's rows, rows around them poisoned and left alone
        big = np.full((len(ids) + 2, codec.page_bytes), 0xA5, np.uint8)
        out = big[1:-1]
        assert codec.pack(np.array(ids), out) is out
        np.testing.assert_array_equal(out, want)
        assert (big[0] == 0xA5).all() and (big[-1] == 0xA5).all()


def test_pack_rejects_bad_ids_and_outputs_before_writing():
    pool = _pool(GEOMS["mha_bf16"], "page_first")
    codec = PageCodec(pool)
    out = np.full((2, codec.page_bytes), 7, np.uint8)
    with pytest.raises(ValueError, match="host_id"):
        codec.pack(np.array([1, 12]), out)
    with pytest.raises(ValueError, match="host_id"):
        codec.pack(np.array([-1, 0]), out)
    assert (out == 7).all()
    for bad in (
        np.zeros((3, codec.page_bytes), np.uint8),
        np.zeros((2, codec.page_bytes - 1), np.uint8),
        np.zeros((2, codec.page_bytes), np.int8),
        np.zeros((2, 2 * codec.page_bytes), np.uint8)[:, ::2],
    ):
        with pytest.raises(ValueError, match="out: expected"):
            codec.pack(np.array([0, 1]), bad)
    ro = np.zeros((2, codec.page_bytes), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out: expected"):
        codec.pack(np.array([0, 1]), ro)
