"""Subprocess driver of the mocked-contract tier: runs one scenario, prints a JSON report.

Usage: python contract_driver.py SCENARIO [kind]. sys.path must hold this folder (the fakes)
and the repository root. MOCKED: the 'npu' here is the fake in ./torch_npu.
"""

import json
import sys

import numpy as np

import fake_log

if __name__ == "__main__" and sys.argv[1:2] == ["no_kernel"]:
    sys.modules["sgl_kernel_npu"] = None  # the kernel package is not installed: any import of it fails


def _mods():
    return {m: m in sys.modules for m in ("torch", "torch_npu", "sgl_kernel_npu", "sgl_kernel_npu.kvcacheio")}


def _geom(kind):
    from hicache_jax import KVGeometry

    if kind == "mha":
        return KVGeometry.mha(3, 4, 2, 8, "bfloat16"), "page_first_direct"
    if kind == "mla_norope":
        return KVGeometry.mla(3, 4, 12, 0, "float8_e4m3fn"), "page_first_kv_split"
    return KVGeometry.mla(3, 4, 12, 4, "float8_e4m3fn"), "page_first_kv_split"


def _bits(t):
    import torch

    return t.view(torch.int8 if t.element_size() == 1 else torch.int16)


def _fill(dev, geom, seed=0):
    import torch

    rng = np.random.default_rng(seed)
    for t in dev.buffers.values():  # fake npu tensors are CPU tensors: fill directly
        bits = _bits(t)
        bits.copy_(torch.from_numpy(rng.integers(-100, 100, tuple(bits.shape)).astype(np.int64)))


def roundtrip(kind, deferred=False):
    import torch

    report = {"before_import": _mods()}
    import npu_bridge

    report["after_import_npu_bridge"] = _mods()
    geom, layout = _geom(kind)
    start = len(fake_log.EVENTS)
    dev, host, eng = npu_bridge.make_torch_backend(geom, 8, 6, layout, device="npu", deferred=deferred)
    report["after_backend"] = _mods()
    report["impl"], report["reason"] = eng.impl, eng.impl_reason
    report["allocs"] = [e for e in fake_log.EVENTS[start:] if e["kind"] == "alloc"]
    report["host_pinned_attr"] = host.pinned
    report["streams"] = {"d2h": eng._d2h_stream.name, "h2d": eng._h2d_stream.name}
    _fill(dev, geom)
    want = {c: [_bits(p.tensor)[:, [5, 1]].clone() for p in dev.parts(c)] for c in geom.components}
    mark = len(fake_log.EVENTS)
    hb = eng.backup([5, 1], [4, 0])
    report["backup_calls_before_complete"] = sum(e["kind"] == "op_call" for e in fake_log.EVENTS[mark:])
    eng.complete_all()
    hb.wait()
    report["backup_events"] = fake_log.EVENTS[mark:]
    mark = len(fake_log.EVENTS)
    lh = eng.load([4, 0], [2, 6])
    eng.complete_all()
    lh.wait()
    report["load_events"] = fake_log.EVENTS[mark:]
    report["layers_done"] = [lh.layer_done(layer) for layer in range(geom.num_layers)]
    if not deferred:
        mark = len(fake_log.EVENTS)
        lh.stream_wait_layer(1)
        report["stream_wait_events"] = fake_log.EVENTS[mark:]
    report["roundtrip_ok"] = all(
        torch.equal(_bits(p.tensor)[:, [2, 6]], w) for c in geom.components for p, w in zip(dev.parts(c), want[c])
    )
    report["pages_moved"] = report["roundtrip_ok"] and not all(
        torch.equal(_bits(p.tensor)[:, [2, 6]], _bits(p.tensor)[:, [3, 7]])
        for c in geom.components
        for p in dev.parts(c)
    )
    eng.close()
    return report


def binding():
    """Engine construction with impl='auto' and impl='ascend' against the installed (fake) op."""
    import npu_bridge
    from npu_bridge.ascend_op import OpSignatureError

    geom, layout = _geom("mha")
    out = {}
    for impl in ("auto", "ascend"):
        try:
            _, _, eng = npu_bridge.make_torch_backend(geom, 4, 4, layout, device="npu", impl=impl)
            out[impl] = {"impl": eng.impl, "reason": eng.impl_reason}
            if eng.impl == "ascend":  # one real call, to see the keywords the binding passes
                mark = len(fake_log.EVENTS)
                eng.backup([1], [2]).wait()
                out[impl]["call"] = [e for e in fake_log.EVENTS[mark:] if e["kind"] == "op_call"]
            eng.close()
        except (OpSignatureError, ImportError) as e:
            out[impl] = {"error": type(e).__name__, "message": str(e)}
    return out


def lazy_only():
    report = {"before": _mods()}
    import npu_bridge  # noqa: F401 (imported for what importing it loads)
    import npu_bridge.kv_split_pool  # noqa: F401 (numpy-only module: what importing it loads)

    report["after_import"] = _mods()
    from npu_bridge.devices import resolve_device

    report["after_devices"] = _mods()
    report["device"] = str(resolve_device("npu"))
    report["after_resolve_npu"] = _mods()
    return report


if __name__ == "__main__":
    scenario = sys.argv[1]
    arg = sys.argv[2] if len(sys.argv) > 2 else "mha"
    if scenario == "roundtrip":
        rep = roundtrip(arg)
    elif scenario == "deferred":
        rep = roundtrip(arg, deferred=True)
    elif scenario in ("binding", "no_kernel"):
        rep = binding()
    else:
        rep = lazy_only()
    print("REPORT " + json.dumps(rep, default=str))
