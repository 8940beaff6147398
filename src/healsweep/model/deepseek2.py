"""deepseek2 (DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2): multi-head latent attention, leading dense
layers, softmax or sigmoid routing with groups and a selection bias, ungated shared experts.

llama.cpp's ``deepseek2`` graph. Attention (MLA): q is ``x·attn_qᵀ`` or, with a ``q_lora_rank``,
``rmsnorm(x·attn_q_aᵀ)·attn_q_bᵀ``, split per head into no-rope and rope dims (rope last);
``x·attn_kv_a_mqaᵀ`` gives the compressed kv (``kv_lora_rank`` wide, then RMSNormed) and one rope
key shared by every head. Keys and values per head come from the compressed kv through
``attn_kv_b`` (no-rope key dims then value dims per head) or, in the split layout, through
``attn_k_b`` and ``attn_v_b``; llama.cpp multiplies the split layout in its absorbed order, which
is the same product. RoPE is llama.cpp's "normal" kind (consecutive pairs), with YaRN
frequencies where the file asks (``rope.scaling.type`` yarn, ``factor``,
``original_context_length``); scores are scaled by ``mscale²/sqrt(no-rope + rope dims)``, where
``mscale = 1 + yarn_log_multiplier·ln(factor)`` (the file stores ``0.1·mscale_all_dim``; 1
without YaRN). The FFN is routed as ``hp`` says (:func:`select_experts`) plus
``expert_shared_count`` shared experts in one SwiGLU of width ``n_ff_exp · expert_shared_count``
with gate 1; the first ``leading_dense_block_count`` layers are dense.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from healsweep.gguf_io import ModelHparams
from healsweep.model.layers import as_dense, causal_attention, matmul, rms_norm, rope
from healsweep.model.layers import moe_ffn as moe_block

__all__ = ["attention", "moe_block"]


def attention(hp: ModelHparams, w: dict[str, Any], x: jax.Array, positions: jax.Array):
    """Multi-head latent attention of one sequence: ``x [T, D]`` (normed) → ``[T, D]``."""
    t, n_head, n_rope = x.shape[0], hp.n_head, hp.rope_dim
    n_nope = hp.head_dim - n_rope
    if hp.q_lora_rank:
        q_a = rms_norm(matmul(x, w["attn_q_a.weight"]), w["attn_q_a_norm.weight"], hp.rms_norm_eps)
        q = matmul(q_a, w["attn_q_b.weight"])
    else:
        q = matmul(x, w["attn_q.weight"])
    q = q.reshape(t, n_head, hp.head_dim)  # [T, H, nope + rope]
    kv_pe = matmul(x, w["attn_kv_a_mqa.weight"])  # [T, r + rope]
    kv = rms_norm(kv_pe[:, : hp.kv_lora_rank], w["attn_kv_a_norm.weight"], hp.rms_norm_eps)
    k_pe = rope(kv_pe[:, None, hp.kv_lora_rank :], positions, hp.rope_freq_base, n_rope,
                hp.rope_kind, hp.yarn)  # [T, 1, rope]
    q_pe = rope(q[..., n_nope:], positions, hp.rope_freq_base, n_rope, hp.rope_kind, hp.yarn)
    if hp.kv_b_split:
        k_nope = jnp.einsum("tr,hrn->thn", kv, as_dense(w["attn_k_b.weight"]))  # [T, H, nope]
        v = jnp.einsum("tr,hvr->thv", kv, as_dense(w["attn_v_b.weight"]))  # [T, H, hv]
    else:
        kv_b = matmul(kv, w["attn_kv_b.weight"]).reshape(t, n_head, n_nope + hp.head_dim_v)
        k_nope, v = kv_b[..., :n_nope], kv_b[..., n_nope:]
    q = jnp.concatenate([q[..., :n_nope], q_pe], axis=-1)  # [T, H, nope + rope]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (t, n_head, n_rope))], axis=-1)
    return matmul(causal_attention(q, k, v, attention_scale(hp)), w["attn_output.weight"])


def attention_scale(hp: ModelHparams) -> float:
    """``mscale² / sqrt(head_dim)``: YaRN's ``mscale = 1 + 0.1·mscale_all_dim·ln(factor)`` (1
    without YaRN) scales the scores, while the rotation itself keeps magnitude 1. The file's
    ``yarn_log_multiplier`` holds ``0.1·mscale_all_dim`` (the converter's convention, which
    llama.cpp divides back by 0.1), so ``mscale = 1 + yarn_log_multiplier·ln(factor)``."""
    mscale = 1.0 + hp.yarn_log_mul * math.log(hp.yarn_factor) if hp.yarn else 1.0
    return mscale * mscale / math.sqrt(hp.head_dim)
