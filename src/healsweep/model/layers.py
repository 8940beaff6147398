"""Building blocks shared by the MoE architectures: pure jax.numpy, float32.

Weights follow the GGUF numpy layout ``[out, in]`` (experts ``[E, out, in]``). Any weight may be
a dense array or a quantized pytree with ``.dequantize()`` (e.g. ``kernels.q2_0.Q2Weight``); it
goes through :func:`matmul`, so the forward does not care which it gets.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def as_dense(w: Any) -> jax.Array:
    """A dense float32 array of ``w`` (dequantized when it is a quantized pytree)."""
    if isinstance(w, (jax.Array, np.ndarray)):
        return jnp.asarray(w, jnp.float32)
    return jnp.asarray(w.dequantize(), jnp.float32)


def matmul(x: jax.Array, w: Any) -> jax.Array:
    """``x @ w.T`` for ``x [..., in]`` and ``w [out, in]`` (dense or quantized) → ``[..., out]``."""
    return jnp.einsum("...i,oi->...o", x, as_dense(w))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, then a per-channel gain."""
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight


def rope_neox(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """NeoX rotary embedding (rotate halves): ``x [T, H, hd]``, ``positions [T]``."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, hd/2]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal GQA attention of one sequence: ``q [T, H, hd]``, ``k, v [T, Hkv, hd]`` → ``[T, H*hd]``.

    Query head ``h`` reads key/value head ``h // (H / Hkv)``, as llama.cpp and transformers do.
    """
    t, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    k = jnp.repeat(k, group, axis=1)  # [T, H, hd]
    v = jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(jnp.float32(head_dim))  # [H, T, T]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hts,shd->thd", probs, v).reshape(t, n_head * head_dim)


def router_topk(
    router_logits: jax.Array, k: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token: ``(ids [T, k] int32, weights [T, k])``.

    Softmax over all experts, then the k largest probabilities; qwen2moe keeps them as they are
    (``normalize=False``), qwen3moe rescales them to sum to one (``normalize=True``).
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def swiglu(x: jax.Array, w_gate: Any, w_up: Any, w_down: Any) -> jax.Array:
    """``(silu(x·Wgᵀ) * (x·Wuᵀ))·Wdᵀ`` for ``x [N, D]``."""
    return matmul(swiglu_hidden(x, w_gate, w_up), w_down)


def swiglu_hidden(x: jax.Array, w_gate: Any, w_up: Any) -> jax.Array:
    """The down-projection input ``h = silu(x·Wgᵀ) * (x·Wuᵀ)`` → ``[N, F]``."""
    return jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up)


def expert_tile_rows(n_assignments: int, n_expert: int) -> int:
    """Rows per tile of :func:`routed_experts`: about half an expert's average load, 8..128."""
    mean_load = max(n_assignments // max(n_expert, 1), 1)
    return int(min(max(2 ** int(np.log2(mean_load)) // 2, 8), 128))


def _expert(w: Any, e: jax.Array) -> Any:
    """Expert ``e`` of a stacked weight ``[E, out, in]`` (dense or a quantized pytree)."""
    if isinstance(w, (jax.Array, np.ndarray)):
        return jnp.asarray(w)[e]
    return jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf)[e], w)


def routed_experts(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    n_expert: int,
    tile: int,
) -> jax.Array:
    """Weighted sum over each token's routed experts: ``x [N, D]`` → ``[N, D]``.

    Grouped matmul instead of a dense all-experts einsum (which costs E/k times the FLOPs and
    an ``[N, E, F]`` buffer): the N·k (token, expert) assignments are sorted by expert and laid
    out in tiles of ``tile`` rows, each expert's run padded to whole tiles, so every tile
    belongs to one expert. A ``lax.scan`` over tiles slices that expert's weights (dequantizing
    a quantized expert one at a time) and skips the unused tail tiles. Shapes are static: at
    most ``ceil(N·k / tile) + E`` tiles.
    """
    n_tokens, n_embd = x.shape
    k = topk_ids.shape[1]
    n_assign = n_tokens * k
    n_tiles = -(-n_assign // tile) + n_expert
    flat_ids = topk_ids.reshape(-1)  # [A]
    order = jnp.argsort(flat_ids, stable=True)  # [A]
    sorted_ids = flat_ids[order]
    counts = jnp.zeros(n_expert, jnp.int32).at[flat_ids].add(1)  # [E]
    padded = (counts + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    dest = padded_start[sorted_ids] + jnp.arange(n_assign, dtype=jnp.int32) - start[sorted_ids]
    rows = n_tiles * tile
    row_token = jnp.full(rows, n_tokens, jnp.int32).at[dest].set(order // k)  # [P]
    row_weight = jnp.zeros(rows, jnp.float32).at[dest].set(topk_weights.reshape(-1)[order])
    tile_first_row = jnp.arange(n_tiles, dtype=jnp.int32) * tile
    tile_expert = jnp.minimum(
        jnp.searchsorted(padded_end, tile_first_row, side="right"), n_expert - 1
    ).astype(jnp.int32)  # [n_tiles]
    tile_used = tile_first_row < padded_end[-1]
    x_rows = jnp.concatenate([x, jnp.zeros((1, n_embd), x.dtype)])[row_token]  # [P, D]

    def one_tile(_, inputs):
        x_tile, e, used = inputs  # [tile, D]

        def compute(x_tile):
            return swiglu(x_tile, _expert(w_gate, e), _expert(w_up, e), _expert(w_down, e))

        return None, jax.lax.cond(used, compute, jnp.zeros_like, x_tile)

    _, y = jax.lax.scan(
        one_tile, None, (x_rows.reshape(n_tiles, tile, n_embd), tile_expert, tile_used)
    )
    y = y.reshape(rows, n_embd) * row_weight[:, None]  # [P, D]
    return jnp.zeros((n_tokens + 1, n_embd), jnp.float32).at[row_token].add(y)[:n_tokens]
