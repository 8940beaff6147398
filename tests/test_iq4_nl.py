"""IQ4_NL codec: gguf-py decodes our bytes to our values exactly, and the search never loses to
plain round-to-nearest at the amax scale (checked in float64 from the decoded weights)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from healsweep.conformance import references as ref
from healsweep.kernels import iq4_nl


def gguf_decode(d, idx) -> np.ndarray:
    packed = np.asarray(iq4_nl.pack(d, idx))
    flat = gguf.quants.dequantize(packed.reshape(-1), gguf.GGMLQuantizationType.IQ4_NL)
    return flat.reshape(-1, 32).astype(np.float64)


def blocks() -> np.ndarray:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((4000, 32))
    special = [
        np.zeros((3, 32)),
        np.full((1, 32), 0.2),
        np.full((1, 32), -0.2),
        -np.abs(base[:8]),
        base[8:16] * 1e-30,
        base[16:24] * 1e-4,
        base[24:32] * 50.0,
        rng.standard_t(2.0, (64, 32)),
    ]
    spike = base[32:48] * 0.01
    spike[:, 7] = 3.0
    return np.concatenate([base, *special, spike]).astype(np.float32)


def test_gguf_decodes_our_bytes_to_our_values_exactly():
    w = blocks()
    d, idx = iq4_nl.quantize(w)
    assert d.dtype == np.float16 and idx.dtype == np.int8 and idx.min() >= 0 and idx.max() <= 15
    ours = np.asarray(iq4_nl.dequantize(d, idx)).astype(np.float64)
    np.testing.assert_array_equal(gguf_decode(d, idx), ours)


@pytest.mark.parametrize("importance", ["uniform", "per_block", "per_channel"])
def test_never_worse_than_round_to_nearest_at_amax_scale(importance):
    w = blocks()
    rng = np.random.default_rng(1)
    a = {
        "uniform": np.ones((1, 32)),
        "per_block": rng.lognormal(0, 1, w.shape),
        "per_channel": rng.uniform(0.1, 10, (1, 32)),
    }[importance].astype(np.float32)
    arg = None if importance == "uniform" else (a[0] if importance == "per_channel" else a)
    d, idx = iq4_nl.quantize(w, arg)
    sse = (a * (w.astype(np.float64) - gguf_decode(d, idx)) ** 2).sum(1)
    _, baseline = ref.iq4_best_sse(w, a, iq4_nl.MULTIPLIERS)
    assert np.all(sse <= baseline * (1 + 1e-5) + 1e-300)
    assert sse.sum() < 0.95 * baseline.sum()  # and the search does find better scales


def test_result_is_the_best_of_the_documented_candidates():
    """Float64 model of the candidate set: RTN baseline, then base scales m/-127 and m/113 times
    each multiplier with nearest indices and a least-squares refit, judged with fp16 d."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((1500, 32)).astype(np.float32)
    x = w.astype(np.float64)
    best, _ = ref.iq4_best_sse(w, np.ones((1, 32)), iq4_nl.MULTIPLIERS)
    d, idx = iq4_nl.quantize(w)
    ours = ((x - gguf_decode(d, idx)) ** 2).sum(1)
    np.testing.assert_allclose(ours, best, rtol=1e-4)


def test_zero_block_and_pack_round_trip():
    w = np.zeros((2, 32), np.float32)
    d, idx = iq4_nl.quantize(w)
    assert (d == 0).all() and (np.asarray(iq4_nl.dequantize(d, idx)) == 0).all()
    rng = np.random.default_rng(3)
    d, idx = iq4_nl.quantize(rng.standard_normal((9, 32)).astype(np.float32))
    packed = np.asarray(iq4_nl.pack(d, idx))
    assert packed.shape == (9, 18) and packed.dtype == np.uint8
    assert packed[0, 2] == (idx[0, 0] | (idx[0, 16] << 4))
    d2, idx2 = iq4_nl.unpack(packed)
    np.testing.assert_array_equal(np.asarray(d2), d)
    np.testing.assert_array_equal(np.asarray(idx2), idx)


def test_matrix_round_trips_through_a_real_gguf_file(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    d, idx = iq4_nl.quantize_matrix(w, rng.uniform(0.5, 2, 96).astype(np.float32))
    assert d.shape == (48, 3) and idx.shape == (48, 96)
    raw = np.asarray(iq4_nl.pack(d, idx)).reshape(48, 3 * 18)
    path = tmp_path / "iq4.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.IQ4_NL
    decoded = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    np.testing.assert_array_equal(
        decoded.reshape(48, 96), np.asarray(iq4_nl.dequantize_matrix(d, idx))
    )
    rel = ((decoded.reshape(48, 96) - w) ** 2).sum() / (w**2).sum()
    assert rel < 0.01


def test_bad_shapes_raise_value_error_naming_the_function():
    with pytest.raises(ValueError, match="iq4_nl.quantize"):
        iq4_nl.quantize(np.zeros((4, 64), np.float32))
    with pytest.raises(ValueError, match="iq4_nl.quantize_matrix"):
        iq4_nl.quantize_matrix(np.zeros((4, 40), np.float32))
