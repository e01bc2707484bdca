"""The Ascend KV transfer op (sgl-kernel-npu ``transfer_kv_dim_exchange``): binding and CPU reference.

Facts (upstream sglang's NPU host pools and the pinned wrapper's keyword names):
``transfer_kv_dim_exchange(device_indices, host_indices, device_k, host_k, device_v, host_v,
device_index_k=None, host_index_k=None, page_size=128, direction=H2D|D2H, flags=FAST2D)``.
Device tensors are ``(L, P_dev, page, H, w)``, host tensors ``(P_host, L, page, H, w)``; the
indices are *token* indices, moved to CPU by the op, of which only the first token of each
page is used; one 2-D copy per page per tensor (all layers at once) on the current stream;
V (and index_k) skipped when empty.

Signature skew: newer wrappers take extra optional ``*_index_k_scale`` arguments, forks add
``layer_start``/``layer_num`` in different positional orders. So the op is always called
with keyword arguments, after ``bind_op`` has checked its signature with ``inspect``;
a signature we cannot satisfy by keyword is reported (``OpSignatureError``) and the engine
falls back to a torch copy (or raises when the op was explicitly requested).

``transfer_kv_dim_exchange_reference`` is a torch implementation with the op's semantics and
keyword names, for CPU tests (the CPU tier of the test tiers, README "Tests"). It is stricter than the kernel: the
kernel does not bounds-check page ids, validate contiguity, or check that the tokens after
the first of each page belong to it; the reference raises on all of these (``strict=False``
reproduces the kernel's first-token-only reading of the indices).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import _lazy

torch = _lazy.torch()

H2D = 1
D2H = 2
FLAG_1D = 1
FAST2D = 2  # the op requires this flag bit

# Arguments this project can supply by keyword; the first group must be accepted.
REQUIRED_KWARGS = ("device_indices", "host_indices", "device_k", "host_k", "page_size", "direction")
OPTIONAL_KWARGS = ("device_v", "host_v", "flags", "layer_start", "layer_num")


class OpSignatureError(TypeError):
    """The installed op's signature cannot be called safely with keyword arguments."""


