"""GGUF MoE models by architecture (one module each, :mod:`healsweep.model.registry`) and their
teacher-forced JAX forward, layer by layer."""

from healsweep.model.files import describe_model, expected_tensor_shapes, open_model, write_model
from healsweep.model.forward import (
    ForwardResult,
    LayerCapture,
    LayerReplacement,
    forward,
    forward_batches,
    forward_each,
)
from healsweep.model.layers import matmul
from healsweep.model.registry import ARCHITECTURES, SUPPORTED_ARCHS, architecture
from healsweep.model.routing import router_topk, select_experts

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHS",
    "ForwardResult",
    "LayerCapture",
    "LayerReplacement",
    "architecture",
    "describe_model",
    "expected_tensor_shapes",
    "forward",
    "forward_batches",
    "forward_each",
    "matmul",
    "open_model",
    "router_topk",
    "select_experts",
    "write_model",
]
