import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, HostPoolConfig, KVGeometry
from hicache_jax.host_layout import host_array_shape

GEOMS = [
    KVGeometry.mha(3, 4, 2, 8, "bfloat16"),
    KVGeometry.mla(3, 1, 12, 4, "float8_e4m3fn"),
    KVGeometry.mha(2, 33, 1, 4, "float32"),
]


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{g.kind}-p{g.page_size}-{g.dtype}")
@pytest.mark.parametrize("layout", list(HostLayout))
def test_write_read_roundtrip_bit_exact(geom, layout):
    rng = np.random.default_rng(0)
    pool = HostKVPool(geom, 10, layout)
    ids = np.array([7, 2, 9])
    written = {}
    for c in geom.components:
        shape = pool.read_pages(c, ids).shape
        data = rng.integers(1, np.iinfo(geom.container_dtype).max, shape, dtype=geom.container_dtype)
        pool.write_pages(c, ids, data)
        written[c] = data
    for c in geom.components:
        np.testing.assert_array_equal(pool.read_pages(c, ids), written[c])
        # per-layer reads agree with the page reads
        for layer in range(geom.num_layers):
            full = pool.read_pages(c, ids)
            want = (
                full[layer]
                if layout is HostLayout.LAYER_FIRST
                else (full[:, :, layer] if layout is HostLayout.PAGE_FIRST else full[:, layer])
            )
            np.testing.assert_array_equal(pool.read_layer(c, ids, layer), want)
    # untouched pages stay zero
    others = np.setdiff1d(np.arange(10), ids)
    for c in geom.components:
        assert not pool.read_pages(c, others).any()


def test_upstream_shapes():
    g = KVGeometry.mha(4, 16, 8, 128)
    assert host_array_shape(g, HostLayout.LAYER_FIRST, 10) == (2, 4, 160, 8, 128)
    assert host_array_shape(g, HostLayout.PAGE_FIRST, 10) == (2, 160, 4, 8, 128)
    assert host_array_shape(g, HostLayout.PAGE_FIRST_DIRECT, 10) == (2, 10, 4, 16, 8, 128)
    m = KVGeometry.mla(4, 16, 512, 64)
    assert host_array_shape(m, HostLayout.LAYER_FIRST, 10) == (4, 160, 1, 576)
    assert host_array_shape(m, HostLayout.PAGE_FIRST, 10) == (160, 4, 1, 576)
    assert host_array_shape(m, HostLayout.PAGE_FIRST_DIRECT, 10) == (10, 4, 16, 1, 576)


def test_page_first_page_is_token_major_slice():
    """In page_first a host page is tokens [id*page, (id+1)*page) of the (size, L, H, D) array."""
    g = KVGeometry.mha(2, 4, 1, 2, "float16")
    pool = HostKVPool(g, 5, "page_first")
    data = np.arange(1, 1 + 4 * 2 * 1 * 2, dtype=np.uint16).reshape(1, 4, 2, 1, 2)
    pool.write_pages("v", [3], data)
    np.testing.assert_array_equal(pool.array[1, 12:16], data[0])


def test_sizing_by_ratio_and_bytes():
    g = KVGeometry.mha(2, 16, 2, 64)
    assert HostPoolConfig(ratio=2.0).num_pages(g, 100) == 200
    assert HostPoolConfig(ratio=0.5).num_pages(g, 100) == 50  # smaller than device: allowed
    assert HostPoolConfig(size_bytes=10 * g.bytes_per_page + 5).num_pages(g, 100) == 10
    with pytest.raises(ValueError, match="at least 1"):
        HostPoolConfig(size_bytes=1).num_pages(g, 100)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(layout="row_major"), ValueError, "layout"),
        (dict(ratio=0), ValueError, "ratio"),
        (dict(ratio="2"), TypeError, "ratio"),
        (dict(size_bytes=-1), ValueError, "size_bytes"),
    ],
)
def test_config_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        HostPoolConfig(**kwargs)


def test_bad_writes_rejected_without_change():
    g = KVGeometry.mha(2, 2, 1, 2, "bfloat16")
    pool = HostKVPool(g, 4)
    good = np.ones((2, 2, 2, 1, 2), np.uint16)
    with pytest.raises(ValueError, match="shape"):
        pool.write_pages("k", [0, 1], good[:1])
    with pytest.raises(ValueError, match="duplicate"):
        pool.write_pages("k", [1, 1], good)
    with pytest.raises(ValueError, match="out of range"):
        pool.write_pages("k", [1, 4], good)
    with pytest.raises(TypeError, match="2-byte"):
        pool.write_pages("k", [0, 1], good.astype(np.float32))
    with pytest.raises(ValueError, match="component"):
        pool.write_pages("q", [0, 1], good)
    assert not pool.array.any()
