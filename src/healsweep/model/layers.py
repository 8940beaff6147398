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

from healsweep.model.expert_cache import route_through_cache
from healsweep.model.routing import routing_scores, select_experts


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
    """NeoX rotary embedding (rotate halves) of every dim: ``x [T, H, hd]``, ``positions [T]``."""
    return rope(x, positions, base, x.shape[-1], "neox")


def rope(
    x: jax.Array,
    positions: jax.Array,
    base: float,
    n_rot: int,
    kind: str,
    yarn: tuple[float, int] | None = None,
) -> jax.Array:
    """Rotary embedding of the first ``n_rot`` dims of each head of ``x [T, H, hd]``.

    ``kind`` is llama.cpp's rope type: ``"neox"`` pairs dim i with i + n_rot/2, ``"norm"`` pairs
    dims 2i and 2i+1; pair i turns by ``position · base^(-2i/n_rot)``. Dims past ``n_rot`` pass
    through unchanged. ``yarn = (factor, original context)`` applies YaRN's frequencies as
    ggml does (beta_fast 32, beta_slow 1): slow pairs are interpolated by ``1/factor``, fast ones
    kept, with a linear ramp between; the magnitude stays 1 (the caller scales attention).
    """
    half = n_rot // 2
    inv_freq = 1.0 / (base ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / n_rot))
    if yarn is not None and yarn[0] > 1.0:
        factor, n_ctx_orig = yarn

        def corr_dim(n_turns: float) -> float:
            return n_rot * np.log(n_ctx_orig / (n_turns * 2 * np.pi)) / (2 * np.log(base))

        low = max(0.0, np.floor(corr_dim(32.0)))
        high = min(n_rot - 1.0, np.ceil(corr_dim(1.0)))
        ramp = (np.arange(half, dtype=np.float32) - low) / max(0.001, high - low)
        extrapolate = jnp.asarray(1.0 - np.clip(ramp, 0.0, 1.0), jnp.float32)  # [n_rot/2]
        inv_freq = inv_freq / jnp.float32(factor) * (1 - extrapolate) + inv_freq * extrapolate
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, n_rot/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, n_rot/2]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if kind == "neox":
        x1, x2 = rot[..., :half], rot[..., half:]
        turned = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        turned = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        turned = turned.reshape(rot.shape)
    return jnp.concatenate([turned, rest], axis=-1) if n_rot < x.shape[-1] else turned


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None
) -> jax.Array:
    """Causal GQA attention of one sequence: ``q, k [T, H|Hkv, hd]``, ``v [T, Hkv, hv]`` →
    ``[T, H*hv]``; scores are scaled by ``scale`` (default ``1/sqrt(hd)``).

    Query head ``h`` reads key/value head ``h // (H / Hkv)``, as llama.cpp and transformers do.
    """
    t, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    k = jnp.repeat(k, group, axis=1)  # [T, H, hd]
    v = jnp.repeat(v, group, axis=1)  # [T, H, hv]
    scores = jnp.einsum("thd,shd->hts", q, k)  # [H, T, T]
    if scale is None:
        scores = scores / jnp.sqrt(jnp.float32(head_dim))
    else:
        scores = scores * jnp.float32(scale)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hts,shd->thd", probs, v).reshape(t, -1)


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


def _projection(x: jax.Array, w: dict[str, Any], name: str) -> jax.Array:
    out = matmul(x, w[f"{name}.weight"])
    bias = w.get(f"{name}.bias")
    return out if bias is None else out + bias


def _qk_norm(x: jax.Array, weight: jax.Array | None, n_heads: int, eps: float) -> jax.Array:
    """RMSNorm of a projection ``x [T, H*hd]`` → ``[T, H, hd]``: per head when the gain has hd
    entries (qwen3moe, glm4moe), over the whole projection when it has H*hd (olmoe)."""
    t = x.shape[0]
    if weight is not None and weight.shape[-1] == x.shape[-1]:
        x = rms_norm(x, weight, eps)
    x = x.reshape(t, n_heads, -1)
    if weight is not None and weight.shape[-1] != n_heads * x.shape[-1]:
        x = rms_norm(x, weight, eps)
    return x


