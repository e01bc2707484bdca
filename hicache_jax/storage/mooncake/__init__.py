"""The ``mooncake`` L3 backend (a Mooncake Store client) and a local master for tests and benchmarks.

``MooncakeStorage`` (``store``) needs the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``)
and, on Debian, ``libibverbs1 librdmacm1 libnuma1``; it is imported only when created.
``MooncakeMaster`` (``server``) starts a local store on free loopback ports: a master, its HTTP
metadata server and a store node (a long-lived client lending the memory the pages live in, so
they outlive the engines that wrote them); ``unavailable_reason()`` says why one cannot run here.
"""

from __future__ import annotations

from .server import DEFAULT_STORE_NODE_BYTES, MasterStartError, MooncakeMaster, free_port, unavailable_reason


def __getattr__(name: str):
    if name == "MooncakeStorage":
        from .store import MooncakeStorage
        return MooncakeStorage
    raise AttributeError(name)


__all__ = ["DEFAULT_STORE_NODE_BYTES", "MasterStartError", "MooncakeMaster", "MooncakeStorage", "free_port",
           "unavailable_reason"]
