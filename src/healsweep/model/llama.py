"""llama with routed experts (Mixtral): interleaved-pair RoPE, renormalized softmax top-k.

llama.cpp's ``llama`` graph with ``ffn_gate_inp``/``ffn_*_exps`` tensors: q/k/v projections
without bias or norm; RoPE of llama.cpp's "normal" kind, which turns consecutive pairs of head
dims (``2i``, ``2i+1``) rather than halves (the converter permutes q/k rows for it); the MoE block
takes a softmax over all experts and rescales the top-k probabilities to sum to one. There is no
shared expert, so Part B does not apply. A llama file without experts (a dense Llama) is refused
when it is opened.
"""

from healsweep.model.layers import moe_ffn as moe_block
from healsweep.model.layers import self_attention as attention

__all__ = ["attention", "moe_block"]
