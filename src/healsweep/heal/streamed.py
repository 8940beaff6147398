"""Per-layer values read when asked for: how a built student holds its layers.

A student of a 48-layer model must not hold 48 layers' quantized experts and healed shared
experts: scoring reads one layer at a time (the forward advances every window of a batch through
layer l before it reads layer l + 1), and so does an export. A :class:`LayerMap` is a mapping from
layer index to a value that it loads on each read (from the stage cache, by key) and keeps only
for the last ``keep`` layers read: what it holds is flat in the model's depth.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

V = TypeVar("V")
KEEP = 2  # the layer a forward computes and the next one, which a reader may load ahead


class LayerMap(Mapping[int, V], Generic[V]):
    """``{layer: load(layer)}`` over ``layers``, each value loaded when read and the last
    ``keep`` of them kept (an export reads a layer's tensors one by one; a forward reads the
    next layer on a thread while it computes this one). Thread-safe."""

    def __init__(self, layers: Iterable[int], load: Callable[[int], V], keep: int = KEEP) -> None:
        self._layers = tuple(dict.fromkeys(layers))
        self._load = load
        self._keep = keep
        self._kept: OrderedDict[int, V] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, layer: int) -> V:
        if layer not in self._layers:
            raise KeyError(layer)
        with self._lock:
            if layer in self._kept:
                self._kept.move_to_end(layer)
                return self._kept[layer]
        value = self._load(layer)
        with self._lock:
            self._kept[layer] = value
            while len(self._kept) > self._keep:
                self._kept.popitem(last=False)
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __contains__(self, layer: object) -> bool:
        return layer in self._layers

    def __repr__(self) -> str:
        return f"LayerMap(layers={list(self._layers)}, kept={list(self._kept)})"


def field_of(layers: Mapping[int, V], name: str, layer: int) -> object:
    """``getattr(layers[layer], name)``: a view of one field of another map's values (a
    module-level function, so a map built on it pickles)."""
    return getattr(layers[layer], name)


__all__ = ["KEEP", "LayerMap", "field_of"]
