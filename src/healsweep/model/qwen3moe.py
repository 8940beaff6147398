"""qwen3moe (Qwen3-MoE): per-head RMSNorm on q and k before RoPE, renormalized top-k, no shared expert.

llama.cpp's ``qwen3moe`` graph: q/k/v projections without bias, ``attn_q_norm``/``attn_k_norm``
(``[head_dim]``) applied to every head before NeoX RoPE, head size from
``attention.key_length``; the MoE block takes a softmax over all experts and rescales the top-k
probabilities to sum to one (``hp.norm_topk_prob`` is True). There is no shared expert.
"""

from healsweep.model.layers import moe_ffn as moe_block
from healsweep.model.layers import self_attention as attention

__all__ = ["attention", "moe_block"]
