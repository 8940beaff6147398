"""Hyperparameters of the supported MoE architectures and the tensors each one must have.

The metadata keys follow llama.cpp (``{arch}.block_count``, ``{arch}.attention.head_count``, ...),
so a GGUF converted by llama.cpp opens here and a GGUF written here opens in llama.cpp (and, for
qwen2moe/qwen3moe, in Hugging Face transformers).

Per architecture (llama.cpp's graphs): ``qwen2moe`` biased q/k/v, softmax top-k as is, a shared
expert gated by ``sigmoid(x·w_gate_inp_shexp)``; ``qwen3moe`` per-head q/k RMSNorm, renormalized
top-k; ``olmoe`` q/k RMSNorm over the whole projection, softmax top-k as is; ``llama`` with
``ffn_*_exps`` (Mixtral) interleaved-pair RoPE, renormalized top-k (neither has a shared expert);
``glm4moe`` biased q/k/v, partial NeoX RoPE, leading dense layers, sigmoid gating with a
selection-only bias, optional renormalization, a weight scale and an ungated shared expert of
width ``n_ff_exp · expert_shared_count``. Expert groups are read for every architecture, as
llama.cpp does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from healsweep.errors import GGUFFormatError

SUPPORTED_ARCHS = ("qwen2moe", "qwen3moe", "olmoe", "llama", "glm4moe", "deepseek2")
ROPE_KIND = {
    "qwen2moe": "neox", "qwen3moe": "neox", "olmoe": "neox", "llama": "norm", "glm4moe": "neox",
    "deepseek2": "norm",
}
_ATTENTION_KIND = {
    "qwen2moe": "GQA with q/k/v bias",
    "qwen3moe": "GQA with per-head q/k RMSNorm",
    "olmoe": "GQA with q/k RMSNorm over the whole projection",
    "llama": "GQA",
    "glm4moe": "GQA with q/k/v bias",
    "deepseek2": "MLA",
}
# llama.cpp's build_moe_ffn ``norm_w`` per architecture (top-k weights rescaled to sum to one)
# (glm4moe reads it from ``expert_weights_norm``)
NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "olmoe": False, "llama": True, "glm4moe": False,
             "deepseek2": False}
GATING_FUNC = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values
_DEFAULT_GATING = {"glm4moe": "sigmoid"}  # when the file does not say


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

    @property
    def shexp_gated(self) -> bool:
        """Whether the shared expert is scaled by a per-token sigmoid gate (qwen2moe)."""
        return self.arch == "qwen2moe"

    def routing_summary(self) -> str:
        """One line: gating, selection, weighting (what ``model info`` prints)."""
        parts = [f"{self.gating} over {self.n_expert}, top-{self.n_expert_used}"]
        if self.n_expert_groups > 1:
            parts.append(f"in {self.n_group_used} of {self.n_expert_groups} groups")
        parts.append("renormalized" if self.norm_topk_prob else "weights as is")
        if self.expert_weights_scale != 1.0:
            parts.append(f"scaled x{self.expert_weights_scale:g}")
        return ", ".join(parts)

    def attention_summary(self) -> str:
        """One line: attention kind and RoPE (what ``model info`` prints)."""
        rope = f"{self.rope_kind} RoPE on {self.rope_dim} of {self.head_dim} head dims"
        if self.arch == "deepseek2":
            q = f"q_lora {self.q_lora_rank}" if self.q_lora_rank else "attn_q"
            layout = "attn_k_b/attn_v_b" if self.kv_b_split else "attn_kv_b"
            return (f"MLA ({q}, kv_lora {self.kv_lora_rank}, {layout}), {self.n_head} heads of "
                    f"{self.head_dim - self.rope_dim} no-rope + {self.rope_dim} rope dims, "
                    f"v {self.head_dim_v}, {self.rope_kind} RoPE"
                    + (f", YaRN x{self.yarn_factor:g} from {self.yarn_orig_ctx}" if self.yarn
                       else ""))
        return f"{_ATTENTION_KIND[self.arch]}, {self.n_head}/{self.n_head_kv} heads, {rope}"

    def replace(self, **changes: Any) -> ModelHparams:
        """A copy with some fields changed (used to build variants of a model)."""
        return dataclasses.replace(self, **changes)


# Metadata key suffixes (after ``{arch}.``) per hparam field, and whether a file must have it.
_REQUIRED_KEYS = {
    "n_layer": "block_count",
    "n_embd": "embedding_length",
    "n_head": "attention.head_count",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "context_length": "context_length",
}
_OPTIONAL_KEYS = {
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "n_ff_exp": "expert_feed_forward_length",
    "n_ff_shexp": "expert_shared_feed_forward_length",
    "rope_freq_base": "rope.freq_base",
    "n_vocab": "vocab_size",
    "n_rot": "rope.dimension_count",
    "n_ff": "feed_forward_length",
    "n_expert_shared": "expert_shared_count",
    "n_leading_dense": "leading_dense_block_count",
    "expert_weights_scale": "expert_weights_scale",
    "expert_weights_norm": "expert_weights_norm",
    "gating_func": "expert_gating_func",
    "n_expert_groups": "expert_group_count",
    "n_group_used": "expert_group_used_count",
    "n_layer_nextn": "nextn_predict_layers",
    "head_dim_v": "attention.value_length",
    "head_dim_mla": "attention.key_length_mla",
    "head_dim_v_mla": "attention.value_length_mla",
    "q_lora_rank": "attention.q_lora_rank",
    "kv_lora_rank": "attention.kv_lora_rank",
    "rope_scaling": "rope.scaling.type",
    "yarn_factor": "rope.scaling.factor",
    "yarn_orig_ctx": "rope.scaling.original_context_length",
    "yarn_log_mul": "rope.scaling.yarn_log_multiplier",
}
_ROUTING_ARCHS = ("glm4moe", "deepseek2")  # archs whose routing llama.cpp reads from the file
_ROPE_FREQ_BASE_DEFAULT = 10000.0  # llama.cpp's default when the key is absent


def missing_required_keys(arch: str, has_key: Callable[[str], bool]) -> list[str]:
    """Full metadata keys this architecture needs that the file lacks."""
    return [f"{arch}.{k}" for k in _REQUIRED_KEYS.values() if not has_key(f"{arch}.{k}")]


def hparams_from_metadata(
    arch: str,
    get: Callable[[str], Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
) -> ModelHparams:
    """Build :class:`ModelHparams` from metadata (``get(key)`` returns None when absent).

    Sizes that llama.cpp treats as optional (expert FFN sizes, vocab) fall back to the shapes of
    the tensors, exactly as llama.cpp does; call :func:`missing_required_keys` first.
    """

    def value(field: str, default: Any = None) -> Any:
        suffix = _REQUIRED_KEYS.get(field) or _OPTIONAL_KEYS[field]
        found = get(f"{arch}.{suffix}")
        return default if found is None else found

    n_embd = int(value("n_embd"))
    n_head = int(value("n_head"))
    exps = next((s for n, s in tensor_shapes.items() if n.endswith(".ffn_gate_exps.weight")),
                (0, 0, 0))
    shexp = next((s for n, s in tensor_shapes.items() if n.endswith(".ffn_gate_shexp.weight")),
                 (0, 0))
    embd = tensor_shapes.get("token_embd.weight", (0, 0))
    head_dim = int(value("head_dim", n_embd // n_head))
    n_expert_shared = int(value("n_expert_shared", 0)) if arch in _ROUTING_ARCHS else 0
    n_ff_exp = int(value("n_ff_exp", exps[1]))
    if arch == "qwen2moe":
        n_ff_shexp = int(value("n_ff_shexp", shexp[0]))
    else:
        n_ff_shexp = n_ff_exp * n_expert_shared
    routing: dict[str, Any] = {"norm_topk_prob": NORM_TOPK[arch]}
    if arch in _ROUTING_ARCHS:
        gating = int(value("gating_func", 0))
        if gating and gating not in GATING_FUNC:
            raise GGUFFormatError(
                f"{arch}.expert_gating_func is {gating}; healsweep knows 1 (softmax) and 2 "
                "(sigmoid), re-export the file or open an issue for this gating"
            )
        routing = {
            "norm_topk_prob": bool(value("expert_weights_norm", False)),
            "gating": GATING_FUNC.get(gating) or _DEFAULT_GATING.get(arch, "softmax"),
            "expert_weights_scale": float(value("expert_weights_scale", 0.0)) or 1.0,
            "n_leading_dense": int(value("n_leading_dense", 0)),
        }
    n_layer_nextn = int(value("n_layer_nextn", 0))
    scaling = value("rope_scaling")
    if arch in ("olmoe", "llama", "glm4moe") and scaling not in (None, "none"):
        raise GGUFFormatError(
            f"{arch}.rope.scaling.type is {scaling!r}; healsweep runs RoPE scaling only for "
            "deepseek2 (YaRN), so this file's positions would be wrong: open an issue for it"
        )
    if "rope_freqs.weight" in tensor_shapes:
        raise GGUFFormatError(
            "the file has rope_freqs.weight (per-dimension RoPE factors, Llama-3 style), which "
            "healsweep does not apply: its positions would be wrong; open an issue for it"
        )
    mla: dict[str, Any] = {}
    if arch == "deepseek2":
        # a file with the split k_b/v_b layout keeps the per-head sizes in *_mla keys (its
        # key/value_length describe the compressed cache); an attn_kv_b file in key/value_length
        split = value("head_dim_mla") is not None
        head_dim = int(value("head_dim_mla")) if split else head_dim
        mla = {
            "head_dim_v": int(value("head_dim_v_mla" if split else "head_dim_v", head_dim)),
            "q_lora_rank": int(value("q_lora_rank", 0)),
            "kv_lora_rank": int(value("kv_lora_rank", 0)),
            "kv_b_split": split,
        }
        if value("rope_scaling") == "yarn":
            mla |= {
                "yarn_factor": float(value("yarn_factor", 1.0)),
                "yarn_orig_ctx": int(value("yarn_orig_ctx", value("context_length"))),
                "yarn_log_mul": float(value("yarn_log_mul", 0.0)),
            }
    return ModelHparams(
        arch=arch,
        n_layer=int(value("n_layer")) - n_layer_nextn,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(value("n_head_kv", n_head)),
        head_dim=head_dim,
        n_expert=int(value("n_expert")),
        n_expert_used=int(value("n_expert_used")),
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        n_vocab=int(embd[0]) if embd[0] else int(value("n_vocab", 0)),
        rope_freq_base=float(value("rope_freq_base", _ROPE_FREQ_BASE_DEFAULT)),
        rms_norm_eps=float(value("rms_norm_eps")),
        context_length=int(value("context_length")),
        rope_kind=ROPE_KIND[arch],
        n_rot=0 if int(value("n_rot", head_dim)) == head_dim else int(value("n_rot")),
        **mla,
        n_expert_groups=int(value("n_expert_groups", 0)),
        n_group_used=int(value("n_group_used", 0)),
        n_ff=int(value("n_ff", 0)) if arch in _ROUTING_ARCHS else 0,  # dense layers' width
        n_expert_shared=n_expert_shared,
        n_layer_nextn=n_layer_nextn,
        **routing,
    )


def metadata_from_hparams(hp: ModelHparams) -> dict[str, int | float | str]:
    """The ``{arch}.*`` metadata keys that describe ``hp`` (what :func:`write_model` writes)."""
    a = hp.arch
    keys: dict[str, int | float | str] = {
        f"{a}.context_length": hp.context_length,
        f"{a}.embedding_length": hp.n_embd,
        f"{a}.block_count": hp.n_layer,
        f"{a}.feed_forward_length": hp.n_ff or hp.n_ff_exp,
        f"{a}.expert_feed_forward_length": hp.n_ff_exp,
        f"{a}.expert_count": hp.n_expert,
        f"{a}.expert_used_count": hp.n_expert_used,
        f"{a}.vocab_size": hp.n_vocab,
        f"{a}.attention.head_count": hp.n_head,
        f"{a}.attention.head_count_kv": hp.n_head_kv,
        f"{a}.attention.key_length": hp.head_dim,
        f"{a}.attention.value_length": hp.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": hp.rms_norm_eps,
        f"{a}.rope.freq_base": hp.rope_freq_base,
        f"{a}.rope.dimension_count": hp.rope_dim,
    }
    if hp.arch == "qwen2moe":
        keys[f"{a}.expert_shared_feed_forward_length"] = hp.n_ff_shexp
    if hp.n_expert_groups > 1:
        keys[f"{a}.expert_group_count"] = hp.n_expert_groups
        keys[f"{a}.expert_group_used_count"] = hp.n_group_used
    if hp.arch == "deepseek2":
        keys |= {
            f"{a}.attention.q_lora_rank": hp.q_lora_rank,  # 0: attn_q (llama.cpp needs the key)
            f"{a}.attention.kv_lora_rank": hp.kv_lora_rank,
            f"{a}.attention.value_length": hp.head_dim_v,
        }
        if hp.yarn:
            keys |= {
                f"{a}.rope.scaling.type": "yarn",
                f"{a}.rope.scaling.factor": hp.yarn_factor,
                f"{a}.rope.scaling.original_context_length": hp.yarn_orig_ctx,
                f"{a}.rope.scaling.yarn_log_multiplier": hp.yarn_log_mul,
            }
        if hp.kv_b_split:  # llama.cpp's MLA layout: the cache is the compressed kv + rope dims
            keys |= {
                f"{a}.attention.key_length": hp.kv_lora_rank + hp.rope_dim,
                f"{a}.attention.value_length": hp.kv_lora_rank,
                f"{a}.attention.key_length_mla": hp.head_dim,
                f"{a}.attention.value_length_mla": hp.head_dim_v,
            }
    if hp.arch in _ROUTING_ARCHS:
        keys |= {
            f"{a}.expert_shared_count": hp.n_expert_shared,
            f"{a}.leading_dense_block_count": hp.n_leading_dense,
            f"{a}.expert_weights_scale": hp.expert_weights_scale,
            f"{a}.expert_weights_norm": hp.norm_topk_prob,
            f"{a}.expert_gating_func": {v: k for k, v in GATING_FUNC.items()}[hp.gating],
        }
    return keys


def _mla_shapes(hp: ModelHparams) -> dict[str, tuple]:
    d, h, hk, hv, r = hp.n_embd, hp.n_head, hp.head_dim, hp.head_dim_v, hp.kv_lora_rank
    nope = hk - hp.rope_dim
    shapes: dict[str, tuple] = {
        "attn_norm.weight": (d,),
        "attn_kv_a_mqa.weight": (r + hp.rope_dim, d),
        "attn_kv_a_norm.weight": (r,),
        "attn_output.weight": (d, h * hv),
    }
    if hp.q_lora_rank:
        shapes |= {
            "attn_q_a.weight": (hp.q_lora_rank, d),
            "attn_q_a_norm.weight": (hp.q_lora_rank,),
            "attn_q_b.weight": (h * hk, hp.q_lora_rank),
        }
    else:
        shapes["attn_q.weight"] = (h * hk, d)
    if hp.kv_b_split:
        shapes |= {"attn_k_b.weight": (h, r, nope), "attn_v_b.weight": (h, hv, r)}
    else:
        shapes["attn_kv_b.weight"] = (h * (nope + hv), r)
    return shapes


def _attention_shapes(hp: ModelHparams) -> dict[str, tuple]:
    if hp.arch == "deepseek2":
        return _mla_shapes(hp)
    d, hd = hp.n_embd, hp.head_dim
    q_dim, kv_dim = hp.n_head * hd, hp.n_head_kv * hd
    shapes: dict[str, tuple] = {
        "attn_norm.weight": (d,),
        "attn_q.weight": (q_dim, d),
        "attn_k.weight": (kv_dim, d),
        "attn_v.weight": (kv_dim, d),
        "attn_output.weight": (d, q_dim),
    }
    if hp.arch in ("qwen2moe", "glm4moe"):
        shapes |= {"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,)}
    elif hp.arch == "qwen3moe":  # one RMSNorm gain per head dim
        shapes |= {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    elif hp.arch == "olmoe":  # one RMSNorm over the whole q (k) projection
        shapes |= {"attn_q_norm.weight": (q_dim,), "attn_k_norm.weight": (kv_dim,)}
    return shapes


def ffn_norm_name(arch: str) -> str:
    """The layer's norm before its FFN (glm4moe calls it ``post_attention_norm``)."""
    return "post_attention_norm.weight" if arch == "glm4moe" else "ffn_norm.weight"


