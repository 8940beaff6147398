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


def select_experts(
    router_logits: jax.Array, k: int, normalize: bool, cache: Any = None
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(ids, weights, extra captures)``: :func:`router_topk`, or with ``cache`` (a
    :class:`~healsweep.model.expert_cache.CacheRouting`) through the layer's expert cache."""
    if cache is None:
        return (*router_topk(router_logits, k, normalize), {})
    from healsweep.model.expert_cache import route_through_cache

    return route_through_cache(router_logits, k, normalize, cache)


def swiglu(x: jax.Array, w_gate: Any, w_up: Any, w_down: Any) -> jax.Array:
    """``(silu(x·Wgᵀ) * (x·Wuᵀ))·Wdᵀ`` for ``x [N, D]``."""
    return matmul(swiglu_hidden(x, w_gate, w_up), w_down)


def swiglu_hidden(x: jax.Array, w_gate: Any, w_up: Any) -> jax.Array:
    """The down-projection input ``h = silu(x·Wgᵀ) * (x·Wuᵀ)`` → ``[N, F]``."""
    return jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up)


def expert_tile_rows(n_assignments: int, n_expert: int) -> int:
    """Rows per tile of :func:`routed_experts`: an expert's average load (a power of 2), 16..128.

    Each expert's rows are padded to whole tiles, so a smaller tile wastes fewer padded rows
    (at most ``tile - 1`` per expert) but makes more, smaller matmuls; since an expert is decoded
    once whatever its tile count, the matmul size wins (2 CPU cores, Qwen1.5-MoE shapes: tile 32
    at 512 tokens 842 ms a layer, tile 8 1037 ms; at 2048 tokens tile 64 1839 ms, 32 1916 ms).
    """
    mean_load = max(n_assignments // max(n_expert, 1), 1)
    return int(min(max(2 ** int(np.log2(mean_load)), 16), 128))


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
    an ``[N, E, F]`` buffer): the N·k (token, expert) assignments are sorted by expert and
    each expert's run is padded to whole tiles of ``tile`` rows. A ``lax.scan`` over experts
    decodes each used expert's weights once (a quantized expert is decoded in the graph from
    its stored bytes, so only one expert's float32 copy exists at a time), then loops over that
    expert's tiles, gathering the tiles' tokens and adding their weighted outputs into the
    ``[N, D]`` result. Unused experts are skipped.
    """
    n_tokens, n_embd = x.shape
    k = topk_ids.shape[1]
    n_assign = n_tokens * k
    rows = (-(-n_assign // tile) + n_expert) * tile
    flat_ids = topk_ids.reshape(-1)  # [A]
    order = jnp.argsort(flat_ids, stable=True)  # [A]
    sorted_ids = flat_ids[order]
    counts = jnp.zeros(n_expert, jnp.int32).at[flat_ids].add(1)  # [E]
    padded = (counts + tile - 1) // tile * tile
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(counts) - counts
    dest = padded_start[sorted_ids] + jnp.arange(n_assign, dtype=jnp.int32) - start[sorted_ids]
    row_token = jnp.full(rows, n_tokens, jnp.int32).at[dest].set(order // k)  # [P], N = padding
    row_weight = jnp.zeros(rows, jnp.float32).at[dest].set(topk_weights.reshape(-1)[order])

    def one_expert(out, e):
        def compute(out):
            gate, up, down = (as_dense(_expert(w, e)) for w in (w_gate, w_up, w_down))

            def one_tile(j, out):
                first = padded_start[e] + j * tile
                tokens = jax.lax.dynamic_slice_in_dim(row_token, first, tile)  # [tile]
                weight = jax.lax.dynamic_slice_in_dim(row_weight, first, tile)
                x_tile = x.at[tokens].get(mode="fill", fill_value=0)  # [tile, D]
                y_tile = swiglu(x_tile, gate, up, down) * weight[:, None]
                return out.at[tokens].add(y_tile, mode="drop")  # padding rows fall off

            return jax.lax.fori_loop(0, padded[e] // tile, one_tile, out)

        return jax.lax.cond(counts[e] > 0, compute, lambda out: out, out), None

    out0 = jnp.zeros((n_tokens, n_embd), jnp.float32)
    out, _ = jax.lax.scan(one_expert, out0, jnp.arange(n_expert, dtype=jnp.int32))
    return out
