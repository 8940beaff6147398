"""The ggml types a routed expert can be stored in: name, id, block geometry, bits per weight.

One table for every layer that needs these facts (the decoders, the heal stages, the knobs, the
size budget), without asking gguf-py: gguf-py does not name Q2_0 (type 42), and healsweep does not
patch its enum for that. Names are the knob spellings (llama.cpp's type names, lower case).
``requires_imatrix`` is what ggml's ``ggml_quantize_requires_imatrix`` answers: its quantizer
refuses those types without an importance row. (llama-quantize, the tool, also refuses IQ2_S and
IQ1_M without an imatrix; healsweep always passes the calibration importance to ggml anyway.)

Every type here has an in-graph decoder (``kernels.ggml_decode``) and, but the float types, an
fp16 block or super-block scale that Part A's alpha folds into (``gguf_io.fold_scale``): where its
bytes sit in the block is a fact of the type too (``scale_offsets``), so this table is the one
place a block's geometry is written (:data:`STORED_TYPES`, :func:`stored_type`). What a type
does with the geometry (encode, decode, fold, write) is its storage format's class,
:mod:`healsweep.quant.formats`.
"""

from __future__ import annotations

from dataclasses import dataclass

from healsweep.errors import GGUFFormatError, KnobError


@dataclass(frozen=True)
class GGMLType:
    """One ggml storage type: ``block_weights`` weights take ``block_bytes`` bytes; alpha scales
    the fp16 fields at ``scale_offsets`` of each block (None: a float type, no block scale), and
    for IQ1_M the fp16 spread over the top nibbles of four uint16 at ``nibble_scale``."""

    name: str
    ggml_id: int
    block_weights: int
    block_bytes: int
    requires_imatrix: bool
    scale_offsets: tuple[int, ...] | None = (0,)
    nibble_scale: int | None = None
    own_quantizer: bool = False  # routed experts in it need no ggml: healsweep quantizes them

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight, ``8 * block_bytes / block_weights`` (exact in binary)."""
        return 8 * self.block_bytes / self.block_weights

    def row_bytes(self, n_in: int) -> int:
        """Stored bytes of one row of ``n_in`` weights; raises :class:`KnobError` when the row
        does not fill whole blocks (a model whose rows this type cannot store)."""
        if n_in % self.block_weights:
            raise KnobError(
                f"rows of {n_in} weights do not fill whole {self.name} blocks of "
                f"{self.block_weights}; choose a type with blocks that divide {n_in}"
            )
        return n_in // self.block_weights * self.block_bytes


# Ordered by bits per weight; ids and geometry as in ggml's type traits (ggml.c).
ROUTED_TYPES: tuple[GGMLType, ...] = (
    GGMLType("iq1_s", 19, 256, 50, True),
    GGMLType("iq1_m", 29, 256, 56, False, (), nibble_scale=48),  # four uint16 at bytes 48-55
    GGMLType("iq2_xxs", 16, 256, 66, True),
    GGMLType("q2_0", 42, 64, 18, False, own_quantizer=True),  # fp16 d, then 16 bytes of 2-bit codes LSB first
    GGMLType("iq2_xs", 17, 256, 74, True),
    GGMLType("iq2_s", 22, 256, 82, False),
    GGMLType("q2_k", 10, 256, 84, False, (80, 82)),  # d, dmin after 16 scale and 64 code bytes
    GGMLType("iq3_xxs", 18, 256, 98, False),
    GGMLType("iq3_s", 21, 256, 110, False),
    GGMLType("q3_k", 11, 256, 110, False, (108,)),  # d last
    GGMLType("iq4_xs", 23, 256, 136, False),
    GGMLType("iq4_nl", 20, 32, 18, False),
    GGMLType("q4_k", 12, 256, 144, False, (0, 2)),  # d, dmin
    GGMLType("q5_k", 13, 256, 176, False, (0, 2)),  # d, dmin
)
_BY_NAME = {t.name: t for t in ROUTED_TYPES}
_BY_ID = {t.ggml_id: t for t in ROUTED_TYPES}

# The types of every other tensor (attention, shared expert, embeddings, output, dense layers):
# the routed types and the larger ones whole-file recipes keep sensitive tensors in (Unsloth's
# dynamic quants: Q4_K-Q8_0), ordered by bits per weight. Each has an in-graph decoder.
TENSOR_TYPES: tuple[GGMLType, ...] = tuple(
    sorted(
        (
            *ROUTED_TYPES,
            GGMLType("q4_0", 2, 32, 18, False),
            GGMLType("q5_0", 6, 32, 22, False),
            GGMLType("q6_k", 14, 256, 210, False, (208,)),
            GGMLType("q8_0", 8, 32, 34, False),
        ),
        key=lambda t: t.bits_per_weight,
    )
)
_TENSOR_BY_NAME = {t.name: t for t in TENSOR_TYPES}

# Every type healsweep decodes in the graph: the tensor types, the float types a GGUF keeps
# vectors and unquantized matrices in, and the legacy affine types (a scale and a min).
STORED_TYPES: tuple[GGMLType, ...] = (
    *TENSOR_TYPES,
    GGMLType("f32", 0, 1, 4, False, None),
    GGMLType("f16", 1, 1, 2, False, None),
    GGMLType("bf16", 30, 1, 2, False, None),
    GGMLType("q4_1", 3, 32, 20, False, (0, 2)),  # d, m
    GGMLType("q5_1", 7, 32, 24, False, (0, 2)),  # d, m
)
_STORED_BY_ID = {t.ggml_id: t for t in STORED_TYPES}


def ggml_type(key: str | int) -> GGMLType:
    """The routed-expert type named ``key`` (``"iq2_xs"``, any case) or with ggml id ``key``;
    raises :class:`KnobError` for any other."""
    found = _BY_NAME.get(key.lower()) if isinstance(key, str) else _BY_ID.get(int(key))
    if found is None:
        raise KnobError(
            f"{key!r} is not a routed-expert type healsweep offers; choose one of "
            f"{', '.join(_BY_NAME)}"
        )
    return found


def stored_type(ggml_id: int) -> GGMLType:
    """The type with ggml id ``ggml_id`` among :data:`STORED_TYPES`; raises
    :class:`GGUFFormatError` for any other (a type healsweep has no geometry for)."""
    found = _STORED_BY_ID.get(int(ggml_id))
    if found is None:
        raise GGUFFormatError(f"ggml type {int(ggml_id)} is not one healsweep stores or decodes")
    return found


def stored_ids() -> frozenset[int]:
    """The ggml ids of :data:`STORED_TYPES`."""
    return frozenset(_STORED_BY_ID)


def block_geometry(qtype: int) -> tuple[int, int]:
    """``(weights per block, bytes per block)`` of ggml type ``qtype`` (an int id).

    Covers every in-graph type, Q2_0 (42) included, and any other type gguf-py knows (for the
    host fallback); an unknown id raises :class:`GGUFFormatError`.
    """
    qtype = int(qtype)
    if qtype in _STORED_BY_ID:  # the in-graph types (kernels.ggml_decode has a decoder for each)
        kind = _STORED_BY_ID[qtype]
        return kind.block_weights, kind.block_bytes
    # lazy: heavy (gguf)
    from gguf import GGML_QUANT_SIZES

    sizes = {int(t): s for t, s in GGML_QUANT_SIZES.items()}
    if qtype not in sizes:
        raise GGUFFormatError(f"unknown ggml tensor type {qtype}: no block geometry for it")
    return sizes[qtype]


def row_bytes(qtype: int, n_in: int) -> int:
    """Stored bytes of one row of ``n_in`` weights of type ``qtype``."""
    block, size = block_geometry(qtype)
    if n_in % block:
        raise GGUFFormatError(
            f"rows of {n_in} weights do not fill whole blocks of {block} (ggml type {int(qtype)})"
        )
    return n_in // block * size


def tensor_type(name: str) -> GGMLType:
    """The storage type named ``name`` among :data:`TENSOR_TYPES` (the routed types and q4_0,
    q5_0, q5_k, q6_k, q8_0); raises :class:`KnobError` for any other."""
    found = _TENSOR_BY_NAME.get(name.lower())
    if found is None:
        raise KnobError(
            f"{name!r} is not a tensor type healsweep offers; choose one of "
            f"{', '.join(_TENSOR_BY_NAME)}"
        )
    return found


def fitting_type(name: str, width: int) -> GGMLType:
    """The type a tensor with rows of ``width`` weights is stored in when ``name`` is asked for:
    ``name`` itself where its blocks fill the rows, else the smallest type of
    :data:`TENSOR_TYPES` with at least its bits per weight whose blocks do (llama-quantize also
    falls back to a type of smaller blocks there), else Q8_0 (blocks of 32). ``KnobError`` for
    rows no block type of the table fills (not a multiple of 32)."""
    asked = tensor_type(name)
    fits = [t for t in TENSOR_TYPES if width % t.block_weights == 0]
    if asked in fits:
        return asked
    found = next((t for t in fits if t.bits_per_weight >= asked.bits_per_weight), None)
    if found is None and fits:
        found = fits[-1]
    if found is None:
        raise KnobError(
            f"rows of {width} weights fill no block of a tensor type healsweep offers (every "
            "block holds 32, 64 or 256 weights); keep that tensor group as the teacher stores it"
        )
    return found


def step_up(name: str, width: int | None = None) -> str:
    """One step up the ladder of :data:`ROUTED_TYPES`: the first type after ``name`` in the table
    with more bits per weight (``iq2_xxs`` → ``q2_0`` → ``iq2_xs`` → ``iq2_s`` → ``q2_k`` →
    ``iq3_xxs`` → ``iq3_s`` → ``iq4_xs`` → ``iq4_nl`` → ``q5_k``; ``q3_k`` → ``iq4_xs``,
    ``q4_k`` → ``q5_k``); with ``width``, the first such type whose blocks fill rows of ``width``
    weights. Where there is none (the largest type, ``q5_k``), ``name`` itself."""
    start = ggml_type(name)
    later = ROUTED_TYPES[ROUTED_TYPES.index(start) + 1 :]
    fits = [t for t in later if width is None or width % t.block_weights == 0]
    return next((t.name for t in fits if t.bits_per_weight > start.bits_per_weight), start.name)


def step_down(name: str, width: int | None = None) -> str:
    """One step down the ladder of :data:`ROUTED_TYPES`, the mirror of :func:`step_up`: the last
    type before ``name`` in the table with fewer bits per weight (``iq2_xs`` → ``q2_0`` →
    ``iq2_xxs`` → ``iq1_m`` → ``iq1_s``; ``iq3_s`` and ``q3_k`` → ``iq3_xxs``); with ``width``,
    the last such type whose blocks fill rows of ``width`` weights. Where there is none
    (``iq1_s``), ``name`` itself."""
    start = ggml_type(name)
    earlier = ROUTED_TYPES[: ROUTED_TYPES.index(start)]
    fits = [t for t in earlier if width is None or width % t.block_weights == 0]
    found = [t for t in fits if t.bits_per_weight < start.bits_per_weight]
    return found[-1].name if found else start.name
