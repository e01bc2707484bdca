"""Lazy, explicit imports of torch, torch_npu and the Ascend kernel package.

``import npu_bridge`` imports none of them. Each loader imports its package on first use and
turns a failure into a ``MissingDependencyError`` that names the package, why it is needed and
how to get it, instead of a bare ``ModuleNotFoundError`` from deep inside a backend.

torch_npu: never ``torch_npu.contrib.transfer_to_npu`` (it patches ``torch.cuda`` globally).
Without CANN, importing torch_npu fails on missing Ascend libraries (torch_npu's own packaging: it links against CANN at import); that
error is reported with its cause.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


class MissingDependencyError(ImportError):
    """A package npu_bridge needs for the requested feature is not importable."""


_TORCH_HINT = "install torch==2.13.0 (the 'npu' extra: pip install 'hicache-jax[npu]'; never an unpinned torch)"


def torch() -> ModuleType:
    """The torch module; MissingDependencyError naming torch if absent."""
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise MissingDependencyError(f"npu_bridge needs torch: {_TORCH_HINT} ({e})") from e


def torch_npu() -> ModuleType:
    """Import torch_npu (registers the 'npu' device with torch)."""
    torch()
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise MissingDependencyError(
            "device 'npu' needs torch_npu (matching torch 2.13) and Ascend CANN libraries; "
            f"importing torch_npu failed: {e!r}"
        ) from e
    except OSError as e:  # missing libascendcl / libhccl surfaces as OSError on some builds
        raise MissingDependencyError(f"torch_npu is installed but its CANN libraries are missing: {e!r}") from e


KVCACHEIO_MODULE = "sgl_kernel_npu.kvcacheio"
TRANSFER_OP_NAME = "transfer_kv_dim_exchange"


def kvcacheio(required: bool = False) -> ModuleType | None:
    """``sgl_kernel_npu.kvcacheio`` or None when absent (it is optional: a torch copy is the fallback).

    With ``required=True`` absence raises MissingDependencyError naming the package.
    """
    try:
        return importlib.import_module(KVCACHEIO_MODULE)
    except ImportError as e:
        if required:
            raise MissingDependencyError(
                f"the Ascend transfer op needs {KVCACHEIO_MODULE} (package sgl-kernel-npu, built from source; "
                f"not on PyPI): {e!r}"
            ) from e
        return None


def loaded(name: str) -> bool:
    """Whether ``name`` is already imported (for tests of laziness)."""
    return name in sys.modules
