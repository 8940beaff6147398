"""llama with routed experts (Mixtral): interleaved-pair RoPE, renormalized softmax top-k.

llama.cpp's ``llama`` graph with ``ffn_gate_inp``/``ffn_*_exps`` tensors: q/k/v projections
without bias or norm; RoPE of llama.cpp's "normal" kind, which turns consecutive pairs of head
dims (``2i``, ``2i+1``) rather than halves (the converter permutes q/k rows for it); the MoE block
takes a softmax over all experts and rescales the top-k probabilities to sum to one. There is no
shared expert, so Part B does not apply. A llama file without experts (a dense Llama) is refused
when it is opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gguf import MODEL_TENSOR as T

from healsweep.errors import UnsupportedArchitectureError
from healsweep.gguf_io import layer_tensor
from healsweep.model.arch import Architecture, Value, refuse_rope_scaling


class Llama(Architecture):
    name = "llama"
    rope_kind = "norm"
    norm_topk_prob = True

    def check_file(self, path: Any, tensor_names: list[str], supported: Sequence[str]) -> None:
        if not any(name.endswith(layer_tensor(T.FFN_GATE_INP)) for name in tensor_names):
            raise UnsupportedArchitectureError(
                f"{path} is a dense llama model (no ffn_gate_inp/ffn_*_exps expert tensors); "
                f"healsweep supports MoE models: {', '.join(supported)} (llama with experts)"
            )

    def read_rope_scaling(self, value: Value) -> dict:
        refuse_rope_scaling(self.name, value)
        return {}


ARCH = Llama()
