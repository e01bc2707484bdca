"""The ``mooncake`` L3 backend (a Mooncake Store client) and a local master for tests and benchmarks.

``MooncakeStorage`` (``store``) needs the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``)
and, on Debian, ``libibverbs1 librdmacm1 libnuma1``; it is imported only when created.
``MooncakeMaster`` (``server``) starts a local store on free loopback ports: a master, its HTTP
metadata server and a store node (a long-lived client lending the memory the pages live in, so
they outlive the engines that wrote them); ``unavailable_reason()`` says why one cannot run here.

Every name is loaded on first use (module ``__getattr__``): importing the package imports no
submodule, so ``python -m hicache_jax.storage.mooncake.server`` runs the module once, as
``__main__``, without runpy's warning about a module already in ``sys.modules``.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "MooncakeStorage": "store",
    "DEFAULT_LOG_LEVEL": "server",
    "DEFAULT_STORE_NODE_BYTES": "server",
    "LOG_LEVELS": "server",
    "MasterStartError": "server",
    "MooncakeMaster": "server",
    "free_port": "server",
    "quiet_client_logs": "server",
    "unavailable_reason": "server",
}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


__all__ = sorted(_NAMES)  # noqa: PLE0605 (a list: the lazy table's names)
