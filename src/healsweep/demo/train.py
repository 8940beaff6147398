"""Training of the demo qwen2moe model in plain JAX: a differentiable forward, loss and AdamW.

The forward here is the same math as the runtime forward in :mod:`healsweep.model` (RMSNorm,
NeoX RoPE, GQA causal attention with q/k/v biases, a softmax router whose top-k weights are NOT
renormalized, SwiGLU routed experts and a shared expert scaled by its sigmoid gate), written over
a parameter pytree instead of a GGUF file so it can be differentiated. Parameters are keyed by
their GGUF tensor names and use the GGUF numpy shapes (``[out, in]``), so exporting is a rename.

Everything is dense so that training is deterministic on every backend: every routed expert is
evaluated for every token and masked by its routing weight (no scatter in the backward pass), the
embedding lookup and the target log-probabilities use one-hot products, and the top-k selection
is taken under ``stop_gradient`` so its gradient flows through the softmax probabilities only.
This module imports only jax, optax and numpy: it runs on a bare accelerator machine with optax
beside jax. AdamW and the gradient clipping are optax's (``optimizer``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from healsweep._atomic import atomic_file
from healsweep.gguf_io import block_prefix, split_block

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Architecture of the demo qwen2moe model (defaults: the shipped model)."""

    n_vocab: int
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 16
    n_expert_used: int = 2
    n_ff_exp: int = 128
    n_ff_shexp: int = 256
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-6
    context_length: int = 1024

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ValueError(f"MoEConfig: n_head {self.n_head} not a multiple of n_head_kv")
        if self.head_dim % 2:
            raise ValueError(f"MoEConfig: head_dim {self.head_dim} must be even for NeoX RoPE")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"MoEConfig: n_expert_used must be in 1..{self.n_expert}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimization recipe (defaults: the recipe of the shipped model)."""

    steps: int = 1300
    batch_size: int = 8
    seq_len: int = 1024
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.3
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.02
    seed: int = 0


# --- the forward --------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, as llama.cpp computes it."""
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight


def rope_neox(x: jax.Array, base: float) -> jax.Array:
    """NeoX rotary embedding (rotate halves) of ``x [B, T, H, hd]`` at positions 0..T-1."""
    t, hd = x.shape[1], x.shape[3]
    half = hd // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / hd)  # [hd/2]
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(x: jax.Array, p: Params, cfg: MoEConfig) -> jax.Array:
    """GQA causal self-attention with q/k/v biases; ``x [B, T, D]`` is already normed."""
    b, t, _ = x.shape
    h, hkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    q = (x @ p["attn_q.weight"].T + p["attn_q.bias"]).reshape(b, t, h, hd)
    k = (x @ p["attn_k.weight"].T + p["attn_k.bias"]).reshape(b, t, hkv, hd)
    v = (x @ p["attn_v.weight"].T + p["attn_v.bias"]).reshape(b, t, hkv, hd)
    q, k = rope_neox(q, cfg.rope_freq_base), rope_neox(k, cfg.rope_freq_base)
    q = q.reshape(b, t, hkv, h // hkv, hd)  # query head j*(h/hkv)+r uses kv head j
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k) / math.sqrt(hd)  # [B, Hkv, R, T, T]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v).reshape(b, t, h * hd)  # [B, T, H*hd]
    return out @ p["attn_output.weight"].T


class MoEOutput(NamedTuple):
    """Output of one MoE block and its routing statistics (for the load-balancing loss)."""

    output: jax.Array  # [B, T, D]
    router_probs: jax.Array  # [B, T, E]
    routed_mask: jax.Array  # [B, T, E] 1.0 where the expert is in the token's top-k


