"""What every architecture shares: the generic hparams reading, metadata, tensor layout and forward.

:class:`Architecture` reads the keys llama.cpp reads for every architecture (``{arch}.block_count``,
``{arch}.attention.head_count``, ... spelled by ``gguf.Keys``), lays out the tensors of a
GQA-attention MoE transformer and runs its attention and MoE block through the shared building
blocks of :mod:`healsweep.model.layers`. An architecture's own file (``model/<arch>.py``)
subclasses it and overrides only what differs; :mod:`healsweep.model.registry` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gguf import MODEL_TENSOR as T
from gguf import Keys

from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import ModelHparams, block_prefix, layer_tensor, tensor_name
from healsweep.model import layers
from healsweep.model._hparam_rules import blocks_in, check_relations, checked_value

GATING_FUNC = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values

# hparam field → metadata key (``{arch}`` formatted in), required ones first.
REQUIRED_KEYS = {
    "n_layer": Keys.LLM.BLOCK_COUNT,
    "n_embd": Keys.LLM.EMBEDDING_LENGTH,
    "n_head": Keys.Attention.HEAD_COUNT,
    "n_expert": Keys.LLM.EXPERT_COUNT,
    "n_expert_used": Keys.LLM.EXPERT_USED_COUNT,
    "rms_norm_eps": Keys.Attention.LAYERNORM_RMS_EPS,
    "context_length": Keys.LLM.CONTEXT_LENGTH,
}
OPTIONAL_KEYS = {
    "n_head_kv": Keys.Attention.HEAD_COUNT_KV,
    "head_dim": Keys.Attention.KEY_LENGTH,
    "n_ff_exp": Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    "n_ff_shexp": Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
    "rope_freq_base": Keys.Rope.FREQ_BASE,
    "n_vocab": Keys.LLM.VOCAB_SIZE,
    "n_rot": Keys.Rope.DIMENSION_COUNT,
    "n_ff": Keys.LLM.FEED_FORWARD_LENGTH,
    "n_expert_shared": Keys.LLM.EXPERT_SHARED_COUNT,
    "n_leading_dense": Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
    "expert_weights_scale": Keys.LLM.EXPERT_WEIGHTS_SCALE,
    "expert_weights_norm": Keys.LLM.EXPERT_WEIGHTS_NORM,
    "gating_func": Keys.LLM.EXPERT_GATING_FUNC,
    "n_expert_groups": Keys.LLM.EXPERT_GROUP_COUNT,
    "n_group_used": Keys.LLM.EXPERT_GROUP_USED_COUNT,
    "n_layer_nextn": Keys.LLM.NEXTN_PREDICT_LAYERS,
    "head_dim_v": Keys.Attention.VALUE_LENGTH,
    "head_dim_mla": Keys.Attention.KEY_LENGTH_MLA,
    "head_dim_v_mla": Keys.Attention.VALUE_LENGTH_MLA,
    "q_lora_rank": Keys.Attention.Q_LORA_RANK,
    "kv_lora_rank": Keys.Attention.KV_LORA_RANK,
    "rope_scaling": Keys.Rope.SCALING_TYPE,
    "yarn_factor": Keys.Rope.SCALING_FACTOR,
    "yarn_orig_ctx": Keys.Rope.SCALING_ORIG_CTX_LEN,
    "yarn_log_mul": Keys.Rope.SCALING_YARN_LOG_MUL,
}
_ROPE_FREQ_BASE_DEFAULT = 10000.0  # llama.cpp's default when the key is absent

Value = Callable[..., Any]  # value(field, default=None): a metadata value by hparam field


def metadata_key(field: str, arch: str) -> str:
    """The full metadata key of an hparam field (``"n_layer"`` → ``"qwen2moe.block_count"``)."""
    return (REQUIRED_KEYS.get(field) or OPTIONAL_KEYS[field]).format(arch=arch)


class Architecture:
    """One MoE architecture as llama.cpp reads and runs it: the shared defaults.

    Class attributes are the static facts of the architecture; methods are the steps where
    architectures differ, each overridden by the ones that differ there.
    """

    name = ""
    rope_kind = "neox"  # "neox" (rotate halves) | "norm" (rotate consecutive pairs)
    norm_topk_prob = False  # llama.cpp's build_moe_ffn ``norm_w``: top-k weights sum to one
    attention_kind = "GQA"  # what ``model info`` says about the attention
    ffn_norm = layer_tensor(T.FFN_NORM)  # the layer's norm before its FFN

    # --- reading a file ---------------------------------------------------------------------
    def check_file(self, path: Any, tensor_names: list[str], supported: Sequence[str]) -> None:
        """Refuse a file of this architecture that healsweep cannot run (before any hparam);
        ``supported`` names the architectures healsweep runs, for the message."""

    def missing_keys(self, has_key: Callable[[str], bool]) -> list[str]:
        """Full metadata keys this architecture needs that the file lacks."""
        keys = [key.format(arch=self.name) for key in REQUIRED_KEYS.values()]
        return [key for key in keys if not has_key(key)]

    def read_hparams(
        self, get: Callable[[str], Any], tensor_shapes: Mapping[str, tuple[int, ...]]
    ) -> ModelHparams:
        """:class:`ModelHparams` from metadata (``get(key)`` is None when absent).

        Sizes that llama.cpp treats as optional (expert FFN sizes, vocab) fall back to the
        shapes of the tensors, as llama.cpp does; call :meth:`missing_keys` first. Every value
        is checked as it is read (type and range) and the result against itself and the file's
        blocks (:meth:`check_hparams`) before anything is sized by it: a
        :class:`GGUFFormatError` names the key, its value and what was expected.
        """

        def value(field: str, default: Any = None) -> Any:
            key = metadata_key(field, self.name)
            found = get(key)
            return default if found is None else checked_value(key, field, found)

        n_embd, n_head = int(value("n_embd")), int(value("n_head"))
        gate_exps = "." + layer_tensor(T.FFN_GATE_EXP)
        exps = next((s for n, s in tensor_shapes.items() if n.endswith(gate_exps)), (0, 0, 0))
        embd = tensor_shapes.get(tensor_name(T.TOKEN_EMBD), (0, 0))
        head_dim = int(value("head_dim", n_embd // n_head))
        n_ff_exp = int(value("n_ff_exp", exps[1]))
        shared = self.read_shared_expert(value, n_ff_exp, tensor_shapes)
        routing = self.read_routing(value)
        n_layer_nextn = int(value("n_layer_nextn", 0))
        scaling = self.read_rope_scaling(value)
        if tensor_name(T.ROPE_FREQS) in tensor_shapes:
            raise GGUFFormatError(
                "the file has rope_freqs.weight (per-dimension RoPE factors, Llama-3 style), "
                "which healsweep does not apply: its positions would be wrong; open an issue for it"
            )
        head_dim, attention = self.read_attention(value, head_dim)
        hp = ModelHparams(
            arch=self.name,
            n_layer=int(value("n_layer")) - n_layer_nextn,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(value("n_head_kv", n_head)),
            head_dim=head_dim,
            n_expert=int(value("n_expert")),
            n_expert_used=int(value("n_expert_used")),
            n_ff_exp=n_ff_exp,
            n_vocab=int(embd[0]) if embd[0] else int(value("n_vocab", 0)),
            rope_freq_base=float(value("rope_freq_base", _ROPE_FREQ_BASE_DEFAULT)),
            rms_norm_eps=float(value("rms_norm_eps")),
            context_length=int(value("context_length")),
            rope_kind=self.rope_kind,
            n_rot=0 if int(value("n_rot", head_dim)) == head_dim else int(value("n_rot")),
            n_expert_groups=int(value("n_expert_groups", 0)),
            n_group_used=int(value("n_group_used", 0)),
            n_layer_nextn=n_layer_nextn,
            **shared,
            **routing,
            **scaling,
            **attention,
        )
        self.check_hparams(
            hp,
            lambda field: metadata_key(field, self.name),
            blocks_in(tensor_shapes),
            lambda field: get(metadata_key(field, self.name)) is not None,
        )
        return hp

    def check_hparams(self, hp: ModelHparams, key: Callable[[str], str], n_blocks: int,
                      has: Callable[[str], bool]) -> None:  # fmt: skip
        """Raise :class:`GGUFFormatError` for hparams that contradict each other or the file
        (``n_blocks``: the blocks it has tensors for); architectures add their own checks."""
        check_relations(hp, key, n_blocks, has)

    def read_shared_expert(self, value: Value, n_ff_exp: int, shapes: Mapping) -> dict[str, int]:
        """``n_ff_shexp`` (and ``n_expert_shared``): none by default."""
        return {"n_ff_shexp": 0}

    def read_routing(self, value: Value) -> dict[str, Any]:
        """How the router's weights are formed: the architecture's fixed ``norm_topk_prob``."""
        return {"norm_topk_prob": self.norm_topk_prob}

    def read_rope_scaling(self, value: Value) -> dict[str, Any]:
        """RoPE scaling hparams; by default the key is not read (llama.cpp's qwen graphs)."""
        return {}

    def read_attention(self, value: Value, head_dim: int) -> tuple[int, dict[str, Any]]:
        """``(head_dim, further attention hparams)``: GQA needs none."""
        return head_dim, {}

    # --- writing a file ---------------------------------------------------------------------
    def metadata(self, hp: ModelHparams) -> dict[str, int | float | str]:
        """The ``{arch}.*`` metadata keys that describe ``hp`` (``hp.arch`` is the prefix)."""

        def key(field: str) -> str:
            return metadata_key(field, hp.arch)

        keys: dict[str, int | float | str] = {
            key("context_length"): hp.context_length,
            key("n_embd"): hp.n_embd,
            key("n_layer"): hp.n_layer,
            key("n_ff"): hp.n_ff or hp.n_ff_exp,
            key("n_ff_exp"): hp.n_ff_exp,
            key("n_expert"): hp.n_expert,
            key("n_expert_used"): hp.n_expert_used,
            key("n_vocab"): hp.n_vocab,
            key("n_head"): hp.n_head,
            key("n_head_kv"): hp.n_head_kv,
            key("head_dim"): hp.head_dim,
            key("head_dim_v"): hp.head_dim,
            key("rms_norm_eps"): hp.rms_norm_eps,
            key("rope_freq_base"): hp.rope_freq_base,
            key("n_rot"): hp.rope_dim,
        }
        keys |= {key(f): v for f, v in self.shared_expert_metadata(hp).items()}
        if hp.n_expert_groups > 1:
            keys[key("n_expert_groups")] = hp.n_expert_groups
            keys[key("n_group_used")] = hp.n_group_used
        keys |= {key(f): v for f, v in self.attention_metadata(hp).items()}
        keys |= {key(f): v for f, v in self.routing_metadata(hp).items()}
        return keys

    def shared_expert_metadata(self, hp: ModelHparams) -> dict[str, Any]:
        """Shared-expert fields by hparam field name (none by default)."""
        return {}

    def attention_metadata(self, hp: ModelHparams) -> dict[str, Any]:
        """Attention fields beyond GQA's, by hparam field name (none by default)."""
        return {}

    def routing_metadata(self, hp: ModelHparams) -> dict[str, Any]:
        """Routing fields by hparam field name (none: llama.cpp fixes the routing per graph)."""
        return {}

    def random_hparams(self, hp: ModelHparams) -> ModelHparams:
        """A random test model's hparams, from generic ones: no shared expert by default."""
        return hp.replace(n_ff_shexp=0)

    # --- tensor layout ------------------------------------------------------------------------
    def attention_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        """Per-layer attention tensors (suffix → numpy shape)."""
        d, hd = hp.n_embd, hp.head_dim
        q_dim, kv_dim = hp.n_head * hd, hp.n_head_kv * hd
        return {
            layer_tensor(T.ATTN_NORM): (d,),
            layer_tensor(T.ATTN_Q): (q_dim, d),
            layer_tensor(T.ATTN_K): (kv_dim, d),
            layer_tensor(T.ATTN_V): (kv_dim, d),
            layer_tensor(T.ATTN_OUT): (d, q_dim),
        }

    def router_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        """Router tensors beyond ``ffn_gate_inp`` (none by default)."""
        return {}

    def moe_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        """Per-layer tensors of an MoE FFN."""
        d, e, f, fs = hp.n_embd, hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
        shapes: dict[str, tuple] = {
            self.ffn_norm: (d,),
            layer_tensor(T.FFN_GATE_INP): (e, d),
            layer_tensor(T.FFN_GATE_EXP): (e, f, d),
            layer_tensor(T.FFN_UP_EXP): (e, f, d),
            layer_tensor(T.FFN_DOWN_EXP): (e, d, f),
        }
        shapes |= self.router_shapes(hp)
        if fs:
            shapes |= {
                layer_tensor(T.FFN_GATE_SHEXP): (fs, d),
                layer_tensor(T.FFN_UP_SHEXP): (fs, d),
                layer_tensor(T.FFN_DOWN_SHEXP): (d, fs),
            }
        return shapes

    def dense_shapes(self, hp: ModelHparams) -> dict[str, tuple]:
        """Per-layer tensors of a leading dense FFN."""
        d, f = hp.n_embd, hp.n_ff
        return {
            self.ffn_norm: (d,),
            layer_tensor(T.FFN_GATE): (f, d),
            layer_tensor(T.FFN_UP): (f, d),
            layer_tensor(T.FFN_DOWN): (d, f),
        }

    def tensor_shapes(self, hp: ModelHparams, *, tied_output: bool = False) -> dict[str, tuple]:
        """Every tensor the forward reads, with its numpy shape (reversed ggml ``ne``)."""
        d, v = hp.n_embd, hp.n_vocab
        shapes: dict[str, tuple] = {
            tensor_name(T.TOKEN_EMBD): (v, d),
            tensor_name(T.OUTPUT_NORM): (d,),
        }
        if not tied_output:
            shapes[tensor_name(T.OUTPUT)] = (v, d)
        attention, moe, dense = (
            self.attention_shapes(hp),
            self.moe_shapes(hp),
            self.dense_shapes(hp),
        )
        for i in range(hp.n_layer):
            per_layer = attention | (dense if i < hp.n_leading_dense else moe)
            shapes |= {block_prefix(i) + name: shape for name, shape in per_layer.items()}
        return shapes

    # --- what ``model info`` says -------------------------------------------------------------
    def attention_summary(self, hp: ModelHparams) -> str:
        """One line: attention kind and RoPE."""
        rope = f"{hp.rope_kind} RoPE on {hp.rope_dim} of {hp.head_dim} head dims"
        return f"{self.attention_kind}, {hp.n_head}/{hp.n_head_kv} heads, {rope}"

    # --- the forward (jitted with ``hp`` static) ----------------------------------------------
    def attention(self, hp: ModelHparams, w: dict[str, Any], x: Any, positions: Any) -> Any:
        """Self-attention of one sequence, ``x [T, D]`` (normed) → ``[T, D]``."""
        return self.attention_with_inputs(hp, w, x, positions)[0]

    def attention_with_inputs(
        self, hp: ModelHparams, w: dict[str, Any], x: Any, positions: Any
    ) -> tuple[Any, dict[str, Any]]:
        """:meth:`attention` and the inputs ``[T, n]`` of its matrices that do not read ``x``,
        by tensor suffix (``attn_output.weight``; MLA's inner projections): what the input
        importance of a requantized attention tensor is taken from (``model.input_moments``).
        An architecture overrides this one, not :meth:`attention`."""
        return layers.self_attention_with_inputs(hp, w, x, positions)

    def moe_block(
        self, hp: ModelHparams, w: dict[str, Any], x: Any, tile: int, cache: Any = None
    ) -> tuple[Any, dict]:
        """Routed (and shared) experts, ``x [N, D]`` (normed) → ``(out [N, D], capture)``."""
        return layers.moe_ffn(hp, w, x, tile, cache)


class RoutingFromFile(Architecture):
    """Architectures whose routing llama.cpp reads from the file (gating, weight norm and scale,
    leading dense layers, ungated shared experts of width ``n_ff_exp · expert_shared_count``)."""

    default_gating = "softmax"  # when the file has no ``expert_gating_func``

    def read_shared_expert(self, value: Value, n_ff_exp: int, shapes: Mapping) -> dict[str, int]:
        n_expert_shared = int(value("n_expert_shared", 0))
        return {"n_expert_shared": n_expert_shared, "n_ff_shexp": n_ff_exp * n_expert_shared}

    def read_routing(self, value: Value) -> dict[str, Any]:
        gating = int(value("gating_func", 0))
        if gating and gating not in GATING_FUNC:
            raise GGUFFormatError(
                f"{self.name}.expert_gating_func is {gating}; healsweep knows 1 (softmax) and 2 "
                "(sigmoid), re-export the file or open an issue for this gating"
            )
        return {
            "norm_topk_prob": bool(value("expert_weights_norm", False)),
            "gating": GATING_FUNC.get(gating) or self.default_gating,
            "expert_weights_scale": float(value("expert_weights_scale", 0.0)) or 1.0,
            "n_leading_dense": int(value("n_leading_dense", 0)),
            "n_ff": int(value("n_ff", 0)),  # the dense layers' width
        }

    def routing_metadata(self, hp: ModelHparams) -> dict[str, Any]:
        return {
            "n_expert_shared": hp.n_expert_shared,
            "n_leading_dense": hp.n_leading_dense,
            "expert_weights_scale": hp.expert_weights_scale,
            "expert_weights_norm": hp.norm_topk_prob,
            "gating_func": {v: k for k, v in GATING_FUNC.items()}[hp.gating],
        }


def refuse_rope_scaling(arch: str, value: Value) -> None:
    """Raise for a file that asks for RoPE scaling an architecture's forward does not apply."""
    scaling = value("rope_scaling")
    if scaling not in (None, "none"):
        raise GGUFFormatError(
            f"{arch}.rope.scaling.type is {scaling!r}; healsweep runs RoPE scaling only for "
            "deepseek2 (YaRN), so this file's positions would be wrong: open an issue for it"
        )


def qk_bias_shapes(hp: ModelHparams) -> dict[str, tuple]:
    """q/k/v projection biases (qwen2moe, glm4moe)."""
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    return {
        layer_tensor(T.ATTN_Q, "bias"): (q_dim,),
        layer_tensor(T.ATTN_K, "bias"): (kv_dim,),
        layer_tensor(T.ATTN_V, "bias"): (kv_dim,),
    }
