"""Part A: one scalar per layer that rescales the quantized routed experts' output.

``alpha = cos^(1-gamma) / ratio`` with ``cos = <y_ref, y_q> / (|y_ref| |y_q|)`` and
``ratio = |y_q| / |y_ref|``, pooled over every token and hidden channel the comparison covers.
gamma = 0 gives the MSE-optimal scalar ``<y_ref, y_q> / |y_q|^2``; gamma = 1 gives norm matching
``|y_ref| / |y_q|``. The factor multiplies every down-projection scale ``d`` of the layer, which
multiplies the layer's routed output by exactly ``alpha`` (the down projection is linear in d).

Two ways to get the pair (y_ref, y_q):

* ``mse`` mode: the teacher's routed output and the quantized experts' routed output on the same
  calibration inputs and routing (the pipeline computes both; this module reduces them).
* ``gaussian`` mode, the audit's shipped procedure kept as a legacy baseline: 16 iid Gaussian
  tokens ``x = z * s`` (``s`` the importance proxy per input channel), pushed through a fixed
  subset of 4 experts (``gaussian_probe_experts``), dense vs quantized, pooled over the subset.

All functions are pure jax.numpy in float32. Sums are taken per token first, then over tokens, so
that float32 accumulation error stays small for long traces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels._precision import healing_jit

GAUSSIAN_TOKENS = 16
GAUSSIAN_SEED = 0


@jax.jit
def alpha_from_stats(dot: jax.Array, ref_sq: jax.Array, q_sq: jax.Array, gamma: float) -> jax.Array:
    """alpha from the pooled sufficient statistics <y_ref,y_q>, |y_ref|^2 and |y_q|^2.

    A negative cosine keeps its sign (``sign(cos) |cos|^(1-gamma)``), so gamma = 0 is the MSE
    optimum even then. When either output is all zeros there is nothing to fit and alpha is 1.
    """
    dot, ref_sq, q_sq = (jnp.asarray(v, jnp.float32) for v in (dot, ref_sq, q_sq))
    tiny = jnp.finfo(jnp.float32).tiny
    degenerate = (ref_sq <= tiny) | (q_sq <= tiny)
    ref_norm = jnp.sqrt(jnp.where(degenerate, 1.0, ref_sq))
    q_norm = jnp.sqrt(jnp.where(degenerate, 1.0, q_sq))
    cos = jnp.clip(dot / (ref_norm * q_norm), -1.0, 1.0)
    ratio = q_norm / ref_norm
    shaped = jnp.sign(cos) * jnp.abs(cos) ** (1.0 - jnp.float32(gamma))
    return jnp.where(degenerate, jnp.float32(1.0), shaped / ratio)


@healing_jit
def output_stats(y_ref: jax.Array, y_q: jax.Array) -> jax.Array:
    """[3] float32: <y_ref, y_q>, |y_ref|^2, |y_q|^2 over all tokens (y_* are [T, D])."""
    y_ref = jnp.asarray(y_ref, jnp.float32)  # [T, D]
    y_q = jnp.asarray(y_q, jnp.float32)  # [T, D]
    per_token = jnp.stack(
        [
            jnp.einsum("td,td->t", y_ref, y_q),
            jnp.einsum("td,td->t", y_ref, y_ref),
            jnp.einsum("td,td->t", y_q, y_q),
        ]
    )  # [3, T]
    return jnp.sum(per_token, axis=1)


@healing_jit
def alpha_mse(y_ref: jax.Array, y_q: jax.Array, gamma: float) -> jax.Array:
    """alpha = cos^(1-gamma)/ratio over a layer's routed outputs y_ref, y_q [T, D] (a scalar)."""
    dot, ref_sq, q_sq = output_stats(y_ref, y_q)
    return alpha_from_stats(dot, ref_sq, q_sq, gamma)


# The name the contracts use for the same reduction.
alpha_from_outputs = alpha_mse


@healing_jit
def residual_fraction(y_ref: jax.Array, y_q: jax.Array, alpha: float) -> jax.Array:
    """Relative routed residual |y_ref - alpha*y_q|^2 / |y_ref|^2 (a scalar; 0 for y_ref = 0)."""
    y_ref = jnp.asarray(y_ref, jnp.float32)  # [T, D]
    residual = y_ref - jnp.float32(alpha) * jnp.asarray(y_q, jnp.float32)  # [T, D]
    res_sq = jnp.sum(jnp.einsum("td,td->t", residual, residual))
    ref_sq = jnp.sum(jnp.einsum("td,td->t", y_ref, y_ref))
    return jnp.where(ref_sq > 0, res_sq / jnp.where(ref_sq > 0, ref_sq, 1.0), 0.0)


@healing_jit
def expert_outputs(
    x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """Every listed expert applied to every token: [n, T, D] = down(silu(x·gate) * (x·up)).

    ``x`` [T, D]; ``gate``/``up`` [n, F, D] and ``down`` [n, D, F] in GGUF's [out, in] layout.
    """
    x = jnp.asarray(x, jnp.float32)  # [T, D]
    g = jnp.einsum("td,nfd->ntf", x, gate)  # [n, T, F]
    u = jnp.einsum("td,nfd->ntf", x, up)  # [n, T, F]
    h = jax.nn.silu(g) * u  # [n, T, F]
    return jnp.einsum("ntf,ndf->ntd", h, down)  # [n, T, D]


@healing_jit
def alpha_gaussian(
    x: jax.Array,
    dense: tuple[jax.Array, jax.Array, jax.Array],
    quantized: tuple[jax.Array, jax.Array, jax.Array],
    gamma: float,
) -> jax.Array:
    """The shipped Part A: alpha from dense vs quantized experts on Gaussian probe tokens.

    ``x`` [T, D] are the probe tokens (``gaussian_probe_inputs``); ``dense`` and ``quantized``
    are (gate [n, F, D], up [n, F, D], down [n, D, F]) of the probed experts (dense float32, the
    quantized ones dequantized). cos and ratio are pooled over all probed experts and tokens.
    """
    y_ref = expert_outputs(x, *dense)  # [n, T, D]
    y_q = expert_outputs(x, *quantized)  # [n, T, D]
    d = y_ref.shape[-1]
    return alpha_mse(y_ref.reshape(-1, d), y_q.reshape(-1, d), gamma)


def gaussian_probe_experts(n_expert: int) -> tuple[int, ...]:
    """The fixed expert subset {0, E/8, E/4, E/2} ({0, 32, 64, 128} of 256 in the audit)."""
    picks = (0, n_expert // 8, n_expert // 4, n_expert // 2)
    return tuple(dict.fromkeys(min(p, n_expert - 1) for p in picks))  # distinct, in order


def gaussian_probe_inputs(
    scale: np.ndarray, n_tokens: int = GAUSSIAN_TOKENS, seed: int = GAUSSIAN_SEED
) -> np.ndarray:
    """[n_tokens, D] float32 probe tokens x = z * s with z iid N(0, 1) from a seeded generator."""
    scale = np.asarray(scale, np.float32)  # [D]
    z = np.random.default_rng(seed).standard_normal((n_tokens, scale.shape[0]), dtype=np.float32)
    return z * scale[None, :]