def moe_block(x: jax.Array, p: Params, cfg: MoEConfig) -> MoEOutput:
    """qwen2moe MoE: softmax router, top-k weights not renormalized, plus the gated shared expert.

    Every expert is evaluated densely and masked, so ``x [B, T, D]`` costs ``E/k`` times the sparse
    compute; at demo sizes this is cheap and keeps the backward pass free of scatters.
    """
    e, f, k = cfg.n_expert, cfg.n_ff_exp, cfg.n_expert_used
    router_logits = x @ p["ffn_gate_inp.weight"].T  # [B, T, E]
    probs = jax.nn.softmax(router_logits, axis=-1)
    _, topk_ids = jax.lax.top_k(jax.lax.stop_gradient(probs), k)  # [B, T, k]
    mask = jnp.sum(jax.nn.one_hot(topk_ids, e, dtype=x.dtype), axis=-2)  # [B, T, E]
    weights = probs * mask
    gate = jnp.einsum("btd,efd->btef", x, p["ffn_gate_exps.weight"])  # [B, T, E, F]
    up = jnp.einsum("btd,efd->btef", x, p["ffn_up_exps.weight"])
    hidden = jax.nn.silu(gate) * up * weights[..., None]
    routed = jnp.einsum("btef,edf->btd", hidden, p["ffn_down_exps.weight"])  # [B, T, D]
    assert hidden.shape[-2:] == (e, f)
    sh = jax.nn.silu(x @ p["ffn_gate_shexp.weight"].T) * (x @ p["ffn_up_shexp.weight"].T)
    shared = sh @ p["ffn_down_shexp.weight"].T  # [B, T, D]
    shared_gate = jax.nn.sigmoid(x @ p["ffn_gate_inp_shexp.weight"])[..., None]  # [B, T, 1]
    return MoEOutput(routed + shared_gate * shared, probs, mask)


def forward(params: Params, tokens: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, list[MoEOutput]]:
    """Logits ``[B, T, V]`` for ``tokens [B, T]`` and each layer's MoE routing statistics."""
    embd = params["token_embd.weight"]  # [V, D]
    x = jax.nn.one_hot(tokens, cfg.n_vocab, dtype=embd.dtype) @ embd  # [B, T, D]
    moe_outputs = []
    for layer in params["blk"]:
        x = x + attention(rms_norm(x, layer["attn_norm.weight"], cfg.rms_norm_eps), layer, cfg)
        moe = moe_block(rms_norm(x, layer["ffn_norm.weight"], cfg.rms_norm_eps), layer, cfg)
        x = x + moe.output
        moe_outputs.append(moe)
    x = rms_norm(x, params["output_norm.weight"], cfg.rms_norm_eps)
    return x @ params["output.weight"].T, moe_outputs


def load_balance_loss(moe: MoEOutput, n_expert_used: int) -> jax.Array:
    """Switch-style auxiliary loss ``E * sum_e f_e * P_e`` (1.0 when routing is uniform)."""
    n_expert = moe.router_probs.shape[-1]
    fraction = jnp.mean(moe.routed_mask, axis=(0, 1)) / n_expert_used  # [E] share of assignments
    mean_prob = jnp.mean(moe.router_probs, axis=(0, 1))  # [E]
    return n_expert * jnp.sum(fraction * mean_prob)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Negative log-likelihood of ``targets [B, T]`` under ``logits [B, T, V]``, per token."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1)


