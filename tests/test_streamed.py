"""LayerMap: a built student's layers, read when asked for and kept two at a time."""

from __future__ import annotations

import pytest

from healsweep.heal.streamed import LayerMap, field_of


def test_a_layer_map_loads_on_read_and_keeps_only_the_last_two():
    loads: list[int] = []

    def load(i: int) -> dict:
        loads.append(i)
        return {"layer": i}

    layers = LayerMap([0, 1, 2, 3], load)
    assert list(layers) == [0, 1, 2, 3] and len(layers) == 4 and 2 in layers and 7 not in layers
    assert loads == []  # iterating, sizing and membership read nothing
    assert layers[1] == {"layer": 1} and layers[1] is layers[1] and loads == [1]
    layers[2], layers[3]  # noqa: B018 (reads)
    assert loads == [1, 2, 3]
    assert layers[1] == {"layer": 1} and loads == [1, 2, 3, 1]  # 1 was let go: read again
    assert layers.get(9) is None
    with pytest.raises(KeyError):
        layers[9]  # noqa: B018
    names = LayerMap(layers, lambda i: field_of(layers, "get", i)("layer"))
    assert [names[i] for i in names] == [0, 1, 2, 3]
