"""Page-copy kernels vs the pure-JAX reference: bit-exact on random data, poisoned outputs.

CPU runs the TPU (DMA) and GPU (Triton) kernels in interpret mode; the ``gpu`` / ``tpu``
marked tests execute them compiled on real hardware and skip elsewhere with the reason. The
Mosaic GPU kernels have their own file (``test_page_copy_mgpu``: their interpreter compiles
slowly, so they get a chosen set of cases); here they join the dispatcher-level checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import gpu, reference, tpu
from .common import ORDERS, buffer_shape, default_buckets
from .dispatch import AUTO_GPU_IMPL, PageCopier, PageCopyConfig

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]
PAGE_SIZES = [1, 16, 33]
IMPLS = ["xla", "tpu", "gpu"]
POISON = 0xA5  # byte pattern written to every output before a run
NUM_PAGES, L, H, D = 64, 3, 2, 8


def _bits(x) -> np.ndarray:
    """Raw bits of an array (bitwise comparison: NaN payloads and -0.0 included)."""
    a = np.asarray(x)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _random_layers(rng, dtype, page, n_layers=L, num_pages=NUM_PAGES):
    """Random bits (never zeros: every byte drawn from 1..255) viewed as ``dtype``."""
    d = jnp.dtype(dtype)
    shape = (num_pages, page, H, D)
    return [
        jnp.asarray(rng.integers(1, 256, size=shape + (d.itemsize,), dtype=np.uint8).view(d).reshape(shape))
        for _ in range(n_layers)
    ]


def _poison(shape, dtype):
    d = jnp.dtype(dtype)
    return jnp.asarray(np.full(tuple(shape) + (d.itemsize,), POISON, np.uint8).view(d).reshape(shape))


def _numpy_gather(pools, ids, order):
    """Independent oracle in numpy: the pages ``ids`` of every layer, stacked in ``order``."""
    pages = [_bits(p)[ids] for p in pools]
    return np.stack(pages, axis={"nlp": 1, "npl": 2, "lnp": 0}[order])


def _ids(rng, n, num_pages=NUM_PAGES):
    return rng.permutation(num_pages)[:n].astype(np.int32)


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_scatter_bit_exact(impl, dtype, page):
    rng = np.random.default_rng(hash((impl, dtype, page)) % 2**32)
    copier = PageCopier(PageCopyConfig(impl=impl, max_pages=NUM_PAGES))
    orders = ORDERS if dtype == "bfloat16" else ("npl",)
    pools = _random_layers(rng, dtype, page)
    for order in orders:
        for n in (0, 1, 37):
            ids = _ids(rng, n)
            nb = copier.bucket_for(n)
            expected = _numpy_gather(pools, ids, order)
            # gather into a fresh buffer: the first n pages must match
            buf, got_n = copier.gather(pools, ids, order)
            assert got_n == n and buf.shape == buffer_shape(order, nb, L, (page, H, D))
            page_axis = 1 if order == "lnp" else 0
            take = lambda a: np.take(a, np.arange(n), axis=page_axis)  # noqa: E731
            np.testing.assert_array_equal(take(_bits(buf)), expected)
            # gather into a poisoned buffer: padding positions keep the poison
            poisoned = _poison(buf.shape, dtype)
            buf2, _ = copier.gather(pools, ids, order, out=poisoned)
            b2 = _bits(buf2)
            np.testing.assert_array_equal(take(b2), expected)
            pad = np.take(b2, np.arange(n, nb), axis=page_axis)
            assert (pad.view(np.uint8) == POISON).all(), "gather wrote outside the live pages"
            # scatter each layer of the buffer back into a poisoned pool at fresh destinations
            dest = _ids(rng, n)
            for layer in range(L):
                pool = _poison((NUM_PAGES, page, H, D), dtype)
                new = copier.scatter(pool, dest, buf2, layer, order)
                got = _bits(new)
                np.testing.assert_array_equal(got[dest], _bits(pools[layer])[ids])
                untouched = np.setdiff1d(np.arange(NUM_PAGES), dest)
                assert (got[untouched].view(np.uint8) == POISON).all(), "scatter touched pages it was not given"


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_functions_match_reference_directly(impl):
    """The raw kernel entry points (no dispatcher) against the reference, odd page size, all orders.

    Kernels take unsigned containers (the dispatcher bitcasts): interpreted masked float
    copies may flush subnormals or canonicalise NaNs, bit copies never do.
    """
    rng = np.random.default_rng(7)
    mod = tpu if impl == "tpu" else gpu
    pools = tuple(_random_layers(rng, "uint16", 33))
    ids = jnp.asarray(np.concatenate([_ids(rng, 5), np.zeros(3, np.int32)]))
    n = jnp.array([5], jnp.int32)
    for order in ORDERS:
        shape = buffer_shape(order, 8, L, (33, H, D))
        want = reference.gather_layers(pools, ids, n, _poison(shape, "uint16"), order)
        got = mod.gather_layers(pools, ids, n, _poison(shape, "uint16"), order, interpret=True)
        np.testing.assert_array_equal(_bits(got), _bits(want))
        np.testing.assert_array_equal(
            np.take(_bits(got), range(5), 1 if order == "lnp" else 0), _numpy_gather(pools, np.asarray(ids[:5]), order)
        )
        layer = jnp.array([2], jnp.int32)
        want_pool = reference.scatter_layer(_poison(pools[0].shape, "uint16"), ids, n, want, layer, order)
        got_pool = mod.scatter_layer(_poison(pools[0].shape, "uint16"), ids, n, want, layer, order, interpret=True)
        np.testing.assert_array_equal(_bits(got_pool), _bits(want_pool))


@pytest.mark.parametrize("impl", IMPLS + ["mgpu"])
def test_invalid_ids_rejected_before_launch(impl):
    rng = np.random.default_rng(1)
    copier = PageCopier(PageCopyConfig(impl=impl, max_pages=NUM_PAGES))
    pools = _random_layers(rng, "bfloat16", 4)
    buf, _ = copier.gather(pools, [1, 2, 3], "nlp")
    before = copier.compile_count
    pool = pools[0]
    with pytest.raises(ValueError, match="out of range"):
        copier.scatter(pool, [1, NUM_PAGES, 3], buf, 0, "nlp")
    with pytest.raises(ValueError, match="out of range"):
        copier.scatter(pool, [-1, 2, 3], buf, 0, "nlp")
    with pytest.raises(ValueError, match="duplicate"):
        copier.scatter(pool, [5, 5, 6], buf, 0, "nlp")
    with pytest.raises(ValueError, match="out of range"):
        copier.gather(pools, [0, NUM_PAGES], "nlp")
    with pytest.raises(TypeError, match="integer"):
        copier.gather(pools, [0.5, 1.0], "nlp")
    with pytest.raises(ValueError, match="layer"):
        copier.scatter(pool, [1, 2, 3], buf, L, "nlp")
    with pytest.raises(ValueError, match="order"):
        copier.gather(pools, [1], "pln")
    # nothing was launched or compiled, and the pool was not donated
    assert copier.compile_count == before
    assert not pool.is_deleted()
    np.testing.assert_array_equal(_bits(pool), _bits(pools[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_steady_state_never_recompiles(impl):
    """Counts inside a precompiled bucket reuse one executable: JAX compiles nothing new."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    )
    rng = np.random.default_rng(2)
    copier = PageCopier(PageCopyConfig(impl=impl, max_pages=NUM_PAGES))
    pools = _random_layers(rng, "bfloat16", 16)
    built = copier.precompile((NUM_PAGES, 16, H, D), jnp.bfloat16, L, ("npl",))
    assert built == 2 * len(copier.buckets)
    assert copier.bucket_for(20) == copier.bucket_for(24)  # same bucket (24)
    buf, _ = copier.gather(pools, _ids(rng, 20), "npl")
    pool = copier.scatter(jnp.copy(pools[0]), _ids(rng, 20), buf, 1, "npl")
    jax.block_until_ready(pool)
    compiles.clear()
    count_before = copier.compile_count
    buf, _ = copier.gather(pools, _ids(rng, 24), "npl")
    pool = copier.scatter(pool, _ids(rng, 24), buf, 2, "npl")
    jax.block_until_ready(pool)
    assert copier.compile_count == count_before
    assert compiles == [], f"steady state compiled: {compiles}"


