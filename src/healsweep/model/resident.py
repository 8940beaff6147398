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

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from healsweep.errors import SettingError

_ENV = "HEALSWEEP_RESIDENT_GB"


def resident_budget() -> int:
    """Bytes of layer weights to keep on the device between forwards."""
    if os.environ.get(_ENV):
        try:
            gib = float(os.environ[_ENV])
        except ValueError:
            raise SettingError(
                f"{_ENV}={os.environ[_ENV]!r} is not a number; set it to the GiB of layer "
                "weights to keep on the device (0 keeps none) or unset it"
            ) from None
        return max(int(gib * 2**30), 0)
    device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda", "rocm"):
        return 0
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) // 2


def _nbytes(weights: dict[str, Any]) -> int:
    leaves = jax.tree_util.tree_leaves(weights)
    return sum(int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize for leaf in leaves)


class ResidentLayers:
    """An LRU of per-layer weight dicts on the device, bounded by :func:`resident_budget`."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, tuple[dict[str, Any], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The weights of ``key``, from the device if kept, else ``load()`` (kept if they fit)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return dict(self._entries[key][0])
        weights = load()
        budget = resident_budget()
        size = _nbytes(weights)
        with self._lock:
            if size <= budget and key not in self._entries:
                while self._entries and self._bytes + size > budget:
                    _, (_, freed) = self._entries.popitem(last=False)
                    self._bytes -= freed
                self._entries[key] = (weights, size)
                self._bytes += size
        return dict(weights)

    def clear(self) -> None:
        """Drop every kept layer."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0


RESIDENT = ResidentLayers()
