"""Build the demo assets from a seed: corpus → tokenizer → trained qwen2moe → GGUF.

The shipped ``assets/demo-moe.gguf`` is what :func:`build_demo` produces with the default seed and
recipe on a GPU (``docs/demo-model.md`` gives the figures). Training is deterministic in the seed
on a given JAX backend; a CPU build follows the same recipe and takes longer.

The figures that show the model is usable as a teacher are computed here with the *runtime*
forward (:func:`healsweep.model.forward` over the written GGUF), not with the training forward:
perplexity on the dev documents against a unigram baseline, and the share of routed tokens each
expert receives on the calibration pool.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from gguf import GGMLQuantizationType, Keys

from healsweep.bundled import demo_corpus_path, demo_tokenizer_path
from healsweep.data.corpus import load_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.demo.corpus_builder import DemoCorpusConfig, build_demo_corpus, write_demo_assets
from healsweep.demo.train import MoEConfig, Params, TrainConfig, TrainResult, to_gguf_tensors, train
from healsweep.errors import SettingError
from healsweep.gguf_io import ModelHparams, block_prefix, tokenizer_metadata_from_tokenizer
from healsweep.model import forward, write_model

EOT = "<|endoftext|>"
MODEL_FILE, CORPUS_FILE, TOKENIZER_FILE = (
    "demo-moe.gguf",
    "demo-corpus.jsonl",
    "demo-tokenizer.json",
)


class Preset(NamedTuple):
    """A demo model size: its architecture and recipe (changes from the shipped defaults), the
    file it is written to and the storage type of its routed experts (None: F16)."""

    model: dict[str, Any]
    recipe: dict[str, Any]
    model_file: str
    expert_type: str | None
    packaged_corpus: bool = False  # train on the shipped corpus and tokenizer, not regenerated


PRESETS: dict[str, Preset] = {
    # the shipped 10 MB model (docs/demo-model.md)
    "small": Preset({}, {}, MODEL_FILE, None),
    # rows of 256 (D and the expert FFN), so llama.cpp's K- and IQ-quants apply to its experts;
    # 109 M parameters, 101 M of them routed experts, stored Q8_0 (a 124 MB file instead of 218)
    "medium": Preset(
        {
            "n_layer": 8,
            "n_embd": 256,
            "n_head": 4,
            "n_head_kv": 2,
            "head_dim": 64,
            "n_expert": 64,
            "n_expert_used": 4,
            "n_ff_exp": 256,
            "n_ff_shexp": 512,
        },
        {"steps": 600, "learning_rate": 2e-3, "warmup_steps": 60},
        "demo-moe-medium.gguf",
        "Q8_0",
        # the corpus is built from the running Python's standard library, so a rebuild under
        # another Python version gives other documents; the shipped ones keep the medium model's
        # dev and test documents those of the shipped demo (and out of its training pool)
        packaged_corpus=True,
    ),
    # the budget sweep's model that anyone can build (issue 29): rows of 256 and a shared expert
    # like "medium", sized to train on a 2-core CPU within an hour; ~17 MB, shipped
    "medium-cpu": Preset(
        {
            "n_layer": 4,
            "n_embd": 256,
            "n_head": 4,
            "n_head_kv": 2,
            "head_dim": 64,
            "n_expert": 8,
            "n_expert_used": 2,
            "n_ff_exp": 256,
            "n_ff_shexp": 512,
        },
        {"steps": 360, "learning_rate": 3e-3, "warmup_steps": 36},
        "demo-moe-medium-cpu.gguf",
        "Q8_0",
        packaged_corpus=True,
    ),
}


def demo_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name is a SettingError naming the known ones."""

    if name not in PRESETS:
        raise SettingError(
            f"unknown demo preset {name!r}: choose one of {', '.join(PRESETS)} (--preset)"
        )
    return PRESETS[name]