def _moe_shapes(hp: ModelHparams) -> dict[str, tuple]:
    d, e, f, fs = hp.n_embd, hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
    shapes: dict[str, tuple] = {
        ffn_norm_name(hp.arch): (d,),
        "ffn_gate_inp.weight": (e, d),
        "ffn_gate_exps.weight": (e, f, d),
        "ffn_up_exps.weight": (e, f, d),
        "ffn_down_exps.weight": (e, d, f),
    }
    if hp.arch == "qwen2moe":
        shapes["ffn_gate_inp_shexp.weight"] = (d,)
    if hp.arch == "glm4moe" or hp.arch == "deepseek2" and hp.gating == "sigmoid":
        shapes["exp_probs_b.bias"] = (e,)  # DeepSeek-V3 style; V2 (softmax) has none
    if fs:
        shapes |= {
            "ffn_gate_shexp.weight": (fs, d),
            "ffn_up_shexp.weight": (fs, d),
            "ffn_down_shexp.weight": (d, fs),
        }
    return shapes


def _dense_shapes(hp: ModelHparams) -> dict[str, tuple]:
    d, f = hp.n_embd, hp.n_ff
    return {
        ffn_norm_name(hp.arch): (d,),
        "ffn_gate.weight": (f, d),
        "ffn_up.weight": (f, d),
        "ffn_down.weight": (d, f),
    }


def expected_tensor_shapes(hp: ModelHparams, *, tied_output: bool = False) -> dict[str, tuple]:
    """Every tensor the forward reads, with its numpy shape (reversed ggml ``ne``)."""
    d, v = hp.n_embd, hp.n_vocab
    shapes: dict[str, tuple] = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    if not tied_output:
        shapes["output.weight"] = (v, d)
    attention, moe, dense = _attention_shapes(hp), _moe_shapes(hp), _dense_shapes(hp)
    for i in range(hp.n_layer):
        per_layer = attention | (dense if i < hp.n_leading_dense else moe)
        shapes |= {f"blk.{i}.{suffix}": shape for suffix, shape in per_layer.items()}
    return shapes
