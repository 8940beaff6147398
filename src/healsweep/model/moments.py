"""The second moments of the inputs of a model's matrices other than its routed experts.

What ``llama-imatrix`` records for a matrix (Σ x² per input column over the tokens it saw) for
every matrix healsweep may requantize besides the routed experts, from a teacher-forced pass of
the same layer functions the forward runs (:func:`healsweep.model.forward._block`'s steps):

- ``attn_in``: the attention norm's output, read by every attention matrix that takes the
  layer's hidden state (q/k/v, qkv, MLA's ``attn_q_a``/``attn_kv_a_mqa``/``attn_q``);
- per tensor suffix, the inputs :meth:`Architecture.attention_with_inputs` names: the heads'
  mix (``attn_output.weight``), MLA's normed latents (``attn_q_b.weight``, ``attn_kv_b.weight``);
- ``ffn_in``: the FFN norm's output (the shared expert's and a dense FFN's gate and up);
- ``shexp_hidden``: the shared expert's ``silu(g)·u`` (its down's input, before the gate);
- ``dense_hidden``: a leading dense layer's ``silu(g)·u`` (its down's input);
- ``output_in``: the output norm's output (the output matrix's input).

Sums are over real tokens only (the right padding of a batch is masked out), per layer as
``"<site>.<layer>"`` and ``"output_in"``, float64 on the host; ``tokens`` counts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.gguf_io import GGUFModel, ModelHparams
from healsweep.model.forward import _embed, _layer_weights, _pad_batch
from healsweep.model.layers import expert_tile_rows, matmul, rms_norm, swiglu_hidden
from healsweep.model.registry import architecture


def _squares(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ over real tokens of ``x²``: ``x [..., n]`` with ``mask`` of its leading shape → [n]."""
    flat = x.reshape(-1, x.shape[-1])
    return jnp.einsum("t,tn->n", mask.reshape(-1), jnp.square(flat))


@partial(jax.jit, static_argnums=(0, 1, 2))
def _block_moments(hp: ModelHparams, tile: int, dense: bool, w: dict, h, positions, mask):
    """One layer as the forward runs it → ``(h, {site: Σ x² over real tokens})``;
    ``mask [B, T]`` is 1 at real tokens, 0 at padding."""
    arch = architecture(hp.arch)
    b, t, d = h.shape
    x = rms_norm(h, w["attn_norm.weight"], hp.rms_norm_eps)
    attended, inner = jax.vmap(lambda xs: arch.attention_with_inputs(hp, w, xs, positions))(x)
    sums = {"attn_in": _squares(x, mask)}
    sums |= {suffix: _squares(v, mask) for suffix, v in inner.items()}
    h = h + attended
    x = rms_norm(h, w[arch.ffn_norm], hp.rms_norm_eps).reshape(b * t, d)  # [B*T, D]
    sums["ffn_in"] = _squares(x, mask)
    if dense:
        hidden = swiglu_hidden(x, w["ffn_gate.weight"], w["ffn_up.weight"])
        sums["dense_hidden"] = _squares(hidden, mask)
        return h + matmul(hidden, w["ffn_down.weight"]).reshape(b, t, d), sums
    out, cap = arch.moe_block(hp, w, x, tile)
    if "shexp_hidden" in cap:
        sums["shexp_hidden"] = _squares(cap["shexp_hidden"], mask)
    return h + out.reshape(b, t, d), sums


@partial(jax.jit, static_argnums=(0,))
def _output_moments(eps: float, h, weight, mask):
    return _squares(rms_norm(h, weight, eps), mask)


def input_moments(
    model: GGUFModel, sequences: Sequence[np.ndarray]
) -> tuple[dict[str, np.ndarray], int]:
    """Σ x² of every site of the module docstring over the tokens of ``sequences`` (int token
    ids, one batch), the teacher's weights: ``({"<site>.<layer>" | "output_in": float64 [n]},
    number of real tokens)``."""
    hp = model.hparams
    tokens, lengths = _pad_batch(sequences, hp.n_vocab)
    n_batch, padded_len = tokens.shape
    mask = jnp.asarray(np.arange(padded_len)[None, :] < np.asarray(lengths)[:, None], jnp.float32)
    positions = jnp.arange(padded_len, dtype=jnp.int32)
    tile = expert_tile_rows(n_batch * padded_len * hp.n_expert_used, hp.n_expert)
    h = jnp.asarray(_embed(model, tokens))  # [B, T, D]
    found: dict[str, np.ndarray] = {}
    for i in range(hp.n_layer):
        weights = _layer_weights(model, i, None)
        h, sums = _block_moments(hp, tile, i < hp.n_leading_dense, weights, h, positions, mask)
        found |= {f"{site}.{i}": np.asarray(v, np.float64) for site, v in sums.items()}
        weights = None
    norm = jnp.asarray(model.tensor("output_norm.weight"))
    found["output_in"] = np.asarray(_output_moments(hp.rms_norm_eps, h, norm, mask), np.float64)
    return found, int(sum(lengths))
