"""The routed-expert type table against gguf-py's and ggml's own type traits.

gguf-py (every type but Q2_0, which it does not name) gives ids and block geometry; ggml (slow
tier, the ``[bench]`` extra) gives all of them, Q2_0 included, and says which types its quantizer
refuses without an importance matrix. Bits per weight are also checked against the figures
llama.cpp publishes for its types.
"""

from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from healsweep.errors import KnobError
from healsweep.gguf_io import FOLDABLE_TYPES
from healsweep.kernels.ggml_decode import IN_GRAPH_TYPES, block_geometry
from healsweep.kernels.ggml_types import ROUTED_TYPES, GGMLType, ggml_type

T = GGMLQuantizationType
# bits per weight as llama.cpp's sources state them (ggml-common.h, ggml-quants.c), Q2_0's from
# DESIGN.md
PUBLISHED_BPW = {"iq1_s": 1.5625, "iq1_m": 1.75, "iq2_xxs": 2.0625, "q2_0": 2.25, "iq2_xs": 2.3125,
                 "iq2_s": 2.5625, "q2_k": 2.625, "iq3_xxs": 3.0625, "iq3_s": 3.4375,
                 "q3_k": 3.4375, "iq4_xs": 4.25, "iq4_nl": 4.5, "q4_k": 4.5,
                 "q5_k": 5.5}  # fmt: skip


def test_table_matches_gguf_py_and_the_decoders():
    names = [t.name for t in ROUTED_TYPES]
    assert len(set(names)) == len(names) and len({t.ggml_id for t in ROUTED_TYPES}) == len(names)
    issue_29 = {"iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "q2_k", "iq3_xxs", "iq3_s", "q3_k", "q4_k"}
    assert issue_29 <= set(names)
    for t in ROUTED_TYPES:
        geometry = (t.block_weights, t.block_bytes)
        if t.name == "q2_0":
            assert t.ggml_id == 42 and geometry == (64, 18)
        else:
            assert int(T[t.name.upper()]) == t.ggml_id
            assert GGML_QUANT_SIZES[T(t.ggml_id)] == geometry
        assert block_geometry(t.ggml_id) == geometry
        assert t.ggml_id in IN_GRAPH_TYPES and t.ggml_id in FOLDABLE_TYPES
        assert t.bits_per_weight == PUBLISHED_BPW[t.name]
    bpw = [t.bits_per_weight for t in ROUTED_TYPES]
    assert bpw == sorted(bpw)


def test_lookup_by_name_id_and_enum():
    assert ggml_type("IQ2_XS") is ggml_type("iq2_xs") is ggml_type(17) is ggml_type(T.IQ2_XS)
    assert ggml_type(42).name == "q2_0"
    assert ggml_type("q2_k").row_bytes(512) == 168
    for bad in ("q8_0", "iq5", 0, 999):
        with pytest.raises(KnobError, match="not a routed-expert type") as info:
            ggml_type(bad)
        assert "\n" not in str(info.value) and "iq2_xxs" in str(info.value)
    with pytest.raises(KnobError, match="blocks of 256"):
        ggml_type("iq2_xxs").row_bytes(320)
    assert isinstance(ROUTED_TYPES[0], GGMLType)


@pytest.mark.slow
def test_table_matches_ggml():
    from healsweep.gguf_io._ggml_lib import block_geometry as ggml_geometry
    from healsweep.gguf_io._ggml_lib import libggml, requires_imatrix

    for t in ROUTED_TYPES:
        assert ggml_geometry(t.ggml_id) == (t.block_weights, t.block_bytes), t.name
        assert requires_imatrix(t.ggml_id) == t.requires_imatrix, t.name
        name = libggml().ggml_get_type_traits(t.ggml_id).contents.type_name.decode()
        assert name.lower() == t.name
