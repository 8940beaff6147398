"""olmoe (OLMoE): q/k RMSNorm over the whole projection, softmax top-k as is, no shared expert.

llama.cpp's ``olmoe`` graph: q/k/v projections without bias; ``attn_q_norm`` and
``attn_k_norm`` have one gain per channel of the whole projection (``[n_head·head_dim]``, not
per head as in qwen3moe) and are applied before the heads are split; NeoX RoPE; the MoE block
takes a softmax over all experts and keeps the top-k probabilities as they are (no
renormalization). There is no shared expert, so Part B does not apply.
"""

from __future__ import annotations

from gguf import MODEL_TENSOR as T

from healsweep.gguf_io import ModelHparams, layer_tensor
from healsweep.model.arch import Architecture, Value, refuse_rope_scaling


class Olmoe(Architecture):
    name = "olmoe"
    attention_kind = "GQA with q/k RMSNorm over the whole projection"

    def read_rope_scaling(self, value: Value) -> dict:
        refuse_rope_scaling(self.name, value)
        return {}

    def attention_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        norms = {layer_tensor(T.ATTN_Q_NORM): (q_dim,), layer_tensor(T.ATTN_K_NORM): (kv_dim,)}
        return super().attention_shapes(hp) | norms


ARCH = Olmoe()
