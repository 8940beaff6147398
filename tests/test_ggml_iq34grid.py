"""The IQ3_XXS, IQ3_S (:mod:`healsweep.quant.ggml_iq3grid`) and IQ4_XS
(:mod:`healsweep.quant.ggml_iq4grid`) grids that column-wise error feedback re-rounds on.

References: gguf-py's dequantizer and the in-graph decoder for what stored bytes mean (gguf-py
also gives each group's scale: a block decoded with known codes); a float64 brute force over
every grid row and every allowed sign mask (IQ3) or every code (IQ4_XS); the alpha fold against
alpha times the decode. ggml's own quantizer is needed for the rest, so those tests sit in the
slow tier with the ``[bench]`` extra, as every ggml test does.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ4_NL, dequantize

from healsweep.kernels.ggml_decode import GGMLWeight, decode_rows
from healsweep.quant import ggml_gptq, ggml_iq3grid, ggml_iq4grid
from healsweep.quant.formats import format_of

IQ3_XXS, IQ3_S, IQ4_XS = int(T.IQ3_XXS), int(T.IQ3_S), int(T.IQ4_XS)
TYPES = (IQ3_XXS, IQ3_S, IQ4_XS)
NAMES = ["iq3_xxs", "iq3_s", "iq4_xs"]
SIZE = {IQ3_XXS: 98, IQ3_S: 110, IQ4_XS: 136}
# per byte of a block, the bits re-choosing codes must leave alone: d and the scales
KEPT = {IQ3_XXS: {0: 0xFF, 1: 0xFF, **{66 + 4 * k + 3: 0xF0 for k in range(8)}},
        IQ3_S: {0: 0xFF, 1: 0xFF, 106: 0xFF, 107: 0xFF, 108: 0xFF, 109: 0xFF},
        IQ4_XS: dict.fromkeys(range(8), 0xFF)}  # fmt: skip


def random_rows(qtype: int, rows: int, blocks: int, rng) -> np.ndarray:
    """Random rows with a finite positive fp16 ``d`` of ordinary size (every other bit pattern is
    valid); IQ4_XS's 6-bit scales kept off 32, whose sub-block decodes to zero whatever its codes."""
    raw = rng.integers(0, 256, (rows, blocks, SIZE[qtype]), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(0.001, 0.01, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype == IQ4_XS:
        raw[..., 3] &= 0x55  # every high scale pair 0 or 1: ls < 32 ...
        raw[..., 4:8] |= 0x11  # ... and its low nibble odd, so ls != 32 - never zero
    return raw.reshape(rows, blocks * SIZE[qtype])


def grid_of(raw, qtype):
    return (ggml_iq4grid.IQ4Grid if qtype == IQ4_XS else ggml_iq3grid.IQ3Grid)(raw, qtype)


def choose_all(raw, qtype, targets, omega_of):
    """Every group of ``targets`` [rows, n] chosen on ``raw``'s scales: (bytes, values)."""
    grid = grid_of(raw, qtype)
    k = grid.width
    values = [grid.round(g, targets[:, k * g : k * g + k], omega_of(k))
              for g in range(targets.shape[1] // k)]  # fmt: skip
    return grid.packed(), np.concatenate(values, axis=1)


def kept_mask(qtype: int) -> np.ndarray:
    mask = np.zeros(SIZE[qtype], np.uint8)
    for byte, bits in KEPT[qtype].items():
        mask[byte] = bits
    return mask


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_rechoosing_stored_values_gives_back_the_bytes(qtype):
    rng = np.random.default_rng(qtype)
    raw = random_rows(qtype, 5, 2, rng)
    stored = np.asarray(dequantize(raw, T(qtype)), np.float32)
    packed, values = choose_all(raw, qtype, stored, lambda k: rng.uniform(0.2, 3, k))
    np.testing.assert_array_equal(packed, raw)
    np.testing.assert_array_equal(values, stored)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_choices_decode_as_gguf_py_and_the_graph_and_keep_the_scales(qtype):
    rng = np.random.default_rng(10 + qtype)
    raw = random_rows(qtype, 6, 2, rng)
    targets = rng.normal(0, 0.1, (6, 512)).astype(np.float32)
    packed, values = choose_all(raw, qtype, targets, lambda k: rng.uniform(0.2, 3, k))
    np.testing.assert_array_equal(dequantize(packed, T(qtype)), values)
    np.testing.assert_array_equal(np.asarray(decode_rows(packed, qtype, 512)), values)
    kept = kept_mask(qtype)
    blocks = (6, 2, SIZE[qtype])
    np.testing.assert_array_equal(packed.reshape(blocks) & kept, raw.reshape(blocks) & kept)
    assert not np.array_equal(packed, raw)


def block_scales(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Each grid row's (IQ3) or weight's (IQ4_XS) scale as gguf-py decodes it: the block with
    every code set to a known one, decoded, divided by that code's magnitude. float64 [rows, n]."""
    blocks = raw.reshape(raw.shape[0], -1, SIZE[qtype]).copy()
    if qtype == IQ4_XS:
        blocks[..., 8:136] = 0x88  # K[8] = 1: the value is dl itself
        return np.asarray(dequantize(blocks.reshape(raw.shape), T(qtype)), np.float64)
    blocks[..., 2:66] = 0  # grid row 0, signs all plus
    if qtype == IQ3_XXS:
        words = np.ascontiguousarray(blocks[..., 66:98]).view("<u4") & np.uint32(0xF0000000)
        blocks[..., 66:98] = words.view(np.uint8)
    else:
        blocks[..., 66:106] = 0
    first = ggml_iq3grid.grid_table(qtype)[0, 0].astype(np.float64)
    decoded = np.asarray(dequantize(blocks.reshape(raw.shape), T(qtype)), np.float64)
    return decoded[:, ::4] / first


def even_signs() -> np.ndarray:
    """Every sign pattern of 8 with an even count of minus signs: [128, 8] of ±1."""
    masks = np.array([m for m in range(256) if bin(m).count("1") % 2 == 0])
    return np.where((masks[:, None] >> np.arange(8)) & 1, -1.0, 1.0)


def brute_force_iq3(target, omega, scale, table, qtype):
    """The lowest ``Σ ω (t − v)²`` over every grid row and allowed sign mask, float64 [rows]:
    IQ3_S one row of 4 under any of its 16 masks; IQ3_XXS two rows of 4 under any even mask of 8
    (for a fixed mask the two rows are independent, so each is minimized alone)."""
    if qtype == IQ3_S:
        signs = np.where((np.arange(16)[:, None] >> np.arange(4)) & 1, -1.0, 1.0)  # [16, 4]
        every = scale[:, None, None, None] * signs[None, :, None] * table[None, None]
        return ((target[:, None, None] - every) ** 2 * omega).sum(-1).min(axis=(1, 2))
    total = np.zeros((len(target), 128))
    for half in (slice(0, 4), slice(4, 8)):
        signs = even_signs()[:, half]  # [128, 4]
        every = scale[:, None, None, None] * signs[None, :, None] * table[None, None]
        cost = ((target[:, None, None, half] - every) ** 2 * omega[half]).sum(-1)  # [r, 128, N]
        total += cost.min(axis=2)
    return total.min(axis=1)


@pytest.mark.parametrize("qtype", (IQ3_XXS, IQ3_S), ids=NAMES[:2])
def test_iq3_group_choice_is_the_weighted_optimum(qtype):
    rng = np.random.default_rng(20 + qtype)
    raw = random_rows(qtype, 10, 1, rng)
    raw[1, 1] |= 0x80  # a negative d: every sign mirrored
    grid = ggml_iq3grid.IQ3Grid(raw, qtype)
    k = grid.width
    table = ggml_iq3grid.grid_table(qtype).astype(np.float64)
    scales = block_scales(raw, qtype)  # [rows, 64], per grid row
    for g in (0, 5, 256 // k - 1):
        omega = rng.uniform(0.2, 3, k)
        target = rng.normal(0, 0.1, (10, k)).astype(np.float32)
        target[0, :] = -np.abs(target[0, :])  # an odd or even count of minus signs
        got = grid.round(g, target, omega).astype(np.float64)
        got_cost = ((target - got) ** 2 * omega).sum(axis=1)
        scale = scales[:, g * k // 4]
        best = brute_force_iq3(target.astype(np.float64), omega, scale, table, qtype)
        np.testing.assert_allclose(got_cost, best, rtol=1e-6, atol=1e-15)
        assert np.all(np.count_nonzero(got < 0, axis=1) % 2 == 0) or qtype == IQ3_S


def test_iq4_xs_code_is_the_nearest_of_its_sixteen_values():
    np.testing.assert_array_equal(ggml_iq4grid.KVALUES, np.array(IQ4_NL.kvalues, np.float32))
    rng = np.random.default_rng(30)
    raw = random_rows(IQ4_XS, 8, 1, rng)
    raw.reshape(8, 136)[0, 3] |= 0xC0  # a negative scale too (ls ≥ 32 in the last sub-block)
    grid = ggml_iq4grid.IQ4Grid(raw, IQ4_XS)
    dl = block_scales(raw, IQ4_XS)  # [rows, 256]
    every = dl[..., None] * ggml_iq4grid.KVALUES.astype(np.float64)  # [rows, 256, 16]
    targets = rng.normal(0, 0.3, (8, 256)) * np.abs(dl).max()
    for j in range(256):
        got = grid.round(j, targets[:, j : j + 1].astype(np.float32), np.ones(1))[:, 0]
        best = np.abs(targets[:, j, None] - every[:, j]).min(axis=1)
        np.testing.assert_allclose(np.abs(targets[:, j] - got), best, rtol=0, atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_alpha_folds_into_the_chosen_bytes_within_fp16_rounding(qtype):
    """``fold_alpha`` of the re-chosen bytes decodes to alpha times their decode, each scale
    rounded once to fp16 (relative error ≤ 2⁻¹¹ of a weight's magnitude)."""
    rng = np.random.default_rng(40 + qtype)
    raw = random_rows(qtype, 6, 2, rng)
    targets = rng.normal(0, 0.1, (6, 512)).astype(np.float32)
    packed, values = choose_all(raw, qtype, targets, lambda k: rng.uniform(0.2, 3, k))
    stack = GGMLWeight(packed[None], qtype, 512)
    for alpha in (0.83, np.array([1.21], np.float32)):
        folded = format_of(qtype).fold_alpha(stack, alpha)
        got = np.asarray(dequantize(np.asarray(folded.raw[0]), T(qtype)), np.float64)
        want = np.float64(np.ravel(alpha)[0]) * values.astype(np.float64)
        assert np.all(np.abs(got - want) <= 2.0**-11 * np.abs(want) + 1e-12)
        assert np.abs(got - want).max() > 0  # the scales were rounded, not skipped


def test_the_new_grids_are_column_grids():
    for name in NAMES:
        ggml_gptq.check_options(name, "column", 256, "conditional")
    assert ggml_gptq.COLUMN_GRIDS[IQ3_XXS] is ggml_iq3grid.IQ3Grid
    assert ggml_gptq.COLUMN_GRIDS[IQ4_XS] is ggml_iq4grid.IQ4Grid
    with pytest.raises(ValueError, match="not IQ3_XXS"):
        ggml_iq3grid.IQ3Grid(np.zeros((1, 66), np.uint8), int(T.IQ2_XXS))


# ---- with ggml's quantizer (slow tier: the [bench] extra) --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("qtype", NAMES)
def test_a_scaled_identity_h_rechooses_at_most_ggmls_error_per_row(qtype):
    """H = c·I: column-wise feedback keeps ggml's scales and picks each group's optimum under
    the flat metric, so no row's error exceeds ggml's answer's (on the IQ3 grids, where ggml
    searches its grid's neighbours, the total is lower), and the bytes decode alike in ggml,
    gguf-py and the graph."""
    from healsweep.gguf_io._ggml_lib import dequantize_rows
    from test_ggml_gptq import flat_h_column

    kind, w, raw, ggml = flat_h_column(qtype)
    ours, theirs = (dequantize_rows(r, kind.ggml_id, 512) for r in (raw, ggml))
    np.testing.assert_array_equal(dequantize(raw, T(kind.ggml_id)), ours)
    np.testing.assert_array_equal(np.asarray(decode_rows(raw, kind.ggml_id, 512)), ours)
    ours, theirs = (np.square(w - v).sum(1) for v in (ours, theirs))
    assert np.all(ours <= theirs * (1 + 1e-6)), (ours / theirs).max()
    if qtype != "iq4_xs":
        assert ours.sum() < theirs.sum()
    kept = kept_mask(kind.ggml_id)
    blocks = (w.shape[0], 2, SIZE[kind.ggml_id])
    np.testing.assert_array_equal(raw.reshape(blocks) & kept, ggml.reshape(blocks) & kept)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", NAMES)
def test_column_feedback_beats_block_feedback_and_plain_ggml_on_a_correlated_h(qtype):
    """Over three seeds of a correlated H the H-weighted error of column-wise feedback is at least
    10% below plain ggml with the imatrix on every seed, and below block-wise feedback in total."""
    from test_ggml_gptq import ef_and_plain

    column, plain = np.array([ef_and_plain(qtype, seed, method="column")[:2]
                              for seed in range(3)]).T  # fmt: skip
    block = np.array([ef_and_plain(qtype, seed)[0] for seed in range(3)])
    assert np.all(column < 0.9 * plain), (column / plain).round(3)
    assert column.sum() < block.sum(), (column / block).round(3)
