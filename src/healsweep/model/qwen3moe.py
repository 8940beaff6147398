"""qwen3moe (Qwen3-MoE): per-head RMSNorm on q and k before RoPE, renormalized top-k, no shared expert.

llama.cpp's ``qwen3moe`` graph: q/k/v projections without bias, ``attn_q_norm``/``attn_k_norm``
applied to every head before NeoX RoPE, head size from ``attention.key_length``; the MoE block
takes a softmax over all experts and rescales the top-k probabilities to sum to one
(``hp.norm_topk_prob`` is True). There is no shared expert.
"""

from __future__ import annotations

from typing import Any

import jax

from healsweep.gguf_io import ModelHparams
from healsweep.model.layers import (
    causal_attention,
    matmul,
    rms_norm,
    rope_neox,
    routed_experts,
    select_experts,
)


def attention(hp: ModelHparams, w: dict[str, Any], x: jax.Array, positions: jax.Array):
    """Self-attention of one sequence: ``x [T, D]`` (normed) → ``[T, D]``."""
    t = x.shape[0]
    q = matmul(x, w["attn_q.weight"]).reshape(t, hp.n_head, hp.head_dim)
    k = matmul(x, w["attn_k.weight"]).reshape(t, hp.n_head_kv, hp.head_dim)
    v = matmul(x, w["attn_v.weight"]).reshape(t, hp.n_head_kv, hp.head_dim)
    q = rms_norm(q, w["attn_q_norm.weight"], hp.rms_norm_eps)  # per head, over hd
    k = rms_norm(k, w["attn_k_norm.weight"], hp.rms_norm_eps)
    q = rope_neox(q, positions, hp.rope_freq_base)  # [T, H, hd]
    k = rope_neox(k, positions, hp.rope_freq_base)  # [T, Hkv, hd]
    return matmul(causal_attention(q, k, v), w["attn_output.weight"])


def moe_block(hp: ModelHparams, w: dict[str, Any], x: jax.Array, tile: int, cache: Any = None):
    """MoE FFN of ``x [N, D]`` (normed) → ``(out [N, D], capture dict)``; ``cache`` routes
    through the expert cache (see ``layers.select_experts``)."""
    router_logits = matmul(x, w["ffn_gate_inp.weight"])  # [N, E]
    topk_ids, topk_weights, cached = select_experts(
        router_logits, hp.n_expert_used, hp.norm_topk_prob, cache
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
    return routed, capture
