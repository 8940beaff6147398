"""``fold_scale``: a factor folded into the fp16 block scales scales every decoded weight by it.

The decoded values come from gguf-py's numpy dequantizer (Q2_0, which gguf-py cannot read, from
the float64 decoder of its spec in test_ggml_decode) and, in the slow tier, from ggml's own
``to_float`` on rows ggml quantized. The bound is the fp16 rounding of the new scale(s): for a
symmetric type ``|new - f*old| <= (2^-11 + 2^-20) |f*old|`` per weight; for the affine types
(``d*sc*q - dmin*m``, ``d*q + m``) the same relative bound on ``|f*d*sc*q| + |f*dmin*m|``, both
terms read by decoding a copy with the other fp16 field zeroed. Where the fp16 fields sit comes
from the decoder tests' layout tables, written from ggml's block structs.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import FOLDABLE_TYPES, fold_scale
from test_ggml_decode import FP16_FIELDS as LEGACY_FIELDS
from test_ggml_decode import q2_0_reference
from test_ggml_iquants import FP16_FIELDS as IQ_FIELDS
from test_ggml_iquants import set_iq1_m_scale

T = GGMLQuantizationType
Q2_0, IQ1_M = 42, int(T.IQ1_M)
FIELDS = {**LEGACY_FIELDS, **IQ_FIELDS}
AFFINE = {int(T.Q4_1), int(T.Q5_1), int(T.Q2_K), int(T.Q4_K), int(T.Q5_K)}  # two fp16 fields
TYPES = sorted(FIELDS)
REL = 2.0**-11 + 2.0**-20  # fp16 rounding of the scale, plus float32 rounding of the decode
ids = [str(t) if t == Q2_0 else T(t).name for t in TYPES]


def geometry(qtype: int) -> tuple[int, int]:
    return (64, 18) if qtype == Q2_0 else GGML_QUANT_SIZES[T(qtype)]


def decode(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Float32 values of rows ``[..., row_bytes]`` by an independent decoder."""
    rows = raw.reshape(-1, raw.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"):
        if qtype == Q2_0:
            values = q2_0_reference(rows).astype(np.float32)
        else:
            values = np.asarray(dequantize(rows, T(qtype)), np.float32)
    return values.reshape(*raw.shape[:-1], -1)


def get_u16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset].astype(np.uint16) | (blocks[..., offset + 1].astype(np.uint16) << 8)


def scale_fields(raw: np.ndarray, qtype: int) -> list[np.ndarray]:
    """The fp16 scales of every block, float16 ``[..., out, nb]`` per field."""
    blocks = raw.reshape(*raw.shape[:-1], -1, geometry(qtype)[1])
    if qtype == IQ1_M:
        bits = sum((get_u16(blocks, 48 + 2 * i) >> 12) << (4 * i) for i in range(4))
        return [bits.astype(np.uint16).view(np.float16)]
    return [get_u16(blocks, o).view(np.float16) for o in FIELDS[qtype]]


def with_field(raw: np.ndarray, qtype: int, which: int, bits: int) -> np.ndarray:
    blocks = raw.reshape(*raw.shape[:-1], -1, geometry(qtype)[1]).copy()
    offset = FIELDS[qtype][which]
    blocks[..., offset], blocks[..., offset + 1] = bits & 0xFF, bits >> 8
    return blocks.reshape(raw.shape)


