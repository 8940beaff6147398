"""Small random MoE GGUFs (every supported architecture) with a real tokenizer, for tests and benchmarks.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on a few sentences, with ChatML
control tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``; other models' markers on
request) and Qwen's user-defined ``<think>``/``</think>``; a file may carry a chat template.
Weights are drawn per tensor from a seed and the tensor's name, lazily, so a model of many layers
is written with one tensor in memory at a time.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, Keys

from healsweep.gguf_io import ModelHparams, split_block, tokenizer_metadata_from_tokenizer
from healsweep.gguf_io._synthetic_vocab import grown_tokenizer
from healsweep.gguf_io._tokenizer import PRE_PATTERNS, byte_level_pre_tokenizer
from healsweep.model.files import write_model
from healsweep.model.registry import ARCHITECTURES

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>", "</think>")

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route every token to a few experts out of many.",
    "Quantization to two bits damages the experts; healing repairs part of the damage.",
    "def forward(x):\n    return x @ w.T + b  # a tiny linear layer\n",
    '{"name": "launch retro", "date": "2024-05-01", "items": [1, 2, 3]}',
    "Kullback-Leibler divergence compares the teacher and the student, token by token.",
    "日本語のテキストも少しだけ含めます。東京は晴れです。",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
)


def train_tiny_tokenizer(
    texts: tuple[str, ...] = _SENTENCES,
    vocab_size: int = 384,
    *,
    pre: str = "qwen2",
    control_tokens: tuple[str, ...] = CONTROL_TOKENS,
):
    """A byte-level BPE ``tokenizers.Tokenizer`` behind the split regexes of ``pre`` (a
    ``tokenizer.ggml.pre`` name) with ``control_tokens`` as special tokens (ids 0, 1, ...)."""
    # lazy: heavy (tokenizers)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(PRE_PATTERNS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(control_tokens),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts) * 4, trainer)
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in USER_DEFINED_TOKENS]
    )
    return tokenizer


def _init_scale(suffix: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor's random init: norms near 1, matrices ~ 1/sqrt(fan_in)."""
    if suffix.endswith("norm.weight"):
        return 1.0, 0.1
    if suffix.endswith(".bias"):
        return 0.0, 0.1
    if suffix == "token_embd.weight":
        return 0.0, 1.0
    if suffix in ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"):
        return 0.0, 2.0 / np.sqrt(shape[-1])  # router logits of order 1: routing matters
    if suffix == "exp_probs_b.bias":
        return 0.0, 0.3  # a selection bias that changes which experts win
    return 0.0, 1.0 / np.sqrt(shape[-1])


class RandomTensors(Mapping):
    """Name → float32 array, drawn on access from ``(seed, crc32(name))``."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], seed: int):
        self._shapes = dict(shapes)
        self._seed = seed

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self._shapes[name]
        suffix = split_block(name)[1]
        mean, std = _init_scale(suffix, shape)
        rng = np.random.default_rng([self._seed, zlib.crc32(name.encode())])
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without drawing it (what a writer lays out first)."""
        return tuple(self._shapes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _resolve_types(types: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Per-tensor types from one type (for every matrix), or a map by full name or suffix."""

    def as_type(t: Any) -> Any:
        return GGMLQuantizationType[t] if isinstance(t, str) else t

    if types is None:
        return {}
    if not isinstance(types, Mapping):
        return {n: as_type(types) for n, s in shapes.items() if len(s) >= 2}
    out = {}
    for name in shapes:
        suffix = split_block(name)[1]
        chosen = types[name] if name in types else types.get(suffix)
        if chosen is not None:
            out[name] = as_type(chosen)
    return out


def write_random_model(
    path: str | Path,
    arch: str = "qwen2moe",
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_ff_shexp: int = 64,
    context_length: int = 512,
    rope_freq_base: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    types: Any = None,
    seed: int = 0,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    bos: str = "<|endoftext|>",
    eos: str = "<|im_end|>",
    pre: str | None = None,
    chat_template: str | None = None,
    drop_tensors: tuple[str, ...] = (),
    drop_keys: tuple[str, ...] = (),
    extra_metadata: Mapping[str, Any] | None = None,
    **routing: Any,
) -> Path:
    """Write a random ``arch`` model with a trained tiny tokenizer and return its path.

    ``types`` is a ``GGMLQuantizationType`` (or its name) for every matrix, or a map from full
    tensor name or per-layer suffix (``"ffn_up_exps.weight"``) to a type; unspecified tensors
    get F32 (vectors) / F16 (matrices). ``routing`` sets further :class:`ModelHparams` fields
    (glm4moe: ``n_leading_dense``, ``n_ff``, ``n_expert_shared``, ``gating``,
    ``expert_weights_scale``, ``norm_topk_prob``, ``n_expert_groups``, ``n_group_used``,
    ``n_rot``); ``extra_metadata`` adds keys. ``drop_tensors``/``drop_keys`` leave tensors or
    ``{arch}.*`` metadata out, to make deliberately broken files. Any ``arch`` string is written
    (an unsupported one, e.g. ``"gpt2"``, gets the qwen2moe layout under its own name).
    ``bos``/``eos`` name the tokenizer's special tokens (the padding token is ``bos``); ``pre``
    records another ``tokenizer.ggml.pre`` than the one the tokenizer's regexes imply (for names
    that share regexes); ``chat_template`` is stored as ``tokenizer.chat_template``.
    ``vocab_size`` grows the tokenizer (the given one or the tiny one) to that many tokens in
    all, e.g. 151936 for Qwen (:func:`_synthetic_vocab.grown_tokenizer`), so that the
    embedding and the output head have a real model's rows.
    """
    tokenizer = tokenizer or train_tiny_tokenizer()
    if vocab_size is not None:
        tokenizer = grown_tokenizer(tokenizer, vocab_size)
    tok_meta = tokenizer_metadata_from_tokenizer(tokenizer, bos=bos, eos=eos, pad=bos)
    if pre is not None:
        tok_meta = dataclasses.replace(tok_meta, pre=pre)
    if chat_template is not None:
        extra_metadata = {Keys.Tokenizer.CHAT_TEMPLATE: chat_template, **(extra_metadata or {})}
    layout = ARCHITECTURES.get(arch, ARCHITECTURES["qwen2moe"])
    hp = ModelHparams(
        arch=layout.name, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim or n_embd // n_head, n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp, n_vocab=len(tok_meta.tokens),
        rope_freq_base=rope_freq_base, rms_norm_eps=rms_norm_eps, context_length=context_length,
        norm_topk_prob=layout.norm_topk_prob, rope_kind=layout.rope_kind,
    )  # fmt: skip
    hp = layout.random_hparams(hp).replace(**routing)
    if hp.kv_b_split:  # llama.cpp's MLA layout caches one latent "head": MQA
        hp = hp.replace(n_head_kv=1)
    if hp.n_expert_shared:
        hp = hp.replace(n_ff_shexp=hp.n_ff_exp * hp.n_expert_shared)
    shapes = {n: s for n, s in layout.tensor_shapes(hp).items() if n not in drop_tensors}
    return write_model(
        path,
        arch,
        hp,
        RandomTensors(shapes, seed),
        _resolve_types(types, shapes),
        tok_meta,
        name=f"random-{arch}",
        drop_keys=tuple(f"{arch}.{k}" for k in drop_keys),
        extra_metadata=extra_metadata,
    )