def test_config_names_and_validation():
    assert PageCopyConfig(impl="direct").impl == "xla" and PageCopyConfig(impl="kernel").impl == "auto"
    assert PageCopier(PageCopyConfig(impl="kernel", platform="cpu")).impl == "xla"
    assert PageCopier(PageCopyConfig(impl="kernel", platform="gpu")).impl == AUTO_GPU_IMPL == "xla"
    assert PageCopier(PageCopyConfig(impl="mgpu", platform="cpu")).interpret
    assert PageCopier(PageCopyConfig(impl="kernel", platform="tpu")).impl == "tpu"
    assert PageCopier(PageCopyConfig(impl="tpu", platform="cpu")).interpret
    assert not PageCopier(PageCopyConfig(impl="direct", platform="cpu")).interpret
    with pytest.raises(ValueError, match="impl"):
        PageCopyConfig(impl="cuda")
    with pytest.raises(ValueError, match="max_pages"):
        PageCopyConfig(max_pages=0)
    with pytest.raises(ValueError, match="buckets"):
        PageCopyConfig(buckets=(4, 2))


def test_default_buckets():
    b = default_buckets(4096)
    assert b[:5] == (1, 2, 4, 8, 16) and b[-1] == 4096 and list(b) == sorted(set(b))
    assert all(b2 / b1 <= 2 for b1, b2 in zip(b, b[1:]))
    assert len(b) <= 24
    assert default_buckets(5) == (1, 2, 4, 5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tp", [4, 8])
def test_sharded_pools_same_bytes(impl, tp):
    """Pools sharded over the KV-head axis on a CPU mesh give the unsharded bytes.

    Not ``mgpu``: Mosaic GPU's interpreter (jax 0.12.0.1) keeps one process-wide simulated
    shared memory and fails ("Barrier remains allocated") when shards run on several CPU devices.
    """
    devices = jax.devices("cpu")
    if len(devices) < tp:
        pytest.skip(f"needs {tp} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), have {len(devices)}")
    mesh = Mesh(np.array(devices[:tp]), ("tp",))
    rng = np.random.default_rng(3)
    heads = 8
    pools = [
        jnp.asarray(rng.integers(1, 2**16, (NUM_PAGES, 16, heads, D), dtype=np.uint16)).view(jnp.bfloat16)
        for _ in range(L)
    ]
    sharded = [jax.device_put(p, NamedSharding(mesh, PartitionSpec(None, None, "tp", None))) for p in pools]
    plain = PageCopier(PageCopyConfig(impl=impl, max_pages=NUM_PAGES))
    shard = PageCopier(PageCopyConfig(impl=impl, max_pages=NUM_PAGES), mesh=mesh, kv_axis="tp")
    ids, dest = _ids(rng, 11), _ids(rng, 11)
    for order in ORDERS:
        a, _ = plain.gather(pools, ids, order)
        b, _ = shard.gather(sharded, ids, order)
        page_axis = 1 if order == "lnp" else 0
        np.testing.assert_array_equal(np.take(_bits(a), range(11), page_axis), np.take(_bits(b), range(11), page_axis))
        pa = plain.scatter(jnp.copy(pools[0]), dest, a, 2, order)
        pb = shard.scatter(jnp.copy(sharded[0]), dest, b, 2, order)
        assert pb.sharding.spec == PartitionSpec(None, None, "tp", None)
        np.testing.assert_array_equal(_bits(pa), _bits(pb))


def _lower_both(platform, impl):
    f_g = jax.jit(
        lambda pools, ids, n: (tpu if impl == "tpu" else gpu).gather_layers(tuple(pools), ids, n, None, "npl")
    )
    f_s = jax.jit(
        lambda pool, ids, n, buf, layer: (tpu if impl == "tpu" else gpu).scatter_layer(pool, ids, n, buf, layer, "npl"),
        donate_argnums=(0,),
    )
    pool = jax.ShapeDtypeStruct((NUM_PAGES, 16, H, D), jnp.uint16)
    ids, n = jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    buf = jax.ShapeDtypeStruct(buffer_shape("npl", 8, L, (16, H, D)), jnp.uint16)
    texts = [
        f_g.trace([pool] * L, ids, n).lower(lowering_platforms=(platform,)).as_text(),
        f_s.trace(pool, ids, n, buf, n).lower(lowering_platforms=(platform,)).as_text(),
    ]
    return texts


def test_lowering_smoke_tpu():
    """The DMA kernels lower to Mosaic TPU without a TPU (MLIR only: no VMEM or codegen checks)."""
    texts = _lower_both("tpu", "tpu")
    assert all("tpu_custom_call" in t for t in texts)


def test_lowering_smoke_cuda():
    """The Triton kernels lower for CUDA without a GPU, given an abstract H100."""
    from jax._src.mesh import AbstractDevice, AbstractMesh  # private: no public way to name a GPU kind yet

    ad = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=ad)):
        texts = _lower_both("cuda", "gpu")
    assert all("xla.gpu.triton" in t or "triton_kernel_call" in t for t in texts)


