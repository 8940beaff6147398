"""The numpy K-quant writers (Q4_K, Q5_K, Q6_K, IQ4_XS), read back by gguf-py.

Error bounds, for rows of N(0, 1) weights and round-to-nearest on a uniform grid of step s
(error RMS s/sqrt(12)):

- Q4_K: s = range/15 per 32 weights; the mean range of 32 normals is 4.07, so the relative RMS
  error is about 4.07/15/sqrt(12) = 0.078. gguf-py's Q4_1 is the same 4-bit asymmetric grid
  per 32 weights with exact fp16 scale and min, so Q4_K (whose scales are 6-bit integers on top)
  may lose only a little to it: bound 1.05x Q4_1 and 0.085 absolute.
- Q5_K: 31 levels, about 0.038; bound 1.05x gguf-py's Q5_1 and 0.042.
- Q6_K: symmetric, s = amax/32 per 16 weights, mean amax of 16 normals 1.77: about 0.016 plus
  the int8 sub-scales' rounding; bound 0.021.
- IQ4_XS: 16 non-uniform levels per 32 weights; on normal weights it beats gguf-py's uniform
  symmetric Q4_0 (same 4 bits, block of 32): bound 1.0x Q4_0.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize, quantize

from healsweep.gguf_io._kquant import KQUANT_TYPES, pack_k_scales, quantize_kquant
from healsweep.kernels.ggml_decode import decode_rows

T = GGMLQuantizationType
decode_jit = jax.jit(decode_rows, static_argnums=(1, 2))
# type -> (absolute bound on relative RMS error, gguf-py type to compare with, allowed ratio)
BOUNDS = {
    T.Q4_K: (0.085, T.Q4_1, 1.05),
    T.Q5_K: (0.042, T.Q5_1, 1.05),
    T.Q6_K: (0.021, None, None),
    T.IQ4_XS: (0.085, T.Q4_0, 1.0),
}


def relative_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact**2)))


@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda t: t.name)
def test_reconstructs_normal_weights_on_a_grid_of_its_bits(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((64, 1024)).astype(np.float32) * 0.03  # expert-like scale
    raw = quantize_kquant(x, int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (64, 1024 // block * size)
    approx = dequantize(raw, qtype)
    error = relative_rms(approx, x)
    bound, other, ratio = BOUNDS[qtype]
    assert error < bound
    if other is not None:
        assert error < ratio * relative_rms(dequantize(quantize(x, other), other), x)
    # the in-graph decoder reads these bytes exactly as gguf-py does
    np.testing.assert_array_equal(np.asarray(decode_jit(raw, int(qtype), 1024)), approx)


def test_packed_k_scales_round_trip_every_6_bit_value():
    values = np.arange(64, dtype=np.uint8)
    sc = np.stack([np.roll(values, 7 * j) for j in range(8)], axis=-1)  # [64, 8], all per slot
    mn = np.stack([np.roll(values[::-1], 3 * j + 1) for j in range(8)], axis=-1)
    packed = pack_k_scales(sc, mn)
    assert packed.shape == (64, 12) and packed.dtype == np.uint8
    got_sc, got_mn = Q4_K.get_scale_min(packed)
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_mn, mn)


@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda t: t.name)
def test_degenerate_rows(qtype):
    x = np.zeros((3, 256), np.float32)
    x[1] = 0.5  # constant positive
    x[2, ::2] = -1.0  # two values
    approx = dequantize(quantize_kquant(x, int(qtype)), qtype)
    np.testing.assert_array_equal(approx[0], 0.0)
    assert np.isfinite(approx).all()
    assert relative_rms(approx[1:], x[1:]) < 0.05


def test_writes_a_model_with_kquant_experts(tmp_path):
    from healsweep.model import open_model
    from healsweep.model.synthetic import RandomTensors, write_random_model

    types = {
        "ffn_gate_exps.weight": T.Q4_K,
        "ffn_up_exps.weight": "Q5_K",
        "ffn_down_exps.weight": T.Q6_K,
        "ffn_down_shexp.weight": T.IQ4_XS,
    }
    path = write_random_model(
        tmp_path / "kq.gguf", "qwen2moe", n_layer=1, n_embd=256, n_head=2, n_head_kv=1,
        n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, types=types, seed=3,
    )  # fmt: skip
    model = open_model(path)
    for suffix, qtype in types.items():
        name = f"blk.0.{suffix}"
        qtype = T[qtype] if isinstance(qtype, str) else qtype
        assert model.tensor_type(name) == qtype
        assert int(qtype) in KQUANT_TYPES
        exact = RandomTensors({name: model.tensor_shape(name)}, 3)[name]
        stored = model.tensor(name)
        assert stored.shape == exact.shape
        assert relative_rms(stored, exact) < BOUNDS[qtype][0]
    for name in model.tensor_names:  # every matrix decodes in graph as on the host
        shape = model.tensor_shape(name)
        if len(shape) >= 2:
            raw = model.raw_rows(name)
            got = decode_jit(raw, int(model.tensor_type(name)), shape[-1])
            np.testing.assert_array_equal(np.asarray(got), model.tensor(name))