def loss_fn(
    params: Params, batch: jax.Array, cfg: MoEConfig, aux_coef: float
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Mean next-token NLL of ``batch [B, T+1]`` plus ``aux_coef`` times the mean balance loss."""
    logits, moe_outputs = forward(params, batch[:, :-1], cfg)
    nll = jnp.mean(token_nll(logits, batch[:, 1:]))
    aux = jnp.mean(jnp.stack([load_balance_loss(m, cfg.n_expert_used) for m in moe_outputs]))
    return nll + aux_coef * aux, (nll, aux)


# --- parameters -----------------------------------------------------------------------------


def init_params(cfg: MoEConfig, seed: int) -> Params:
    """Random float32 parameters (GPT-2 style: N(0, 0.02), residual outputs scaled down)."""
    d, hd, e, f, fs = cfg.n_embd, cfg.head_dim, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layer)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 16 * cfg.n_layer))

    def normal(shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(next(keys), shape, dtype=jnp.float32)

    def layer() -> Params:
        return {
            "attn_norm.weight": jnp.ones((d,), jnp.float32),
            "attn_q.weight": normal((cfg.n_head * hd, d), std),
            "attn_q.bias": jnp.zeros((cfg.n_head * hd,), jnp.float32),
            "attn_k.weight": normal((cfg.n_head_kv * hd, d), std),
            "attn_k.bias": jnp.zeros((cfg.n_head_kv * hd,), jnp.float32),
            "attn_v.weight": normal((cfg.n_head_kv * hd, d), std),
            "attn_v.bias": jnp.zeros((cfg.n_head_kv * hd,), jnp.float32),
            "attn_output.weight": normal((d, cfg.n_head * hd), out_std),
            "ffn_norm.weight": jnp.ones((d,), jnp.float32),
            "ffn_gate_inp.weight": normal((e, d), std),
            "ffn_gate_exps.weight": normal((e, f, d), std),
            "ffn_up_exps.weight": normal((e, f, d), std),
            "ffn_down_exps.weight": normal((e, d, f), out_std),
            "ffn_gate_inp_shexp.weight": normal((d,), std),
            "ffn_gate_shexp.weight": normal((fs, d), std),
            "ffn_up_shexp.weight": normal((fs, d), std),
            "ffn_down_shexp.weight": normal((d, fs), out_std),
        }

    return {
        "token_embd.weight": normal((cfg.n_vocab, d), std),
        "blk": [layer() for _ in range(cfg.n_layer)],
        "output_norm.weight": jnp.ones((d,), jnp.float32),
        "output.weight": normal((cfg.n_vocab, d), std),
    }


def to_gguf_tensors(params: Params) -> dict[str, np.ndarray]:
    """Flatten the pytree into GGUF tensor names (``blk.{i}.<suffix>``) as float32 numpy."""
    tensors = {
        name: np.asarray(value, np.float32) for name, value in params.items() if name != "blk"
    }
    for i, layer in enumerate(params["blk"]):
        tensors.update({block_prefix(i) + n: np.asarray(v, np.float32) for n, v in layer.items()})
    return tensors


def from_gguf_tensors(tensors: dict[str, np.ndarray], n_layer: int) -> Params:
    """Inverse of :func:`to_gguf_tensors` (float32 jax arrays)."""
    named = [(split_block(name), value) for name, value in tensors.items()]
    params: Params = {n: jnp.asarray(v, jnp.float32) for (i, n), v in named if i is None}
    params["blk"] = [{} for _ in range(n_layer)]
    for (layer, inside), value in named:
        if layer is not None:
            params["blk"][layer][inside] = jnp.asarray(value, jnp.float32)
    return params


def is_decayed(name: str) -> bool:
    """AdamW decays matrices only (not norms, biases or the shared-expert gate vector)."""
    return not (
        name.endswith("norm.weight")
        or name.endswith(".bias")
        or name == "ffn_gate_inp_shexp.weight"
    )


def decay_mask(params: Params) -> Params:
    """A pytree of booleans, parallel to ``params``: which leaves get weight decay."""
    mask: Params = {n: is_decayed(n) for n in params if n != "blk"}
    mask["blk"] = [{n: is_decayed(n) for n in layer} for layer in params["blk"]]
    return mask


# --- AdamW ----------------------------------------------------------------------------------


def learning_rate(step: jax.Array, tcfg: TrainConfig) -> jax.Array:
    """Linear warmup, then cosine decay to ``min_lr_ratio * learning_rate`` at ``steps``."""
    step = jnp.asarray(step).astype(jnp.float32)
    warm = step / max(tcfg.warmup_steps, 1)
    progress = jnp.clip((step - tcfg.warmup_steps) / max(tcfg.steps - tcfg.warmup_steps, 1), 0, 1)
    cosine = tcfg.min_lr_ratio + (1 - tcfg.min_lr_ratio) * 0.5 * (1 + jnp.cos(math.pi * progress))
    return tcfg.learning_rate * jnp.where(step < tcfg.warmup_steps, warm, cosine)


def optimizer(tcfg: TrainConfig, mask: Params) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay on the leaves ``mask`` marks) after global-norm gradient
    clipping, at :func:`learning_rate`'s schedule (optax calls it with the update count)."""
    return optax.chain(
        optax.clip_by_global_norm(tcfg.grad_clip),
        optax.adamw(
            learning_rate=functools.partial(learning_rate, tcfg=tcfg),
            b1=tcfg.beta1,
            b2=tcfg.beta2,
            eps=tcfg.adam_eps,
            weight_decay=tcfg.weight_decay,
            mask=mask,
        ),
    )


# --- the loop -------------------------------------------------------------------------------


class TrainLog(NamedTuple):
    """One logged training step: total loss, next-token NLL (nats) and the balance loss."""

    step: int
    loss: float
    nll: float
    aux: float


class TrainResult(NamedTuple):
    """Trained float32 parameters and the logged history."""

    params: Params
    history: list[TrainLog]


def batch_starts(n_tokens: int, tcfg: TrainConfig) -> np.ndarray:
    """Random window starts ``[steps, batch_size]`` in a stream, fixed by the seed."""
    if n_tokens < tcfg.seq_len + 2:
        raise ValueError(f"batch_starts: stream of {n_tokens} tokens is shorter than seq_len + 2")
    rng = np.random.default_rng(tcfg.seed)
    return rng.integers(0, n_tokens - tcfg.seq_len - 1, size=(tcfg.steps, tcfg.batch_size))


@functools.lru_cache(maxsize=8)
def make_train_step(cfg: MoEConfig, tcfg: TrainConfig) -> Callable[..., Any]:
    """The jitted ``(params, opt_state, batch) -> (params, opt_state, loss, nll, aux)``.

    Cached per configuration, so a second run of the same recipe reuses the compiled step. The
    weight-decay mask holds Python booleans and is closed over, not traced.
    """
    opt = optimizer(tcfg, decay_mask(jax.eval_shape(functools.partial(init_params, cfg, 0))))

    def step(params: Params, opt_state: optax.OptState, batch: jax.Array) -> Any:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (nll, aux)), grads = grad_fn(params, batch, cfg, tcfg.aux_loss_coef)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, nll, aux

    return jax.jit(step, donate_argnums=(0, 1))


