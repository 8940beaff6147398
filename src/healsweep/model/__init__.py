"""Teacher-forced JAX forward of GGUF MoE models (qwen2moe, qwen3moe, olmoe, Mixtral-style llama), layer by layer."""

from healsweep.model.forward import ForwardResult, LayerCapture, LayerReplacement, forward
from healsweep.model.layers import matmul, router_topk, select_experts

__all__ = [
    "ForwardResult",
    "LayerCapture",
    "LayerReplacement",
    "forward",
    "matmul",
    "router_topk",
    "select_experts",
]
