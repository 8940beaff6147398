"""In-graph dequantization: GGUF tensors travel as their stored bytes and decode inside ``jit``.

:func:`decode_rows` turns rows of stored bytes (uint8 ``[..., row_bytes]``, exactly as in the
file, float types included) into float32 ``[..., n_in]``, bit-identical to
``gguf.quants.dequantize``. It is pure ``jax.numpy`` on int32/float16/float32 values: no float64,
no unsigned-index gathers, little-endian fields assembled with shifts, so it lowers on CPU,
CUDA and Metal. :class:`GGMLWeight` holds such bytes as a pytree leaf, so a jitted layer can
slice an expert stack and decode one expert (or one tile) at a time.

Types are plain ints (ggml's ids): Q2_0 is type 42, which gguf-py does not name.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.errors import GGUFFormatError
from healsweep.kernels import _decode_iquants as iq
from healsweep.kernels import _decode_kquants as kq
from healsweep.kernels import _decode_legacy as lg
from healsweep.kernels.ggml_types import block_geometry, row_bytes

GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
GGML_Q2_K, GGML_Q3_K, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 10, 11, 12, 13, 14
GGML_IQ2_XXS, GGML_IQ2_XS, GGML_IQ3_XXS, GGML_IQ1_S = 16, 17, 18, 19
GGML_IQ4_NL, GGML_IQ3_S, GGML_IQ2_S, GGML_IQ4_XS, GGML_IQ1_M = 20, 21, 22, 23, 29
GGML_Q2_0 = 42

# qtype -> decoder of int32 [..., nb, bytes] blocks; each type's geometry is its row of
# kernels.ggml_types.STORED_TYPES, the one table of block sizes
_DECODERS: dict[int, Callable[[jax.Array], jax.Array]] = {
    GGML_F32: lg.decode_f32,
    GGML_F16: lg.decode_f16,
    GGML_BF16: lg.decode_bf16,
    GGML_Q8_0: lg.decode_q8_0,
    GGML_Q4_0: lg.decode_q4_0,
    GGML_Q4_1: lg.decode_q4_1,
    GGML_Q5_0: lg.decode_q5_0,
    GGML_Q5_1: lg.decode_q5_1,
    GGML_IQ4_NL: lg.decode_iq4_nl,
    GGML_Q2_0: lg.decode_q2_0,
    GGML_Q2_K: kq.decode_q2_k,
    GGML_Q3_K: kq.decode_q3_k,
    GGML_Q4_K: kq.decode_q4_k,
    GGML_Q5_K: kq.decode_q5_k,
    GGML_Q6_K: kq.decode_q6_k,
    GGML_IQ4_XS: kq.decode_iq4_xs,
    GGML_IQ1_S: iq.decode_iq1_s,
    GGML_IQ1_M: iq.decode_iq1_m,
    GGML_IQ2_XXS: iq.decode_iq2_xxs,
    GGML_IQ2_XS: iq.decode_iq2_xs,
    GGML_IQ2_S: iq.decode_iq2_s,
    GGML_IQ3_XXS: iq.decode_iq3_xxs,
    GGML_IQ3_S: iq.decode_iq3_s,
}

IN_GRAPH_TYPES: frozenset[int] = frozenset(_DECODERS)


def decode_rows(raw, qtype: int, n_in: int) -> jax.Array:
    """Decode rows of stored GGUF bytes to float32, bit-identical to ``gguf.quants.dequantize``.

    ``raw`` is uint8 ``[..., row_bytes]`` (each row's bytes as in the file, also for F32, F16 and
    BF16), ``qtype`` an int in :data:`IN_GRAPH_TYPES`, ``n_in`` the weights per row; returns
    float32 ``[..., n_in]``. ``qtype`` and ``n_in`` are static under ``jax.jit``.
    """
    qtype, n_in = int(qtype), int(n_in)
    if qtype not in _DECODERS:
        raise GGUFFormatError(f"ggml type {qtype} has no in-graph decoder; dequantize it on host")
    block, size = block_geometry(qtype)
    decode = _DECODERS[qtype]
    raw = jnp.asarray(raw)
    expected = row_bytes(qtype, n_in)
    if raw.dtype != jnp.uint8 or raw.ndim < 1 or raw.shape[-1] != expected:
        raise GGUFFormatError(
            f"decode_rows: expected uint8 rows of {expected} bytes for {n_in} weights of ggml "
            f"type {qtype}, got {raw.dtype} {tuple(raw.shape)}"
        )
    lead = raw.shape[:-1]
    blocks = raw.astype(jnp.int32).reshape(*lead, n_in // block, size)  # [..., nb, size]
    return decode(blocks).reshape(*lead, n_in)  # [..., n_in] float32


@jax.tree_util.register_pytree_node_class
class GGMLWeight:
    """A matrix kept as stored GGUF bytes: ``raw`` uint8 ``[..., out, row_bytes]`` is the leaf,
    ``(qtype, n_in)`` the static aux data; leading dims (e.g. experts) come from ``raw``, so
    ``tree_map(lambda leaf: leaf[e], w)`` yields expert ``e``."""

    __slots__ = ("raw", "qtype", "n_in")

    def __init__(self, raw, qtype: int, n_in: int):
        self.raw = raw
        self.qtype = int(qtype)
        self.n_in = int(n_in)

    def tree_flatten(self):
        return (self.raw,), (self.qtype, self.n_in)

    @classmethod
    def tree_unflatten(cls, aux, children) -> GGMLWeight:
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dense matrix, ``(..., out, n_in)``."""
        return (*self.raw.shape[:-1], self.n_in)

    @property
    def nbytes(self) -> int:
        """Stored bytes (the size of ``raw``)."""
        return int(np.prod(self.raw.shape, dtype=np.int64))

    def dequantize(self) -> jax.Array:
        """The dense float32 matrix ``[..., out, n_in]``."""
        return decode_rows(self.raw, self.qtype, self.n_in)

    def __repr__(self) -> str:
        return f"GGMLWeight(shape={self.shape}, qtype={self.qtype})"
