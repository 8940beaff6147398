"""Error feedback (GPTQ) for ggml's types: each routed expert quantized by ggml, chunk by chunk,
with each chunk's error fed forward through the expert's input second moment.

Plain ggml quantization with an importance row (what ``llama-quantize --imatrix`` does, and
:class:`healsweep.quant.ggml.GGMLImatrix`) sees only ``diag(H_e)``. Here each expert ``e`` gets its
full ``H_e = Σ x xᵀ`` over its routed calibration tokens
(:func:`healsweep.quant.gptq.second_moments`; gate/up: the FFN input x, down: the teacher
expert's ``h``), damped (:func:`healsweep.quant.gptq.damped`) and factored as
``(H_e + λ·mean(diag H_e)·I)⁻¹ = uᵀu`` on the host (:func:`inverse_factor`).
Then, per matrix ``W`` [out, in], the input dimension is walked in chunks ``S`` of ``chunk``
columns (a multiple of the type's block; 256 = one super-block):

``method="block"`` (every type): ggml quantizes the chunk's columns of the error-updated ``W``
for all rows (``ggml_quantize_chunk`` with an importance row for the chunk, see below), its
to_float decodes them to ``Q_S``, and the chunk's error is fed to the columns not yet quantized
by GPTQ's block update ``W_R −= (W_S − Q_S)·u_SS⁻¹·u_SR`` (the least-squares optimal re-fit of
``W_R`` given the fixed ``Q_S``; with a column-wise in-chunk step it is GPTQ's lazy batch update
exactly). Superblocks are quantized independently by ggml, so the bytes are laid out exactly as
ggml's quantizer lays out a whole row.

``method="column"`` (the types of :data:`COLUMN_GRIDS`): as ``block``, but inside the
chunk the scales (and the mins of Q2_K, Q4_K and Q5_K, IQ1_S's shifts) ggml chose for the error-updated weights are
kept, read from its bytes, and the chunk is re-rounded onto that fixed grid group by group, GPTQ proper: a group of ``k`` columns
(``k = 1`` on the K grids, :mod:`healsweep.quant.ggml_kgrid`; ``k = 8``, one grid row with its
signs, on the IQ2 grids, :mod:`healsweep.quant.ggml_iqgrid`; one grid row with its shift
``δ`` on the IQ1 grids, :mod:`healsweep.quant.ggml_iq1grid`; two grid rows of 4 with their
signs on IQ3_XXS, one on IQ3_S, :mod:`healsweep.quant.ggml_iq3grid`; ``k = 1`` on IQ4_XS,
:mod:`healsweep.quant.ggml_iq4grid`) is chosen under the diagonal of its
conditional metric ``(u_ggᵀu_gg)⁻¹``, and its error ``E_g`` updates the chunk's later columns by
``E_g·u_gg⁻¹·u_g,later``. The new codes are packed back into ggml's bytes.

``chunk_importance`` is the importance row ggml gets for a chunk: ``conditional`` (default)
``diag((u_SSᵀu_SS)⁻¹)``, the diagonal of the metric GPTQ's objective puts on the chunk's error
once later columns re-fit (the Schur complement of the not-yet-quantized columns); ``hessian``
the damped ``diag(H_e)`` slice; ``imatrix`` the caller's importance row (the calibration
``E[x²]``/``E[h²]`` that plain ggml gets). With ``H = c·I`` nothing propagates and ``block``
is chunk-by-chunk ggml quantization with that row (``column`` too on Q2_K-Q5_K, whose final codes
ggml picks as the nearest on its own grid; on IQ2 ``column`` then picks each group's exact
optimum on ggml's scales, never worse per row than ggml's neighbour search).

With rows of 256 (one chunk per row) ``block`` cannot feed anything forward: it is plain ggml
with the chunk's importance row; only ``column`` and ``rounds`` then act.

``rounds`` (``block`` only; default 0): in-chunk refinement for the grids healsweep does not
re-round itself. ggml sees a diagonal importance, so inside a chunk its answer ignores the
off-diagonal part of the chunk's metric ``M_S = (u_SSᵀu_SS)⁻¹``. Each round has ggml quantize
the chunk again, toward ``W_S − β·(E − E·u_SS⁻¹·diag(u_SS))`` (``E = W_S − Q_S`` the current
error, β = :data:`REFINE_STEP`; at β = 1 this is what column-wise GPTQ would round at each column
had it made the current decisions, and the iteration oscillates), and every row keeps the bytes
of lowest ``‖E·u_SS⁻¹‖²`` (its share of the objective once later columns re-fit): no row ends
above ggml's first answer on the calibration ``H``. It is a search, not GPTQ: measure it held out.

Interface for the heal stages (mirrors :func:`healsweep.quant.gptq.quantize_experts`):
:func:`quantize_experts_ef` (stacks that share an input, gate and up: one ``H_e`` and one factor
serve both) and :func:`quantize_stack_ef` (one stack) return ggml's stored bytes
``uint8 [E, out, row_bytes]`` for every expert of the stack; experts not in ``experts`` (fewer
than ``min_tokens_per_expert`` routed tokens) and those whose damped ``H`` does not factor are
quantized by plain ggml with their importance row, as ``baseline llama --imatrix-from-calibration``
does. Host code: ggml's quantizer runs on the CPU; the per-expert work runs in a thread pool
(ggml's quantizer and numpy's products release the GIL); ``second_moments`` runs on the JAX
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from healsweep.errors import KnobError
from healsweep.gguf_io._ggml_lib import dequantize_rows, quantize_rows
from healsweep.kernels._precision import healing_jit
from healsweep.kernels.ggml_types import GGMLType, ggml_type
from healsweep.quant import ggml_iq1grid, ggml_iq3grid, ggml_iq4grid, ggml_iqgrid, ggml_kgrid
from healsweep.quant.gptq import _HIGHEST, _routed_rows, damped, hidden_rows, second_moments
from healsweep.quant.imatrix import quantize_expert_stack
from healsweep.threads import host_threads, one_thread

METHODS = ("block", "column")
CHUNK_IMPORTANCE = ("conditional", "hessian", "imatrix")
GROUP = 8  # experts whose [n, n] second moments and factors are held at once
COLUMN_GRIDS = {
    **dict.fromkeys(ggml_kgrid.K_TYPES, ggml_kgrid.KGrid),
    **dict.fromkeys(ggml_iqgrid.IQ_TYPES, ggml_iqgrid.IQ2Grid),
    **dict.fromkeys(ggml_iq1grid.IQ1_TYPES, ggml_iq1grid.IQ1Grid),
    **dict.fromkeys(ggml_iq3grid.IQ3_TYPES, ggml_iq3grid.IQ3Grid),
    **dict.fromkeys(ggml_iq4grid.IQ4_TYPES, ggml_iq4grid.IQ4Grid),
}  # ggml id -> the grid that column-wise feedback re-rounds on
REFINE_STEP = 0.5  # fraction of the GPTQ-consistent correction each refinement round takes


class Factor(NamedTuple):
    """What error feedback needs of one damped ``H`` [n, n] at one chunk width."""

    diagonal: list[np.ndarray]  # per chunk, u's diagonal block [c, c] float32 (upper)
    inverse: list[np.ndarray]  # per chunk, u_SS⁻¹ [c, c] float32 (upper): the chunk's metric
    update: np.ndarray  # [n, n] float32: u_SS⁻¹·u_SR right of each chunk S, zero elsewhere
    conditional: np.ndarray  # [n] float32: diag((u_SSᵀ u_SS)⁻¹) per chunk
    hessian: np.ndarray  # [n] float32: the damped diag(H)


@healing_jit
def _student_grams(x_rows, teacher: tuple, student: tuple, experts) -> tuple:
    """``(h_sᵀh_s, h_tᵀh_s)`` [G, F, F] per expert of ``experts`` [G], with ``h = silu(x·Wgᵀ)·
    (x·Wuᵀ)`` of the ``teacher``'s and of the ``student``'s ``(Wg, Wu)`` [E, F, D] on each
    expert's routed rows ``x_rows`` [G, P, D] (zero rows give h = 0)."""
    h_t = hidden_rows(x_rows, *teacher, experts)
    h_s = hidden_rows(x_rows, *student, experts)
    grams = jnp.einsum("gpf,gpk->gfk", h_s, h_s, precision=_HIGHEST)
    return grams, jnp.einsum("gpf,gpk->gfk", h_t, h_s, precision=_HIGHEST)


