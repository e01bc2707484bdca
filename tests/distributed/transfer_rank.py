"""One rank of the two-process transfer test (``test_engine_ranks``): a device pool sharded over
both processes' devices on the KV-head axis (MHA; MLA replicated, and so is a one-head MHA pool
built with ``replicate_fewer_heads``, as a draft pool with fewer heads than ranks), each
process's host pool holding its own heads (all of them for a replicated pool). Pages written through the global pool must come back bit-exact: D2H
into this rank's host pages (its heads only), H2D back into other device pages. Prints "ok".
"""

from __future__ import annotations

import numpy as np

from hicache_jax.distributed import initialize_from_env, run_rank


def main() -> None:
    rank, n = initialize_from_env()
    import jax
    from jax.sharding import Mesh

    from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine
    from hicache_jax.backends.jax.transfer_engine import local_numpy
    from hicache_jax.host_pool import HostKVPool
    from hicache_jax.kv_geometry import KVGeometry

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("tp",))
    for geom, layout, fewer in (
        (KVGeometry.mha(2, 4, 4, 8, "float32"), "page_first", False),
        (KVGeometry.mha(2, 4, 2, 8, "bfloat16"), "layer_first", False),
        (KVGeometry.mla(2, 4, 8, 4, "float32"), "page_first_direct", False),
        (KVGeometry.mha(2, 4, 1, 8, "float32"), "page_first", True),
    ):
        dev = JaxDevicePool(geom, 16, mesh=mesh, replicate_fewer_heads=fewer)
        assert dev.replicated == (geom.kind == "mla" or fewer), geom
        lg = dev.local_geom
        assert lg.heads == (geom.heads if dev.replicated else geom.heads // n), lg
        host = HostKVPool(lg, 16, layout)
        eng = JaxTransferEngine(dev, host)
        assert eng.replicated == dev.replicated
        rng = np.random.default_rng(0)  # the same global pages on every rank (device_put checks it)
        full = {c: rng.random((geom.num_layers, 3) + geom.page_shape, np.float32) for c in geom.components}
        for c in geom.components:
            dev.write_pages_host(c, [1, 2, 3], full[c].astype(dev.dtype))
        eng.backup([1, 2, 3], [5, 6, 7]).wait()
        h0 = 0 if dev.replicated else rank * lg.heads
        order = host.layout.transfer_order
        for c in geom.components:
            exp = full[c].astype(dev.dtype)[..., h0 : h0 + lg.heads, :].view(geom.container_dtype)  # (L, n, page, H, D)
            got = host.read_pages(c, np.array([5, 6, 7]))
            got = (
                got.transpose(2, 0, 1, 3, 4)
                if order == "npl"
                else got.transpose(1, 0, 2, 3, 4)
                if order == "nlp"
                else got
            )
            assert np.array_equal(got, exp), (rank, c, layout)
        lh = eng.load([5, 6, 7], [9, 10, 11])
        for layer in range(geom.num_layers):
            lh.wait_layer(layer)
        for c in geom.components:
            for layer, arr in enumerate(dev.layers(c)):
                loc = local_numpy(arr)[[9, 10, 11]].view(geom.container_dtype)
                exp = full[c][layer].astype(dev.dtype)[..., h0 : h0 + lg.heads, :].view(geom.container_dtype)
                assert np.array_equal(loc, exp), (rank, c, layer, layout)
        eng.close()
    print("ok", rank)


if __name__ == "__main__":
    run_rank(main)