def _platform_devices(platform):
    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not _platform_devices("gpu"), reason="no CUDA GPU visible to JAX")
def test_gpu_compiled_bit_exact():
    _compiled_bit_exact("gpu")


@pytest.mark.tpu
@pytest.mark.skipif(not _platform_devices("tpu"), reason="no TPU visible to JAX")
def test_tpu_compiled_bit_exact():
    _compiled_bit_exact("tpu")


def _compiled_bit_exact(platform):
    dev = _platform_devices(platform)[0]
    rng = np.random.default_rng(4)
    with jax.default_device(dev):
        # the kernel itself, not auto's choice (XLA on GPU)
        copier = PageCopier(PageCopyConfig(impl=platform, max_pages=NUM_PAGES, platform=platform))
        assert not copier.interpret
        for dtype in DTYPES:
            for page in PAGE_SIZES:
                pools = [jax.device_put(p, dev) for p in _random_layers(rng, dtype, page)]
                for order in ORDERS:
                    ids, dest = _ids(rng, 37), _ids(rng, 37)
                    buf, _ = copier.gather(pools, ids, order)
                    page_axis = 1 if order == "lnp" else 0
                    np.testing.assert_array_equal(
                        np.take(_bits(buf), range(37), page_axis), _numpy_gather(pools, ids, order)
                    )
                    new = copier.scatter(_poison(pools[0].shape, dtype), dest, buf, 1, order)
                    got = _bits(new)
                    np.testing.assert_array_equal(got[dest], _bits(pools[1])[ids])
                    assert (got[np.setdiff1d(np.arange(NUM_PAGES), dest)].view(np.uint8) == POISON).all()


