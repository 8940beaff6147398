"""olmoe (OLMoE): q/k RMSNorm over the whole projection, softmax top-k as is, no shared expert.

llama.cpp's ``olmoe`` graph: q/k/v projections without bias; ``attn_q_norm`` and
``attn_k_norm`` have one gain per channel of the whole projection (``[n_head·head_dim]``, not
per head as in qwen3moe) and are applied before the heads are split; NeoX RoPE; the MoE block
takes a softmax over all experts and keeps the top-k probabilities as they are (no
renormalization). There is no shared expert, so Part B does not apply.
"""

from healsweep.model.layers import moe_ffn as moe_block
from healsweep.model.layers import self_attention as attention

__all__ = ["attention", "moe_block"]
