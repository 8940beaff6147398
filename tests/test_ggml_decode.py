"""In-graph GGUF decoders against ``gguf.quants.dequantize``, bit for bit.

Every type in ``IN_GRAPH_TYPES`` but Q2_0 is compared with gguf-py on random blocks (fp16 fields
replaced by finite fp16 values of many magnitudes) and on adversarial blocks (all-zero and all-0xFF
codes, fp16 fields at ±65504, ±smallest subnormal, ±0, ±1, ±inf and NaNs, every 6-bit pattern of
the K-quants' packed scales). Q2_0, which gguf-py cannot read, is compared with a float64 numpy
decoder written from the block spec (``healsweep.conformance.references``, which doctor uses
too), and with the project's own Q2_0 codec. The layout tables below are ggml's block structs,
written down independently of the module under test.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from healsweep.conformance.references import q2_0_from_bytes as q2_0_reference
from healsweep.errors import GGUFFormatError
from healsweep.kernels import _decode_legacy as lg
from healsweep.kernels.ggml_decode import (
    GGML_Q2_0,
    IN_GRAPH_TYPES,
    GGMLWeight,
    block_geometry,
    decode_rows,
)

T = GGMLQuantizationType
REQUIRED = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)
GGUF_TYPES = sorted(int(T[n]) for n in REQUIRED)
FLOAT_TYPES = (int(T.F32), int(T.F16), int(T.BF16))
# byte offsets of the fp16 fields of each block type (d, and dmin/m where there is one)
FP16_FIELDS = {
    int(T.Q8_0): (0,),
    int(T.Q4_0): (0,),
    int(T.Q4_1): (0, 2),
    int(T.Q5_0): (0,),
    int(T.Q5_1): (0, 2),
    int(T.Q4_K): (0, 2),
    int(T.Q5_K): (0, 2),
    int(T.Q6_K): (208,),
    int(T.IQ4_NL): (0,),
    int(T.IQ4_XS): (0,),
    GGML_Q2_0: (0,),
}
SCALE_BYTES = {
    int(T.Q4_K): (4, 16),
    int(T.Q5_K): (4, 16),
    int(T.Q6_K): (192, 208),
    int(T.IQ4_XS): (2, 8),
}  # the packed sub-block scales
CODE_START = {
    int(T.Q8_0): 2,
    int(T.Q4_0): 2,
    int(T.Q4_1): 4,
    int(T.Q5_0): 6,
    int(T.Q5_1): 8,
    int(T.Q4_K): 16,
    int(T.Q5_K): 48,
    int(T.Q6_K): 0,
    int(T.IQ4_NL): 2,
    int(T.IQ4_XS): 8,
    GGML_Q2_0: 2,
}
FP16_SPECIAL = (
    0x7BFF,
    0xFBFF,
    0x0001,
    0x8001,
    0x0000,
    0x8000,
    0x3C00,
    0xBC00,
    0x7C00,
    0xFC00,
    0x7E00,
    0x7C01,
)  # ±65504, ±min subnormal, ±0, ±1, ±inf, NaN, signalling NaN
F32_SPECIAL = (
    0x00000000,
    0x80000000,
    0x00000001,
    0x807FFFFF,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0x7F800001,
    0x3F800000,
    0x00800000,
)
BF16_SPECIAL = (
    0x0000,
    0x8000,
    0x0001,
    0x8001,
    0x7F7F,
    0xFF7F,
    0x7F80,
    0xFF80,
    0x7FC0,
    0x7F81,
    0x3F80,
    0x0080,
)

decode_jit = jax.jit(decode_rows, static_argnums=(1, 2))


def geometry(qtype: int) -> tuple[int, int]:
    return (64, 18) if qtype == GGML_Q2_0 else GGML_QUANT_SIZES[T(qtype)]


def assert_bit_exact(got, want) -> None:
    """Same shape, float32, NaN at the same places and identical bits everywhere else."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and want.dtype == np.float32
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def finite_fp16(rng, n: int) -> np.ndarray:
    """``n`` finite fp16 bit patterns, signed, magnitudes from subnormal to near 65504."""
    values = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-8.0, 4.8, n)
    return values.astype(np.float16).view(np.uint16)


def set_u16(blocks: np.ndarray, offset: int, bits) -> None:
    bits = np.asarray(bits, np.uint16)
    blocks[:, offset] = bits & 0xFF
    blocks[:, offset + 1] = bits >> 8


