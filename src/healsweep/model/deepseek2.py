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
from gguf import MODEL_TENSOR as T

from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import ModelHparams, layer_tensor
from healsweep.model.arch import RoutingFromFile, Value
from healsweep.model.layers import as_dense, causal_attention, matmul, rms_norm, rope


class Deepseek2(RoutingFromFile):
    name = "deepseek2"
    rope_kind = "norm"
    attention_kind = "MLA"

    def read_rope_scaling(self, value: Value) -> dict[str, Any]:
        if value("rope_scaling") != "yarn":
            return {}
        return {
            "yarn_factor": float(value("yarn_factor", 1.0)),
            "yarn_orig_ctx": int(value("yarn_orig_ctx", value("context_length"))),
            "yarn_log_mul": float(value("yarn_log_mul", 0.0)),
        }

    def read_attention(self, value: Value, head_dim: int) -> tuple[int, dict[str, Any]]:
        # a file with the split k_b/v_b layout keeps the per-head sizes in *_mla keys (its
        # key/value_length describe the compressed cache); an attn_kv_b file in key/value_length
        split = value("head_dim_mla") is not None
        head_dim = int(value("head_dim_mla")) if split else head_dim
        return head_dim, {
            "head_dim_v": int(value("head_dim_v_mla" if split else "head_dim_v", head_dim)),
            "q_lora_rank": int(value("q_lora_rank", 0)),
            "kv_lora_rank": int(value("kv_lora_rank", 0)),
            "kv_b_split": split,
        }

    def check_hparams(self, hp: ModelHparams, key, n_blocks: int, has) -> None:
        super().check_hparams(hp, key, n_blocks, has)
        if hp.kv_lora_rank < 1:
            raise GGUFFormatError(
                f"{key('kv_lora_rank')} is {hp.kv_lora_rank}; expected a positive width of the "
                "compressed kv (multi-head latent attention): the metadata is inconsistent, "
                "re-export the file"
            )

    def attention_metadata(self, hp: ModelHparams) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "q_lora_rank": hp.q_lora_rank,  # 0: attn_q (llama.cpp needs the key)
            "kv_lora_rank": hp.kv_lora_rank,
            "head_dim_v": hp.head_dim_v,
        }
        if hp.yarn:
            fields |= {
                "rope_scaling": "yarn",
                "yarn_factor": hp.yarn_factor,
                "yarn_orig_ctx": hp.yarn_orig_ctx,
                "yarn_log_mul": hp.yarn_log_mul,
            }
        if hp.kv_b_split:  # llama.cpp's MLA layout: the cache is the compressed kv + rope dims
            fields |= {
                "head_dim": hp.kv_lora_rank + hp.rope_dim,
                "head_dim_v": hp.kv_lora_rank,
                "head_dim_mla": hp.head_dim,
                "head_dim_v_mla": hp.head_dim_v,
            }
        return fields

    def random_hparams(self, hp: ModelHparams) -> ModelHparams:
        # V3-like: 16 rope dims of 48, q_lora, kv_lora 64, 2 shared experts, one dense layer
        return hp.replace(n_ff_shexp=0, gating="sigmoid", n_ff=2 * hp.n_ff_exp,
                          n_expert_shared=2, head_dim=48, n_rot=16, head_dim_v=32,
                          q_lora_rank=48, kv_lora_rank=64, n_head_kv=hp.n_head,
                          n_leading_dense=1, norm_topk_prob=True)  # fmt: skip

    def attention_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        d, h, hk, hv, r = hp.n_embd, hp.n_head, hp.head_dim, hp.head_dim_v, hp.kv_lora_rank
        nope = hk - hp.rope_dim
        shapes: dict[str, tuple] = {
            layer_tensor(T.ATTN_NORM): (d,),
            layer_tensor(T.ATTN_KV_A_MQA): (r + hp.rope_dim, d),
            layer_tensor(T.ATTN_KV_A_NORM): (r,),
            layer_tensor(T.ATTN_OUT): (d, h * hv),
        }
        if hp.q_lora_rank:
            shapes |= {
                layer_tensor(T.ATTN_Q_A): (hp.q_lora_rank, d),
                layer_tensor(T.ATTN_Q_A_NORM): (hp.q_lora_rank,),
                layer_tensor(T.ATTN_Q_B): (h * hk, hp.q_lora_rank),
            }
        else:
            shapes[layer_tensor(T.ATTN_Q)] = (h * hk, d)
        if hp.kv_b_split:
            shapes |= {layer_tensor(T.ATTN_K_B): (h, r, nope), layer_tensor(T.ATTN_V_B): (h, hv, r)}
        else:
            shapes[layer_tensor(T.ATTN_KV_B)] = (h * (nope + hv), r)
        return shapes

    def router_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        # DeepSeek-V3 style selection bias; V2 (softmax) has none
        if hp.gating != "sigmoid":
            return {}
        return {layer_tensor(T.FFN_EXP_PROBS_B, "bias"): (hp.n_expert,)}

    def attention_summary(self, hp: ModelHparams) -> str:
        q = f"q_lora {hp.q_lora_rank}" if hp.q_lora_rank else "attn_q"
        layout = "attn_k_b/attn_v_b" if hp.kv_b_split else "attn_kv_b"
        yarn = f", YaRN x{hp.yarn_factor:g} from {hp.yarn_orig_ctx}" if hp.yarn else ""
        return (f"MLA ({q}, kv_lora {hp.kv_lora_rank}, {layout}), {hp.n_head} heads of "
                f"{hp.head_dim - hp.rope_dim} no-rope + {hp.rope_dim} rope dims, "
                f"v {hp.head_dim_v}, {hp.rope_kind} RoPE{yarn}")  # fmt: skip

    def attention_with_inputs(
        self, hp: ModelHparams, w: dict[str, Any], x: jax.Array, positions: jax.Array
    ):
        return attention_with_inputs(hp, w, x, positions)


