"""Teacher-forced JAX forward of GGUF MoE models (qwen2moe, qwen3moe), layer by layer."""

from healsweep.model.forward import ForwardResult, LayerCapture, LayerReplacement, forward
from healsweep.model.layers import matmul, router_topk

__all__ = [
    "ForwardResult",
    "LayerCapture",
    "LayerReplacement",
    "forward",
    "matmul",
    "router_topk",
]
