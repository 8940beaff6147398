"""The healed student as a GGUF: type-42 (Q2_0) experts written and read back, any Q2_0 GGUF as a
student, unreadable tensor types named in one line.

References are independent of the writer: type-42 blocks are decoded with ``np.unpackbits`` from
the ggml layout (fp16 ``d``, then code ``j`` at bits ``2*(j%4)`` of byte ``j//4``), and the
exported file's logits come from our forward reading the file itself, against the forward of the
student held in memory.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from _cli import run_cli
from _heal_fixtures import heal_setup
from healsweep.cache import StageCache
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import GGML_Q2_0, QUANT_SIZES, TensorType, q2_0_type
from healsweep.heal.export import write_healed_gguf, write_q2_sidecar
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import forward, open_model
from healsweep.quant.formats import Q2_0

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _decode_type42(raw: np.ndarray) -> np.ndarray:
    """float64 values of type-42 rows ``uint8 [..., nb*18]``, straight from the byte layout."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 18)
    d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float64)
    bits = np.unpackbits(blocks[..., 2:, None], axis=-1, bitorder="little")  # [..., 16, 8]
    codes = bits.reshape(*bits.shape[:-2], 64, 2) @ np.array([1, 2])  # bits 2k, 2k+1 -> code
    return ((codes - 1) * d[..., None]).reshape(*raw.shape[:-1], -1)


@pytest.fixture(scope="module")
def exported(setup, tmp_path_factory):
    model, corpus = setup
    root = tmp_path_factory.mktemp("export")
    student = build_student(model, Knobs(), CAL, StageCache(root / "cache"), corpus=corpus)
    q2 = write_healed_gguf(student, root / "q2.gguf", metadata={"trial": "t-1"})
    f16 = write_healed_gguf(student, root / "f16.gguf", experts="f16")
    return student, q2, f16, root


def test_type_42_is_a_local_type_with_the_decoders_geometry_and_gguf_py_is_left_alone():
    from healsweep.kernels.ggml_decode import block_geometry

    member = q2_0_type()
    assert q2_0_type() is member is TensorType(GGML_Q2_0)
    assert member.name == "Q2_0" and int(member) == 42
    assert QUANT_SIZES[member] == block_geometry(42) == (64, 18)
    # every gguf-py type is a TensorType of the same name, value and geometry, and compares equal
    for qtype, sizes in gguf.GGML_QUANT_SIZES.items():
        ours = TensorType[qtype.name]
        assert ours == qtype and hash(ours) == hash(qtype) and QUANT_SIZES[ours] == sizes
    # nothing was registered into gguf-py's own enum or table
    assert all(type(t) is gguf.GGMLQuantizationType for t in gguf.GGML_QUANT_SIZES)
    assert all(type(t) is gguf.GGMLQuantizationType for t in gguf.GGMLQuantizationType)


def test_type42_rows_follow_the_ggml_layout():
    from healsweep.kernels.q2_0 import Q2Packed, Q2Weight

    rng = np.random.default_rng(0)
    q = rng.integers(-1, 3, (3, 5, 128)).astype(np.int8)
    d = rng.normal(size=(3, 5, 2)).astype(np.float16)
    rows = Q2_0.gguf_rows(Q2Weight(d, q))
    assert rows.shape == (3, 5, 36) and rows.dtype == np.uint8
    want = q.reshape(3, 5, 2, 64).astype(np.float64) * d.astype(np.float64)[..., None]
    np.testing.assert_array_equal(_decode_type42(rows), want.reshape(3, 5, 128))
    # A Q2Packed of the same weight gives the same bytes (its codes are already ggml's order).
    c = (q + 1).astype(np.uint8).reshape(3, 5, 32, 4)
    codes = c[..., 0] | c[..., 1] << 2 | c[..., 2] << 4 | c[..., 3] << 6
    np.testing.assert_array_equal(Q2_0.gguf_rows(Q2Packed(d, codes)), rows)


def test_exported_experts_are_the_students_blocks_bit_for_bit(exported):
    student, q2, _, _ = exported
    model = open_model(q2)
    assert model.metadata("healsweep.experts") == "q2_0"
    for layer, replacement in student.replacements.items():
        for suffix, field in zip(EXPERTS, ("gate_exps", "up_exps", "down_exps"), strict=True):
            name = f"blk.{layer}.{suffix}"
            weight = getattr(replacement, field)
            assert int(model.tensor_type(name)) == 42
            raw = model.raw_rows(name)
            np.testing.assert_array_equal(raw, Q2_0.gguf_rows(weight))
            dense = np.asarray(weight.dequantize())
            np.testing.assert_array_equal(_decode_type42(raw), dense)  # alpha is in d
            np.testing.assert_array_equal(model.tensor(name), dense)  # host decode of type 42
        shexp = f"blk.{layer}.ffn_down_shexp.weight"
        assert model.tensor_type(shexp) == student.base.tensor_type(shexp)  # Q8_0 kept
        np.testing.assert_array_equal(
            model.raw_rows(shexp).reshape(-1), np.asarray(student.shexp_raw[layer]).reshape(-1)
        )


