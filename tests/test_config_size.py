"""A config's routed bits per weight and file bytes, from its knobs and the model's shapes alone,
checked against the files ``export`` and ``baseline llama`` really write (the routed tensors'
stored bytes, the data section, the ``healsweep.*`` metadata an export adds).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from _heal_fixtures import heal_setup
from healsweep.cache import StageCache
from healsweep.gguf_io import routed_expert_bpw
from healsweep.gguf_io._header import read_header
from healsweep.heal.export import routed_bits_per_weight, write_healed_gguf
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.size import MIB, ConfigSize, ModelShapes, config_size
from healsweep.kernels.ggml_types import ggml_type
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
setup = heal_setup


def _file_parts(path) -> tuple[int, int, int]:
    """(file size, size of its tensor data section, bytes of its healsweep.* key-value entries),
    as healsweep's header parser reads the file (gguf-py does not name type 42)."""
    header = read_header(path)
    extra = sum(f.end - f.offset for f in header.fields.values() if f.name.startswith("healsweep."))
    size = path.stat().st_size
    return size, size - header.data_offset, extra


def _check_against_file(model, knobs, written) -> ConfigSize:
    """``config_size`` of ``knobs`` equals what gguf-py reads in the file ``written``: its routed
    bpw, and its bytes but for the ``healsweep.*`` metadata (the data section exactly)."""
    predicted = config_size(model, knobs)
    assert predicted.routed_bpw == routed_expert_bpw(open_model(written))
    teacher_size, teacher_data, _ = _file_parts(model.path)
    size, data, extra = _file_parts(written)
    assert data - teacher_data == predicted.file_bytes - teacher_size  # the tensors, exactly
    header_growth = size - data - (teacher_size - teacher_data)
    alignment = ModelShapes.of(model).alignment
    assert abs(header_growth - extra) < alignment  # only the metadata (padding differs)
    return predicted


def test_a_q2_0_students_sizes_are_those_of_its_export(setup, tmp_path):
    model, corpus = setup  # rows of 64: the matrices are F16 in the teacher
    knobs = Knobs(alpha="none", ridge=False)
    student = build_student(model, knobs, CAL, StageCache(tmp_path / "c"), corpus=corpus)
    out = write_healed_gguf(student, tmp_path / "s.gguf")
    predicted = _check_against_file(model, knobs, out)
    assert predicted.routed_bpw == routed_bits_per_weight(student) == 2.25
    assert predicted.file_bytes < model.path.stat().st_size  # F16 experts became 2.25 bits
    assert predicted.file_mib == predicted.file_bytes / MIB


def test_sizes_follow_each_layers_types_in_float64():
    """bpw of a mixed allocation is the weight-weighted mean of its types' bpw (independent
    arithmetic: fractions of each tensor's weights, from the table's block geometry)."""
    shapes = ModelShapes(
        routed=tuple(
            (f"blk.{i}.ffn_{p}_exps.weight", i, "d" if p == "down" else "gu", (8, 256, 512), 0)
            for i in range(4)
            for p in ("gate", "up", "down")
        ),
        file_bytes=10_000,
        alignment=32,
        moe_layers=(0, 1, 2, 3),
        n_layer=4,
    )
    knobs = Knobs(type_gu="iq2_xxs", type_d="iq2_xs", up_last=1, layer_types="0:q2_k/iq3_xxs")
    bpw = {name: ggml_type(name).bits_per_weight for name in
           ("iq2_xxs", "iq2_xs", "iq2_s", "q2_k", "iq3_xxs", "q2_0")}  # fmt: skip
    # layer 0: q2_k/iq3_xxs; 1, 2: iq2_xxs/iq2_xs; 3 (up_last): one step up: q2_0/iq2_s
    expect = (
        np.mean(
            [
                2 * bpw["q2_k"] + bpw["iq3_xxs"],
                2 * bpw["iq2_xxs"] + bpw["iq2_xs"],
                2 * bpw["iq2_xxs"] + bpw["iq2_xs"],
                2 * bpw["q2_0"] + bpw["iq2_s"],
            ]
        )
        / 3
    )
    size = shapes.size(knobs)
    assert math.isclose(size.routed_bpw, float(expect), rel_tol=1e-12)
    # each tensor: 2048 rows of 512 = 2 blocks of 256 (Q2_0: 8 of 64 = 144 bytes, 72 per 256)
    per_256 = (2 * 84 + 98) + 2 * (2 * 66 + 74) + (2 * 72 + 82)
    assert size.file_bytes == 10_000 + 2048 * 2 * per_256  # from 0 stored bytes
    assert shapes.size(Knobs(type_gu="iq2_xxs", type_d="iq2_xxs")).routed_bpw == 2.0625
    assert shapes.size(Knobs(type_gu="iq2_xs", type_d="iq2_xs")).routed_bpw == 2.3125


@pytest.mark.slow
def test_a_mixed_type_students_sizes_are_those_of_its_export(tmp_path):
    """ggml types of every block size, a step up and a per-layer override, healed."""
    from _heal_fixtures import _corpus_file
    from healsweep.data.corpus import load_corpus
    from healsweep.heal.llama_baseline import write_llama_baseline

    model = open_model(write_random_model(
        tmp_path / "m.gguf", n_layer=3, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4,
        n_expert_used=2, types={"ffn_down_shexp.weight": "Q8_0"}))  # fmt: skip
    corpus = load_corpus(_corpus_file(tmp_path / "corpus.jsonl"))
    cache = StageCache(tmp_path / "c")
    knobs = Knobs(type_gu="iq2_xxs", type_d="iq4_nl", up_first=1, layer_types="-1:q2_0/q3_k",
                  alpha="mse")  # fmt: skip
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    predicted = _check_against_file(model, knobs, write_healed_gguf(student, tmp_path / "s.gguf"))
    assert predicted.routed_bpw == routed_bits_per_weight(student)
    uniform = write_llama_baseline(model, "q2_k", tmp_path / "q2_k.gguf")
    assert _check_against_file(model, Knobs(type_gu="q2_k", type_d="q2_k"), uniform).routed_bpw == (
        2.625
    )
