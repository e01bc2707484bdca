"""Device handling through torch's device-module abstraction (``torch.get_device_module``).

One code path serves ``npu``, ``cuda`` and ``cpu``. On ``cpu`` the module is ``torch.cpu``,
whose streams and argument-less events exist but do nothing (torch 2.13's CPU device module), so anything
that must really be ordered on CPU is ordered by threads instead (see ``transfer``).
Gated on ``device.type != "cpu"``: pinned memory, ``record_stream``, timing events.

dtypes: KV moves as raw bits. Device tensors hold the logical dtype (what a model reads);
copies go through a *signed* integer view of the same width, because torch implements
indexing for int8/16/32 but not for uint16/uint32, and numpy sees the same bytes through the
geometry's unsigned container dtype.
"""

from __future__ import annotations

from hicache_jax.kv_geometry import KVGeometry

from . import _lazy

torch = _lazy.torch()

_LOGICAL = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def resolve_device(device: "str | torch.device") -> "torch.device":
    """A ``torch.device``; for ``npu`` imports torch_npu first (it registers the device type)."""
    name = device.type if isinstance(device, torch.device) else str(device)
    if name.split(":")[0] == "npu":
        _lazy.torch_npu()
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, device_module(dev).current_device())
    return dev


def device_module(device: "torch.device"):
    """``torch.npu`` / ``torch.cuda`` / ``torch.cpu``."""
    return torch.get_device_module(device)


def is_accelerator(device: "torch.device") -> bool:
    return device.type != "cpu"


def supports_pinned(device: "torch.device") -> bool:
    """Pinned host memory exists only next to an accelerator (torch raises on a CPU-only build)."""
    return is_accelerator(device)


def logical_dtype(geom: KVGeometry) -> "torch.dtype":
    return _LOGICAL[geom.dtype]


def bits_dtype(geom: KVGeometry) -> "torch.dtype":
    """Signed integer dtype of the KV width (torch can index these; see module docstring)."""
    return _BITS[geom.itemsize]
