"""Expert selection of the MoE architectures: scores, the top-k, and the chosen experts' weights.

llama.cpp's choice for every architecture healsweep reads: softmax or sigmoid gating, a selection
bias, group-limited routing, renormalization and a weight scale. Pure jax.numpy, float32; the
simulated expert cache (:mod:`healsweep.model.expert_cache`) routes with the same pieces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_topk(
    router_logits: jax.Array, k: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token: ``(ids [T, k] int32, weights [T, k])``.

    Softmax over all experts, then the k largest probabilities; qwen2moe keeps them as they are
    (``normalize=False``), qwen3moe rescales them to sum to one (``normalize=True``).
    """
    return select_experts(router_logits, k, normalize=normalize)


def select_experts(
    router_logits: jax.Array,
    k: int,
    *,
    normalize: bool,
    gating: str = "softmax",
    scale: float = 1.0,
    selection_bias: jax.Array | None = None,
    n_groups: int = 0,
    n_groups_used: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """llama.cpp's expert selection: ``(ids [T, k] int32, weights [T, k])``.

    Probabilities are a softmax or a sigmoid of the logits. ``selection_bias [E]`` is added for
    choosing experts only; the weights stay the unbiased probabilities. With ``n_groups > 1``
    the experts form equal consecutive groups, each scored by the sum of its two largest biased
    probabilities, and only the ``n_groups_used`` best groups may be chosen. The k chosen
    weights are then rescaled to sum to one (``normalize``) and multiplied by ``scale``.
    """
    probs, selection = routing_scores(
        router_logits, gating=gating, selection_bias=selection_bias, n_groups=n_groups,
        n_groups_used=n_groups_used,
    )  # fmt: skip
    _, ids = jax.lax.top_k(selection, k)
    return ids.astype(jnp.int32), mix_weights(probs, ids, normalize=normalize, scale=scale)


def routing_scores(
    router_logits: jax.Array,
    *,
    gating: str = "softmax",
    selection_bias: jax.Array | None = None,
    n_groups: int = 0,
    n_groups_used: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """``(probs [T, E], selection [T, E])`` of :func:`select_experts`: the probabilities the
    weights come from, and the scores experts are chosen by (biased; -inf outside the chosen
    groups)."""
    logits = router_logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if gating == "softmax" else jax.nn.sigmoid(logits)
    selection = probs if selection_bias is None else probs + selection_bias  # [T, E]
    if n_groups > 1:
        t, e = selection.shape
        grouped = selection.reshape(t, n_groups, e // n_groups)  # [T, G, E/G]
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, best = jax.lax.top_k(group_score, n_groups_used)  # [T, g]
        keep = jnp.zeros((t, n_groups), bool).at[jnp.arange(t)[:, None], best].set(True)
        selection = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
    return probs, selection


def mix_weights(probs: jax.Array, ids: jax.Array, *, normalize: bool, scale: float) -> jax.Array:
    """The chosen experts' mixing weights [T, k]: their unbiased probabilities, rescaled to sum
    to one (``normalize``), times ``scale`` (llama.cpp treats 0 as "not set")."""
    weights = jnp.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if normalize:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        weights = weights * jnp.float32(scale)
    return weights
