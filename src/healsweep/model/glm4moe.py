"""glm4moe (GLM-4.5 / 4.6): biased q/k/v, partial NeoX RoPE, leading dense layers, sigmoid routing
with a selection-only bias, and an ungated shared expert.

llama.cpp's ``glm4moe`` graph: q/k/v projections with biases (and per-head q/k RMSNorm when the
file has ``attn_q_norm``/``attn_k_norm``); NeoX RoPE on the first ``rope.dimension_count`` dims
of each head (half of them in GLM-4.5); the FFN's input norm is ``post_attention_norm``. The
first ``leading_dense_block_count`` layers have a dense SwiGLU FFN (``ffn_gate/up/down``). MoE
layers take sigmoid probabilities (``expert_gating_func`` 2), choose the top-k on the
probabilities plus ``exp_probs_b`` (the weights stay unbiased), within the best
``expert_group_used_count`` groups when the file has groups, optionally renormalize
(``expert_weights_norm``) and multiply by ``expert_weights_scale``. The shared expert (width
``n_ff_exp · expert_shared_count``) is added with gate 1, so Part B fits it with a gate of 1.
Trailing ``nextn_predict_layers`` (multi-token prediction) are not run.
"""

from __future__ import annotations

from gguf import MODEL_TENSOR as T

from healsweep.gguf_io import ModelHparams, layer_tensor
from healsweep.model.arch import RoutingFromFile, Value, qk_bias_shapes, refuse_rope_scaling


class Glm4Moe(RoutingFromFile):
    name = "glm4moe"
    attention_kind = "GQA with q/k/v bias"
    ffn_norm = layer_tensor(T.ATTN_POST_NORM)
    default_gating = "sigmoid"

    def read_rope_scaling(self, value: Value) -> dict:
        refuse_rope_scaling(self.name, value)
        return {}

    def random_hparams(self, hp: ModelHparams) -> ModelHparams:
        return hp.replace(n_ff_shexp=0, gating="sigmoid", n_ff=2 * hp.n_ff_exp, n_expert_shared=1)

    def attention_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        return super().attention_shapes(hp) | qk_bias_shapes(hp)

    def router_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        return {layer_tensor(T.FFN_EXP_PROBS_B, "bias"): (hp.n_expert,)}  # the selection-only bias


ARCH = Glm4Moe()
