"""Part B as cached stages: ``ridge_basis`` → ``ridge_fit`` (rho) → ``part_b`` (eta), and the
held-out diagnostic ``ridge_heldout`` beside them.

The trace keeps the FFN input X, not the shared expert's down input Z (whose width Fs can be
several times D); Z' = silu(X·Wgᵀ)·(X·Wuᵀ)·gate is recomputed here, chunk by chunk, from X and the
layer's shared-expert weights.

* ``ridge_basis`` (per trace and layer, no knobs): the Gram G = Z'ᵀZ' in float32 on the default
  device, then ``G = V diag(sigma) Vᵀ`` by ``eigh``: on a CUDA/ROCm device in float64 there, else
  on the host CPU in float32 (Metal: DESIGN.md); :func:`basis_on` is the one switch. Paid once
  per sweep and layer.
* ``ridge_rhs`` (adds part_a and routed_q, no knobs): B = Z'ᵀdY, C = VᵀB, the in-sample |dY|²
  and, per fold block, tr(Z'_kᵀZ'_k) — the one pass over Z' a target needs, shared by every rho.
* ``ridge_fit`` (adds rho): dW = V diag(1/(sigma+lambda)) C — one matrix product, no Z' (a
  rho-only trial used to recompute Z' for B). It stores dW and the in-sample sums; B and C stay
  in the ``ridge_rhs`` entry, which ``part_b`` and ``ridge_heldout`` read beside the fit.
* ``ridge_heldout`` (the fit's key, nothing more): the leave-one-block-out diagnostic without
  refactoring G: the fit without block k predicts block k with residual ``(I - H_k)^-1 e_k``
  (H_k = Z'_k (G + lambda_k I)^-1 Z'_kᵀ, ``e_k`` the block's residual under the full fit at
  lambda_k), a system of min(block tokens, Fs) unknowns solved on the host. It stores per block
  the sums (|Y|², <Y, P>, |P|²) from which any eta's held-out change follows without Z'. Nothing
  a trial builds reads it, so the pipeline runs it on a background thread while the next layers
  heal (its host solves took 1.3 s of a 4-layer real-size trial).
* ``part_b`` (adds eta): W + eta·dWᵀ, requantized to the tensor's storage type; its realized
  residual change is ``(-2<B, Δ> + |diag(sigma)^½ VᵀΔ|²) / |dY|²`` — again no Z'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from gguf import MODEL_TENSOR

from healsweep.gguf_io import TensorType, tensor_name
from healsweep.heal._runner import join_entry, split_entry
from healsweep.heal.stages import stage_key
from healsweep.kernels import ridge as kr
from healsweep.kernels._precision import full_float32, healing_jit, matmul
from healsweep.model.forward import dense_on_device
from healsweep.model.layers import swiglu_hidden
from healsweep.quant.formats import dequantized, requantize_ggml, requantize_on_device

if TYPE_CHECKING:
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.knobs import Knobs

BASIS_ON_ENV = "HEALSWEEP_BASIS_ON"  # host | device | auto (the backend decides)
LOBO_BLOCKS = 4
CHUNK = 2048  # tokens of Z' alive at a time (padded to a multiple of 64)
Arrays = dict[str, np.ndarray]


class RidgeBasis(NamedTuple):
    """``ridge_basis``: ``G = V diag(sigma) Vᵀ`` of a layer's gated Gram ``G = Z'ᵀZ'``."""

    basis: np.ndarray  # V [Fs, Fs] float32
    sigma: np.ndarray  # [Fs] float32
    trace_g: float  # tr(G)
    n_tokens: int
    eigh_seconds: float

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return split_entry(self, ("basis", "sigma"))

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> RidgeBasis:
        return join_entry(cls, arrays, meta)


