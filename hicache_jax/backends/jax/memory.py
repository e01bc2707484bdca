"""Host memory kinds: pinned where the platform has it, else unpinned / plain numpy."""

from __future__ import annotations

import jax


def host_memory_kind(device: jax.Device | None = None) -> str | None:
    """The best host memory kind a device can address: 'pinned_host', 'unpinned_host' or None.

    'unpinned_host' is never chosen on TPU: it corrupts bf16 there (REFERENCE.md 5.1).
    """
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - very old runtimes have no memories API
        return None
    if "pinned_host" in kinds:
        return "pinned_host"
    if "unpinned_host" in kinds and device.platform != "tpu":
        return "unpinned_host"
    return None