def page_token_indices(page_ids: np.ndarray, page_size: int) -> "torch.Tensor":
    """CPU int64 token indices of whole pages: ``id*page + [0, page)`` for each id, in order."""
    ids = np.asarray(page_ids, dtype=np.int64)
    tok = (ids[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).reshape(-1)
    return torch.from_numpy(tok)


def _pages_from_tokens(indices, page_size: int, name: str, strict: bool) -> "torch.Tensor":
    idx = torch.as_tensor(indices).to("cpu", torch.int64).reshape(-1)
    if idx.numel() % page_size:
        raise ValueError(
            f"{name}: {idx.numel()} indices is not a multiple of page_size {page_size} "
            "(partial pages are not supported)"
        )
    groups = idx.reshape(-1, page_size)
    first = groups[:, 0]
    if strict:
        whole = (first % page_size == 0) & (groups == first[:, None] + torch.arange(page_size)).all(dim=1)
        if not bool(whole.all()):
            bad = torch.nonzero(~whole).reshape(-1)[:4].tolist()
            raise ValueError(f"{name}: groups {bad} are not whole aligned pages (partial pages are not supported)")
    return torch.div(first, page_size, rounding_mode="floor")


def _check_pair(dev, host, name: str) -> None:
    if dev.dim() != 5 or host.dim() != 5:
        raise ValueError(
            f"{name}: expected 5-D device (L, P, page, H, w) and host (P, L, page, H, w) tensors, "
            f"got {tuple(dev.shape)} and {tuple(host.shape)}"
        )
    if dev.shape[0] != host.shape[1]:
        raise ValueError(f"{name}: layer counts differ: device {dev.shape[0]}, host {host.shape[1]}")
    if dev.shape[2:] != host.shape[2:]:
        raise ValueError(f"{name}: page shapes differ: device {tuple(dev.shape[2:])}, host {tuple(host.shape[2:])}")
    if not (dev.is_contiguous() and host.is_contiguous()):
        raise ValueError(f"{name}: tensors must be contiguous (the kernel copies raw 2-D blocks)")


def transfer_kv_dim_exchange_reference(
    device_indices,
    host_indices,
    device_k,
    host_k,
    device_v=None,
    host_v=None,
    device_index_k=None,
    host_index_k=None,
    page_size: int = 128,
    direction: int = H2D,
    flags: int = FAST2D,
    strict: bool = True,
) -> None:
    """Torch reference of the Ascend op (see module docstring). Copies in place; returns None."""
    if not flags & FAST2D:
        raise ValueError(f"flags: FAST2D ({FAST2D}) must be set, got {flags}")
    if direction not in (H2D, D2H):
        raise ValueError(f"direction: expected H2D ({H2D}) or D2H ({D2H}), got {direction}")
    dp = _pages_from_tokens(device_indices, page_size, "device_indices", strict)
    hp = _pages_from_tokens(host_indices, page_size, "host_indices", strict)
    if dp.numel() != hp.numel():
        raise ValueError(f"device_indices and host_indices: {dp.numel()} vs {hp.numel()} pages")
    pairs = [(device_k, host_k, "k")]
    for d, h, name in ((device_v, host_v, "v"), (device_index_k, host_index_k, "index_k")):
        if d is not None and h is not None and d.numel() and h.numel():  # empty V is skipped, as in the op
            pairs.append((d, h, name))
    for d, h, name in pairs:
        _check_pair(d, h, name)
        if d.shape[2] != page_size:
            raise ValueError(f"{name}: page axis {d.shape[2]} != page_size {page_size}")
        if d.element_size() != device_k.element_size():  # the kernel sizes every copy by K's element size
            raise ValueError(f"{name}: element size {d.element_size()} differs from K's {device_k.element_size()}")
        if dp.numel() and (
            int(dp.max()) >= d.shape[1] or int(hp.max()) >= h.shape[0] or int(dp.min()) < 0 or int(hp.min()) < 0
        ):
            raise IndexError(f"{name}: page ids out of range (device < {d.shape[1]}, host < {h.shape[0]})")
    for d, h, _ in pairs:
        # Per page, one block (L, page*H*w) moves: device rows strided by P, host rows contiguous.
        for i in range(dp.numel()):
            dpi, hpi = int(dp[i]), int(hp[i])
            if direction == D2H:
                h[hpi].copy_(d[:, dpi])
            else:
                d[:, dpi].copy_(h[hpi])


@dataclass
class BoundOp:
    """An op whose signature was checked: ``call(**core)`` passes only accepted keywords."""

    fn: Callable
    accepted: frozenset
    var_kw: bool
    extras: dict = field(default_factory=dict)  # fork-only required arguments we fill in

    def kwargs(self, core: dict, num_layers: int) -> dict:
        out = {k: v for k, v in core.items() if self.var_kw or k in self.accepted}
        for k, v in (("layer_start", 0), ("layer_num", num_layers)):
            if k in self.accepted:
                out[k] = v
        return out

    def call(self, core: dict, num_layers: int) -> object:
        return self.fn(**self.kwargs(core, num_layers))


def bind_op(fn: Callable, need_v: bool) -> BoundOp:
    """Check ``fn``'s signature; OpSignatureError when a keyword call cannot be made safely."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise OpSignatureError(f"cannot read the signature of {fn!r}: {e}") from e
    params = sig.parameters.values()
    pos_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    if pos_only:
        raise OpSignatureError(f"positional-only parameters {pos_only} cannot be passed by keyword")
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    supplied = set(REQUIRED_KWARGS) | set(OPTIONAL_KWARGS)
    unknown_required = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in supplied
    ]
    if unknown_required:
        raise OpSignatureError(f"required parameters {unknown_required} are unknown to npu_bridge (signature {sig})")
    missing = [k for k in REQUIRED_KWARGS if k not in named and not var_kw]
    if need_v:
        missing += [k for k in ("device_v", "host_v") if k not in named and not var_kw]
    if missing:
        raise OpSignatureError(f"parameters {missing} are not accepted (signature {sig})")
    return BoundOp(fn, frozenset(named), var_kw)


def find_op(required: bool = False) -> Callable | None:
    """The installed ``transfer_kv_dim_exchange`` or None (imports sgl_kernel_npu lazily)."""
    mod = _lazy.kvcacheio(required=required)
    fn = getattr(mod, _lazy.TRANSFER_OP_NAME, None) if mod is not None else None
    if fn is None and required:
        raise _lazy.MissingDependencyError(f"{_lazy.KVCACHEIO_MODULE} has no {_lazy.TRANSFER_OP_NAME}")
    return fn