def train(
    stream: np.ndarray,
    cfg: MoEConfig,
    tcfg: TrainConfig,
    *,
    log_every: int = 50,
    progress: Callable[[TrainLog, Params], None] | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 10,
) -> TrainResult:
    """Train on random windows of the packed token ``stream [N]`` (deterministic in the seed).

    Every ``log_every`` steps (and at the last) the step's losses are recorded and
    ``progress(log, params)`` is called, e.g. to print or to evaluate held-out text.

    With ``checkpoint`` (a file path), the parameters, the optimizer state and the history are
    written there atomically every ``checkpoint_every`` steps, and a run that finds a checkpoint
    of the same stream, architecture and recipe continues from it: the data offsets are fixed by
    the seed up front, so a resumed run ends with the same parameters, bit for bit, as one that
    was never stopped. A checkpoint of anything else is ignored and overwritten.
    """
    stream = np.asarray(stream, np.int32)
    starts = batch_starts(len(stream), tcfg)
    offsets = np.arange(tcfg.seq_len + 1)
    params = init_params(cfg, tcfg.seed)
    opt_state = optimizer(tcfg, decay_mask(params)).init(params)
    step_fn = make_train_step(cfg, tcfg)
    history: list[TrainLog] = []
    first = 0
    identity = _run_identity(stream, cfg, tcfg)
    if checkpoint is not None:
        resumed = _read_checkpoint(Path(checkpoint), identity, (params, opt_state))
        if resumed is not None:
            first, (params, opt_state), history = resumed
    for i in range(first, tcfg.steps):
        batch = jnp.asarray(stream[starts[i][:, None] + offsets[None, :]])  # [B, S+1]
        params, opt_state, loss, nll, aux = step_fn(params, opt_state, batch)
        if (i + 1) % log_every == 0 or i + 1 == tcfg.steps:
            record = TrainLog(i + 1, float(loss), float(nll), float(aux))
            history.append(record)
            if progress is not None:
                progress(record, params)
        if checkpoint is not None and (i + 1) % checkpoint_every == 0 and i + 1 < tcfg.steps:
            _write_checkpoint(Path(checkpoint), identity, i + 1, (params, opt_state), history)
    return TrainResult(params, history)


