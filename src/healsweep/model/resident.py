"""Layers kept on the device between forwards, within a byte budget.

A trial runs many forwards over the same layers (the teacher trace, then every scored window of
the student), and on an accelerator re-reading and re-sending a layer's bytes each time can cost
more than the layer's arithmetic. Layers read once stay on the device, least recently used first
out, up to a budget: ``HEALSWEEP_RESIDENT_GB`` when set, else half the accelerator's memory on
CUDA/ROCm, and 0 on the CPU and on unified-memory backends (Metal), where device memory is the
host's and a layer's memory is the rule. Entries are keyed by the file's path, size and mtime, so
a rewritten file is never served stale.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from healsweep._lru import BoundedLRU, gib_setting

_ENV = "HEALSWEEP_RESIDENT_GB"


def resident_budget() -> int:
    """Bytes of layer weights to keep on the device between forwards."""
    configured = gib_setting(_ENV, "layer weights to keep on the device")
    if configured is not None:
        return configured
    device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda", "rocm"):
        return 0
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) // 2


def _nbytes(weights: dict[str, Any]) -> int:
    leaves = jax.tree_util.tree_leaves(weights)
    return sum(int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize for leaf in leaves)


class ResidentLayers(BoundedLRU):
    """An LRU of per-layer weight dicts on the device, bounded by :func:`resident_budget`."""

    def __init__(self) -> None:
        super().__init__(resident_budget, _nbytes)

    def get(self, key: tuple, load: Any) -> dict[str, Any]:
        """The weights of ``key``, from the device if kept, else ``load()`` (kept if they fit)."""
        return dict(super().get(key, load))


RESIDENT = ResidentLayers()
