"""qwen2moe (Qwen1.5-MoE / Qwen2-MoE): q/k/v biases, softmax top-k kept as is, gated shared expert.

llama.cpp's ``qwen2moe`` graph: attention with biased q/k/v projections and NeoX RoPE; the MoE
block routes with a softmax over all experts and uses the top-k probabilities without
renormalizing (``hp.norm_topk_prob`` is False); a shared expert ``silu(x·Wg)*(x·Wu)·Wd`` is added,
scaled per token by ``sigmoid(x·w_gate_inp_shexp)``. The shared building blocks read each of
these variants off the layer's tensors and ``hp``.
"""

from __future__ import annotations

from gguf import MODEL_TENSOR as T

from healsweep.gguf_io import ModelHparams, layer_tensor
from healsweep.model.arch import Architecture, Value, qk_bias_shapes


class Qwen2Moe(Architecture):
    name = "qwen2moe"
    attention_kind = "GQA with q/k/v bias"

    def read_shared_expert(self, value: Value, n_ff_exp: int, shapes) -> dict[str, int]:
        gate_name = "." + layer_tensor(T.FFN_GATE_SHEXP)
        gate = next((s for n, s in shapes.items() if n.endswith(gate_name)), (0, 0))
        return {"n_ff_shexp": int(value("n_ff_shexp", gate[0]))}

    def shared_expert_metadata(self, hp: ModelHparams) -> dict[str, int]:
        return {"n_ff_shexp": hp.n_ff_shexp}

    def random_hparams(self, hp: ModelHparams) -> ModelHparams:
        return hp  # the one architecture whose random models keep the given shared expert

    def attention_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        return super().attention_shapes(hp) | qk_bias_shapes(hp)

    def router_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        # the shared expert's sigmoid gate
        return {layer_tensor(T.FFN_GATE_INP_SHEXP): (hp.n_embd,)}


ARCH = Qwen2Moe()