def _run_identity(stream: np.ndarray, cfg: MoEConfig, tcfg: TrainConfig) -> str:
    """What a checkpoint must match to be resumed: the token stream, architecture and recipe."""
    digest = hashlib.sha256(np.ascontiguousarray(stream).tobytes())
    digest.update(repr((dataclasses.asdict(cfg), dataclasses.asdict(tcfg))).encode())
    return digest.hexdigest()


def _write_checkpoint(path: Path, identity: str, step: int, state: Any, history: list) -> None:

    leaves = jax.tree_util.tree_leaves(state)
    arrays = {f"leaf_{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    meta = json.dumps({"identity": identity, "step": step, "history": [list(h) for h in history]})
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as handle:
        np.savez(handle, meta=np.frombuffer(meta.encode(), np.uint8), **arrays)


def _read_checkpoint(path: Path, identity: str, template: Any) -> tuple | None:
    """``(step, state, history)`` of the checkpoint at ``path`` if it is this run's, else None."""
    if not path.exists():
        return None
    try:
        with np.load(path) as saved:
            meta = json.loads(saved["meta"].tobytes())
            if meta.get("identity") != identity:
                return None
            leaves, tree = jax.tree_util.tree_flatten(template)
            loaded = [saved[f"leaf_{i}"] for i in range(len(leaves))]
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None  # unreadable or partial: start over (it is overwritten at the next save)
    mismatched = (
        a.shape != np.shape(b) or a.dtype != np.asarray(b).dtype
        for a, b in zip(loaded, leaves, strict=True)
    )
    if any(mismatched):
        return None
    state = jax.tree_util.tree_unflatten(tree, [jnp.asarray(a) for a in loaded])
    return meta["step"], state, [TrainLog(*h) for h in meta["history"]]


# --- held-out evaluation ------------------------------------------------------------------------


class Evaluation(NamedTuple):
    """Mean next-token NLL over held-out sequences and the routed share of every expert."""

    nll: float
    tokens: int
    expert_share: np.ndarray  # [L, E] share of routed (token, slot) assignments; rows sum to 1


def evaluate(
    params: Params, sequences: list[np.ndarray], cfg: MoEConfig, batch_size: int = 8
) -> Evaluation:
    """Score each sequence from its first token (as an eval window would be), padded in batches."""
    length = -(-max(len(s) for s in sequences) // 128) * 128

    @jax.jit
    def score(params: Params, tokens: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, moe = forward(params, tokens, cfg)  # [B, T, V]
        nll = jnp.sum(token_nll(logits[:, :-1], tokens[:, 1:]) * valid[:, 1:])
        load = jnp.stack([jnp.sum(m.routed_mask * valid[..., None], axis=(0, 1)) for m in moe])
        return nll, load  # load [L, E]

    nll_sum, load = 0.0, np.zeros((cfg.n_layer, cfg.n_expert))
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        tokens = np.zeros((batch_size, length), np.int32)
        valid = np.zeros((batch_size, length), np.float32)
        for row, seq in enumerate(chunk):
            tokens[row, : len(seq)], valid[row, : len(seq)] = seq, 1.0
        nll, counts = score(params, jnp.asarray(tokens), jnp.asarray(valid))
        nll_sum, load = nll_sum + float(nll), load + np.asarray(counts, np.float64)
    n_scored = sum(len(s) - 1 for s in sequences)
    return Evaluation(nll_sum / n_scored, n_scored, load / load.sum(axis=1, keepdims=True))
