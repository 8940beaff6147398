"""qwen2moe (Qwen1.5-MoE / Qwen2-MoE): q/k/v biases, softmax top-k kept as is, gated shared expert.

llama.cpp's ``qwen2moe`` graph: attention with biased q/k/v projections and NeoX RoPE; the MoE
block routes with a softmax over all experts and uses the top-k probabilities without
renormalizing (``hp.norm_topk_prob`` is False); a shared expert ``silu(x·Wg)*(x·Wu)·Wd`` is added,
scaled per token by ``sigmoid(x·w_gate_inp_shexp)``. The shared building blocks read each of
these variants off the layer's tensors and ``hp``.
"""

from healsweep.model.layers import moe_ffn as moe_block
from healsweep.model.layers import self_attention as attention

__all__ = ["attention", "moe_block"]
