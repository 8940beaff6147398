"""A least-recently-used store bounded by bytes, and the GiB settings that size such stores.

Used for layers kept on the device between forwards (:mod:`healsweep.model.resident`) and for
stage-cache entries kept in host memory between the trials of one worker (:mod:`healsweep.cache`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from healsweep.errors import SettingError


def gib_setting(env: str, what: str) -> int | None:
    """Bytes from the environment variable ``env`` (GiB, a number), or None when unset.
    A value that is not a number is a one-line :class:`SettingError` naming ``what`` it sizes."""
    raw = os.environ.get(env)
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        raise SettingError(
            f"{env}={raw!r} is not a number; set it to the GiB of {what} (0 keeps none) or "
            "unset it"
        ) from None
    return max(int(gib * 2**30), 0)


class BoundedLRU:
    """Values kept least recently used first out, up to ``budget()`` bytes (each value weighs
    ``size(value)``). A value larger than the budget is returned but not kept. Thread-safe."""

    def __init__(self, budget: Callable[[], int], size: Callable[[Any], int]) -> None:
        self._budget = budget
        self._size = size
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], Any]) -> Any:
        """The value of ``key``: kept, or ``load()`` (then kept if it fits)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key][0]
        value = load()
        if value is None:
            return None
        budget, size = self._budget(), self._size(value)
        with self._lock:
            if size <= budget and key not in self._entries:
                while self._entries and self._bytes + size > budget:
                    _, (_, freed) = self._entries.popitem(last=False)
                    self._bytes -= freed
                self._entries[key] = (value, size)
                self._bytes += size
        return value

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the values kept now."""
        return self._bytes

    def clear(self) -> None:
        """Drop every kept value."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