def test_package_imports_nothing_from_the_cache():
    """Dependencies point one way: no module under pallas_kernels imports the cache manager."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            offenders += [f"{path.relative_to(root)}:{node.lineno}" for m in names if m.split(".")[0] == "hicache_jax"]
    assert offenders == []


def test_check_page_ids():
    from .common import check_page_ids

    out = check_page_ids(np.array([3, 0, 7], np.int64), 8)
    assert out.dtype == np.int32 and out.tolist() == [3, 0, 7]
    assert check_page_ids([], 8).shape == (0,) and check_page_ids([2, 2], 8, unique=False).tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"out of range \[0, 8\): \[8, -1\]"):
        check_page_ids([1, 8, -1], 8)
    with pytest.raises(ValueError, match="out of range"):
        check_page_ids([2**40], 8)  # does not wrap into range through the int32 cast
    with pytest.raises(ValueError, match=r"duplicate ids \[5\]"):
        check_page_ids([5, 1, 5], 8)
    with pytest.raises(ValueError, match="1-D"):
        check_page_ids([[1, 2]], 8)
    for bad in ([0.5], [True, False], np.array([1], object)):
        with pytest.raises(TypeError, match="integer"):
            check_page_ids(bad, 8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_per_page_scatter_matches_reference(dtype):
    """``scatter_layer_pages`` (the CPU form) against the scatter reference: every order, live
    counts 0 / 1 / partial / full bucket, poisoned pools; pages past ``n`` never written."""
    rng = np.random.default_rng(11)
    pools = tuple(_random_layers(rng, dtype, 5))
    for order in ORDERS:
        for n_live in (0, 1, 5, 8):
            ids = jnp.asarray(np.concatenate([_ids(rng, n_live), np.zeros(8 - n_live, np.int32)]))
            n = jnp.array([n_live], jnp.int32)
            buf = reference.gather_layers(pools, _ids(rng, 8), jnp.array([8], jnp.int32), None, order)
            for layer in (0, L - 1):
                lay = jnp.array([layer], jnp.int32)
                want = reference.scatter_layer(_poison(pools[0].shape, dtype), ids, n, buf, lay, order)
                got = reference.scatter_layer_pages(_poison(pools[0].shape, dtype), ids, n, buf, lay, order)
                np.testing.assert_array_equal(_bits(got), _bits(want))
                untouched = np.setdiff1d(np.arange(NUM_PAGES), np.asarray(ids[:n_live]))
                assert (_bits(got)[untouched].view(np.uint8) == POISON).all()


@pytest.mark.parametrize("platform, per_page", [("cpu", True), ("gpu", False)])
def test_xla_scatter_form_by_platform(platform, per_page):
    """On the CPU the ``xla`` copier scatters with per-page copies (no HLO scatter); for a GPU it
    keeps XLA's scatter (a loop there is one launch per page)."""
    if jax.default_backend() != "cpu":
        pytest.skip("compiles for the host CPU to read the HLO")
    copier = PageCopier(PageCopyConfig(impl="xla", max_pages=NUM_PAGES, platform=platform))
    shape = (NUM_PAGES, 4, H, D)
    exe = copier.precompile_scatter(shape, jnp.bfloat16, buffer_shape("nlp", 8, L, shape[1:]), 8, "nlp")
    hlo = exe.as_text()
    assert ("dynamic-update-slice" in hlo and " scatter(" not in hlo) == per_page, hlo[:2000]


