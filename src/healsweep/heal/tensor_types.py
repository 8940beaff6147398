"""Every tensor group other than the routed experts, stored in the type its knob chooses.

The knobs ``type_attn``, ``type_shexp``, ``type_embd``, ``type_output`` and ``type_dense``
(:class:`~healsweep.heal.knobs.Knobs`) choose a type for a group of the model's matrices;
``teacher`` (their default) keeps the group's bytes as the teacher stores them. The groups, by
tensor name (any architecture: the names are llama.cpp's):

- ``attn``: every matrix of a layer whose name starts with ``attn_`` (q/k/v/o, fused qkv, and
  MLA's ``attn_q_a``/``attn_q_b``/``attn_kv_a_mqa``/``attn_kv_b``/``attn_k_b``/``attn_v_b``);
  norms, biases and sinks are vectors and stay;
- ``shexp``: ``ffn_{gate,up,down}_shexp`` (the shared expert; its sigmoid gate is a vector);
- ``embd``: ``token_embd``; ``output``: ``output`` (a tied model has none: its head is the
  embedding, and follows ``type_embd``);
- ``dense``: ``ffn_{gate,up,down}`` of the leading dense layers.

The router (``ffn_gate_inp``) and every vector keep the teacher's bytes, as llama-quantize leaves them. A
tensor whose rows the asked type's blocks do not fill takes the smallest type of at least its
bits that does (:func:`~healsweep.kernels.ggml_types.fitting_type`); one already stored in the
type it would get keeps its bytes.

Requantizing (stage ``requant_tensor``, one entry per tensor, type and importance) is ggml's
quantizer (``ggml_quantize_chunk``) on the teacher's values with one importance row per tensor,
E[x²] of the tensor's input over the calibration tokens, as ``llama-imatrix`` records it for
``llama-quantize --imatrix`` (stage ``tensor_importance``, :mod:`healsweep.heal.tensor_importance`:
:mod:`healsweep.model.moments` over the calibration pool's chunks). Which input each matrix reads: the attention norm's output for
the attention matrices that read the hidden state, the heads' mix for ``attn_output``, MLA's
normed q/kv latents for ``attn_q_b``/``attn_kv_b``, the FFN norm's output for the shared expert's
(and a dense FFN's) gate and up, their ``silu(g)·u`` for their down, the output norm's output for
``output``. The token embeddings (a row lookup: no input, and ``llama-imatrix`` records none) and
MLA's per-head ``attn_k_b``/``attn_v_b`` get no row, except that the types ggml cannot make
without one (IQ1_S, IQ2_XXS, IQ2_XS) get equal weights. Part B's healed ``ffn_down_shexp`` is
requantized by Part B itself, to the same type with the same row (:mod:`healsweep.heal.ridge`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from healsweep import kernels  # a lazy face: jax is imported where a kernel runs
from healsweep.gguf_io import split_block
from healsweep.gguf_io._ggml_lib import requires_imatrix
from healsweep.heal._runner import stage_key
from healsweep.heal.knobs import Knobs
from healsweep.kernels.ggml_types import GGMLType, fitting_type, tensor_type
from healsweep.quant.formats import format_of
from healsweep.stage_names import Stage

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel

GROUPS = ("attn", "shexp", "embd", "output", "dense")
_SHEXP = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# the attention matrices whose input is named by the architecture (Architecture
# .attention_with_inputs): their importance site is the tensor suffix itself
_INNER = ("attn_output.weight", "attn_q_b.weight", "attn_kv_b.weight")
_NO_INPUT = ("attn_k_b.weight", "attn_v_b.weight")  # per-head inputs: no importance row
ROW_CHUNK = 4096  # rows of a tensor quantized at a time (one float32 slice on the host)


class GroupTensor(NamedTuple):
    """A matrix of a group other than the routed experts, as the teacher stores it."""

    name: str
    group: str  # one of GROUPS
    shape: tuple[int, ...]  # numpy shape, rows last
    stored: int  # ggml type id in the teacher
    nbytes: int  # its bytes in the teacher's file


def tensor_group(name: str, ndim: int, n_leading_dense: int) -> str | None:
    """The group of tensor ``name`` (a matrix of ``ndim`` >= 2 dims), None for a vector, a
    routed expert, the router or anything else no knob types."""
    if ndim < 2:
        return None
    if name == "token_embd.weight":
        return "embd"
    if name == "output.weight":
        return "output"
    layer, suffix = split_block(name)
    if layer is None:
        return None
    if suffix.startswith("attn_") and suffix.endswith(".weight"):
        return "attn"
    if suffix in _SHEXP:
        return "shexp"
    if layer < n_leading_dense and suffix in _DENSE:
        return "dense"
    return None


def group_tensors(model: GGUFModel) -> tuple[GroupTensor, ...]:
    """Every matrix of ``model`` a group knob types, in file order (its tensor table only)."""
    found = []
    for name in model.tensor_names:
        shape = tuple(model.tensor_shape(name))
        group = tensor_group(name, len(shape), model.hparams.n_leading_dense)
        if group is not None:
            stored = int(model.tensor_type(name))
            found.append(GroupTensor(name, group, shape, stored, model.tensor_nbytes(name)))
    return tuple(found)


def planned_types(tensors: tuple[GroupTensor, ...], knobs: Knobs) -> dict[str, GGMLType]:
    """The tensors of ``tensors`` that ``knobs`` store in another type than the teacher's, and
    that type (the group's knob, or the type that fits its rows); ``KnobError`` for rows no
    type fills."""
    asked = knobs.file_types()
    planned = {}
    for tensor in tensors:
        if tensor.group not in asked:
            continue
        chosen = fitting_type(asked[tensor.group], tensor.shape[-1])
        if chosen.ggml_id != tensor.stored:
            planned[tensor.name] = chosen
    return planned


def importance_site(name: str) -> str | None:
    """The key in :func:`healsweep.model.moments.input_moments` of the input tensor ``name``
    reads (``"attn_in.3"``, ``"attn_output.weight.3"``, ``"output_in"``), None where it has no
    importance row (see the module docstring)."""
    if name == "output.weight":
        return "output_in"
    layer, suffix = split_block(name)
    if layer is None or suffix in _NO_INPUT:
        return None
    if suffix in _INNER:
        return f"{suffix}.{layer}"
    if suffix.startswith("attn_"):
        return f"attn_in.{layer}"
    if suffix in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", *_DENSE[:2]):
        return f"ffn_in.{layer}"
    if suffix == "ffn_down_shexp.weight":
        return f"shexp_hidden.{layer}"
    if suffix == "ffn_down.weight":
        return f"dense_hidden.{layer}"
    return None


# --- stage tensor_importance --------------------------------------------------------------------


class InputMoments(NamedTuple):
    """``tensor_importance``: Σ x² per site over the calibration tokens, and their count."""

    sums: dict[str, np.ndarray]  # site -> float64 [n]
    tokens: int

    def to_entry(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return dict(self.sums), {"tokens": self.tokens}

    @classmethod
    def from_entry(cls, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> InputMoments:
        return cls(dict(arrays), int(meta["tokens"]))

    def row(self, name: str, n_in: int, required: bool) -> np.ndarray | None:
        """The importance row [n_in] float32 of tensor ``name``: E[x²] of its input; where it
        has none, equal weights if ggml ``required`` one, else None."""
        site = importance_site(name)
        sums = self.sums.get(site) if site is not None else None
        if sums is not None and sums.shape == (n_in,) and self.tokens > 0:
            return (sums / self.tokens).astype(np.float32)
        return np.ones(n_in, np.float32) if required else None


# --- stage requant_tensor -----------------------------------------------------------------------


class RequantTensor(NamedTuple):
    """``requant_tensor``: one tensor's stored bytes in its new type."""

    raw: np.ndarray  # uint8 [..., out, row_bytes]
    type_name: str
    n_in: int

    def to_entry(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {"raw": self.raw}, {"type": self.type_name, "n_in": self.n_in}

    @classmethod
    def from_entry(cls, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> RequantTensor:
        return cls(arrays["raw"], meta["type"], int(meta["n_in"]))

    def weight(self) -> Any:
        """The tensor as the forward takes it: a ``GGMLWeight`` of its bytes."""
        return kernels.ggml_decode.GGMLWeight(self.raw, tensor_type(self.type_name).ggml_id, self.n_in)


def requant_key(model: GGUFModel, name: str, chosen: GGMLType, importance: str | None) -> str:
    """Key of tensor ``name`` of ``model`` in type ``chosen`` with the importance of key
    ``importance``."""
    inputs = {"model": model.fingerprint, "tensor": name, "type": chosen.name}
    return stage_key(Stage.REQUANT_TENSOR, {**inputs, "importance": importance})


def requantize_tensor(
    model: GGUFModel, name: str, chosen: GGMLType, moments: InputMoments | None
) -> RequantTensor:
    """Tensor ``name`` of ``model`` quantized by ggml to ``chosen`` with its importance row,
    :data:`ROW_CHUNK` rows at a time (one slice of float32 on the host)."""
    shape = tuple(model.tensor_shape(name))
    n_in = shape[-1]
    row = None
    if moments is not None:
        row = moments.row(name, n_in, requires_imatrix(chosen.ggml_id))
    elif requires_imatrix(chosen.ggml_id):
        row = np.ones(n_in, np.float32)
    per_first = int(np.prod(shape[1:-1], dtype=np.int64))  # rows per index of the first axis
    step = max(1, ROW_CHUNK // per_first)
    encode = format_of(chosen.ggml_id).encode_ggml  # ggml's quantizer, as the format asks it
    pieces = []
    for start in range(0, shape[0], step):
        values = model.tensor_rows(name, start, start + step).reshape(-1, n_in)
        pieces.append(encode(values, chosen.ggml_id, row))
    raw = np.concatenate(pieces).reshape(*shape[:-1], chosen.row_bytes(n_in))
    return RequantTensor(raw, chosen.name, n_in)


def layer_tensors(retyped: dict[str, Any], layer: int | None) -> dict[str, Any]:
    """The weights of ``retyped`` (name → weight) of block ``layer`` by suffix, or (``layer``
    None) those outside the layers by name."""
    found = {}
    for name, weight in retyped.items():
        index, suffix = split_block(name)
        if index == layer:
            found[suffix if layer is not None else name] = weight
    return found
