"""qwen2moe (Qwen1.5-MoE / Qwen2-MoE): q/k/v biases, softmax top-k kept as is, gated shared expert.

llama.cpp's ``qwen2moe`` graph: attention with biased q/k/v projections and NeoX RoPE; the MoE
block routes with a softmax over all experts and uses the top-k probabilities without
renormalizing (``hp.norm_topk_prob`` is False); a shared expert ``silu(x·Wg)*(x·Wu)·Wd`` is added,
scaled per token by ``sigmoid(x·w_gate_inp_shexp)``.
"""

from __future__ import annotations

from typing import Any

import jax

from healsweep.gguf_io import ModelHparams
from healsweep.model.layers import (
    causal_attention,
    matmul,
    rope_neox,
    routed_experts,
    select_experts,
    swiglu_hidden,
)


def attention(hp: ModelHparams, w: dict[str, Any], x: jax.Array, positions: jax.Array):
    """Self-attention of one sequence: ``x [T, D]`` (normed) → ``[T, D]``."""
    t = x.shape[0]
    q = (matmul(x, w["attn_q.weight"]) + w["attn_q.bias"]).reshape(t, hp.n_head, hp.head_dim)
    k = (matmul(x, w["attn_k.weight"]) + w["attn_k.bias"]).reshape(t, hp.n_head_kv, hp.head_dim)
    v = (matmul(x, w["attn_v.weight"]) + w["attn_v.bias"]).reshape(t, hp.n_head_kv, hp.head_dim)
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
    shexp_hidden = swiglu_hidden(x, w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"])  # [N, Fs]
    shexp_gate = jax.nn.sigmoid(x @ w["ffn_gate_inp_shexp.weight"])  # [N]
    shared = matmul(shexp_hidden, w["ffn_down_shexp.weight"]) * shexp_gate[:, None]
    capture = {
        "router_logits": router_logits,
        "topk_ids": topk_ids,
        "topk_weights": topk_weights,
        "routed_output": routed,
        **cached,
        "shexp_gate": shexp_gate,
    }
    return routed + shared, capture

