"""One class per storage format (issue 48): geometry from one table, every fact asked of the class.

Checked against independent references: gguf-py's own block sizes and dequantizer, the float64
type-42 decoder of the conformance suite, and properties (fold = factor x decode, shapes planned
before the rows are built).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from healsweep.conformance.references import q2_0_from_bytes
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import FOLDABLE_TYPES, fold_scale, q2_0_type
from healsweep.kernels import ggml_decode, q2_0
from healsweep.kernels.ggml_decode import GGMLWeight, block_geometry, decode_rows
from healsweep.kernels.ggml_types import STORED_TYPES, stored_ids, stored_type
from healsweep.quant.formats import (
    IQ4NL,
    Q2_0,
    Q8_0,
    Float16,
    Float32,
    StorageFormat,
    format_of,
    requantize,
    stack_format,
    stack_type_name,
)


def test_one_table_gives_every_decoder_its_geometry_and_gguf_py_agrees():
    assert set(ggml_decode._DECODERS) == stored_ids()  # a decoder for each row, and no other
    sizes = {int(t): tuple(int(v) for v in s) for t, s in GGML_QUANT_SIZES.items()}
    for kind in STORED_TYPES:
        assert block_geometry(kind.ggml_id) == (kind.block_weights, kind.block_bytes)
        if kind.ggml_id in sizes:  # gguf-py 0.19 does not name Q2_0 (42)
            assert sizes[kind.ggml_id] == (kind.block_weights, kind.block_bytes), kind.name
    assert FOLDABLE_TYPES == {t.ggml_id for t in STORED_TYPES if t.scale_offsets is not None}
    with pytest.raises(GGUFFormatError, match="ggml type 99 is not one healsweep"):
        stored_type(99)


def test_each_type_is_served_by_its_class():
    assert format_of(T.F32) is Float32 and format_of(T.F16) is Float16
    assert format_of(T.IQ4_NL) is IQ4NL and format_of(42) is Q2_0
    assert format_of(T.Q8_0) is Q8_0 and format_of(T.IQ2_XS) is StorageFormat


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.Q4_0, T.IQ4_NL])
def test_requantized_values_are_what_gguf_py_decodes_the_bytes_to(qtype):
    values = (np.random.default_rng(3).standard_normal((6, 64)) * 0.1).astype(np.float32)
    raw, dense = requantize("w", values, qtype)
    np.testing.assert_array_equal(dense, np.asarray(dequantize(raw, qtype), np.float32))
    assert np.abs(dense - values).max() <= 0.1 * np.abs(values).max()


def test_q2_0_requantizes_by_its_codec_and_decodes_as_the_float64_reference():
    values = (np.random.default_rng(4).standard_normal((4, 128)) * 0.1).astype(np.float32)
    raw, dense = requantize("w", values, q2_0_type())
    assert raw.shape == (4, 2 * 18) and raw.dtype == np.uint8
    np.testing.assert_array_equal(dense, q2_0_from_bytes(raw).astype(np.float32))
    relative = np.linalg.norm(dense - values) / np.linalg.norm(values)
    assert relative < 0.6  # 2 bits a weight: a coarse grid, but the values' shape
    with pytest.raises(GGUFFormatError, match="not a multiple of its block size 64"):
        requantize("blk.0.w", values[:, :96], q2_0_type())


def _q2_stack(rng):
    w = rng.standard_normal((2, 3, 128)).astype(np.float32)
    return q2_0.quantize_matrix(w, None, 0.0, packed=True)


def _ggml_stack(rng, qtype=T.Q8_0):
    values = (rng.standard_normal((2 * 3, 64)) * 0.1).astype(np.float32)
    raw, _ = requantize("w", values, qtype)
    return GGMLWeight(np.asarray(raw).reshape(2, 3, -1), int(qtype), 64)


@pytest.mark.parametrize("make", [_q2_stack, _ggml_stack], ids=["q2_0", "q8_0"])
def test_a_stack_folds_alpha_and_is_written_as_its_format_says(make):
    stack = make(np.random.default_rng(5))
    found = stack_format(stack)
    factor = np.asarray([0.5, 1.25], np.float32)  # one per expert
    folded = found.fold_alpha(stack, factor)
    dense, scaled = np.asarray(stack.dequantize()), np.asarray(folded.dequantize())
    np.testing.assert_allclose(scaled, dense * factor[:, None, None], rtol=2e-3, atol=1e-6)
    assert found.fold_alpha(stack, 1.0) is stack
    rows = found.gguf_rows(stack)
    assert rows.dtype == np.uint8 and rows.shape == found.gguf_shape(stack)
    n_in = stack.shape[-1] if hasattr(stack, "shape") else stack.d.shape[-1] * 64
    decoded = decode_rows(rows, int(found.gguf_type(stack)), n_in)
    np.testing.assert_array_equal(np.asarray(decoded), dense)  # the file holds the stack


def test_a_dense_stack_names_no_type():
    assert stack_type_name(_q2_stack(np.random.default_rng(6))) == "q2_0"
    assert stack_type_name(_ggml_stack(np.random.default_rng(6), T.IQ4_NL)) == "iq4_nl"
    with pytest.raises(GGUFFormatError, match="dense; write it with experts='f16'"):
        stack_format(np.zeros((2, 3, 64), np.float32))


def test_a_new_format_registers_by_being_defined_and_a_taken_type_is_refused():
    with pytest.raises(TypeError, match="ggml type 42 is Q2_0's"):

        class Again(StorageFormat, ids=(42,)):
            pass

    class Q4Own(StorageFormat, ids=(int(T.Q4_0),)):
        """A stand-in for a codec of healsweep's own: the next type's class in this shape."""

        @classmethod
        def encode(cls, name, values, qtype):
            return np.zeros((values.shape[0], values.shape[1] // 32 * 18), np.uint8)

    try:
        assert format_of(T.Q4_0) is Q4Own
        raw, dense = requantize("w", np.ones((2, 64), np.float32), T.Q4_0)
        assert not raw.any() and not dense.any()  # all-zero blocks: d = 0
    finally:
        del Q4Own
        gc.collect()
    assert format_of(T.Q4_0) is StorageFormat


def test_fold_scale_reads_the_iq1_m_nibbles_from_the_table():
    kind = stored_type(int(T.IQ1_M))
    assert kind.scale_offsets == () and kind.nibble_scale == 48
    raw = np.zeros((1, 1, kind.block_bytes), np.uint8)
    raw[..., 48:56] = np.frombuffer(np.asarray([0x1000] * 4, "<u2").tobytes(), np.uint8)
    folded = fold_scale(raw, T.IQ1_M, 2.0)
    words = folded[..., 48:56].copy().view("<u2")[0, 0]
    d_bits = sum(int(w >> 12) << (4 * i) for i, w in enumerate(words))
    d = np.asarray(d_bits, np.uint16).view(np.float16)
    before = np.asarray(0x1111, np.uint16).view(np.float16)
    assert float(d) == float(np.float16(2.0 * np.float64(before)))