def moderate_blocks(qtype: int, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random rows ``[..., out, row_bytes]`` of 2 blocks each, fp16 scales of magnitude 2^-8..2^8
    (so ``f*d`` stays a normal fp16 for f in [0.5, 1.5])."""
    _, size = geometry(qtype)
    n = int(np.prod(shape)) * 2
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for offset in FIELDS[qtype] or (None,):
        scales = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-8, 8, n)
        bits = scales.astype(np.float16).view(np.uint16)
        if offset is None:
            set_iq1_m_scale(blocks, bits)
        else:
            blocks[:, offset], blocks[:, offset + 1] = bits & 0xFF, bits >> 8
    return blocks.reshape(*shape, 2 * size)


def magnitude(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Per weight, the sum of |terms| the decode adds (just |value| for a symmetric type)."""
    if qtype not in AFFINE:
        return np.abs(decode(raw, qtype))
    first = decode(with_field(raw, qtype, 1, 0), qtype)  # d*sc*q (or d*q) alone
    second = decode(with_field(raw, qtype, 0, 0), qtype)  # -dmin*m (or +m) alone
    return np.abs(first) + np.abs(second)


def test_covers_every_type_with_an_fp16_scale():
    assert set(TYPES) <= FOLDABLE_TYPES


@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_folded_decode_is_factor_times_decode(qtype):
    rng = np.random.default_rng(qtype)
    raw = moderate_blocks(qtype, (5, 6), rng)  # [E, out, row_bytes]
    f = rng.uniform(0.5, 1.5, 5).astype(np.float32)  # one factor per expert
    folded = fold_scale(raw, qtype, f)
    assert folded.dtype == np.uint8 and folded.shape == raw.shape
    want = f[:, None, None] * decode(raw, qtype)
    bound = REL * f[:, None, None] * magnitude(raw, qtype)
    got = decode(folded, qtype)
    assert np.all(np.abs(got - want) <= bound)
    assert np.abs(got - want).max() > 0  # the scale really was rounded, not skipped
    # the fp16 fields are f*d rounded once, nothing else changed
    for old, new in zip(scale_fields(raw, qtype), scale_fields(folded, qtype), strict=True):
        exact = (f[:, None, None].astype(np.float64) * old.astype(np.float64)).astype(np.float16)
        np.testing.assert_array_equal(new.view(np.uint16), exact.view(np.uint16))
    changed = (raw != folded).reshape(-1, geometry(qtype)[1]).any(axis=0)
    allowed = np.zeros_like(changed)
    for offset in FIELDS[qtype] or range(48, 56, 2):
        allowed[offset : offset + 2] = True
    assert not (changed & ~allowed).any()


@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_factor_one_returns_identical_bytes(qtype):
    rng = np.random.default_rng(7 + qtype)
    _, size = geometry(qtype)
    raw = rng.integers(0, 256, (3, 4, 2 * size), dtype=np.uint8)  # any bits: NaN, inf, subnormal
    np.testing.assert_array_equal(fold_scale(raw, qtype, 1.0), raw)
    np.testing.assert_array_equal(fold_scale(raw, qtype, np.ones(3, np.float32)), raw)
    assert fold_scale(raw, qtype, 1.0) is not raw


def test_per_expert_factors_broadcast_over_layers():
    qtype = int(T.IQ2_XS)
    rng = np.random.default_rng(3)
    raw = moderate_blocks(qtype, (2, 3, 4), rng)  # [L, E, out, row_bytes]
    f = np.array([0.5, 1.0, 1.25], np.float32)  # per expert, the same in each layer
    folded = fold_scale(raw, qtype, f)
    for e in range(3):
        np.testing.assert_array_equal(folded[:, e], fold_scale(raw[:, e], qtype, f[e]))
    np.testing.assert_array_equal(folded[:, 1], raw[:, 1])
    # a scalar is one factor for all; powers of two scale exactly
    np.testing.assert_array_equal(
        decode(fold_scale(raw, qtype, 0.5), qtype), 0.5 * decode(raw, qtype)
    )


@pytest.mark.parametrize("qtype", [int(T.Q2_K), IQ1_M, Q2_0], ids=["Q2_K", "IQ1_M", "Q2_0"])
def test_large_factor_saturates_and_nonfinite_scales_stay(qtype):
    _, size = geometry(qtype)
    blocks = np.random.default_rng(0).integers(0, 256, (4, size), dtype=np.uint8)
    d = np.array([60000.0, -60000.0, np.inf, np.nan], np.float16).view(np.uint16)
    if qtype == IQ1_M:
        set_iq1_m_scale(blocks, d)
    else:
        for offset in FIELDS[qtype]:
            blocks[:, offset], blocks[:, offset + 1] = d & 0xFF, d >> 8
    raw = blocks.reshape(1, 4, size)
    for field_before, field_after in zip(
        scale_fields(raw, qtype), scale_fields(fold_scale(raw, qtype, 1.5), qtype), strict=True
    ):
        np.testing.assert_array_equal(field_after[0, :2, 0], [65504.0, -65504.0])
        np.testing.assert_array_equal(
            field_after[0, 2:].view(np.uint16), field_before[0, 2:].view(np.uint16)
        )
    assert np.isfinite(decode(fold_scale(raw[:, :2], qtype, 1.5), qtype)).all()


def test_subnormal_and_negative_factors_round_once():
    qtype = int(T.Q3_K)
    raw = moderate_blocks(qtype, (1, 64), np.random.default_rng(11))  # 128 blocks
    blocks = raw.reshape(128, 110)
    tiny = (np.arange(1, 129) * 7).astype(np.uint16)  # subnormal fp16 patterns, both signs
    tiny[::2] |= 0x8000
    blocks[:, 108], blocks[:, 109] = tiny & 0xFF, tiny >> 8
    for f in (0.3, -0.7, 0.0):
        old, new = scale_fields(raw, qtype)[0], scale_fields(fold_scale(raw, qtype, f), qtype)[0]
        exact = (f * old.astype(np.float64)).astype(np.float16)
        np.testing.assert_array_equal(new.view(np.uint16), exact.view(np.uint16))
    np.testing.assert_array_equal(decode(fold_scale(raw, qtype, -1.0), qtype), -decode(raw, qtype))


def test_bad_arguments_raise_one_line():
    raw = np.zeros((2, 3, 84), np.uint8)
    for qtype in (0, 1, int(T.TQ1_0), 999):  # F32, F16: no block scale; unknown ids
        with pytest.raises(GGUFFormatError, match="no fp16 block scale"):
            fold_scale(raw, qtype, 1.0)
    with pytest.raises(GGUFFormatError, match="whole 84-byte blocks"):
        fold_scale(raw[..., :80], int(T.Q2_K), 1.0)
    with pytest.raises(GGUFFormatError):
        fold_scale(raw.astype(np.int32), int(T.Q2_K), 1.0)
    with pytest.raises(GGUFFormatError):
        fold_scale(raw[0, 0], int(T.Q2_K), 1.0)  # one row without its [out] axis
    with pytest.raises(ValueError, match="finite"):
        fold_scale(raw, int(T.Q2_K), np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="does not broadcast"):
        fold_scale(raw, int(T.Q2_K), np.ones(3))
    with pytest.raises(GGUFFormatError) as info:
        fold_scale(raw, 0, 1.0)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_rows_quantized_by_ggml_fold_as_ggml_decodes_them(qtype):
    from healsweep.gguf_io._ggml_lib import dequantize_rows, quantize_rows

    rng = np.random.default_rng(100 + qtype)
    n_in = 512
    w = rng.standard_normal((3, 8, n_in)).astype(np.float32)  # [E, out, in]
    imatrix = rng.gamma(1.0, 1.0, (3, n_in)).astype(np.float32)
    raw = np.stack([quantize_rows(w[e], qtype, imatrix[e]) for e in range(3)])
    f = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    got = dequantize_rows(fold_scale(raw, qtype, f), qtype, n_in)
    want = f[:, None, None] * dequantize_rows(raw, qtype, n_in)
    if qtype in AFFINE:
        terms = [dequantize_rows(with_field(raw, qtype, i, 0), qtype, n_in) for i in (0, 1)]
        size = np.abs(terms[0]) + np.abs(terms[1])
    else:
        size = np.abs(want / f[:, None, None])
    assert np.all(np.abs(got - want) <= REL * f[:, None, None] * size)


def iq1_reference(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Float64 decode of IQ1_S / IQ1_M rows ``[..., row_bytes]`` written from the block layout
    alone (ggml's ``block_iq1_s``/``block_iq1_m``): ``dl·(grid[idx] + δ)`` per group of 8, with
    IQ1_M's fp16 ``d`` gathered from the top nibbles of its four scale words."""
    from gguf.quants import IQ1_S

    IQ1_S.init_grid()
    grid = np.asarray(IQ1_S.grid, np.float64).reshape(2048, 8)
    size = geometry(qtype)[1]
    blocks = raw.reshape(-1, size).astype(np.int64)
    out = np.empty((len(blocks), 256), np.float64)
    for b, block in enumerate(blocks):

        def u16(offset: int, block=block) -> int:
            return int(block[offset]) | int(block[offset + 1]) << 8

        if qtype == int(T.IQ1_S):
            d = float(np.uint16(u16(0)).view(np.float16))
            for g in range(32):
                qh = u16(34 + 2 * (g // 4))
                idx = int(block[2 + g]) | ((qh >> 3 * (g % 4)) & 7) << 8
                delta = -0.125 if qh & 0x8000 else 0.125
                dl = d * (2 * ((qh >> 12) & 7) + 1)
                out[b, 8 * g : 8 * g + 8] = dl * (grid[idx] + delta)
        else:
            words = [u16(48 + 2 * i) for i in range(4)]
            d = float(np.uint16(sum((w >> 12) << (4 * i) for i, w in enumerate(words)))
                      .view(np.float16))  # fmt: skip
            for g in range(32):
                nibble = int(block[32 + g // 2]) >> (4 * (g % 2))
                idx = int(block[g]) | (nibble & 7) << 8
                delta = -0.125 if nibble & 8 else 0.125
                j = g // 2  # one 3-bit scale per 16 weights
                dl = d * (2 * ((words[j // 4] >> 3 * (j % 4)) & 7) + 1)
                out[b, 8 * g : 8 * g + 8] = dl * (grid[idx] + delta)
    return out.reshape(*raw.shape[:-1], -1)


@pytest.mark.parametrize("qtype", [int(T.IQ1_S), IQ1_M], ids=["IQ1_S", "IQ1_M"])
def test_iq1_fold_against_a_float64_decoder_of_the_layout(qtype):
    """IQ1_M spreads its fp16 ``d`` over four nibbles, so its fold is its own code
    (``gguf_io._fold``); both IQ1 folds scale every weight a float64 decoder written from the
    layout reads by ``f``, to the fp16 rounding of the new ``d``, and that decoder agrees with
    gguf-py's on the bytes before and after."""
    rng = np.random.default_rng(5 + qtype)
    raw = moderate_blocks(qtype, (3, 4), rng)  # [E, out, 2 blocks]
    f = np.array([0.61, 1.0, 1.37], np.float32)
    folded = fold_scale(raw, qtype, f)
    before, after = iq1_reference(raw, qtype), iq1_reference(folded, qtype)
    np.testing.assert_allclose(before, decode(raw, qtype), rtol=1e-6, atol=0)
    np.testing.assert_allclose(after, decode(folded, qtype), rtol=1e-6, atol=0)
    want = f[:, None, None].astype(np.float64) * before
    assert np.all(np.abs(after - want) <= 2.0**-11 * np.abs(want))
    np.testing.assert_array_equal(after[1], before[1])  # a factor of 1 changes nothing
    assert np.abs(after - want).max() > 0
