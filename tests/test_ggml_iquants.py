"""In-graph decoders of Q2_K, Q3_K and the IQ1/IQ2/IQ3 types, bit for bit against two references.

gguf-py's numpy dequantizer (``gguf.quants.dequantize``) is the reference everywhere: random
blocks (fp16 scales finite, every other byte random), adversarial blocks (fp16 scales at ±0,
±65504, ±subnormal, ±inf, NaN; codes all-zero, all-0xFF, random; every byte value in every
sub-scale byte) and blocks whose grid indices enumerate every row of the type's grid. ggml's own
``to_float`` and quantizer (``healsweep.gguf_io._ggml_lib``, llama-cpp-python's libggml-base)
are the second reference, in the slow tier, which installs the ``[bench]`` extra: rows quantized
by ggml with an importance row decode as ggml decodes them, and every grid row decodes as ggml's
own C tables say (the decoders' grids come from gguf-py, so this is what checks the tables).
The index layouts below are written from ggml's block structs, independently of the decoders.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ2_XXS, dequantize

from healsweep.conformance import backend_violations, iter_eqns
from healsweep.kernels import _decode_iquants as iq
from healsweep.kernels import _decode_legacy as lg
from healsweep.kernels.ggml_decode import IN_GRAPH_TYPES, block_geometry, decode_rows
from test_ggml_decode import FP16_SPECIAL, assert_bit_exact, finite_fp16, set_u16

T = GGMLQuantizationType
NAMES = ("Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ3_S", "IQ2_S", "IQ1_M")
TYPES = [int(T[n]) for n in NAMES]
IQ1_M = int(T.IQ1_M)
FP16_FIELDS = {  # byte offsets of the plain fp16 fields (IQ1_M spreads its d over 4 nibbles)
    int(T.Q2_K): (80, 82),
    int(T.Q3_K): (108,),
    **{int(T[n]): (0,) for n in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ3_S", "IQ2_S")},
    IQ1_M: (),
}
SCALE_BYTES = {  # the packed sub-block scales: every byte value goes through each of them
    int(T.Q2_K): (0, 16),
    int(T.Q3_K): (96, 108),
    int(T.IQ2_XS): (66, 74),
    int(T.IQ2_S): (74, 82),
    int(T.IQ3_S): (106, 110),
}
GRID_ROWS = {"IQ2_XXS": 256, "IQ2_XS": 512, "IQ2_S": 1024, "IQ3_XXS": 256, "IQ3_S": 512}
GRID_ROWS |= {"IQ1_S": 2048, "IQ1_M": 2048}
GROUPS = {"IQ3_XXS": 64, "IQ3_S": 64}  # grid lookups per block (the others: 32)

decode_jit = jax.jit(decode_rows, static_argnums=(1, 2))
ids = [T(t).name for t in TYPES]


def reference(rows: np.ndarray, qtype: int) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(dequantize(rows, T(qtype)), np.float32)


def set_iq1_m_scale(blocks: np.ndarray, bits) -> None:
    """IQ1_M's fp16 ``d``: nibble ``i`` in the top nibble of the uint16 at ``48 + 2i``."""
    bits = np.asarray(bits, np.uint16)
    for i in range(4):
        word = blocks[:, 48 + 2 * i].astype(np.uint16) | (
            blocks[:, 49 + 2 * i].astype(np.uint16) << 8
        )
        word = (word & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        set_u16(blocks, 48 + 2 * i, word)


def set_scales(qtype: int, blocks: np.ndarray, bits_per_field) -> None:
    if qtype == IQ1_M:
        set_iq1_m_scale(blocks, bits_per_field[0])
    for offset, bits in zip(FP16_FIELDS[qtype], bits_per_field, strict=False):
        set_u16(blocks, offset, bits)


def random_blocks(qtype: int, n: int, rng) -> np.ndarray:
    _, size = GGML_QUANT_SIZES[T(qtype)]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    set_scales(qtype, blocks, [finite_fp16(rng, n) for _ in range(2)])
    return blocks


def adversarial_blocks(qtype: int, rng) -> np.ndarray:
    """Special fp16 scales × all-zero / all-0xFF / random codes, then a sweep of every byte value
    through every packed sub-scale byte (finite scales)."""
    _, size = GGML_QUANT_SIZES[T(qtype)]
    n_fields = max(1, len(FP16_FIELDS[qtype]))
    out = []
    for fill in (0x00, 0xFF, None):
        specials = np.array(FP16_SPECIAL, np.uint16)
        grids = np.meshgrid(*[specials] * n_fields, indexing="ij")
        combos = [g.reshape(-1) for g in grids]
        n = len(combos[0])
        if fill is None:
            blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
        else:
            blocks = np.full((n, size), fill, np.uint8)
        set_scales(qtype, blocks, combos)
        out.append(blocks)
    if qtype in SCALE_BYTES:
        lo, hi = SCALE_BYTES[qtype]
        sweep = rng.integers(0, 256, (256, size), dtype=np.uint8)
        sweep[:, lo:hi] = np.arange(256, dtype=np.uint8)[:, None]
        set_scales(qtype, sweep, [finite_fp16(rng, 256) for _ in range(2)])
        out.append(sweep)
    return np.concatenate(out)


def with_grid_indices(name: str, blocks: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``blocks`` with grid index ``idx[b, g]`` written into group ``g`` of block ``b``, at the
    bits ggml's ``block_<type>`` struct keeps it (sign and scale bits untouched)."""
    out = blocks.copy()
    g = np.arange(idx.shape[1])
    if name == "IQ2_XXS":  # 8 bytes per 32 weights: 4 index bytes, then signs and scale
        out[:, 2 + 8 * (g // 4) + g % 4] = idx
    elif name == "IQ2_XS":  # uint16 at 2 + 2g: 9-bit index, 7-bit sign index on top
        word = out[:, 2 + 2 * g].astype(np.uint16) | (out[:, 3 + 2 * g].astype(np.uint16) << 8)
        word = (word & 0xFE00) | idx
        out[:, 2 + 2 * g], out[:, 3 + 2 * g] = word & 0xFF, word >> 8
    elif name == "IQ2_S":  # low byte at 2 + g, 2 high bits at bits 2(g%4) of byte 66 + g/4
        out[:, 2 + g] = idx & 0xFF
        for j in range(8):
            byte = 0
            for k in range(4):
                byte = byte | ((idx[:, 4 * j + k] >> 8) << (2 * k))
            out[:, 66 + j] = byte
    elif name == "IQ3_XXS":  # one index byte per 4 weights
        out[:, 2 + g] = idx
    elif name == "IQ3_S":  # low byte at 2 + g, 9th bit at bit g%8 of byte 66 + g/8
        out[:, 2 + g] = idx & 0xFF
        for j in range(8):
            out[:, 66 + j] = sum((idx[:, 8 * j + k] >> 8) << k for k in range(8))
    elif name == "IQ1_S":  # low byte at 2 + g, 3 high bits at bits 3(g%4) of uint16 34 + 2(g/4)
        out[:, 2 + g] = idx & 0xFF
        for j in range(8):
            word = out[:, 34 + 2 * j].astype(np.uint16) | (
                out[:, 35 + 2 * j].astype(np.uint16) << 8
            )
            word = word & 0xF000
            for k in range(4):
                word = word | ((idx[:, 4 * j + k] >> 8) << (3 * k)).astype(np.uint16)
            out[:, 34 + 2 * j], out[:, 35 + 2 * j] = word & 0xFF, word >> 8
    elif name == "IQ1_M":  # low byte at g, 3 high bits in nibble g%2 of byte 32 + g/2 (bit 3 kept)
        out[:, g] = idx & 0xFF
        for j in range(16):
            byte = out[:, 32 + j] & 0x88
            byte = byte | (idx[:, 2 * j] >> 8) | ((idx[:, 2 * j + 1] >> 8) << 4)
            out[:, 32 + j] = byte
    else:
        raise AssertionError(name)
    return out


def grid_sweep_blocks(name: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """Blocks whose groups run through every grid row, fp16 ``d`` = 1; and their indices."""
    qtype = int(T[name])
    groups = GROUPS.get(name, 32)
    n = GRID_ROWS[name] // groups
    idx = (np.arange(n * groups).reshape(n, groups) * 7) % GRID_ROWS[name]  # 7: coprime, spread
    blocks = rng.integers(0, 256, (n, GGML_QUANT_SIZES[T[name]][1]), dtype=np.uint8)
    set_scales(qtype, blocks, [np.full(n, 0x3C00)] * 2)
    return with_grid_indices(name, blocks, idx.astype(np.uint16)), idx


def as_rows(blocks: np.ndarray, per_row: int = 2) -> np.ndarray:
    pad = (-len(blocks)) % per_row
    blocks = np.concatenate([blocks, blocks[:pad]]) if pad else blocks
    return np.ascontiguousarray(blocks.reshape(len(blocks) // per_row, -1))


def test_registered_with_ggml_geometry():
    for qtype in TYPES:
        assert qtype in IN_GRAPH_TYPES
        assert block_geometry(qtype) == GGML_QUANT_SIZES[T(qtype)]


@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(qtype)
    rows = as_rows(random_blocks(qtype, 256, rng))  # [128, 2 blocks]
    want = reference(rows, qtype)
    assert_bit_exact(decode_jit(rows, qtype, 512), want)
    stacked = rows.reshape(4, 32, -1)  # [E, out, row_bytes]
    assert_bit_exact(decode_jit(stacked, qtype, 512), want.reshape(4, 32, 512))


@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_adversarial_blocks_bit_exact(qtype):
    rng = np.random.default_rng(1000 + qtype)
    rows = as_rows(adversarial_blocks(qtype, rng), per_row=1)
    want = reference(rows, qtype)
    assert np.isnan(want).any() and np.isinf(want).any()  # the specials reached the output
    assert (want == 0).any() and (np.signbit(want) & (want != 0)).any()
    assert_bit_exact(decode_jit(rows, qtype, 256), want)


@pytest.mark.parametrize("name", sorted(GRID_ROWS))
def test_every_grid_row_bit_exact(name):
    qtype = int(T[name])
    blocks, idx = grid_sweep_blocks(name, np.random.default_rng(qtype))
    assert set(idx.reshape(-1)) == set(range(GRID_ROWS[name]))
    rows = as_rows(blocks, per_row=1)
    assert_bit_exact(decode_jit(rows, qtype, 256), reference(rows, qtype))


def test_computed_sign_table_is_ggmls_ksigns():
    want = np.frombuffer(IQ2_XXS.ksigns, np.uint8)  # ggml's ksigns_iq2xs, as gguf-py holds it
    signs = np.asarray(iq._ksigns(jnp.arange(128, dtype=jnp.int32)))  # [128, 8] of +-1
    got = ((signs < 0) << np.arange(8)).sum(axis=1)
    np.testing.assert_array_equal(got, want)


def wrong_iq1_m(b):
    """IQ1_M with the fp16 ``d``'s nibbles read from the four scale words in reverse order."""
    words = [lg.u16_at(b, 48 + 2 * i) for i in range(4)]
    swapped = b
    for i in range(4):
        word = (words[i] & 0x0FFF) | (words[3 - i] & 0xF000)
        swapped = swapped.at[..., 48 + 2 * i].set(word & 0xFF)
        swapped = swapped.at[..., 49 + 2 * i].set(word >> 8)
    return iq.decode_iq1_m(swapped)


def wrong_iq3_s(b):
    """IQ3_S with the 9th index bits read MSB-first within each byte."""
    flipped = jnp.zeros_like(b[..., 66:74])
    for k in range(8):
        flipped = flipped | (((b[..., 66:74] >> k) & 1) << (7 - k))
    return iq.decode_iq3_s(b.at[..., 66:74].set(flipped))


@pytest.mark.parametrize(
    "name, wrong", [("IQ1_M", wrong_iq1_m), ("IQ3_S", wrong_iq3_s)], ids=["IQ1_M", "IQ3_S"]
)
def test_deliberately_wrong_decoder_fails(name, wrong):
    qtype = int(T[name])
    rng = np.random.default_rng(17)
    blocks = np.concatenate([random_blocks(qtype, 64, rng), grid_sweep_blocks(name, rng)[0]])
    rows = as_rows(blocks, per_row=1)
    want = reference(rows, qtype)
    assert_bit_exact(decode_jit(rows, qtype, 256), want)
    got = jax.jit(wrong)(jnp.asarray(rows).astype(jnp.int32).reshape(len(rows), 1, -1))
    with pytest.raises(AssertionError):
        assert_bit_exact(got.reshape(len(rows), 256), want)


@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_one_bit_flip_changes_exactly_its_block(qtype):
    rng = np.random.default_rng(5)
    base = random_blocks(qtype, 6, rng)
    set_scales(qtype, base, [np.full(6, 0x3C00)] * 2)
    n_in = 6 * 256
    before = np.asarray(decode_jit(base.reshape(1, -1), qtype, n_in))[0]
    scale_byte = 49 if qtype == IQ1_M else FP16_FIELDS[qtype][0] + 1
    for offset in (scale_byte, 40):  # the fp16 scale's high byte; a byte of codes or indices
        flipped = base.copy()
        flipped[3, offset] ^= 0x10 if offset == scale_byte else 0x01
        after = np.asarray(decode_jit(flipped.reshape(1, -1), qtype, n_in))[0]
        changed = before.view(np.uint32) != after.view(np.uint32)
        assert changed[3 * 256 : 4 * 256].any(), (qtype, offset)
        assert not changed[: 3 * 256].any() and not changed[4 * 256 :].any(), (qtype, offset)


@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_backend_rules(qtype):
    """No float64, no unlowerable primitive, and every gather indexed by signed int32."""
    raw = random_blocks(qtype, 2, np.random.default_rng(0)).reshape(1, -1)
    fn = lambda r: decode_rows(r, qtype, 512)  # noqa: E731
    assert backend_violations(fn, raw) == []
    gathers = [e for e in iter_eqns(jax.make_jaxpr(fn)(raw).jaxpr) if e.primitive.name == "gather"]
    if qtype not in (int(T.Q2_K), int(T.Q3_K)):
        assert gathers  # the grid lookup
    for eqn in gathers:
        assert np.dtype(eqn.invars[1].aval.dtype) == np.int32, eqn


# ---- ggml's own quantizer and to_float (slow tier: the [bench] extra) ---------------------------


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_rows_quantized_by_ggml_decode_as_ggml_and_gguf_py(qtype):
    from healsweep.gguf_io._ggml_lib import dequantize_rows, quantize_rows

    rng = np.random.default_rng(qtype)
    w = rng.standard_normal((3, 8, 512)).astype(np.float32)  # [E, out, in]
    w[:, :, rng.integers(0, 512, 8)] *= 6.0  # a few outlier columns, as real experts have
    imatrix = rng.gamma(1.0, 1.0, (3, 512)).astype(np.float32)  # one importance row per expert
    raw = np.stack([quantize_rows(w[e], qtype, imatrix[e]) for e in range(3)])
    ggml = dequantize_rows(raw, qtype, 512)
    assert np.sqrt(np.mean((ggml - w) ** 2) / np.mean(w**2)) < 0.9  # a quantization of w
    assert_bit_exact(decode_jit(raw, qtype, 512), ggml)
    assert_bit_exact(reference(raw.reshape(24, -1), qtype).reshape(3, 8, 512), ggml)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=ids)
def test_random_adversarial_and_grid_blocks_decode_as_ggml(qtype):
    from healsweep.gguf_io._ggml_lib import dequantize_rows

    rng = np.random.default_rng(2000 + qtype)
    parts = [random_blocks(qtype, 64, rng), adversarial_blocks(qtype, rng)]
    name = T(qtype).name
    if name in GRID_ROWS:  # every row of the grid, against ggml's own C table
        parts.append(grid_sweep_blocks(name, rng)[0])
    rows = as_rows(np.concatenate(parts), per_row=1)
    assert_bit_exact(decode_jit(rows, qtype, 256), dequantize_rows(rows, qtype, 256))


@pytest.mark.slow
def test_forward_decodes_every_new_type_in_the_graph(random_gguf, tmp_path, monkeypatch, caplog):
    """A model whose routed experts use the nine types (three layers x gate/up/down), written
    from ggml's quantizer: the forward decodes them in the graph (no host notice) and its logits
    are those of the same forward fed gguf-py's host-dequantized float32 experts."""
    import importlib
    import logging

    from healsweep.heal.export import write_replacing
    from healsweep.model import forward, open_model
    from healsweep.quant.imatrix import quantize_expert_stack
    from healsweep.runtime import Runtime, use

    forward_module = importlib.import_module("healsweep.model.forward")
    teacher = open_model(random_gguf("qwen2moe", n_layer=3, n_embd=256, n_head=4, n_head_kv=2,
                                     n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256,
                                     seed=29))  # fmt: skip
    suffixes = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
    slots = [f"blk.{i}.{s}" for i in range(3) for s in suffixes]
    qtypes = dict(zip(slots, TYPES, strict=True))
    plan = {
        name: (T(q), (4, 256, GGML_QUANT_SIZES[T(q)][1]), np.dtype(np.uint8))
        for name, q in qtypes.items()
    }
    rng = np.random.default_rng(0)

    def produce(name):
        importance = rng.gamma(1.0, 1.0, (4, 256)).astype(np.float32)  # one row per expert
        return quantize_expert_stack(teacher.tensor(name), qtypes[name], importance)

    student = open_model(write_replacing(teacher, tmp_path / "s.gguf", plan, produce, {}))
    assert {int(student.tensor_type(n)) for n in slots} == set(TYPES)
    seqs = [rng.integers(0, student.hparams.n_vocab, 40).astype(np.int32)]
    with caplog.at_level(logging.WARNING, logger="healsweep.model.forward"):
        in_graph = forward(student, seqs).logits[0]
    assert not [r for r in caplog.records if "dequantized on the host" in r.getMessage()]
    monkeypatch.setattr(forward_module, "IN_GRAPH_TYPES", IN_GRAPH_TYPES - set(TYPES))
    with (
        Runtime() as fresh,  # whose notices are not yet given
        use(fresh),
        caplog.at_level(logging.WARNING, logger="healsweep.model.forward"),
    ):
        on_host = forward(student, seqs).logits[0]
    assert [r for r in caplog.records if "dequantized on the host" in r.getMessage()]
    assert np.abs(on_host).max() > 1.0
    np.testing.assert_allclose(in_graph, on_host, rtol=0, atol=1e-5 * np.abs(on_host).max())
