"""qwen3moe (Qwen3-MoE): per-head RMSNorm on q and k before RoPE, renormalized top-k, no shared expert.

llama.cpp's ``qwen3moe`` graph: q/k/v projections without bias, ``attn_q_norm``/``attn_k_norm``
(``[head_dim]``) applied to every head before NeoX RoPE, head size from
``attention.key_length``; the MoE block takes a softmax over all experts and rescales the top-k
probabilities to sum to one (``hp.norm_topk_prob`` is True). There is no shared expert.
"""

from __future__ import annotations

from gguf import MODEL_TENSOR as T

from healsweep.gguf_io import ModelHparams, layer_tensor
from healsweep.model.arch import Architecture


class Qwen3Moe(Architecture):
    name = "qwen3moe"
    norm_topk_prob = True
    attention_kind = "GQA with per-head q/k RMSNorm"

    def attention_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        hd = hp.head_dim  # one RMSNorm gain per head dim
        norms = {layer_tensor(T.ATTN_Q_NORM): (hd,), layer_tensor(T.ATTN_K_NORM): (hd,)}
        return super().attention_shapes(hp) | norms


ARCH = Qwen3Moe()
