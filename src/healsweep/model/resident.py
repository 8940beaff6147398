"""Layers kept on the device between forwards, within a byte budget.

A trial runs many forwards over the same layers (the teacher trace, then every scored window of
the student), and on an accelerator re-reading and re-sending a layer's bytes each time can cost
more than the layer's arithmetic. Layers read once stay on the device, least recently used first
out, up to a budget: ``HEALSWEEP_RESIDENT_GB`` when set, else half the accelerator's memory on
CUDA/ROCm, and 0 on the CPU and on unified-memory backends (Metal), where device memory is the
host's and a layer's memory is the rule. Entries are keyed by the file's path, size and mtime, so
a rewritten file is never served stale. The store is the process's runtime's
(:func:`resident_layers`), so a fresh :class:`~healsweep.runtime.Runtime` starts empty.

The budget is per GPU, not per host: each trial process of a multi-GPU host has one GPU of its
own (Ray's ``CUDA_VISIBLE_DEVICES``) and keeps ``HEALSWEEP_RESIDENT_GB`` on it. A process that
holds a share of a GPU (a sweep with ``resources: {gpu: 0.5}`` runs two trials on each;
``HEALSWEEP_GPU_SHARE``, set by the sweep's trial task) keeps that share of it, so the processes
of one GPU together keep at most its budget. The default (half the device memory) is half of
this process's allocator limit, which a trial task sets to its share of the GPU.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from healsweep._lru import BoundedLRU, gib_setting
from healsweep.errors import SettingError
from healsweep.runtime import current

_ENV = "HEALSWEEP_RESIDENT_GB"
SHARE_ENV = "HEALSWEEP_GPU_SHARE"


def gpu_share() -> float:
    """This process's share of its GPU: ``HEALSWEEP_GPU_SHARE`` (a number in (0, 1]), else 1."""
    raw = os.environ.get(SHARE_ENV)
    if not raw:
        return 1.0
    try:
        share = float(raw)
    except ValueError:
        share = math.nan
    if not 0.0 < share <= 1.0:
        raise SettingError(
            f"{SHARE_ENV}={raw!r} is not a number in (0, 1]; set it to this process's share of "
            "its GPU (a sweep's trial task sets it from the spec's resources) or unset it"
        )
    return share


def resident_budget() -> int:
    """Bytes of layer weights to keep on the device between forwards: the per-GPU budget times
    this process's share of its GPU (see the module docstring)."""
    configured = gib_setting(_ENV, "layer weights to keep on one GPU")
    if configured is not None:
        return int(configured * gpu_share())
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


def resident_layers() -> ResidentLayers:
    """The layers kept on the device by this process's runtime (:mod:`healsweep.runtime`)."""
    return current().owned(ResidentLayers)