def self_attention(hp: Any, w: dict[str, Any], x: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal GQA self-attention of one sequence, ``x [T, D]`` (normed) → ``[T, D]``.

    The variants are read off the weights: q/k/v biases when ``attn_{q,k,v}.bias`` exist, q/k
    RMSNorm when ``attn_{q,k}_norm.weight`` exist (per head or over the projection, by their
    size); RoPE of kind ``hp.rope_kind`` on the first ``hp.rope_dim`` dims of each head.
    """
    return self_attention_with_inputs(hp, w, x, positions)[0]


def self_attention_with_inputs(
    hp: Any, w: dict[str, Any], x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`self_attention` and the input of its one matrix that does not read ``x``:
    ``{"attn_output.weight": [T, H*hd]}`` (the heads' mix, what an imatrix records for it)."""
    q = _qk_norm(_projection(x, w, "attn_q"), w.get("attn_q_norm.weight"), hp.n_head,
                 hp.rms_norm_eps)  # [T, H, hd]
    k = _qk_norm(_projection(x, w, "attn_k"), w.get("attn_k_norm.weight"), hp.n_head_kv,
                 hp.rms_norm_eps)  # [T, Hkv, hd]
    v = _projection(x, w, "attn_v").reshape(x.shape[0], hp.n_head_kv, -1)
    q = rope(q, positions, hp.rope_freq_base, hp.rope_dim, hp.rope_kind)
    k = rope(k, positions, hp.rope_freq_base, hp.rope_dim, hp.rope_kind)
    mix = causal_attention(q, k, v)  # [T, H*hd]
    return matmul(mix, w["attn_output.weight"]), {"attn_output.weight": mix}


def moe_ffn(
    hp: Any, w: dict[str, Any], x: jax.Array, tile: int, cache: Any = None
) -> tuple[jax.Array, dict]:
    """Routed experts plus, where the layer has one, the shared expert: ``x [N, D]`` (normed)
    → ``(out [N, D], capture dict)``.

    Routing follows ``hp`` (:func:`select_experts`; ``exp_probs_b.bias`` is the selection bias),
    or with ``cache`` (a ``CacheRouting``) goes through the layer's simulated expert cache.
    The shared expert ``swiglu(x)`` is scaled per token by ``sigmoid(x·w_gate_inp_shexp)`` where
    that vector exists (qwen2moe) and by 1 otherwise; the capture's ``shexp_gate`` is that
    factor, so Part B fits a gated and an ungated shared expert alike.
    """
    router_logits = matmul(x, w["ffn_gate_inp.weight"])  # [N, E]
    cached: dict[str, jax.Array] = {}
    if cache is None:
        topk_ids, topk_weights = select_experts(
            router_logits, hp.n_expert_used, normalize=hp.norm_topk_prob, gating=hp.gating,
            scale=hp.expert_weights_scale, selection_bias=w.get("exp_probs_b.bias"),
            n_groups=hp.n_expert_groups, n_groups_used=hp.n_group_used,
        )
    else:  # through the simulated expert cache: the same scores, plus the resident bonus
        probs, selection = routing_scores(
            router_logits, gating=hp.gating, selection_bias=w.get("exp_probs_b.bias"),
            n_groups=hp.n_expert_groups, n_groups_used=hp.n_group_used,
        )  # fmt: skip
        topk_ids, topk_weights, cached = route_through_cache(
            probs, selection, hp.n_expert_used, hp.norm_topk_prob, hp.expert_weights_scale,
            cache,
        )
    routed = routed_experts(
        x, topk_ids, topk_weights, w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"],
        w["ffn_down_exps.weight"], hp.n_expert, tile,
    )  # [N, D]
    capture = {
        "router_logits": router_logits,
        "topk_ids": topk_ids,
        "topk_weights": topk_weights,
        "routed_output": routed,
        **cached,
    }
    if "ffn_gate_shexp.weight" not in w:
        return routed, capture
    hidden = swiglu_hidden(x, w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"])  # [N, Fs]
    if "ffn_gate_inp_shexp.weight" in w:
        gate = jax.nn.sigmoid(x @ w["ffn_gate_inp_shexp.weight"])  # [N]
    else:
        gate = jnp.ones(x.shape[0], jnp.float32)
    capture["shexp_gate"] = gate
    capture["shexp_hidden"] = hidden  # down_shexp's input (input_moments; unused otherwise)
    return routed + matmul(hidden, w["ffn_down_shexp.weight"]) * gate[:, None], capture
