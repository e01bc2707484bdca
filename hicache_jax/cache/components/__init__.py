"""KV components of one cache: the plug-in interface (``base``), the target KV (``full``),
sidecars that follow its page ids (``sidecar``) and the registry that issues their transfers
(``registry``). See ``base`` for the hooks."""

from .base import KVComponent
from .full import FULL, FullComponent
from .registry import ComponentRegistry, MultiLoadHandle, MultiTransferHandle
from .sidecar import SidecarComponent

__all__ = ["FULL", "ComponentRegistry", "FullComponent", "KVComponent", "MultiLoadHandle", "MultiTransferHandle",
           "SidecarComponent"]
