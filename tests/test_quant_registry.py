"""The quantizer registry (issue 42): one class per (quantizer, storage type), looked up by table.

Contract tests over every registered class (as Optuna's run over every sampler): each says what
it reads in terms of real knobs and a real key stage, the classes of one type share one storage
format, an entry round-trips, and the heal stages never branch on a type or a quantizer.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import numpy as np
import pytest

import healsweep
from healsweep.errors import KnobError
from healsweep.gguf_io import TensorType
from healsweep.heal.knobs import Knobs
from healsweep.heal.reads import stage_reads
from healsweep.kernels.ggml_types import ROUTED_TYPES, STORED_TYPES, ggml_type
from healsweep.quant.ggml import (
    GGMLImatrix,
    GGMLStored,
    IQ1GridGptq,
    IQ2GridGptq,
    IQ3GridGptq,
    IQ4GridGptq,
    KGridColumnGptq,
    KGridGptq,
)
from healsweep.quant.q2_0 import Q2Gptq, Q2Plain, Q2Search
from healsweep.quant.registry import (
    GroupInputs,
    QuantizedGroup,
    quantizer_for,
    registered,
    stored,
    types_with,
)
from healsweep.quant.values import GROUPS, Group, Quantizer
from healsweep.stage_names import VERSIONS

PACKAGE = Path(healsweep.__file__).parent
CLASSES = sorted(registered(), key=lambda cls: cls.__name__)


def test_every_type_under_every_quantizer_has_one_class():
    expected = {
        ("q2_0", Quantizer.SEARCH): Q2Search,
        ("q2_0", Quantizer.GPTQ): Q2Gptq,
        ("q2_0", Quantizer.PLAIN): Q2Plain,
        ("q2_k", Quantizer.GPTQ): KGridGptq,
        ("q3_k", Quantizer.GPTQ): KGridGptq,
        ("iq2_xxs", Quantizer.GPTQ): IQ2GridGptq,
        ("iq2_xs", Quantizer.GPTQ): IQ2GridGptq,
        ("iq1_s", Quantizer.GPTQ): IQ1GridGptq,
        ("iq1_m", Quantizer.GPTQ): IQ1GridGptq,
        ("iq3_xxs", Quantizer.GPTQ): IQ3GridGptq,
        ("iq3_s", Quantizer.GPTQ): IQ3GridGptq,
        ("iq4_xs", Quantizer.GPTQ): IQ4GridGptq,
        ("q4_k", Quantizer.GPTQ): KGridColumnGptq,
        ("q5_k", Quantizer.GPTQ): KGridColumnGptq,
    }
    for kind in ROUTED_TYPES:
        for quantizer in Quantizer:
            found = quantizer_for(kind.name, quantizer)
            assert found is expected.get((kind.name, quantizer), GGMLImatrix), (kind, quantizer)
    assert types_with(Quantizer.GPTQ) == (
        "iq1_m", "iq1_s", "iq2_xs", "iq2_xxs", "iq3_s", "iq3_xxs", "iq4_xs", "q2_0", "q2_k", "q3_k",
        "q4_k", "q5_k",
    )  # fmt: skip
    with pytest.raises(KnobError, match="no quantizer stores routed experts as 'q8_0'"):
        quantizer_for("q8_0", Quantizer.SEARCH)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_a_class_states_what_it_reads_in_real_knobs_and_a_versioned_key_stage(cls):
    assert cls.key_stage in VERSIONS
    fields = set(Knobs.model_fields)
    for group in GROUPS:
        assert set(cls.knobs.get(group, ())) <= fields, group
    assert set(cls.inert) <= {name for names in cls.knobs.values() for name in names}
    for name, value in cls.inert.items():
        assert Knobs.model_fields[name].default == value  # inert: the value from before it
    for stored_as in cls.types:
        ggml_type(stored_as)
        for group in GROUPS:
            read = cls.reads(Knobs(quantizer=cls.quantizer or "search"), group, stored_as)
            assert ("type" in read) == cls.keys_type
            assert isinstance(cls.reads_trace(read, group), bool)
            assert isinstance(cls.reads_gate_up(read, group), bool)


def test_the_classes_of_a_type_share_its_storage_format():
    for kind in ROUTED_TYPES:
        serving = [cls for cls in CLASSES if kind.name in cls.types]
        assert serving, kind.name
        for method in ("to_arrays", "from_arrays"):
            assert len({getattr(cls, method).__func__ for cls in serving}) == 1, (kind, method)


def test_what_a_class_reads_is_what_its_key_holds():
    # the key's knobs come from the class: a knob it does not name never reaches its key
    knobs = Knobs(quantizer="gptq", gptq_damp=0.2, gain_gu=1.1, importance="act")
    assert stage_reads(knobs, "quantize", group=Group.GU, stored_as="iq2_s") == {"type": "iq2_s"}
    assert stage_reads(knobs, "quantize", group=Group.GU, stored_as="q2_k") == {
        "type": "q2_k", "quantizer": "gptq", "gptq_damp": 0.2,
    }  # fmt: skip
    assert stage_reads(knobs, "quantize", group=Group.GU, stored_as="q2_0") == {
        "importance": "act", "gain_gu": 1.1, "quantizer": "gptq", "gptq_damp": 0.2,
    }  # fmt: skip


def _rng_stacks(kind, rng, n_exp=2, n_out=4, n_in=256):
    from healsweep.kernels.ggml_decode import GGMLWeight
    from healsweep.kernels.q2_0 import Q2Packed

    if kind.name == "q2_0":
        d = rng.standard_normal((n_exp, n_out, n_in // 64)).astype(np.float16)
        codes = rng.integers(0, 256, (n_exp, n_out, n_in // 4), dtype=np.uint8)
        return Q2Packed(d, codes)
    raw = rng.integers(0, 256, (n_exp, n_out, kind.row_bytes(n_in)), dtype=np.uint8)
    return GGMLWeight(raw, kind.ggml_id, n_in)


@pytest.mark.parametrize("kind", [ROUTED_TYPES[0], ggml_type("q2_0"), ggml_type("q3_k")],
                         ids=lambda kind: kind.name)  # fmt: skip
def test_an_entry_round_trips_through_the_types_storage(kind):
    rng = np.random.default_rng(3)
    group = QuantizedGroup((_rng_stacks(kind, rng), _rng_stacks(kind, rng)), kind.name, {"x": 1})
    arrays, meta = group.to_entry()
    back = QuantizedGroup.from_entry(arrays, meta)
    assert back.type_name == kind.name and back.report == {"x": 1}
    for a, b in zip(group.stacks, back.stacks, strict=True):
        for leaf_a, leaf_b in zip(a.tree_flatten()[0], b.tree_flatten()[0], strict=True):
            np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))
    stack = group.stacks[0]
    assert stored(kind.name).fold_alpha(stack, 1.0) is stack  # alpha 1 is no change


def test_a_new_class_registers_by_being_defined_and_a_taken_pair_is_refused():
    with pytest.raises(TypeError, match=r"\(q2_0, gptq\) is served by Q2Gptq"):

        class Twice(Q2Gptq, types=("q2_0",), quantizer=Quantizer.GPTQ):
            pass

    class Refined(GGMLStored, types=("iq2_s",), quantizer=Quantizer.GPTQ):
        """A stand-in for the next type's GPTQ (issue 39: the IQ1 grids; IQ2_S has none yet): one class."""

        @classmethod
        def quantize(cls, inputs: GroupInputs):
            return (), {}

    try:
        assert quantizer_for("iq2_s", "gptq") is Refined
        assert quantizer_for("iq2_s", "search") is GGMLImatrix
        assert "iq2_s" in types_with(Quantizer.GPTQ)
    finally:
        del Refined
        gc.collect()
    assert quantizer_for("iq2_s", "gptq") is GGMLImatrix