def test_exported_file_runs_the_students_forward_exactly(exported):
    student, q2, f16, _ = exported
    tokens = np.random.default_rng(1).integers(0, student.base.hparams.n_vocab, 70)
    tokens = tokens.astype(np.int32)
    want = forward(student.base, [tokens], replacements=student.replacements).logits[0]
    got = forward(open_model(q2), [tokens]).logits[0]
    np.testing.assert_array_equal(got, want)
    teacher = forward(student.base, [tokens]).logits[0]
    assert np.abs(teacher - want).max() > 1e-3  # the healed experts do differ from the teacher
    # F16 experts: the same weights rounded to fp16, so close but not bit-identical.
    near = forward(open_model(f16), [tokens]).logits[0]
    assert np.abs(near - want).max() < 1e-2 * np.abs(want).max()


def test_metadata_names_knobs_student_and_teacher(exported):
    student, q2, f16, _ = exported
    model = open_model(q2)
    assert json.loads(model.metadata("healsweep.knobs")) == student.knobs.model_dump()
    assert model.metadata("healsweep.student_key") == student.key
    assert model.metadata("healsweep.teacher_fingerprint") == student.base.fingerprint
    assert model.metadata("healsweep.trial") == "t-1"
    np.testing.assert_allclose(model.metadata("healsweep.alphas"), student.alphas, rtol=1e-6)
    assert open_model(f16).metadata("healsweep.experts") == "f16"
    assert int(open_model(f16).tensor_type("blk.0.ffn_up_exps.weight")) == 1
    teacher = gguf.GGUFReader(student.base.path)
    for key, field in teacher.fields.items():  # every teacher field, same value
        if not key.startswith("GGUF."):
            assert model.metadata(key) == field.contents(), key


def test_type42_experts_take_2_25_bits_a_weight_and_the_sidecar_holds_the_same_blocks(exported):
    student, q2, f16, root = exported
    side = np.load(write_q2_sidecar(student, root / "side.npz"))
    model = open_model(q2)
    for layer in student.replacements:
        for suffix in EXPERTS:
            name = f"blk.{layer}.{suffix}"
            blocks = side[name]
            assert blocks.shape[-1] == 18
            np.testing.assert_array_equal(
                blocks.reshape(model.raw_rows(name).shape), model.raw_rows(name)
            )
            assert model.tensor_nbytes(name) * 64 == open_model(f16).tensor_nbytes(name) * 18 / 2


def test_type42_student_scores_against_its_teacher(exported, tmp_path):
    """`score --model q2.gguf --ref teacher` works for a type-42 file (our own, default tier)."""

    student, q2, _, root = exported
    corpus = _eval_corpus(tmp_path / "eval.jsonl")
    run = run_cli("score", "--model", q2, "--ref", student.base.path, "--corpus", corpus,
                  "--max-scored", "16", "--max-context", "16", "--json", tmp_path / "s.json",
                  cache=tmp_path / "cache", timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["pooled"]["kld_mean"] > 0


def _eval_corpus(path):
    from healsweep.data.corpus import Document, Message, write_corpus

    docs = []
    for i in range(1, 6, 2):
        answer = f"<think>\nExperts {i} and {i + 1}.\n</think>\n\nThe answer is {i * 7}."
        messages = (
            Message("user", f"Which experts for token {i}? " * 3),
            Message("assistant", answer),
        )
        docs.append(Document(f"e{i}", "chat", i, "chat", messages=messages))
    return write_corpus(docs, path)


def _with_tensor_type(src, dst, name: str, qtype: int):
    """A copy of ``src`` whose tensor ``name`` claims ggml type ``qtype``: random bytes of that
    type replace its data (a type gguf-py knows), or the header's type id is patched in place."""
    reader = gguf.GGUFReader(src)
    if qtype not in {int(t) for t in gguf.GGMLQuantizationType}:  # patch the type field
        info = next(t for t in reader.tensors if t.name == name)
        at = info.field.offset + sum(int(p.nbytes) for p in info.field.parts[:4])
        data = bytearray(src.read_bytes())
        data[at : at + 4] = np.uint32(qtype).tobytes()
        dst.write_bytes(bytes(data))
        return dst
    writer = gguf.GGUFWriter(dst, reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name == name:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            raw = np.random.default_rng(0).integers(0, 255, byte_shape, dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("qtype", [99, int(gguf.GGMLQuantizationType.Q8_1)])
def test_a_tensor_type_healsweep_cannot_decode_is_one_line_naming_tensor_and_type(
    setup, tmp_path, qtype
):
    model, _ = setup
    name = "blk.1.ffn_up_exps.weight"
    bad = _with_tensor_type(model.path, tmp_path / "bad.gguf", name, qtype)
    with pytest.raises(GGUFFormatError) as err:
        open_model(bad)
    message = str(err.value)
    assert name in message and ("99" in message if qtype == 99 else "Q8_1" in message)
    assert "\n" not in message
    run = run_cli("model", "info", bad, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and name in run.stderr