class RidgeRhs(NamedTuple):
    """``ridge_rhs``: ``B = Z'ᵀdY`` and ``C = VᵀB`` of one target, |dY|², per fold block
    ``tr(Z'_kᵀZ'_k)``."""

    rhs: np.ndarray  # B [Fs, D] float32
    coef: np.ndarray  # C [Fs, D] float32
    block_trace: list[float]
    total: float  # |dY|²

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return split_entry(self, ("rhs", "coef"))

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> RidgeRhs:
        return join_entry(cls, arrays, meta)


class RidgeFit(NamedTuple):
    """``ridge_fit``: dW at one rho, and the in-sample sums ``(|dY|², <B, dW>, tr(dWᵀGdW))``
    from which any eta's change follows (:func:`healsweep.kernels.ridge.eta_change`)."""

    delta: np.ndarray  # dW [Fs, D] float32
    lam: float  # stored as "lambda"
    n_tokens: int
    width: int
    rho: float
    block_trace: list[float]
    in_sample: list[float]

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return split_entry(self, ("delta",), _FIT_KEYS)

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> RidgeFit:
        return join_entry(cls, arrays, meta, _FIT_KEYS)


_FIT_KEYS = {"lam": "lambda"}


class HeldoutFolds(NamedTuple):
    """``ridge_heldout``: per fold block, the sums (|Y|², <Y, P>, |P|²) (no arrays)."""

    folds: list[list[float]]

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return split_entry(self, ())

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> HeldoutFolds:
        return join_entry(cls, arrays, meta)


class HealedShexp(NamedTuple):
    """``part_b``: the healed ``ffn_down_shexp`` as stored (``raw``, the writer's bytes or
    values) and as read back (``dense`` float32 [D, Fs]: a device array where the storage
    format's device codec made it, numpy where the entry was read), and the fit's figures at eta.

    The entry keeps ``raw`` alone (a quarter to two thirds of the bytes): ``dense`` is decoded
    from it when read, bit for bit what the requantization returned
    (:func:`healsweep.quant.formats.dequantized`)."""

    raw: np.ndarray
    dense: Any
    stats: dict[str, Any]

    def to_entry(self) -> tuple[Arrays, dict[str, Any]]:
        return {"raw": self.raw}, {"stats": self.stats, "shape": list(self.dense.shape)}

    @classmethod
    def from_entry(cls, arrays: Arrays, meta: dict[str, Any]) -> HealedShexp:
        stats, raw = meta["stats"], arrays["raw"]
        qtype = TensorType[stats["storage_type"]]
        return cls(raw, dequantized(raw, qtype, tuple(meta["shape"])), stats)


def shexp_weights(model: GGUFModel, layer: int) -> tuple[jax.Array, jax.Array]:
    """The layer's shared-expert gate and up weights [Fs, D] as float32 device arrays."""

    return tuple(
        dense_on_device(model, tensor_name(kind, layer))
        for kind in (MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_UP_SHEXP)
    )


@healing_jit
def _design(x, gate, w_gate, w_up):

    z = swiglu_hidden(jnp.asarray(x, jnp.float32), w_gate, w_up)  # [n, Fs]
    return z * jnp.asarray(gate, jnp.float32)[:, None]