def test_a_class_that_serves_a_type_defines_every_part():
    with pytest.raises(TypeError, match=r"Partial serves .* does not define \['quantize'\]"):

        class Partial(GGMLStored, types=("iq4_xs",), quantizer=Quantizer.PLAIN):
            pass

    gc.collect()
    assert quantizer_for("iq4_xs", "plain") is GGMLImatrix


_QUANTIZER_WORDS = {q.value for q in Quantizer}
_TYPE_WORDS = {t.name for t in ROUTED_TYPES}
_TYPE_MEMBERS = {t.name.upper() for t in STORED_TYPES} | {m.name for m in TensorType}


def _decides(part: ast.expr) -> bool:
    if isinstance(part, ast.Tuple | ast.List | ast.Set):  # `qtype in (T.F16, T.BF16)`
        return any(_decides(element) for element in part.elts)
    text = ast.unparse(part)
    constant = part.value if isinstance(part, ast.Constant) else None
    member = text.rpartition(".")[2]  # T.F32, TensorType.Q8_0, GGMLQuantizationType.BF16
    return (
        text.endswith(".quantizer")
        or text.startswith("Quantizer.")
        or text in ("stored_as", "Q2_0")
        or constant in _QUANTIZER_WORDS | _TYPE_WORDS
        or ("." in text and member in _TYPE_MEMBERS)
        or text.removeprefix("GGML_") in _TYPE_MEMBERS - {text}
    )


def _branches(path: Path) -> list[str]:
    """Comparisons in ``path`` that decide by a quantizer or a storage type: against the
    ``quantizer`` knob, a ``Quantizer`` member, a quantizer's or a type's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        if all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
            continue  # a missing argument, not a choice between types
        if any(_decides(part) for part in [node.left, *node.comparators]):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_nothing_outside_the_registry_and_the_kernels_branches_on_a_type_or_a_quantizer():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] not in ("quant", "kernels"):
            found += _branches(path)
    assert found == []


def test_the_branch_check_finds_a_branch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(knobs, stored_as):\n"
        "    if knobs.quantizer == 'gptq':\n        return 1\n"
        "    return stored_as in ('iq2_xs', 'iq2_xxs')\n"
        "def g(qtype, T):\n"
        "    return qtype == T.F16 or qtype != GGML_IQ1_M or qtype == GGML_RTOL\n"
        "def h(found, qtype, dtype):\n"  # issue 48's last two, and a type in a tuple
        "    a = found.name == Q2_0 or qtype == GGMLQuantizationType.BF16\n"
        "    return a or dtype == np.uint8 and qtype not in (GGMLQuantizationType.I8,)\n"
    )
    assert len(_branches(planted)) == 7
