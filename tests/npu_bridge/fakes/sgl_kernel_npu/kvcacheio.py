"""FAKE sgl_kernel_npu.kvcacheio (mocked-contract tier).

``transfer_kv_dim_exchange`` has the signature picked by env FAKE_OP_VARIANT (the skew seen
across sgl_kernel_npu versions), records every call (positional vs keyword arguments,
current stream, index devices) and moves pages with its own minimal copy: first token of each
page, all layers at once, V skipped when empty.
"""

import inspect
import os

import torch  # noqa: F401 (the real extension loads torch: so does the fake)

import fake_log
import torch_npu

fake_log.record("import", module="sgl_kernel_npu.kvcacheio")

P = inspect.Parameter


def _kw(name, default=P.empty, kind=P.POSITIONAL_OR_KEYWORD):
    return P(name, kind, default=default)


_BASE = [
    _kw("device_indices"),
    _kw("host_indices"),
    _kw("device_k"),
    _kw("host_k"),
    _kw("device_v"),
    _kw("host_v"),
    _kw("device_index_k", None),
    _kw("host_index_k", None),
    _kw("page_size", 128),
    _kw("direction", 1),
    _kw("flags", 2),
]
VARIANTS = {
    "pinned": _BASE,
    "newest": _BASE + [_kw("device_index_k_scale", None), _kw("host_index_k_scale", None)],
    # a fork: layer range inserted before page_size, without defaults
    "fork": _BASE[:6] + [_kw("layer_num"), _kw("layer_start")] + _BASE[6:],
    "posonly": [P(p.name, P.POSITIONAL_ONLY, default=p.default) for p in _BASE],
    "unknown": _BASE[:6] + [_kw("stream_handle")] + _BASE[6:],
}


class _FakeOp:
    def __init__(self, variant):
        self.variant = variant
        self.__signature__ = inspect.Signature(VARIANTS[variant])

    def __call__(self, *args, **kwargs):
        bound = self.__signature__.bind(*args, **kwargs)  # TypeError like the real wrapper on bad args
        bound.apply_defaults()
        a = bound.arguments
        fake_log.record(
            "op_call",
            n_positional=len(args),
            keywords=sorted(kwargs),
            stream=torch_npu.current_stream().name,
            direction=a["direction"],
            flags=a["flags"],
            page_size=a["page_size"],
            index_devices=[str(a["device_indices"].device), str(a["host_indices"].device)],
            index_dtypes=[str(a["device_indices"].dtype), str(a["host_indices"].dtype)],
            n_indices=int(a["device_indices"].numel()),
            layer_args={k: a[k] for k in ("layer_start", "layer_num") if k in a},
            k_shapes=[list(a["device_k"].shape), list(a["host_k"].shape)],
        )
        ps = a["page_size"]
        dpages = (a["device_indices"][::ps] // ps).tolist()
        hpages = (a["host_indices"][::ps] // ps).tolist()
        pairs = [(a["device_k"], a["host_k"])]
        if a["device_v"] is not None and a["device_v"].numel():
            pairs.append((a["device_v"], a["host_v"]))
        for dev, host in pairs:
            for dp, hp in zip(dpages, hpages):
                if a["direction"] == 2:
                    host[hp] = dev[:, dp]
                else:
                    dev[:, dp] = host[hp]


transfer_kv_dim_exchange = _FakeOp(os.environ.get("FAKE_OP_VARIANT", "pinned"))
