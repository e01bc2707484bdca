"""Host (L2) pool memory layouts.

Pure numpy. Shapes follow upstream HiCache (sglang's --hicache-mem-layout); ``size`` is in tokens,
``page_num`` in pages, ``d`` = kv_lora_rank + rope dim for MLA.

=====================  ===============================  ==============================
layout                 MHA (leading 2 = K, V)            MLA
=====================  ===============================  ==============================
``layer_first``        ``(2, L, size, H, D)``            ``(L, size, 1, d)``
``page_first``         ``(2, size, L, H, D)``            ``(size, L, 1, d)``
``page_first_direct``  ``(2, page_num, L, page, H, D)``  ``(page_num, L, page, 1, d)``
=====================  ===============================  ==============================

Every layout has a *page-major view* per component in which one host page is one index
along a "page" axis, and a matching *transfer order*: the order a contiguous buffer of
``n`` pages must have so that it lands in the host pool with a single fancy-index copy.

* ``page_first_direct``: view ``(page_num, L, page, H, D)``, transfer order ``nlp`` = ``(n, L, page, H, D)``
* ``page_first``:        view ``(page_num, page, L, H, D)``, transfer order ``npl`` = ``(n, page, L, H, D)``
* ``layer_first``:       view ``(L, page_num, page, H, D)``, transfer order ``lnp`` = ``(L, n, page, H, D)``

The device-side all-layer gather kernel writes these orders directly (the host-layout
conversion is fused into the gather), so a backup is gather -> one D2H -> one host copy.
"""

from __future__ import annotations

from enum import Enum

from .kv_geometry import KVGeometry


class HostLayout(str, Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"

    @classmethod
    def parse(cls, value: "str | HostLayout") -> "HostLayout":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"layout: expected one of {[m.value for m in cls]}, got {value!r}") from None

    @property
    def transfer_order(self) -> str:
        """Axis order of a contiguous n-page transfer buffer: n=pages, l=layers, p=tokens in page."""
        return {"layer_first": "lnp", "page_first": "npl", "page_first_direct": "nlp"}[self.value]


def host_array_shape(geom: KVGeometry, layout: HostLayout, num_pages: int) -> tuple[int, ...]:
    """Shape of the whole host pool array (upstream shapes; MHA has a leading K/V axis of 2)."""
    L, P, H, D = geom.num_layers, geom.page_size, geom.heads, geom.width
    size = num_pages * P
    per_comp = {
        HostLayout.LAYER_FIRST: (L, size, H, D),
        HostLayout.PAGE_FIRST: (size, L, H, D),
        HostLayout.PAGE_FIRST_DIRECT: (num_pages, L, P, H, D),
    }[layout]
    return ((2,) if geom.kind == "mha" else ()) + per_comp


def page_major_shape(geom: KVGeometry, layout: HostLayout, num_pages: int) -> tuple[int, ...]:
    """Shape of one component's page-major view (see module docstring)."""
    L, P, H, D = geom.num_layers, geom.page_size, geom.heads, geom.width
    return {
        HostLayout.LAYER_FIRST: (L, num_pages, P, H, D),
        HostLayout.PAGE_FIRST: (num_pages, P, L, H, D),
        HostLayout.PAGE_FIRST_DIRECT: (num_pages, L, P, H, D),
    }[layout]


def transfer_shape(geom: KVGeometry, layout: HostLayout, n: int) -> tuple[int, ...]:
    """Shape of an n-page transfer buffer for one component in ``layout``'s transfer order."""
    return page_major_shape(geom, layout, n)
