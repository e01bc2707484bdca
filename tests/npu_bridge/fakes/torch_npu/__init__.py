"""FAKE torch_npu (mocked-contract tier): registers an 'npu' device whose tensors live on CPU.

What it stands in for: the device name, ``torch.npu`` (streams, events, current stream per
thread), and allocation (``torch.empty``/``torch.zeros`` with ``device='npu'`` or
``pin_memory=True``), which it records and serves from CPU memory. Never real hardware.
"""

import contextlib
import threading

import torch

import fake_log

_tls = threading.local()


class Stream:
    _count = 0

    def __init__(self, device=None, priority=0):
        Stream._count += 1
        self.name = f"stream{Stream._count}"
        self.device = device

    def wait_stream(self, other):
        fake_log.record("wait_stream", stream=self.name, on=other.name)

    def wait_event(self, event):
        fake_log.record("wait_event", stream=self.name, event=event.name)

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT = Stream()
_DEFAULT.name = "default"


def current_stream(device=None):
    return getattr(_tls, "stream", _DEFAULT)


@contextlib.contextmanager
def stream(s):
    prev = current_stream()
    _tls.stream = s
    try:
        yield
    finally:
        _tls.stream = prev


class Event:
    _count = 0

    def __init__(self, *args, **kwargs):
        Event._count += 1
        self.name = f"event{Event._count}"
        self.recorded_on = None

    def record(self, stream=None):
        self.recorded_on = (stream or current_stream()).name
        fake_log.record("event_record", event=self.name, stream=self.recorded_on)

    def query(self):
        return self.recorded_on is not None

    def synchronize(self):
        assert self.recorded_on is not None, "synchronize on an unrecorded event"

    def wait(self, stream=None):
        (stream or current_stream()).wait_event(self)


def is_available():
    return True


def device_count():
    return 1


def current_device():
    return 0


def synchronize(device=None):
    pass


npu = __import__("types").ModuleType("torch.npu")
for _name in (
    "Stream",
    "Event",
    "current_stream",
    "stream",
    "is_available",
    "device_count",
    "current_device",
    "synchronize",
):
    setattr(npu, _name, globals()[_name])

torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)

_real_empty, _real_zeros = torch.empty, torch.zeros


def _serve(real, *shape, **kw):
    dev = kw.get("device")
    dev_type = torch.device(dev).type if dev is not None else "cpu"
    pin = bool(kw.pop("pin_memory", False))
    fake_log.record(
        "alloc",
        fn=real.__name__,
        shape=list(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape),
        device=dev_type,
        pin_memory=pin,
        dtype=str(kw.get("dtype")),
    )
    if dev_type == "npu":
        kw["device"] = "cpu"
    return real(*shape, **kw)


torch.empty = lambda *s, **kw: _serve(_real_empty, *s, **kw)
torch.zeros = lambda *s, **kw: _serve(_real_zeros, *s, **kw)

fake_log.record("import", module="torch_npu")
__version__ = "0.0.fake"
