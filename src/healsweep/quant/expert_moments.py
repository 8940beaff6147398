"""The calibration trace's per-expert moment kernels: E[x²] (gate/up input) and E[h²] (down input).

Sums and counts, not means, so chunks of a trace can be added up; the ``act`` importance
(:mod:`healsweep.quant.importance`) turns them into weights. Kept apart from that module because
these need jax and the quantizers the knobs read must import without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels._precision import healing_jit

ROW_CHUNK = 256  # routed-token rows per call, zero-padded, so every call has one shape


@healing_jit
def expert_input_moments(x: jax.Array, topk_ids: jax.Array, n_expert_grid: jax.Array):
    """(sum of x² [E, D], token counts [E]) over each expert's routed tokens.

    ``x`` [T, D], ``topk_ids`` [T, k]; ``n_expert_grid`` is ``jnp.arange(E)`` (a traced array so
    that E need not be a static argument).
    """
    routed = jnp.any(topk_ids[:, :, None] == n_expert_grid[None, None, :], axis=1)  # [T, E]
    routed = routed.astype(jnp.float32)
    sums = jnp.einsum("te,td->ed", routed, jnp.square(x.astype(jnp.float32)))  # [E, D]
    return sums, jnp.sum(routed, axis=0)


@healing_jit
def _hidden_square_sum(x_rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, e) -> jax.Array:
    """sum over rows of h² [F] of expert ``e`` of the stacks; zero padding rows give
    h = silu(0)*0 = 0 and add nothing."""
    h = jax.nn.silu(x_rows @ w_gate[e].T) * (x_rows @ w_up[e].T)  # [P, F]
    return jnp.sum(jnp.square(h), axis=0)


def expert_hidden_moments(
    x: np.ndarray, topk_ids: np.ndarray, gate_exps, up_exps
) -> tuple[np.ndarray, np.ndarray]:
    """(sum of h² [E, F], token counts [E]) of each teacher expert over its routed tokens.

    ``x`` [T, D], ``topk_ids`` [T, k], ``gate_exps``/``up_exps`` [E, F, D] (numpy or device
    arrays; device stacks stay where they are, only the routed rows of x travel).
    """
    n_expert, n_ff, _ = gate_exps.shape
    sums = np.zeros((n_expert, n_ff), np.float32)
    counts = np.zeros(n_expert, np.float32)
    for e in range(n_expert):
        rows = np.nonzero(np.any(topk_ids == e, axis=1))[0]
        counts[e] = len(rows)
        for a in range(0, len(rows), ROW_CHUNK):  # one shape for every call: one compile
            x_rows = np.zeros((ROW_CHUNK, x.shape[1]), np.float32)
            part = rows[a : a + ROW_CHUNK]
            x_rows[: len(part)] = x[part]
            sums[e] += np.asarray(_hidden_square_sum(x_rows, gate_exps, up_exps, np.int32(e)))
    return sums, counts
