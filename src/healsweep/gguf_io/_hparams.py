"""The hyperparameters of a MoE model, as one frozen dataclass (read and written per architecture
by :mod:`healsweep.model`'s architecture modules).

Field names follow llama.cpp's hparams; what a field means for an architecture, and which
metadata key holds it, is that architecture's module's business.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelHparams:
    """Shape and numerics of one MoE model, read from GGUF metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_vocab: int
    rope_freq_base: float
    rms_norm_eps: float
    context_length: int
    norm_topk_prob: bool
    rope_kind: str = "neox"  # "neox" (rotate halves) | "norm" (rotate consecutive pairs)
    n_rot: int = 0  # rotated dims of a head (0: all of them)
    gating: str = "softmax"  # router probabilities: "softmax" | "sigmoid"
    expert_weights_scale: float = 1.0  # top-k weights multiplied by this (after normalizing)
    n_expert_groups: int = 0  # > 1: experts in groups, only n_group_used groups selectable
    n_group_used: int = 0
    n_leading_dense: int = 0  # first layers with a dense FFN instead of experts
    n_ff: int = 0  # width of those dense FFNs
    n_expert_shared: int = 0  # shared experts (glm4moe: n_ff_shexp = n_ff_exp · this)
    n_layer_nextn: int = 0  # trailing multi-token-prediction layers the forward skips
    # deepseek2 multi-head latent attention: head_dim is the q/k head (no-rope + rope dims)
    head_dim_v: int = 0  # value head dims (0: head_dim)
    q_lora_rank: int = 0  # 0: one attn_q matrix, else attn_q_a -> norm -> attn_q_b
    kv_lora_rank: int = 0  # width of the compressed kv (attn_kv_a_mqa minus the rope dims)
    kv_b_split: bool = False  # attn_k_b/attn_v_b per head instead of one attn_kv_b
    yarn_factor: float = 0.0  # > 1: YaRN RoPE scaling (deepseek2), with the two below
    yarn_orig_ctx: int = 0
    yarn_log_mul: float = 0.0

    @property
    def yarn(self) -> tuple[float, int] | None:
        """``(factor, original context)`` when the file asks for YaRN, else None."""
        return (self.yarn_factor, self.yarn_orig_ctx) if self.yarn_factor > 1.0 else None

    @property
    def rope_dim(self) -> int:
        """How many dims of each head RoPE rotates."""
        return self.n_rot or self.head_dim

    @property
    def moe_layers(self) -> range:
        """Indices of the layers with routed experts (all but the leading dense ones)."""
        return range(self.n_leading_dense, self.n_layer)

    def routing_summary(self) -> str:
        """One line: gating, selection, weighting (what ``model info`` prints)."""
        parts = [f"{self.gating} over {self.n_expert}, top-{self.n_expert_used}"]
        if self.n_expert_groups > 1:
            parts.append(f"in {self.n_group_used} of {self.n_expert_groups} groups")
        parts.append("renormalized" if self.norm_topk_prob else "weights as is")
        if self.expert_weights_scale != 1.0:
            parts.append(f"scaled x{self.expert_weights_scale:g}")
        return ", ".join(parts)

    def replace(self, **changes: Any) -> ModelHparams:
        """A copy with some fields changed (used to build variants of a model)."""
        return dataclasses.replace(self, **changes)