def student_moments(
    x: np.ndarray, ids: np.ndarray, experts: np.ndarray, teacher: tuple, student: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """Down's input statistics when its input comes from the quantized gate and up:
    ``(H_s, C)`` [len(experts), F, F] float32, ``H_s = Σ h_s h_sᵀ`` and ``C = Σ h_t h_sᵀ`` over
    each expert's routed tokens (``h_t`` the teacher's hidden, ``h_s`` the student's)."""
    rows = _routed_rows(np.asarray(x), np.asarray(ids), np.asarray(experts))
    grams, cross = _student_grams(rows, teacher, student, jnp.asarray(experts, jnp.int32))
    return np.asarray(grams), np.asarray(cross)


def corrected_targets(
    weights: Sequence[np.ndarray],
    cross: np.ndarray,
    grams: np.ndarray,
    damp: float,
    u: np.ndarray,
    ok: np.ndarray,
) -> list[np.ndarray]:
    """Down's targets on the student's input, per expert ``g`` with ``ok[g]``: the ridge re-fit
    toward the teacher's ``W``, ``W' = argmin ‖h_t·Wᵀ − h_s·W'ᵀ‖² + λ‖W' − W‖² = (W·C + λ·W)·
    (H_s + λ·I)⁻¹`` (``λ = damp·mean(diag H_s)``, the damping GPTQ puts on ``H_s``; ``uᵀu`` its
    inverse, from :func:`inverse_factor`). GPTQ of ``W'`` over the damped ``H_s`` then minimizes
    ``Σ ‖W·h_t − Q·h_s‖²`` (down's output against the teacher's) plus that penalty. Where the
    student's ``h`` is the teacher's, ``W' = W``; an expert with few routed tokens stays near
    ``W`` instead of fitting them (a re-fit toward zero over 256 or more dimensions from a few
    dozen tokens does not hold out of sample). Host float64; others stay ``W``."""
    lam = damp * np.einsum("gii->gi", grams).astype(np.float64).mean(axis=1)
    out = []
    for w in weights:  # [G, out, F]
        fitted = np.array(w, np.float32)
        for g in np.nonzero(ok)[0]:
            ug, wg = u[g].astype(np.float64), w[g].astype(np.float64)
            fitted[g] = ((wg @ cross[g] + lam[g] * wg) @ ug.T) @ ug
        out.append(fitted)
    return out


def inverse_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper ``u`` with ``uᵀu = (H + damp·mean(diag H)·I)⁻¹`` per matrix of ``h`` [G, n, n].

    Host float64, two triangular LAPACK calls: with ``J`` the reversal and ``J·H·J = L̃L̃ᵀ``,
    ``H = RRᵀ`` for the upper ``R = J·L̃·J`` (the factor :func:`healsweep.quant.gptq.factor`
    scales to unit diagonal), so ``u = R⁻¹ = J·L̃⁻¹·J``. Returns ``(u [G, n, n] float32, ok [G]
    bool)``; a matrix that does not factor even after damping has ``ok`` False and ``u = I``.
    """
    # lazy: heavy (scipy)
    from scipy.linalg import lapack

    u = np.zeros(h.shape, np.float32)
    ok = np.zeros(h.shape[0], bool)
    for g, hg in enumerate(damped(h, damp)):
        if not np.all(np.isfinite(hg)):
            continue
        reversed_h = np.array(hg[::-1, ::-1], np.float64)  # symmetric: its C order reads as F
        upper, info = lapack.dpotrf(reversed_h.T, lower=0, clean=1, overwrite_a=1)  # L̃ᵀ
        if info == 0:
            upper_inv, info = lapack.dtrtri(upper, lower=0, overwrite_c=1)
        if info != 0 or not np.all(np.isfinite(upper_inv)):
            continue
        u[g] = upper_inv.T[::-1, ::-1]  # J·L̃⁻¹·J
        ok[g] = True
    u[~ok] = np.eye(h.shape[-1], dtype=np.float32)
    return u, ok


def feedback_factor(u: np.ndarray, hessian_diag: np.ndarray, chunk: int) -> Factor:
    """:class:`Factor` of the upper ``u`` [n, n] (``uᵀu = H⁻¹`` damped) and the damped
    ``diag(H)`` [n], for chunks of ``chunk`` columns (host, float64 inside)."""
    # lazy: heavy (scipy)
    from scipy.linalg import solve_triangular

    n = u.shape[0]
    u64 = np.asarray(u, np.float64)
    update = np.zeros((n, n), np.float32)
    conditional = np.zeros(n, np.float32)
    diagonal, inverses = [], []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        inverse = solve_triangular(u64[a:b, a:b], np.eye(b - a), lower=False)  # u_SS⁻¹, upper
        conditional[a:b] = np.einsum("ij,ij->i", inverse, inverse)  # diag(u_SS⁻¹ u_SS⁻ᵀ)
        if b < n:
            update[a:b, b:] = inverse @ u64[a:b, b:]
        diagonal.append(np.asarray(u[a:b, a:b], np.float32))
        inverses.append(inverse.astype(np.float32))
    hessian = np.asarray(hessian_diag, np.float32)
    return Factor(diagonal, inverses, update, conditional, hessian)


def check_options(
    qtype: int | str, method: str, chunk: int, chunk_importance: str, rounds: int = 0
) -> GGMLType:
    """The :class:`GGMLType` of ``qtype``; raises :class:`KnobError` for an option that does not
    apply to it."""
    found = ggml_type(qtype)
    if rounds < 0 or (rounds and method != "block"):
        raise KnobError(
            f"error feedback rounds {rounds}: a count >= 0, and only for method 'block' "
            "(column-wise feedback has no ggml re-quantization to refine)"
        )
    if method not in METHODS:
        raise KnobError(f"error feedback method {method!r} is unknown; choose one of {METHODS}")
    if method == "column" and found.ggml_id not in COLUMN_GRIDS:
        grids = ", ".join(sorted(ggml_type(i).name for i in COLUMN_GRIDS))
        raise KnobError(
            f"column-wise error feedback needs a grid healsweep re-rounds on ({grids}), not "
            f"{found.name}; use method 'block' for that type"
        )
    if chunk <= 0 or chunk % found.block_weights:
        raise KnobError(
            f"error feedback chunk {chunk} is not a positive multiple of the {found.name} block "
            f"of {found.block_weights} weights"
        )
    if chunk_importance not in CHUNK_IMPORTANCE:
        raise KnobError(
            f"chunk importance {chunk_importance!r} is unknown; choose one of {CHUNK_IMPORTANCE}"
        )
    return found


def _column_feedback(ws: np.ndarray, grid, u_ss: np.ndarray, inverse: np.ndarray):
    """GPTQ group by group (``grid.width`` columns: 1 on Q2_K/Q3_K/IQ4_XS, 4 on IQ3_S, 8 on
    IQ1/IQ2/IQ3_XXS) on the grid of ggml's bytes held by ``grid`` (a class of
    :data:`COLUMN_GRIDS`) for the chunk ``ws`` [out, c], each group's
    error fed to the chunk's later columns through ``u_ss`` [c, c] (``inverse`` = ``u_ss⁻¹``,
    whose diagonal blocks are those of ``u_ss`` inverted); returns the re-packed bytes and
    their values [out, c]."""
    work = ws.copy()
    values = np.empty_like(ws)
    k = grid.width
    for g in range(ws.shape[1] // k):
        cols, rest = slice(g * k, g * k + k), slice(g * k + k, None)
        inverse_g = inverse[cols, cols]  # u_gg⁻¹
        omega = np.einsum("ij,ij->i", inverse_g, inverse_g)  # the group's conditional diagonal
        values[:, cols] = grid.round(g, work[:, cols], omega)
        error = (work[:, cols] - values[:, cols]) @ inverse_g  # [out, k]
        work[:, rest] -= error @ u_ss[cols, rest]
    return grid.packed(), values


def _refine_chunk(ws, raw, values, inverse, diagonal, row, qtype: int, rounds: int):
    """``rounds`` re-quantizations by ggml of the chunk ``ws`` [out, c] toward the
    GPTQ-consistent target, each row keeping its bytes of lowest chunk objective
    ``‖(ws − Q)·u_SS⁻¹‖²``; returns ``(raw, values)`` of the best rows."""

    scale = np.diag(diagonal)[None, :]  # diag(u_SS)

    def objective(values: np.ndarray) -> np.ndarray:
        return np.square((ws - values) @ inverse).sum(axis=1)

    best, found = objective(values), values
    for _ in range(rounds):
        error = ws - found
        target = ws - REFINE_STEP * (error - (error @ inverse) * scale)
        candidate = quantize_rows(target, qtype, row)
        found = dequantize_rows(candidate, qtype, ws.shape[1])
        score = objective(found)
        better = score < best
        raw[better], values[better], best[better] = candidate[better], found[better], score[better]
    return raw, values


def quantize_matrix(
    w: np.ndarray,
    qtype: int | str,
    factor: Factor,
    importance: np.ndarray | None = None,
    *,
    method: str = "block",
    chunk: int = 256,
    chunk_importance: str = "conditional",
    rounds: int = 0,
) -> np.ndarray:
    """Error-feedback quantization of one matrix ``w`` [out, in] to ggml type ``qtype`` with the
    :func:`feedback_factor` of its damped ``H`` (made at this ``chunk``); ``importance`` [in]
    is the caller's row (needed for ``chunk_importance="imatrix"``); ``rounds`` of in-chunk
    refinement (``block`` only, see the module docstring). Returns ggml's stored bytes uint8
    [out, row_bytes]."""

    kind = check_options(qtype, method, chunk, chunk_importance, rounds)
    rows = np.array(w, np.float32)  # the error-updated weights
    n_out, n_in = rows.shape
    out = np.empty((n_out, kind.row_bytes(n_in)), np.uint8)
    for index, a in enumerate(range(0, n_in, chunk)):
        b = min(a + chunk, n_in)
        ws = rows[:, a:b]
        if chunk_importance == "imatrix":
            if importance is None:
                raise ValueError("quantize_matrix: chunk_importance 'imatrix' needs importance")
            row = importance[a:b]
        else:
            row = getattr(factor, chunk_importance)[a:b]
        raw = quantize_rows(ws, kind.ggml_id, row)
        if method == "column":
            grid = COLUMN_GRIDS[kind.ggml_id](raw, kind.ggml_id)
            raw, values = _column_feedback(ws, grid, factor.diagonal[index], factor.inverse[index])
        else:
            values = dequantize_rows(raw, kind.ggml_id, b - a)
        if rounds:
            raw, values = _refine_chunk(
                ws,
                raw,
                values,
                factor.inverse[index],
                factor.diagonal[index],
                row,
                kind.ggml_id,
                rounds,
            )
        first = a // kind.block_weights * kind.block_bytes
        out[:, first : first + raw.shape[1]] = raw
        if b < n_in:
            rows[:, b:] -= (ws - values) @ factor.update[a:b, b:]
    return out


def h_weighted_error(w, q, h) -> np.ndarray:
    """``tr((W_e − Q_e) H_e (W_e − Q_e)ᵀ)`` per matrix of ``w``, ``q`` [E, out, in] and ``h``
    [E, in, in]: float64 [E] (host)."""
    delta = np.asarray(w, np.float64) - np.asarray(q, np.float64)
    return np.einsum("eoi,eij,eoj->e", delta, np.asarray(h, np.float64), delta, optimize=True)


def quantize_experts_ef(
    stacks: Sequence[Any],
    qtype: int | str,
    x: np.ndarray,
    ids: np.ndarray,
    experts: np.ndarray,
    damp: float,
    importance: np.ndarray,
    gate_up: tuple | None = None,
    *,
    method: str = "block",
    chunk: int = 256,
    chunk_importance: str = "conditional",
    rounds: int = 0,
    workers: int | None = None,
    student_gate_up: tuple | None = None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """ggml type ``qtype`` of every expert of each stack [E, out, in] of ``stacks`` (stacks that
    read one input, as gate and up do), with error feedback for the ``experts`` (ids of those
    with enough routed tokens) over their ``H_e`` from ``x`` [T, D] and ``ids`` [T, k] (with
    ``gate_up = (Wg, Wu)`` [E, F, D]: the teacher's hidden ``h``, for down), damped by ``damp``.

    ``importance`` [E, in] is each expert's plain ggml importance row (the calibration imatrix):
    the row of every expert quantized without feedback, and the chunk row when
    ``chunk_importance="imatrix"``. Returns per stack uint8 [E, out, row_bytes] (ggml's layout)
    and ``fed`` [E] bool: which experts got error feedback (the rest: plain ggml).

    ``student_gate_up`` (down only, with ``gate_up``): the layer's quantized ``(Wg, Wu)``
    [E, F, D] float32. Each fed expert's down is then quantized on the student's ``h``: GPTQ of
    :func:`corrected_targets` over ``H_s`` (:func:`student_moments`), so down makes up what it
    can of gate and up's error; the others stay plain ggml of the teacher's ``W``.
    """
    kind = check_options(qtype, method, chunk, chunk_importance, rounds)
    n_expert, _, n_in = stacks[0].shape
    importance = np.asarray(importance, np.float32)
    outs = [np.empty((n_expert, w.shape[1], kind.row_bytes(n_in)), np.uint8) for w in stacks]
    fed = np.zeros(n_expert, bool)
    experts = np.asarray(experts, np.int64)
    options = dict(method=method, chunk=chunk, chunk_importance=chunk_importance, rounds=rounds)
    # a thread per expert of a group; each quantizes its rows on its own thread (no nested pool)
    pool = ThreadPoolExecutor(max_workers=workers or min(GROUP, host_threads()),
                              initializer=one_thread)  # fmt: skip
    with pool:
        for a in range(0, len(experts), GROUP):
            group = experts[a : a + GROUP]
            weights, u, ok, diag = _group_system(
                stacks, group, x, ids, damp, gate_up, student_gate_up
            )
            done = np.nonzero(ok)[0]
            found = _fed_rows(pool, kind.ggml_id, (weights, u, diag), importance[group], done,
                              options)  # fmt: skip
            for g, rows in zip(done, found, strict=True):
                for out, raw in zip(outs, rows, strict=True):
                    out[group[g]] = raw
            fed[group[done]] = True
    _plain_rest(stacks, outs, fed, kind.ggml_id, importance)
    return outs, fed


def _group_system(stacks, group, x, ids, damp, gate_up, student_gate_up):
    """A group of experts' targets ``[G, out, in]`` per stack, the inverse factors ``u`` of
    their damped ``H`` and which factored (``ok`` [G]), and the damped diagonals ``[G, n]``:
    on the teacher's inputs, or (``student_gate_up``) the student's ``h`` with the targets
    corrected for gate and up's error."""
    weights = [np.asarray(w[group], np.float32) for w in stacks]  # [G, out, in]
    if student_gate_up is None:
        h = second_moments(x, ids, group, gate_up)  # [G, n, n]
        u, ok = inverse_factor(h, damp)
    else:
        h, cross = student_moments(x, ids, group, gate_up, student_gate_up)
        u, ok = inverse_factor(h, damp)
        weights = corrected_targets(weights, cross, h, damp, u, ok)
    diag = np.einsum("gii->gi", h).astype(np.float64)
    diag += damp * diag.mean(axis=1, keepdims=True)  # the diagonal of gptq.damped(h)
    return weights, u, ok, diag


def _fed_rows(pool, qtype: int, system, importance, done, options: dict[str, Any]):
    """Per expert ``g`` of ``done`` (on ``pool``, in order): each stack's rows of ``g`` with
    error feedback over its factor; ``system`` is :func:`_group_system`'s (weights, u, diag)."""
    weights, u, diag = system

    def one(g: int) -> list[np.ndarray]:
        factor = feedback_factor(u[g], diag[g], options["chunk"])
        return [quantize_matrix(w[g], qtype, factor, importance[g], **options) for w in weights]

    return pool.map(one, done)


def _plain_rest(stacks, outs: list[np.ndarray], fed: np.ndarray, qtype: int, importance) -> None:
    """The experts without feedback (too few tokens, or an ``H`` that did not factor): plain
    ggml with their importance rows, into ``outs``."""
    plain = np.nonzero(~fed)[0]
    if len(plain):
        for w, out in zip(stacks, outs, strict=True):
            out[plain] = quantize_expert_stack(
                np.asarray(w[plain], np.float32), qtype, importance[plain]
            )


def quantize_stack_ef(weights, *args: Any, **options: Any) -> np.ndarray:
    """:func:`quantize_experts_ef` of the one stack ``weights`` [E, out, in] (the same further
    arguments): uint8 [E, out, row_bytes]."""
    outs, _ = quantize_experts_ef([weights], *args, **options)
    return outs[0]