def gated_design(
    x: np.ndarray, gate: np.ndarray, weights: tuple[jax.Array, jax.Array], a: int, b: int
) -> jax.Array:
    """Z' [b - a, Fs] of tokens a..b, computed in padded chunks (zero gate on padded rows)."""
    pieces = []
    size = min(CHUNK, -(-(b - a) // 64) * 64)
    for start in range(a, b, size):
        stop = min(start + size, b)
        pad = size - (stop - start)
        xs = np.pad(np.asarray(x[start:stop], np.float32), ((0, pad), (0, 0)))
        gs = np.pad(np.asarray(gate[start:stop], np.float32), (0, pad))
        pieces.append(_design(xs, gs, *weights)[: stop - start])
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def fold_blocks(n_tokens: int, n_blocks: int = LOBO_BLOCKS) -> list[tuple[int, int]]:
    """Contiguous token blocks of the leave-one-block-out diagnostic (a block ≈ a domain)."""
    bounds = np.linspace(0, n_tokens, min(n_blocks, n_tokens) + 1).astype(int)
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


def _pieces(n_tokens: int) -> list[tuple[int, int]]:
    """Chunks of at most CHUNK tokens that never cross a fold block's edge."""
    return [(s, min(s + CHUNK, b)) for a, b in fold_blocks(n_tokens) for s in range(a, b, CHUNK)]


@healing_jit
def _gram(z_gated):
    return z_gated.T @ z_gated


# --- ridge_basis -------------------------------------------------------------------------------


def basis_key(model: GGUFModel, trace_key: str, layer: int) -> str:
    """Key of the eigenbasis of layer ``layer``'s gated Gram: the trace and the shexp weights."""
    return stage_key(
        "ridge_basis", {"model": model.fingerprint, "trace": trace_key, "layer": layer}
    )


def basis_on() -> str:
    """Where the ridge basis's eigendecomposition runs: ``device`` on a CUDA or ROCm GPU (float64
    there: cuSOLVER's eigh), ``host`` elsewhere (LAPACK on the CPU, float32: Metal has neither
    float64 nor eigh, and on the CPU backend host and device are the same cores).
    :data:`BASIS_ON_ENV` = ``host`` | ``device`` overrides the backend's choice (``doctor`` and
    the tests run the device path on the CPU backend this way)."""
    chosen = os.environ.get(BASIS_ON_ENV, "auto").strip().lower()
    if chosen in ("host", "device"):
        return chosen
    return "device" if jax.default_backend() in ("gpu", "cuda", "rocm") else "host"


def eigen_basis(gram: Any, on: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(V [Fs, Fs], sigma [Fs]) float32 with G = V diag(sigma) Vᵀ, where :func:`basis_on` says.

    On the host: LAPACK ``syevd`` in float32. G itself is a float32 sum, so its entries carry
    errors of about eps32·|G| that a float64 factorization cannot remove, and lambda =
    rho·mean(sigma) dominates eigenvalue errors of that size (the tests hold the result to a
    float64 solve at cond(G) ≈ 1e10). A 5632² G took 6.4 s in float32 and 40 s in float64 on a
    2-core CPU. On the device: ``eigh`` of G widened to float64 (x64 only for this call; the
    device's G never crosses to the host), the basis rounded back to float32: at least as
    close to the float64 solve as the host's, so both share one cache key (``doctor`` and
    tests/test_device_phases.py hold each to the same tolerance).
    """
    if (on or basis_on()) == "device":
        with _x64():
            wide = jnp.asarray(gram).astype(jnp.float64)
            sigma, basis = jnp.linalg.eigh(wide, symmetrize_input=True)
            return np.asarray(basis.astype(jnp.float32)), np.asarray(sigma.astype(jnp.float32))
    # lazy: heavy (scipy)
    import scipy.linalg

    sigma, basis = scipy.linalg.eigh(np.asarray(gram, np.float32), driver="evd", check_finite=False)
    return np.asarray(basis, np.float32), np.asarray(sigma, np.float32)


def _x64() -> Any:
    """A context in which JAX computes in float64 (this thread only)."""
    if hasattr(jax, "enable_x64"):  # jax >= 0.6
        return jax.enable_x64(True)
    # lazy: jax 0.5.0 (Metal's last) has it only here
    from jax.experimental import enable_x64

    return enable_x64()


Design = Callable[[int, int], jax.Array]  # (a, b) → Z' of tokens a..b [b - a, Fs]


def layer_design(model: GGUFModel, layer: int, trace_layer: dict[str, np.ndarray]) -> Design:
    """Z' of the layer's trace tokens, recomputed from X and the shared-expert weights: the
    student's gate and up where a student's trace hands them (``shexp_weights``: a retyped
    shared expert, :mod:`healsweep.heal.student_trace`), else the teacher's."""
    x, gate = trace_layer["x"], trace_layer["gate"]
    weights = trace_layer.get("shexp_weights") or shexp_weights(model, layer)
    return lambda a, b: gated_design(x, gate, weights, a, b)


def compute_basis(model: GGUFModel, layer: int, trace_layer: dict[str, np.ndarray]) -> RidgeBasis:
    """The ``ridge_basis`` of a trace layer."""
    return basis_from_design(layer_design(model, layer, trace_layer), len(trace_layer["x"]))


@full_float32
def basis_from_design(design: Design, n_tokens: int) -> RidgeBasis:
    """V, sigma (float32) and tr(G) of the float32 Gram G = Z'ᵀZ' accumulated over chunks."""
    gram = None
    for a, b in _pieces(n_tokens):
        z_gated = design(a, b)
        gram = _gram(z_gated) if gram is None else gram + _gram(z_gated)
    start = time.perf_counter()
    basis, sigma = eigen_basis(gram)  # on the device, G stays there
    seconds = round(time.perf_counter() - start, 3)
    trace_g = float(np.asarray(jnp.diagonal(gram)).sum())
    return RidgeBasis(basis, sigma, trace_g, int(n_tokens), seconds)


# --- ridge_fit ---------------------------------------------------------------------------------


def rhs_key(basis: str, part_a: str, routed_q: str, layer: int) -> str:
    """Key of B = Z'ᵀdY: the design's inputs (named by the basis key) and the target dY."""
    return stage_key(
        "ridge_rhs", {"basis": basis, "part_a": part_a, "routed_q": routed_q, "layer": layer}
    )


def fit_key(knobs: Knobs, basis: str, rhs: str, layer: int) -> str:
    """Key of dW at one rho: the basis, B (:func:`rhs_key`) and rho."""
    return stage_key(
        "ridge_fit",
        {"knobs": knobs.for_stage("ridge_fit"), "basis": basis, "rhs": rhs, "layer": layer},
    )


@healing_jit
def _rhs_sums(z_gated, target):
    return z_gated.T @ target, jnp.sum(z_gated * z_gated), jnp.sum(target * target)


@full_float32
def _heldout_residual(
    u: jax.Array, weights: jax.Array, coef: jax.Array, target: np.ndarray
) -> jax.Array:
    """Block residual under the fit without the block: (I - U W Uᵀ)^-1 e [n, D].

    The system has min(n, Fs) unknowns: n×n directly, or Fs×Fs by Woodbury,
    ``e + U (W^-1 - UᵀU)^-1 Uᵀe``. Its inverse is taken in float64 on the host CPU (never an
    accelerator); applying it to the D right-hand sides is a float32 product on the default
    device. (Solving on the host with the 2048 right-hand sides took 1.5 s of a 4-layer
    real-size rho-only trial on a 16-core host.)
    """
    n, width = u.shape
    resid = kr.fold_residual(u, weights, coef, target)
    if n <= width:
        system = np.eye(n) - np.asarray(kr.fold_leverage(u, weights), np.float64)
        return matmul(_inverse_spd(system), resid)
    gram_k, proj = kr.fold_moments(u, resid)
    system = np.diag(1.0 / np.asarray(weights, np.float64)) - np.asarray(gram_k, np.float64)
    return resid + matmul(u, matmul(_inverse_spd(system), proj))


def _inverse_spd(system: np.ndarray) -> jax.Array:
    """``system⁻¹`` (float32, on the default device) of a symmetric positive definite system
    (I - H_k, or its Woodbury twin: a ridge leverage is below 1), by Cholesky in float64 on
    the host; a system that rounding made indefinite is inverted by LU."""
    # lazy: heavy (scipy)
    from scipy.linalg import lapack

    factor, info = lapack.dpotrf(system, lower=False, clean=True)
    if info == 0:
        upper, info = lapack.dpotri(factor, lower=False)
    if info != 0:
        return jnp.asarray(np.linalg.inv(system), jnp.float32)
    inverse = np.triu(upper) + np.triu(upper, 1).T
    return jnp.asarray(inverse, jnp.float32)


@healing_jit
def _row_sums(y, left):
    """Per token, (|y|², <y, p>, |p|²) of the held-out prediction p = y - left [3, n]."""
    y = jnp.asarray(y, jnp.float32)
    p = y - left
    return jnp.stack([jnp.sum(y * y, axis=1), jnp.sum(y * p, axis=1), jnp.sum(p * p, axis=1)])


def _sums(y: np.ndarray, left: Any) -> list[float]:
    """(|Y|², <Y, P>, |P|²) of a block, P = Y - left: rows summed in float32 on the device,
    then the rows in float64."""
    rows = np.asarray(_row_sums(y, left), np.float64)
    return [float(v) for v in rows.sum(axis=1)]


def compute_rhs(
    model: GGUFModel,
    layer: int,
    trace_layer: dict[str, np.ndarray],
    y_q: np.ndarray,
    alpha: float,
    basis: RidgeBasis,
) -> RidgeRhs:
    """The ``ridge_rhs`` of a layer: B for the target dY = y_ref - alpha * y_q (and VᵀB)."""
    design = layer_design(model, layer, trace_layer)
    return rhs_from_design(design, _target(trace_layer, y_q, alpha), basis)


def _target(trace_layer: dict[str, np.ndarray], y_q: np.ndarray, alpha: float) -> np.ndarray:
    """dY = y_ref - alpha * y_q [T, D], float32; plus, in a student's trace whose shared
    expert is retyped, ``shexp_gap`` (what its gate and up change of the teacher's shared output
    at the same input, :mod:`healsweep.heal.student_trace`)."""
    target = (trace_layer["y_ref"] - np.float32(alpha) * y_q).astype(np.float32)
    gap = trace_layer.get("shexp_gap")
    return target if gap is None else target + gap


@full_float32
def rhs_from_design(design: Design, target: np.ndarray, basis: RidgeBasis) -> RidgeRhs:
    """B = Z'ᵀdY and C = VᵀB [Fs, D] float32; in its meta |dY|² and per fold block
    tr(Z'_kᵀZ'_k)."""
    n_tokens, blocks = int(target.shape[0]), fold_blocks(int(target.shape[0]))
    rhs, block_trace, total = None, [0.0] * len(blocks), 0.0
    for a, b in _pieces(n_tokens):
        part, zz, yy = _rhs_sums(design(a, b), target[a:b])
        rhs = part if rhs is None else rhs + part
        block_trace[next(k for k, (s, e) in enumerate(blocks) if s <= a < e)] += float(zz)
        total += float(yy)
    coef = kr.coefficients(basis.basis, rhs)
    return RidgeRhs(np.asarray(rhs), np.asarray(coef), block_trace, total)


@full_float32
def fit_from_rhs(rhs: RidgeRhs, basis: RidgeBasis, rho: float) -> RidgeFit:
    """dW [Fs, D] and the in-sample residual sums; per fold block, tr(Z'_kᵀZ'_k).

    B stays in the ``ridge_rhs`` entry (one copy per target, not one per rho: 46 MB a layer at
    real size). The held-out diagnostic is not here: :func:`heldout_from_design` (its own
    stage, off a trial's critical path) reads this fit's meta.
    """
    v, sigma = jnp.asarray(basis.basis), jnp.asarray(basis.sigma)
    width, n_tokens = int(v.shape[0]), int(basis.n_tokens)
    lam = kr.ridge_lambda(basis.trace_g, width, rho)
    fit = partial(RidgeFit, lam=lam, n_tokens=n_tokens, width=width, rho=rho,
                  block_trace=list(rhs.block_trace))  # fmt: skip
    if not lam > 0.0:  # Z' is all zeros: there is nothing to fit
        return fit(np.zeros(rhs.rhs.shape, np.float32), in_sample=[rhs.total, 0.0, 0.0])
    delta, explained, quad = kr.eigen_fit(v, sigma, kr.shrink(sigma, lam), rhs.coef)
    return fit(np.asarray(delta), in_sample=[rhs.total, float(explained), float(quad)])


# --- ridge_heldout -----------------------------------------------------------------------------


def heldout_key(fit: str) -> str:
    """Key of the leave-one-block-out diagnostic of a fit (it reads nothing the fit did not)."""
    return stage_key("ridge_heldout", {"ridge_fit": fit})


def compute_heldout(
    model: GGUFModel,
    layer: int,
    trace_layer: dict[str, np.ndarray],
    y_q: np.ndarray,
    alpha: float,
    basis: RidgeBasis,
    rhs: RidgeRhs,
    fit: RidgeFit,
) -> HeldoutFolds:
    """The ``ridge_heldout`` of a layer's fit."""
    design = layer_design(model, layer, trace_layer)
    return HeldoutFolds(
        heldout_from_design(design, _target(trace_layer, y_q, alpha), basis, rhs, fit)
    )


@full_float32
def heldout_from_design(
    design: Design, target: np.ndarray, basis: RidgeBasis, rhs: RidgeRhs, fit: RidgeFit
) -> list[list[float]]:
    """Per fold block, the sums (|Y|², <Y, P>, |P|²) of its prediction P by the fit without it.

    Without refactoring G: the fit without block k predicts block k with residual
    ``(I - H_k)^-1 e_k``, ``e_k`` the block's residual under the full fit at lambda_k.
    """
    v, sigma = jnp.asarray(basis.basis), jnp.asarray(basis.sigma)
    width, n_tokens = int(v.shape[0]), int(target.shape[0])
    blocks = fold_blocks(n_tokens)
    if len(blocks) < 2 or not fit.lam > 0.0:
        return []
    coef = jnp.asarray(rhs.coef)  # Vᵀ B [Fs, D], from the ridge_rhs pass
    folds = []
    for k, (a, b) in enumerate(blocks):
        lam_k = kr.ridge_lambda(basis.trace_g - fit.block_trace[k], width, fit.rho)
        if not lam_k > 0.0:  # the other blocks are all zeros: the refit predicts nothing
            folds.append(_sums(target[a:b], target[a:b]))
            continue
        parts = [matmul(design(s, e), v) for s, e in _pieces(n_tokens) if a <= s < b]
        u = parts[0] if len(parts) == 1 else jnp.concatenate(parts)  # Z'_k V [n, Fs]
        left = _heldout_residual(u, kr.shrink(sigma, lam_k), coef, target[a:b])
        folds.append(_sums(target[a:b], left))
    return folds


def heldout_figures(folds: list[list[float]], eta: float) -> dict[str, Any]:
    """The held-out residual change at ``eta`` (pooled and per block) from the fold sums."""
    before = sum(s[0] for s in folds)
    moved = sum(-2.0 * eta * s[1] + eta * eta * s[2] for s in folds)
    return {
        "heldout_change": moved / before if before > 0 else 0.0,
        "fold_changes": [kr.eta_change(tuple(s), eta) for s in folds],
    }


# --- part_b ------------------------------------------------------------------------------------


def part_b_key(
    knobs: Knobs, model: GGUFModel, fit: str, layer: int, storage: str | None = None
) -> str:
    """Key of the healed shared-expert down weight: the fit at its rho, and eta; ``storage``:
    the type it is stored in where not the teacher's (knob ``type_shexp``; keys from before it
    stay as they were)."""
    inputs = {
        "knobs": knobs.for_stage("part_b"),
        "model": model.fingerprint,
        "ridge_fit": fit,
        "layer": layer,
    }
    if storage is not None:
        inputs["storage"] = storage
    return stage_key("part_b", inputs)


@full_float32
def ridge_layer(
    model: GGUFModel,
    layer: int,
    basis: RidgeBasis,
    rhs: RidgeRhs,
    fit: RidgeFit,
    eta: float,
    target: tuple[Any, np.ndarray | None] | None = None,
) -> HealedShexp:
    """Apply eta·dW to ``blk.{layer}.ffn_down_shexp.weight`` and requantize it to its type.

    On the default device, decoded there from the stored bytes; the result is stored by its
    storage format's class (:mod:`healsweep.quant.formats`).
    ``target`` (knob ``type_shexp``): ``(GGMLType, importance row or None)`` to store it in
    instead, by ggml's quantizer with that row (:mod:`healsweep.heal.tensor_types`).
    """

    name = tensor_name(MODEL_TENSOR.FFN_DOWN_SHEXP, layer)
    qtype = model.tensor_type(name)
    w = dense_on_device(model, name)  # [D, Fs] as the teacher stores it
    new = kr.apply_ridge(w, fit.delta, eta)
    if target is not None:
        qtype = TensorType(target[0].ggml_id)
        raw, stored = requantize_ggml(np.asarray(new), qtype, target[1])
    else:  # its storage format's class, on the device where it has a device codec (F32, F16,
        raw, stored = requantize_on_device(name, new, qtype)  # Q8_0): the bytes come back alone
    quad, lin, moved, size = (
        float(v) for v in kr.step_moments(basis.basis, basis.sigma, rhs.rhs, w, stored)
    )
    stats = _stats(basis, fit, eta, quad, lin)
    stats.update(relative_update=moved / max(size, 1e-30), storage_type=qtype.name)
    return HealedShexp(raw, stored, stats)


def ridge_stats(
    basis: RidgeBasis,
    rhs: RidgeRhs,
    fit: RidgeFit,
    eta: float,
    step: np.ndarray,
    folds: list[list[float]] | None = None,
) -> dict[str, Any]:
    """rank, dof, in-sample (and, given the fold sums, held-out) changes at ``eta``; realized
    change of ``step`` [Fs, D].

    Every figure comes from the basis, B and the fit's sums: no Z', no solve.
    """
    quad = float(kr.gram_quadratic(basis.basis, basis.sigma, step))
    stats = _stats(basis, fit, eta, quad, float(jnp.vdot(jnp.asarray(rhs.rhs), step)))
    return stats if folds is None else {**stats, **heldout_figures(folds, eta)}


def _stats(basis: RidgeBasis, fit: RidgeFit, eta: float, quad: float, lin: float) -> dict[str, Any]:
    """:func:`ridge_stats` from the realized step's ``tr(ΔᵀGΔ)`` and ``<B, Δ>``."""
    total = fit.in_sample[0]
    realized = (-2.0 * lin + quad) / total if total > 0 else 0.0
    lam, n_tokens, width = fit.lam, fit.n_tokens, fit.width
    rank, dof = kr.spectrum_stats(basis.sigma, lam)
    warning = None
    if n_tokens < width:
        warning = (
            f"ridge fitted on T={n_tokens} calibration tokens < Fs={width} shared-expert "
            f"inputs: G is rank-deficient (rank {rank}); use more calibration tokens "
            "(T >> Fs)"
        )
    return {
        "rank": rank,
        "dof": dof,
        "lambda": lam,
        "n_tokens": n_tokens,
        "in_sample_change": kr.eta_change(tuple(fit.in_sample), eta),
        "realized_in_sample_change": realized,
        "warning": warning,
    }


def shared_change(
    model: GGUFModel, layer: int, trace_layer: dict[str, np.ndarray], new_down: np.ndarray
) -> np.ndarray:
    """gate·z·(W_new - W)ᵀ [T, D] in float64: how the healed shared expert moves the output."""
    old = model.tensor(tensor_name(MODEL_TENSOR.FFN_DOWN_SHEXP, layer))  # [D, Fs]
    z_gated = gated_design(
        trace_layer["x"],
        trace_layer["gate"],
        shexp_weights(model, layer),
        0,
        trace_layer["x"].shape[0],
    )
    return np.asarray(z_gated, np.float64) @ (np.asarray(new_down, np.float64) - old).T
