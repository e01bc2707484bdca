"""KV components of one cache: the plug-in interface (``base``), the target KV (``full``),
sidecars that follow its page ids (``sidecar``), the sliding-window KV of hybrid models with
its own pools (``swa``) and the registry that issues their transfers (``registry``). See
``base`` for the hooks."""

from .base import ComponentContext, CopyPlan, KVComponent, NoRoom
from .full import FULL, FullComponent
from .registry import ComponentRegistry, MultiLoadHandle, MultiTransferHandle
from .sidecar import SidecarComponent
from .swa import SWA, SWAComponent, SWAMetrics

__all__ = [
    "FULL",
    "SWA",
    "ComponentContext",
    "ComponentRegistry",
    "CopyPlan",
    "FullComponent",
    "KVComponent",
    "MultiLoadHandle",
    "MultiTransferHandle",
    "NoRoom",
    "SWAComponent",
    "SWAMetrics",
    "SidecarComponent",
]