def demo_model_config(n_vocab: int, preset: str = "small") -> MoEConfig:
    """The architecture of ``preset`` (default: the shipped model) for ``n_vocab`` tokens."""
    return MoEConfig(n_vocab=n_vocab, **demo_preset(preset).model)


def demo_train_config(
    seed: int = 0, steps: int | None = None, preset: str = "small"
) -> TrainConfig:
    """The training recipe of ``preset``, with the seed and optionally the step count changed."""
    recipe = TrainConfig(seed=seed, **demo_preset(preset).recipe)
    if steps is not None:
        if steps < 1:
            raise ValueError(f"demo_train_config: steps must be >= 1, got {steps}")
        # the warm-up stays as shipped unless it would take over half of a short run
        warmup = min(recipe.warmup_steps, max(steps // 2, 1))
        recipe = dataclasses.replace(recipe, steps=steps, warmup_steps=warmup)
    return recipe


def encode_documents(documents: Iterable[Any], tokenizer: Any) -> list[np.ndarray]:
    """Token ids of each document's rendered ChatML text (int32)."""
    texts = [doc.render() for doc in documents]
    return [np.asarray(enc.ids, np.int32) for enc in tokenizer.encode_batch(texts)]


def pack_documents(encoded: Sequence[np.ndarray], eot_id: int) -> np.ndarray:
    """One training stream: every document followed by ``<|endoftext|>``."""
    separator = np.asarray([eot_id], np.int32)
    return np.concatenate([part for ids in encoded for part in (ids, separator)])


def training_stream(corpus: Any, tokenizer: Any) -> np.ndarray:
    """The packed token stream of the corpus's training pool."""
    eot_id = tokenizer.token_to_id(EOT)
    if eot_id is None:
        raise ValueError(f"training_stream: tokenizer has no {EOT} token")
    return pack_documents(encode_documents(corpus.pool("train"), tokenizer), eot_id)


def dev_documents(corpus: Any) -> list[Any]:
    """Eval-pool documents with an odd index: the dev half of the parity split."""
    return [d for d in corpus.pool("eval") if d.index % 2 == 1]


# --- the GGUF ---------------------------------------------------------------------------------


def hparams_for(cfg: MoEConfig) -> Any:
    """The GGUF hyperparameters of the training config (qwen2moe, top-k not renormalized)."""

    return ModelHparams(
        arch="qwen2moe",
        n_layer=cfg.n_layer,
        n_embd=cfg.n_embd,
        n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv,
        head_dim=cfg.head_dim,
        n_expert=cfg.n_expert,
        n_expert_used=cfg.n_expert_used,
        n_ff_exp=cfg.n_ff_exp,
        n_ff_shexp=cfg.n_ff_shexp,
        n_vocab=cfg.n_vocab,
        rope_freq_base=cfg.rope_freq_base,
        rms_norm_eps=cfg.rms_norm_eps,
        context_length=cfg.context_length,
        norm_topk_prob=False,
    )


def write_demo_model(
    path: str | Path,
    tensors: dict[str, np.ndarray] | Params,
    cfg: MoEConfig,
    tokenizer: Any,
    *,
    types: dict[str, Any] | None = None,
    description: str = "",
) -> Path:
    """Write trained parameters (a pytree or GGUF-named arrays) with the tokenizer into a GGUF.

    Matrices are stored F16 and vectors (norms, biases, the shared-expert gate) F32 unless
    ``types`` says otherwise.
    """

    if "blk" in tensors:
        tensors = to_gguf_tensors(tensors)
    meta = tokenizer_metadata_from_tokenizer(tokenizer, bos=EOT, eos="<|im_end|>", pad=EOT)
    ordered = {name: tensors[name] for name in _tensor_order(cfg.n_layer) if name in tensors}
    extra = {Keys.General.DESCRIPTION: description} if description else None
    return write_model(
        path,
        "qwen2moe",
        hparams_for(cfg),
        ordered,
        types,
        meta,
        name="healsweep-demo-moe",
        extra_metadata=extra,
    )


def _tensor_order(n_layer: int) -> list[str]:
    per_layer = [
        "attn_norm.weight",
        "attn_q.weight",
        "attn_q.bias",
        "attn_k.weight",
        "attn_k.bias",
        "attn_v.weight",
        "attn_v.bias",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
        "ffn_gate_inp_shexp.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    ]
    layers = [block_prefix(i) + name for i in range(n_layer) for name in per_layer]
    return ["token_embd.weight", *layers, "output_norm.weight", "output.weight"]


# --- figures with the runtime forward -----------------------------------------------------------


def unigram_nll(train_stream: np.ndarray, sequences: Sequence[np.ndarray], n_vocab: int) -> float:
    """Mean NLL (nats) of tokens 1.. of each sequence under add-one unigram counts of the stream."""
    counts = np.bincount(train_stream, minlength=n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    scored = np.concatenate([seq[1:] for seq in sequences])
    return float(-np.mean(logp[scored]))


def model_nll(model: Any, sequences: Sequence[np.ndarray], batch: int = 8) -> float:
    """Mean teacher-forced NLL (nats) of tokens 1.. of each sequence, by the runtime forward."""

    total, count = 0.0, 0
    for start in range(0, len(sequences), batch):
        chunk = [np.asarray(s, np.int32) for s in sequences[start : start + batch]]
        result = forward(model, chunk, logits_for=[np.arange(len(s) - 1) for s in chunk])
        for seq, logits in zip(chunk, result.logits, strict=True):
            z = logits.astype(np.float64)
            logz = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
            total += float(np.sum(logz - z[np.arange(len(seq) - 1), seq[1:]]))
            count += len(seq) - 1
    return total / count


def window_nll(model: Any, windows: Sequence[Any], batch: int = 8) -> tuple[float, int]:
    """Mean NLL (nats) of the scored tokens of scoring windows, and how many tokens were scored.

    Scored token ``j`` is predicted from the logits at ``j - 1`` (the windows' convention).
    """

    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        chunk = windows[start : start + batch]
        wanted = [np.arange(w.scored_from - 1, w.scored_from + w.n_scored - 1) for w in chunk]
        result = forward(model, [w.tokens for w in chunk], logits_for=wanted)
        for win, logits in zip(chunk, result.logits, strict=True):
            z = logits.astype(np.float64)
            logz = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
            total += float(np.sum(logz - z[np.arange(win.n_scored), win.scored_tokens]))
            count += win.n_scored
    return total / count, count


def expert_load(model: Any, sequences: Sequence[np.ndarray], batch: int = 8) -> np.ndarray:
    """Share of routed (token, slot) assignments per expert, ``[n_layer, n_expert]``; rows sum to 1."""

    hp = model.hparams
    counts = np.zeros((hp.n_layer, hp.n_expert), np.int64)
    for start in range(0, len(sequences), batch):
        chunk = [np.asarray(s, np.int32) for s in sequences[start : start + batch]]
        result = forward(model, chunk, logits_for=[np.zeros(0, np.int64) for _ in chunk])
        for ids in result.router:  # [T, L, k]
            for layer in range(hp.n_layer):
                counts[layer] += np.bincount(ids[:, layer].ravel(), minlength=hp.n_expert)
    return counts / counts.sum(axis=1, keepdims=True)


class DemoFigures(NamedTuple):
    """Acceptance figures of a demo model."""

    window_tokens: int  # scored tokens of the dev windows
    window_perplexity: float
    window_unigram_perplexity: float
    dev_tokens: int  # every token of the dev documents (each read from its start)
    dev_perplexity: float
    unigram_perplexity: float
    calibration_tokens: int
    expert_load: np.ndarray  # [L, E] share of routed assignments on the calibration pool


def demo_figures(
    model: Any, corpus: Any, tokenizer: Any, max_len: int | None = None
) -> DemoFigures:
    """Dev perplexity vs the unigram baseline and the calibration-pool expert load of ``model``.

    Perplexities are over the dev windows' scored tokens (as the sweeps score them) and over the
    whole dev documents; the unigram baseline counts tokens of the training pool (add-one).
    """

    limit = max_len or model.hparams.context_length
    dev = [s[:limit] for s in encode_documents(dev_documents(corpus), tokenizer)]
    cal = [s[:limit] for s in encode_documents(corpus.pool("calibration"), tokenizer)]
    stream = training_stream(corpus, tokenizer)
    windows = make_windows(corpus, tokenizer, parity_split(corpus), "dev")
    win_nll, win_tokens = window_nll(model, windows)
    scored = [np.concatenate([[0], w.scored_tokens]) for w in windows]  # unigram_nll skips [0]
    return DemoFigures(
        window_tokens=win_tokens,
        window_perplexity=math.exp(win_nll),
        window_unigram_perplexity=math.exp(unigram_nll(stream, scored, model.hparams.n_vocab)),
        dev_tokens=sum(len(s) - 1 for s in dev),
        dev_perplexity=math.exp(model_nll(model, dev)),
        unigram_perplexity=math.exp(unigram_nll(stream, dev, model.hparams.n_vocab)),
        calibration_tokens=sum(len(s) for s in cal),
        expert_load=expert_load(model, cal),
    )


# --- the whole build --------------------------------------------------------------------------


class DemoBuild(NamedTuple):
    """Paths of the built assets, the training history and the time each stage took."""

    corpus_path: Path
    tokenizer_path: Path
    model_path: Path
    history: list[Any]
    seconds: dict[str, float]
    backend: str


def build_demo(
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int | None = None,
    preset: str = "small",
    progress: Callable[..., None] | None = None,
) -> DemoBuild:
    """Regenerate corpus, tokenizer and the ``preset`` model under ``out_dir`` from ``seed``
    (a preset with ``packaged_corpus`` copies the shipped corpus and tokenizer instead).

    ``progress(log, params)`` is called at every logged training step (see :func:`train`).
    """
    # lazy: heavy (tokenizers)
    from tokenizers import Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    chosen = demo_preset(preset)
    corpus_path, tokenizer_path = out / CORPUS_FILE, out / TOKENIZER_FILE
    if chosen.packaged_corpus:
        shutil.copyfile(demo_corpus_path(), corpus_path)
        shutil.copyfile(demo_tokenizer_path(), tokenizer_path)
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    else:
        built = build_demo_corpus(DemoCorpusConfig(seed=seed))
        write_demo_assets(built, corpus_path, tokenizer_path)
        tokenizer = built.tokenizer
    seconds["corpus_and_tokenizer"] = time.perf_counter() - started

    started = time.perf_counter()
    corpus = load_corpus(corpus_path)
    cfg = demo_model_config(tokenizer.get_vocab_size(), preset)
    recipe = demo_train_config(seed, steps, preset)
    # a killed build (a CPU build takes up to an hour) continues from its last checkpoint
    checkpoint = out / f".{chosen.model_file}.train-checkpoint.npz"
    result: TrainResult = train(
        training_stream(corpus, tokenizer), cfg, recipe, progress=progress, checkpoint=checkpoint
    )
    checkpoint.unlink(missing_ok=True)
    seconds["training"] = time.perf_counter() - started
    backend = jax.default_backend()
    started = time.perf_counter()
    types = None
    if chosen.expert_type is not None:
        qtype = GGMLQuantizationType[chosen.expert_type]
        types = {
            f"{block_prefix(i)}ffn_{part}_exps.weight": qtype
            for i in range(cfg.n_layer)
            for part in ("gate", "up", "down")
        }
    model_path = write_demo_model(
        out / chosen.model_file,
        result.params,
        cfg,
        tokenizer,
        types=types,
        description=f"healsweep demo MoE ({preset}), seed {seed}, {recipe.steps} steps on {backend}",
    )
    seconds["write"] = time.perf_counter() - started
    return DemoBuild(corpus_path, tokenizer_path, model_path, result.history, seconds, backend)
