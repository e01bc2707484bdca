"""Mosaic GPU page-copy kernels (``gpu_mgpu``): interpreter, CUDA lowering, and GPU execution.

* On the CPU the kernels run in Mosaic GPU's interpreter, bit-exact against the independent
  numpy oracle of ``test_page_copy`` (poisoned outputs, untouched pages, NaN payloads, -0.0).
  The interpreter costs ~1 s per compiled shape, so the cases below are chosen to cover every
  dtype, page size, count, order and MHA / MLA geometry without taking their full product.
* ``lower(lowering_platforms=("cuda",))`` checks every variant lowers to ``mosaic_gpu_v2``
  without a GPU, the tiled path for a page larger than shared memory included, and that the
  scatter's lowered module aliases the donated pool.
* ``gpu``-marked tests run them compiled on a CUDA GPU and skip elsewhere with the reason.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import gpu_mgpu, reference
from .common import ORDERS, buffer_shape
from .dispatch import PageCopier, PageCopyConfig
from .test_page_copy import POISON, _bits, _numpy_gather, _platform_devices, _poison

NUM_PAGES, L = 40, 2
GEOMETRIES = {"mha": (2, 8), "mla": (1, 32)}  # (heads, head dim): MLA is one latent "head"


def _special_bits(itemsize: int) -> list[int]:
    """Bit patterns a float copy could alter: -0.0, quiet / signalling NaNs with payloads, all ones."""
    return {
        1: [0x80, 0xFF, 0x7F, 0xFE],  # float8_e4m3fn: 0x7F / 0xFF are its NaNs
        2: [0x8000, 0xFFFF, 0x7C01, 0xFC05, 0x7F81, 0xFF85],  # float16 and bfloat16 NaN payloads
        4: [0x80000000, 0xFFFFFFFF, 0x7F800001, 0xFFC00005, 0x7FC12345],
    }[itemsize]


def _pools(rng, dtype, page, geometry, num_pages=NUM_PAGES, n_layers=L):
    """Random nonzero bytes per layer, with the special patterns written at random places."""
    h, d = GEOMETRIES[geometry]
    dt = jnp.dtype(dtype)
    c = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dt.itemsize]
    shape = (num_pages, page, h, d)
    out = []
    for _ in range(n_layers):
        raw = rng.integers(1, 256, size=shape + (dt.itemsize,), dtype=np.uint8).view(c).reshape(shape)
        flat = raw.reshape(-1)
        for b in _special_bits(dt.itemsize):
            flat[rng.integers(0, flat.size, 8)] = b
        out.append(jnp.asarray(raw.view(dt)))
    return out


def _ids(rng, n, num_pages=NUM_PAGES):
    return rng.permutation(num_pages)[:n].astype(np.int32)


# (dtype, page size, geometry, orders): every dtype, every page size, every order, MHA and MLA.
# Every order also runs with counts 0 and 1 (padding only) in a case of its own; the case with
# all three orders runs those counts for its first order alone (each interpreted call costs
# ~1 s on a loaded 2-core VM: the other two orders' 0 and 1 took 19 s of 81 and see nothing
# the other cases do not).
CASES = [
    ("bfloat16", 16, "mha", ORDERS),
    ("float16", 33, "mha", ("npl",)),
    ("float32", 1, "mha", ("lnp",)),
    ("float8_e4m3fn", 33, "mla", ("nlp",)),
    ("float8_e4m3fn", 1, "mha", ("npl",)),
    ("bfloat16", 1, "mla", ("npl",)),
]


@pytest.mark.parametrize("dtype,page,geometry,orders", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_mgpu_interpret_bit_exact(dtype, page, geometry, orders):
    rng = np.random.default_rng(abs(hash((dtype, page, geometry))) % 2**32)
    # One bucket: counts 0, 1 and 37 share each compiled shape (the interpreter compiles slowly)
    # and 0 and 1 run with mostly padding positions, which must issue nothing.
    copier = PageCopier(PageCopyConfig(impl="mgpu", max_pages=NUM_PAGES, buckets=(NUM_PAGES,), platform="cpu"))
    assert copier.impl == "mgpu" and copier.interpret
    pools = _pools(rng, dtype, page, geometry)
    page_shape = pools[0].shape[1:]
    for i, order in enumerate(orders):
        page_axis = 1 if order == "lnp" else 0
        for n in (0, 1, 37) if i == 0 else (37,):
            ids, dest = _ids(rng, n), _ids(rng, n)
            nb = copier.bucket_for(n)
            expected = _numpy_gather(pools, ids, order)
            take = lambda a: np.take(a, np.arange(n), axis=page_axis)  # noqa: E731
            buf, got_n = copier.gather(pools, ids, order)
            assert got_n == n and buf.shape == buffer_shape(order, nb, L, page_shape)
            np.testing.assert_array_equal(take(_bits(buf)), expected)
            out, _ = copier.gather(pools, ids, order, out=_poison(buf.shape, dtype))
            b = _bits(out)
            np.testing.assert_array_equal(take(b), expected)
            assert (np.take(b, np.arange(n, nb), axis=page_axis).view(np.uint8) == POISON).all(), (
                "gather wrote outside the live pages"
            )
            for layer in range(L):
                new = copier.scatter(_poison(pools[0].shape, dtype), dest, out, layer, order)
                got = _bits(new)
                np.testing.assert_array_equal(got[dest], _bits(pools[layer])[ids])
                untouched = np.setdiff1d(np.arange(NUM_PAGES), dest)
                assert (got[untouched].view(np.uint8) == POISON).all(), "scatter touched pages it was not given"


def test_mgpu_tiled_and_multi_page_blocks_interpret():
    """Tiny tiles (a page cut into rows x column tiles) and 3 pages per block over 8 positions
    (the last block hangs over the end), every order, against the reference and the oracle."""
    rng = np.random.default_rng(11)
    pools = tuple(jnp.asarray(rng.integers(0, 2**16, (16, 4, 2, 8), dtype=np.uint16)) for _ in range(3))
    ids = jnp.asarray(np.concatenate([_ids(rng, 5, 16), np.zeros(3, np.int32)]))
    n = jnp.array([5], jnp.int32)
    kw = dict(interpret=True, tile_bytes=16, pages_per_block=3)
    assert gpu_mgpu.tiles(4, 8, 16) == (1, 4)  # 8 tiles per page
    for order in ORDERS:
        shape = buffer_shape(order, 8, 3, (4, 2, 8))
        want = reference.gather_layers(pools, ids, n, _poison(shape, "uint16"), order)
        got = gpu_mgpu.gather_layers(pools, ids, n, _poison(shape, "uint16"), order, **kw)
        np.testing.assert_array_equal(_bits(got), _bits(want))
        np.testing.assert_array_equal(
            np.take(_bits(got), range(5), 1 if order == "lnp" else 0), _numpy_gather(pools, np.asarray(ids[:5]), order)
        )
        layer = jnp.array([1], jnp.int32)
        want_pool = reference.scatter_layer(_poison(pools[0].shape, "uint16"), ids, n, want, layer, order)
        got_pool = gpu_mgpu.scatter_layer(_poison(pools[0].shape, "uint16"), ids, n, want, layer, order, **kw)
        np.testing.assert_array_equal(_bits(got_pool), _bits(want_pool))


def test_mgpu_slot_reuse_race_free_interpret():
    """More work items than shared-memory slots, under the interpreter's race detector: a slot is
    reloaded only after the TMA store reading it has finished (drop that wait and this raises)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(12)
    pools = tuple(jnp.asarray(rng.integers(0, 2**16, (16, 4, 2, 8), dtype=np.uint16)) for _ in range(3))
    ids = jnp.asarray(_ids(rng, 8, 16))
    n = jnp.array([6], jnp.int32)
    ip = plgpu.InterpretGPUParams(detect_races=True)
    assert gpu_mgpu._plan(8, 4, 8, 3, gpu_mgpu.TILE_BYTES, 4)[3:] == (4, gpu_mgpu.MAX_SLOTS) == (4, 4)  # 12 items
    got = gpu_mgpu.gather_layers(pools, ids, n, None, "npl", interpret=ip, pages_per_block=4)
    np.testing.assert_array_equal(_bits(got)[:6], _numpy_gather(pools, np.asarray(ids[:6]), "npl"))
    pool = gpu_mgpu.scatter_layer(
        _poison(pools[0].shape, "uint16"),
        ids,
        n,
        got,
        jnp.array([2], jnp.int32),
        "npl",
        interpret=ip,
        pages_per_block=6,
    )  # 6 items, 4 slots
    np.testing.assert_array_equal(_bits(pool)[np.asarray(ids[:6])], _bits(pools[2])[np.asarray(ids[:6])])