def attention(hp: ModelHparams, w: dict[str, Any], x: jax.Array, positions: jax.Array):
    """Multi-head latent attention of one sequence: ``x [T, D]`` (normed) → ``[T, D]``."""
    return attention_with_inputs(hp, w, x, positions)[0]


def attention_with_inputs(hp: ModelHparams, w: dict[str, Any], x: jax.Array, positions: jax.Array):
    """:func:`attention` and the inputs of its matrices that do not read ``x``: the output
    projection's (the heads' mix), ``attn_q_b``'s (the normed q latent) and ``attn_kv_b``'s (the
    normed kv latent; the split ``attn_k_b``/``attn_v_b`` read per-head inputs: none given)."""
    inputs: dict[str, jax.Array] = {}
    t, n_head, n_rope = x.shape[0], hp.n_head, hp.rope_dim
    n_nope = hp.head_dim - n_rope
    if hp.q_lora_rank:
        q_a = rms_norm(matmul(x, w["attn_q_a.weight"]), w["attn_q_a_norm.weight"], hp.rms_norm_eps)
        q = matmul(q_a, w["attn_q_b.weight"])
        inputs["attn_q_b.weight"] = q_a
    else:
        q = matmul(x, w["attn_q.weight"])
    q = q.reshape(t, n_head, hp.head_dim)  # [T, H, nope + rope]
    kv_pe = matmul(x, w["attn_kv_a_mqa.weight"])  # [T, r + rope]
    kv = rms_norm(kv_pe[:, : hp.kv_lora_rank], w["attn_kv_a_norm.weight"], hp.rms_norm_eps)
    k_pe = rope(
        kv_pe[:, None, hp.kv_lora_rank :],
        positions,
        hp.rope_freq_base,
        n_rope,
        hp.rope_kind,
        hp.yarn,
    )  # [T, 1, rope]
    q_pe = rope(q[..., n_nope:], positions, hp.rope_freq_base, n_rope, hp.rope_kind, hp.yarn)
    if hp.kv_b_split:
        k_nope = jnp.einsum("tr,hrn->thn", kv, as_dense(w["attn_k_b.weight"]))  # [T, H, nope]
        v = jnp.einsum("tr,hvr->thv", kv, as_dense(w["attn_v_b.weight"]))  # [T, H, hv]
    else:
        kv_b = matmul(kv, w["attn_kv_b.weight"]).reshape(t, n_head, n_nope + hp.head_dim_v)
        inputs["attn_kv_b.weight"] = kv
        k_nope, v = kv_b[..., :n_nope], kv_b[..., n_nope:]
    q = jnp.concatenate([q[..., :n_nope], q_pe], axis=-1)  # [T, H, nope + rope]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (t, n_head, n_rope))], axis=-1)
    mix = causal_attention(q, k, v, attention_scale(hp))  # [T, H*hv]
    inputs["attn_output.weight"] = mix
    return matmul(mix, w["attn_output.weight"]), inputs


def attention_scale(hp: ModelHparams) -> float:
    """``mscale² / sqrt(head_dim)``: YaRN's ``mscale = 1 + 0.1·mscale_all_dim·ln(factor)`` (1
    without YaRN) scales the scores, while the rotation itself keeps magnitude 1. The file's
    ``yarn_log_multiplier`` holds ``0.1·mscale_all_dim`` (the converter's convention, which
    llama.cpp divides back by 0.1), so ``mscale = 1 + yarn_log_multiplier·ln(factor)``."""
    mscale = 1.0 + hp.yarn_log_mul * math.log(hp.yarn_factor) if hp.yarn else 1.0
    return mscale * mscale / math.sqrt(hp.head_dim)


ARCH = Deepseek2()