def test_a_copier_built_for_a_device_returns_committed_arrays():
    """With ``device`` the executables are built for it, so their outputs come back committed:
    the device pool then installs them as they are (an uncommitted layer would need a
    ``device_put`` each to keep the model step's compiled signature). Without it, they do not."""
    rng = np.random.default_rng(3)
    dev = jax.devices()[0]
    pools = [jax.device_put(p, dev) for p in _random_layers(rng, "bfloat16", 4)]
    ids = _ids(rng, 5)
    expected = _numpy_gather(pools, ids, "npl")
    for device, committed in ((dev, True), (None, False)):
        copier = PageCopier(PageCopyConfig(max_pages=NUM_PAGES), device=device)
        buf, n = copier.gather(pools, ids, "npl")
        assert buf.committed is committed
        np.testing.assert_array_equal(_bits(buf)[:n], expected)
        fresh = [jax.device_put(_poison(p.shape, p.dtype), dev) for p in pools]
        new = copier.scatter_layers(fresh, ids, buf, "npl")
        assert all(a.committed is committed for a in new)
        for a, p in zip(new, pools):
            np.testing.assert_array_equal(_bits(a)[ids], _bits(p)[ids])
    with pytest.raises(ValueError, match="device: only without a mesh"):
        PageCopier(mesh=Mesh(np.array(jax.devices()[:1]), ("kv",)), device=dev)
    with pytest.raises(TypeError, match="device: expected a jax.Device"):
        PageCopier(device="cpu:0")