def test_mgpu_tiles_plan():
    # a real page: 64 tokens x 8 heads x 128 x bf16 = 2048 B/token = 512 words; 32 KiB tiles
    assert gpu_mgpu.tiles(64, 512) == (32, 256)
    assert gpu_mgpu.tiles(33, 8) == (33, 8)
    assert gpu_mgpu.tiles(1, 288) == (1, 144)  # MLA 576 x bf16: 288 words, columns <= 256
    assert gpu_mgpu.supported((16, 2, 8), 1) and not gpu_mgpu.supported((16, 1, 4), 2)
    with pytest.raises(ValueError, match="multiple of 16"):
        PageCopier(PageCopyConfig(impl="mgpu", max_pages=8, platform="cpu")).gather(
            [jnp.zeros((8, 4, 1, 4), jnp.bfloat16)], [1], "npl"
        )


# ---- CUDA lowering (no GPU needed) ---------------------------------------------------------
def _lower(f, *args, donate=()):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no jax deprecation from these kernels
        return jax.jit(f, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _sds(shape, dtype=jnp.uint16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "page_shape,dtype",
    [((16, 2, 8), jnp.uint16), ((33, 1, 32), jnp.uint8), ((64, 8, 256), jnp.uint16)],
    ids=["mha", "mla-fp8", "tiled-256KiB-page"],
)
def test_mgpu_lowering_smoke_cuda(page_shape, dtype):
    """Gather (fresh / into out) and scatter, every order, lower to mosaic_gpu_v2; a 256 KiB page
    (more than an H100 SM's shared memory) is split into tiles; the scatter aliases the pool."""
    nb, nl = 8, 3
    pool, ids, n = _sds((16,) + page_shape, dtype), _sds((nb,), jnp.int32), _sds((1,), jnp.int32)
    words = page_shape[1] * page_shape[2] * jnp.dtype(dtype).itemsize // 4
    tr, tc = gpu_mgpu.tiles(page_shape[0], words)
    n_tiles = (page_shape[0] // tr) * (words // tc)
    if page_shape == (64, 8, 256):
        assert n_tiles == 8 and tr * tc * 4 <= gpu_mgpu.TILE_BYTES
    for order in ORDERS:
        buf = _sds(buffer_shape(order, nb, nl, page_shape), dtype)
        texts = [
            _lower(lambda p, i, k: gpu_mgpu.gather_layers(tuple(p), i, k, None, order), [pool] * nl, ids, n),
            _lower(
                lambda p, i, k, o: gpu_mgpu.gather_layers(tuple(p), i, k, o, order),
                [pool] * nl,
                ids,
                n,
                buf,
                donate=(3,),
            ),
            _lower(
                lambda p, i, k, b, l: gpu_mgpu.scatter_layer(p, i, k, b, l, order), pool, ids, n, buf, n, donate=(0,)
            ),
        ]
        for t in texts:
            assert t.count("@mosaic_gpu_v2") == 1, "expected exactly one Mosaic GPU kernel"
            assert "triton" not in t
        # donation: the pool (gather: out) is aliased to the result in main and in the kernel call
        for t, arg in ((texts[1], nl + 2), (texts[2], 0)):
            assert re.search(rf"%arg{arg}: tensor<[^>]*> {{[^}}]*tf\.aliasing_output = 0", t), f"arg {arg} not aliased"
            assert "output_operand_alias" in t


# ---- GPU execution -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not _platform_devices("gpu"), reason="no CUDA GPU visible to JAX")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_mgpu_compiled_bit_exact(dtype):
    dev = _platform_devices("gpu")[0]
    rng = np.random.default_rng(5)
    with jax.default_device(dev):
        copier = PageCopier(PageCopyConfig(impl="mgpu", max_pages=NUM_PAGES, platform="gpu"))
        assert copier.impl == "mgpu" and not copier.interpret
        for page, geometry in ((1, "mha"), (16, "mla"), (33, "mha")):
            pools = [jax.device_put(p, dev) for p in _pools(rng, dtype, page, geometry, n_layers=3)]
            for order in ORDERS:
                page_axis = 1 if order == "lnp" else 0
                for n in (0, 1, 37):
                    ids, dest = _ids(rng, n), _ids(rng, n)
                    out, _ = copier.gather(
                        pools,
                        ids,
                        order,
                        out=_poison(buffer_shape(order, copier.bucket_for(n), 3, pools[0].shape[1:]), dtype),
                    )
                    b = _bits(out)
                    np.testing.assert_array_equal(np.take(b, range(n), page_axis), _numpy_gather(pools, ids, order))
                    assert (np.take(b, range(n, copier.bucket_for(n)), page_axis).view(np.uint8) == POISON).all()
                    fresh, _ = copier.gather(pools, ids, order)
                    np.testing.assert_array_equal(
                        np.take(_bits(fresh), range(n), page_axis), _numpy_gather(pools, ids, order)
                    )
                    new = copier.scatter(_poison(pools[0].shape, dtype), dest, out, 1, order)
                    got = _bits(new)
                    np.testing.assert_array_equal(got[dest], _bits(pools[1])[ids])
                    assert (got[np.setdiff1d(np.arange(NUM_PAGES), dest)].view(np.uint8) == POISON).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _platform_devices("gpu"), reason="no CUDA GPU visible to JAX")
def test_mgpu_compiled_tiled_real_page():
    """A real page (64 tokens x 8 heads x 128 x bf16 = 128 KiB per layer: 4 tiles), every order."""
    dev = _platform_devices("gpu")[0]
    rng = np.random.default_rng(6)
    shape = (24, 64, 8, 128)
    pools = tuple(jax.device_put(jnp.asarray(rng.integers(0, 2**16, shape, dtype=np.uint16)), dev) for _ in range(4))
    ids = jnp.asarray(np.concatenate([_ids(rng, 13, 24), np.zeros(3, np.int32)]))
    n = jnp.array([13], jnp.int32)
    for order in ORDERS:
        want = reference.gather_layers(pools, ids, n, _poison(buffer_shape(order, 16, 4, shape[1:]), "uint16"), order)
        got = gpu_mgpu.gather_layers(pools, ids, n, _poison(want.shape, "uint16"), order)
        np.testing.assert_array_equal(_bits(got), _bits(want))
        layer = jnp.array([3], jnp.int32)
        want_pool = reference.scatter_layer(_poison(shape, "uint16"), ids, n, want, layer, order)
        got_pool = gpu_mgpu.scatter_layer(_poison(shape, "uint16"), ids, n, want, layer, order)
        np.testing.assert_array_equal(_bits(got_pool), _bits(want_pool))
