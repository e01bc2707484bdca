"""Physical parts of a logical KV component, shared by the torch device and host pools.

A component (``'k'``, ``'v'`` or ``'kv'``) is stored as one or more tensors that split its
width: one tensor normally, two for MLA under ``page_first_kv_split`` (lora ``[0, lora)`` and
rope ``[lora, d)``, as upstream's NPU pools keep them). Engines pair device and host parts
by position and require equal widths, so a copy never reshapes across a split.
"""

from __future__ import annotations

from dataclasses import dataclass

# Axis that indexes pages in a host part's page-major view, per transfer order:
# nlp (page, L, tok, H, w), npl (page, tok, L, H, w), lnp (L, page, tok, H, w).
PAGE_AXIS = {"nlp": 0, "npl": 0, "lnp": 1}


@dataclass(frozen=True)
class Part:
    name: str
    tensor: object  # torch.Tensor: device (L, P, page, H, w); host: page-major view in the layout's order
    lo: int  # width slice [lo, hi) of the logical component
    hi: int

    @property
    def width(self) -> int:
        return self.hi - self.lo