def random_blocks(qtype: int, n: int, rng) -> np.ndarray:
    """``n`` blocks of random bytes whose fp16 fields are finite random fp16 values."""
    _, size = geometry(qtype)
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if qtype == int(T.F16):
        return finite_fp16(rng, n).view(np.uint8).reshape(n, 2)
    for offset in FP16_FIELDS.get(qtype, ()):
        set_u16(blocks, offset, finite_fp16(rng, n))
    return blocks


def adversarial_blocks(qtype: int, rng) -> np.ndarray:
    """Special fp16/f32 fields × all-zero/all-0xFF/random codes, and every packed-scale pattern."""
    if qtype in FLOAT_TYPES:
        special = F32_SPECIAL if qtype == int(T.F32) else FP16_SPECIAL
        if qtype == int(T.BF16):
            special = BF16_SPECIAL
        width = 4 if qtype == int(T.F32) else 2
        bits = np.array(special, np.uint32 if width == 4 else np.uint16)
        return bits.astype(bits.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, width)
    _, size = geometry(qtype)
    fields = FP16_FIELDS[qtype]
    out = []
    for fill in (0x00, 0xFF, None):
        for combo in itertools.product(FP16_SPECIAL, repeat=len(fields)):
            block = (
                rng.integers(0, 256, (1, size), dtype=np.uint8)
                if fill is None
                else np.full((1, size), fill, np.uint8)
            )
            for offset, bits in zip(fields, combo, strict=True):
                set_u16(block, offset, bits)
            out.append(block)
    if qtype in SCALE_BYTES:
        lo, hi = SCALE_BYTES[qtype]
        patterns = np.arange(256, dtype=np.uint8)
        sweep = rng.integers(0, 256, (256, size), dtype=np.uint8)
        sweep[:, lo:hi] = patterns[:, None]  # every byte value in every scale byte
        if qtype == int(T.IQ4_XS):  # high bits (uint16 at 2) independent of the low nibbles
            sweep = np.repeat(sweep, 4, axis=0)
            set_u16(sweep, 2, np.tile(np.arange(4, dtype=np.uint16) * 0x5555, 256))
        if qtype in (int(T.Q4_K), int(T.Q5_K)):  # every 6-bit scale and min in every slot
            packed = rng.integers(0, 256, (64, size), dtype=np.uint8)
            v = np.arange(64)[:, None]
            slots = np.arange(8)[None, :]
            packed[:, 4:16] = pack_k_scales((v + 11 * slots) % 64, (7 * v + 5 + 3 * slots) % 64)
            sweep = np.concatenate([sweep, packed])
        for offset in fields:
            set_u16(sweep, offset, finite_fp16(rng, len(sweep)))
        out.append(sweep)
    return np.concatenate(out)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """ggml's Q4_K/Q5_K scale packing, [N, 8] 6-bit scales and mins -> [N, 12] bytes: slots 0-3
    in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); slots 4-7 keep their low 4 bits in
    bytes 8-11 (scale in the low nibble, min in the high) and their top 2 bits in the top bits
    of bytes 0-3 (scales) and 4-7 (mins)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((len(sc), 12), np.uint8)
    for j in range(4):
        out[:, j] = sc[:, j] | ((sc[:, 4 + j] >> 4) << 6)
        out[:, 4 + j] = mn[:, j] | ((mn[:, 4 + j] >> 4) << 6)
        out[:, 8 + j] = (sc[:, 4 + j] & 0x0F) | ((mn[:, 4 + j] & 0x0F) << 4)
    return out


def as_rows(blocks: np.ndarray, qtype: int, per_row: int = 2) -> tuple[np.ndarray, int]:
    """Blocks ``[N, size]`` -> rows ``[N/per_row, per_row*size]`` (N padded by repetition)."""
    block, size = geometry(qtype)
    pad = (-len(blocks)) % per_row
    blocks = np.concatenate([blocks, blocks[:pad]]) if pad else blocks
    return np.ascontiguousarray(blocks.reshape(-1, per_row * size)), per_row * block


def reference(rows: np.ndarray, qtype: int) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(dequantize(rows, T(qtype)), np.float32)


def test_type_ids_and_geometry():
    for name in REQUIRED:
        assert int(T[name]) in IN_GRAPH_TYPES
        assert block_geometry(int(T[name])) == GGML_QUANT_SIZES[T[name]]
        assert block_geometry(T[name]) == GGML_QUANT_SIZES[T[name]]
    assert GGML_Q2_0 == 42 and GGML_Q2_0 in IN_GRAPH_TYPES and block_geometry(42) == (64, 18)
    from healsweep.gguf_io import QUANT_SIZES, q2_0_type  # gguf-py 0.19 does not name type 42

    assert int(q2_0_type()) == 42 and QUANT_SIZES[q2_0_type()] == (64, 18)  # the local table
    assert block_geometry(int(T.TQ1_0)) == GGML_QUANT_SIZES[T.TQ1_0]  # host-fallback types too
    with pytest.raises(GGUFFormatError):
        block_geometry(999)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: T(t).name)
def test_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(qtype)
    rows, n_in = as_rows(random_blocks(qtype, 256, rng), qtype)
    want = reference(rows, qtype)
    assert_bit_exact(decode_jit(rows, qtype, n_in), want)
    if qtype == int(T.Q8_0):  # eager, op by op (slow to dispatch: one type is enough)
        assert_bit_exact(decode_rows(rows[:4], qtype, n_in), want[:4])
    stacked = rows.reshape(4, -1, rows.shape[-1])  # [E, out, row_bytes]
    assert_bit_exact(decode_jit(stacked, qtype, n_in), want.reshape(4, -1, n_in))


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: T(t).name)
def test_adversarial_blocks_bit_exact(qtype):
    rng = np.random.default_rng(1000 + qtype)
    blocks = adversarial_blocks(qtype, rng)
    rows, n_in = as_rows(blocks, qtype, per_row=1)
    want = reference(rows, qtype)
    if qtype not in FLOAT_TYPES:
        assert np.isnan(want).any() and np.isinf(want).any()  # the specials did reach the output
    assert_bit_exact(decode_jit(rows, qtype, n_in), want)
    if qtype in (int(T.Q4_K), int(T.Q5_K)):  # every 6-bit value reached every slot
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        for slot in range(8):
            assert set(sc[:, slot]) == set(range(64)) and set(mn[:, slot]) == set(range(64))


def test_q2_0_against_float64_spec():
    rng = np.random.default_rng(42)
    blocks = np.concatenate(
        [random_blocks(GGML_Q2_0, 256, rng), adversarial_blocks(GGML_Q2_0, rng)]
    )
    rows, n_in = as_rows(blocks, GGML_Q2_0)
    want64 = q2_0_reference(rows)
    want = want64.astype(np.float32)
    finite = np.isfinite(want64)
    np.testing.assert_array_equal(want[finite].astype(np.float64), want64[finite])  # exact
    assert_bit_exact(decode_jit(rows, GGML_Q2_0, n_in), want)


def test_q2_0_agrees_with_project_codec():
    from healsweep.kernels import q2_0
    from healsweep.kernels.q2_0 import pack_codes

    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 16, 128)).astype(np.float32)  # [E, out, in]
    qw = q2_0.quantize_matrix(w, None, 1.0)
    d, q = np.asarray(qw.d), np.asarray(qw.q)  # [3, 16, 2] f16, [3, 16, 128] int8
    raw = np.asarray(q2_0.pack(d.reshape(-1), q.reshape(-1, 64))).reshape(3, 16, 36)
    by_stages = np.concatenate(
        [d[..., None].view(np.uint8), pack_codes(q.reshape(3, 16, 2, 64))], axis=-1
    ).reshape(3, 16, 36)
    np.testing.assert_array_equal(raw, by_stages)
    assert_bit_exact(decode_jit(raw, GGML_Q2_0, 128), np.asarray(qw.dequantize()))
    np.testing.assert_array_equal(
        q2_0_reference(raw.reshape(48, 36)).reshape(w.shape), np.asarray(qw.dequantize())
    )


def flip_base(qtype: int, rng, n_blocks: int) -> np.ndarray:
    """A row of blocks with fp16 fields 1.0 and non-zero sub-block scales."""
    _, size = geometry(qtype)
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal(n_blocks).astype(np.float32)
        if qtype == int(T.F16):
            return values.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        if qtype == int(T.BF16):
            return values.view(np.uint8).reshape(n_blocks, 4)[:, 2:].copy()
        return values.view(np.uint8).reshape(n_blocks, 4)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        set_u16(blocks, offset, np.full(n_blocks, 0x3C00))
    if qtype in SCALE_BYTES:
        lo, hi = SCALE_BYTES[qtype]
        blocks[:, lo:hi] = 1
    return blocks


@pytest.mark.parametrize("qtype", [*GGUF_TYPES, GGML_Q2_0], ids=str)
def test_one_bit_flip_changes_exactly_its_block(qtype):
    rng = np.random.default_rng(5)
    block, _ = geometry(qtype)
    base = flip_base(qtype, rng, 6)
    n_in = 6 * block
    before = np.asarray(decode_jit(base.reshape(1, -1), qtype, n_in))[0]
    offsets = [0] if qtype in FLOAT_TYPES else [CODE_START[qtype], FP16_FIELDS[qtype][0]]
    for offset in offsets:
        flipped = base.copy()
        flipped[3, offset] ^= 1
        after = np.asarray(decode_jit(flipped.reshape(1, -1), qtype, n_in))[0]
        changed = before.view(np.uint32) != after.view(np.uint32)
        assert changed[3 * block : 4 * block].any(), (qtype, offset)
        assert not changed[: 3 * block].any() and not changed[4 * block :].any(), (qtype, offset)


def wrong_q4_0(b):
    """Q4_0 with the high nibble shifted by 3 instead of 4."""
    d = lg.fp16_at(b, 0)[..., None]
    q = jnp.concatenate([b[..., 2:] & 0x0F, (b[..., 2:] >> 3) & 0x0F], axis=-1)
    return d * (q - 8).astype(jnp.float32)


def wrong_q4_k(b):
    """Q4_K with the high scale bits of sub-blocks 4-7 taken by ``>> 3`` instead of ``>> 2``."""
    d, dmin = lg.fp16_at(b, 0)[..., None], lg.fp16_at(b, 2)[..., None]
    sd, sm, smd = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = jnp.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 3) & 0x30)], axis=-1)
    mn = jnp.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    chunks = b[..., 16:144].reshape(*b.shape[:-1], 4, 1, 32)
    q = jnp.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    dl = (d * sc.astype(jnp.float32))[..., None]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    return (dl * q.astype(jnp.float32) - ml).reshape(*b.shape[:-2], -1, 256)


@pytest.mark.parametrize(
    "qtype, wrong", [(int(T.Q4_0), wrong_q4_0), (int(T.Q4_K), wrong_q4_k)], ids=["Q4_0", "Q4_K"]
)
def test_deliberately_wrong_decoder_fails(qtype, wrong):
    rng = np.random.default_rng(11)
    block, size = geometry(qtype)
    rows, n_in = as_rows(
        np.concatenate([random_blocks(qtype, 64, rng), adversarial_blocks(qtype, rng)]),
        qtype,
        per_row=1,
    )
    want = reference(rows, qtype)
    assert_bit_exact(decode_jit(rows, qtype, n_in), want)
    blocks = jnp.asarray(rows).astype(jnp.int32).reshape(len(rows), -1, size)
    got = jax.jit(wrong)(blocks).reshape(len(rows), n_in)
    with pytest.raises(AssertionError):
        assert_bit_exact(got, want)


def test_bad_inputs_raise():
    raw = np.zeros((2, 34), np.uint8)
    with pytest.raises(GGUFFormatError):
        decode_rows(raw, int(T.TQ1_0), 256)  # no in-graph decoder
    with pytest.raises(GGUFFormatError):
        decode_rows(raw, int(T.Q8_0), 64)  # 64 weights need 68 bytes
    with pytest.raises(GGUFFormatError):
        decode_rows(raw.astype(np.int32), int(T.Q8_0), 32)
    with pytest.raises(GGUFFormatError):
        decode_rows(np.zeros((2, 34), np.uint8), int(T.Q8_0), 33)


def test_ggml_weight_pytree():
    rng = np.random.default_rng(3)
    qtype = int(T.Q4_K)
    rows, n_in = as_rows(random_blocks(qtype, 4 * 6 * 2, rng), qtype)  # 48 rows of 512
    raw = jnp.asarray(rows.reshape(4, 6, -1))  # [E, out, row_bytes]
    w = GGMLWeight(raw, T.Q4_K, n_in)
    assert w.shape == (4, 6, 512) and w.nbytes == 4 * 6 * 2 * 144 and w.qtype == 12
    leaves, treedef = jax.tree_util.tree_flatten(w)
    assert len(leaves) == 1 and leaves[0] is raw
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, GGMLWeight) and (again.qtype, again.n_in) == (12, 512)
    want = reference(rows, qtype).reshape(4, 6, 512)
    assert_bit_exact(jax.jit(GGMLWeight.dequantize)(w), want)
    expert = jax.tree_util.tree_map(lambda leaf: leaf[2], w)
    assert isinstance(expert, GGMLWeight) and expert.shape == (6, 512)
    assert_bit_exact(jax.jit(GGMLWeight.dequantize)(expert), want[2])

    @jax.jit
    def expert_matvec(weight: GGMLWeight, e, x):
        one = jax.tree_util.tree_map(lambda leaf: leaf[e], weight)
        return one.dequantize() @ x  # [out]

    x = rng.standard_normal(512).astype(np.float32)
    got = np.asarray(expert_matvec(w, 1, x))
    np.testing.assert_allclose(
        got,
        want[1].astype(np.float64) @ x,
        rtol=1e-4,
        atol=1e-4 * np.abs(want[1]).max() * np.sqrt(512),
    )
