"""The phases a CUDA device does for a trial, each checked against its host path and float64.

On CUDA the teacher's compact record (top-K and the tail draws), ``routed_q``, the ridge
basis and Part B's requantization run on the device (DESIGN.md, "A trial streams").
``healsweep doctor`` runs :func:`phase_cases` after the kernel conformance suite, with the same
runner (:func:`healsweep.conformance.run_case`): each phase down its production path on the CPU
and, on an accelerator, on the default device, judged by a float64 reference and, where the
device path replaced a host one, by that host path too:

- ``phase.teacher_record``: :func:`healsweep.score.compact.compact_record` against the float64
  top-K and inverse CDF the host used to compute (draws may move only within float32 rounding
  of a token's edge, :func:`healsweep.conformance.references.tail_edge_misses`);
- ``phase.routed_q``: :func:`healsweep.heal.stages.routed_output` (experts resident, f16 inputs
  widened on the device, chunks in flight) against the float64 routed experts, at the forward's
  tolerance (the backend's default matmul precision: TF32 on NVIDIA GPUs);
- ``phase.part_b_requant``: Part B's healed shared-expert down requantized to Q8_0 where it was
  made (:func:`healsweep.quant.formats.requantize_on_device`) against gguf-py's bytes and the
  values gguf-py decodes them to, both exactly (the host path it replaces, as float64 judges
  an encoder: bit for bit);
- ``phase.ridge_basis[host]`` / ``[device]``: :func:`healsweep.heal.ridge.eigen_basis` down each
  path, the ridge solve it gives against the float64 direct solve and (the device path) against
  the host path's, within :data:`RIDGE_RTOL` on an ill-conditioned Gram.

Nothing a stage runs imports this module, so no stage digest covers it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np
from gguf.quants import dequantize, quantize

from healsweep.conformance import KernelCase
from healsweep.conformance import references as ref
from healsweep.gguf_io import TensorType
from healsweep.heal import ridge, stages
from healsweep.kernels.kld import log_softmax
from healsweep.quant.formats import requantize_on_device
from healsweep.score.compact import TeacherCacheFormat, compact_record, tail_strata, window_seed

# The ridge's tolerance: dW's relative (Frobenius) error against a float64 direct solve at
# cond(G) ~ 1e10 (tests/test_ridge.py, the ill-conditioned Gram).
RIDGE_RTOL = 1e-4
# routed_q keeps the backend's default matmul precision, as the forward (conformance.layer).
ROUTED_RTOL = {"cpu": 1e-5, "accelerator": 2e-3}


# --- teacher_record ----------------------------------------------------------------------------


def _record_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Raw teacher logits of 20 positions over 64² + 700 tokens (three levels of the draws'
    tree), peaked, and the scored ids."""
    logits = (rng.standard_normal((20, 64 * 64 + 700)) * 4).astype(np.float32)
    return logits, rng.integers(0, logits.shape[1], 20).astype(np.int32)


def _record(logits: np.ndarray, next_ids: np.ndarray, platform: str = "cpu") -> tuple:

    logprobs = log_softmax(jax.numpy.asarray(logits))  # on the device, as run_teacher leaves it
    router = np.zeros((len(next_ids), 1, 1), np.int32)
    fmt = TeacherCacheFormat("compact", top_k=16, tail_samples=32)
    record = compact_record(logprobs, next_ids, router, "doctor", fmt)
    return record._replace(topk_ids=None)


def _record_reference(logits: np.ndarray, next_ids: np.ndarray) -> dict[str, Any]:
    logp, top_ids, top_logp, logp_next = ref.teacher_top(logits, next_ids, 16)
    return {"logp": logp, "top_ids": top_ids, "top_logp": top_logp, "logp_next": logp_next}


def _record_check(got: Any, want: dict[str, Any], inputs: tuple) -> tuple[float, str | None]:
    """Top-K ids exact, log-probs within 1e-5, every tail draw the float64 inverse CDF's but for
    near-edge moves (at most 1%), the tail mass within 1e-5 of the float64 one."""

    strata = tail_strata(window_seed("doctor"), len(got.top_ids), got.tail_ids.shape[1])
    logp32 = want["logp"].astype(np.float32)
    moved, bad = ref.tail_edge_misses(got.tail_ids, logp32, got.top_ids, strata)
    _, _, mass, full = ref.tail_draws(logp32, got.top_ids, strata)
    errors = {
        "top_logp": float(np.max(np.abs(got.top_logp - want["top_logp"]))),
        "logp_next": float(np.max(np.abs(got.logp_next - want["logp_next"]))),
        "tail_logp": float(np.max(np.abs(got.tail_logp - want["logp"][
            np.arange(len(strata))[:, None], got.tail_ids]))),
        "tail_mass": float(np.max(np.abs(got.tail_mass - mass) / np.maximum(mass, 1e-30))),
    }  # fmt: skip
    err = max(moved, *errors.values())
    problems = [f"{k} off by {v:.1e}" for k, v in errors.items() if v > 1e-5]
    if not np.array_equal(got.top_ids, want["top_ids"]):
        problems.append("top-K ids differ")
    if not np.array_equal(got.tail_full, full):
        problems.append("tail_full differs")
    if bad or moved > 0.01:
        problems.append(f"{bad} draw(s) off their token, {moved:.1%} moved")
    return err, "; ".join(problems) or None


# --- routed_q ----------------------------------------------------------------------------------


def _routed_inputs(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Trace-like inputs (x in f16, top-2 of 6 experts) over several chunks of a small
    ROUTED_CHUNK, and dense experts [E, F, D] / [E, D, F]."""
    n_tokens, n_embd, n_ff, n_expert = 64 * 5 + 17, 32, 48, 6
    x = rng.standard_normal((n_tokens, n_embd)).astype(np.float16)
    ids = np.stack([rng.permutation(n_expert)[:2] for _ in range(n_tokens)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(2), n_tokens).astype(np.float32)
    gate, up = (rng.standard_normal((2, n_expert, n_ff, n_embd)) / 6).astype(np.float32)
    down = (rng.standard_normal((n_expert, n_embd, n_ff)) / 7).astype(np.float32)
    return x, ids, weights, gate, up, down


def _routed(x, ids, weights, gate, up, down, platform: str = "cpu") -> np.ndarray:
    trace_layer = {"x": x, "ids": ids, "weights": weights}
    experts = stages.ExpertStacks(gate, up, down)
    # chunks of 64 tokens: six of them, more than are kept in flight
    return stages.routed_output(experts, trace_layer, gate.shape[0], chunk_tokens=64)


def _routed_check(got: Any, want: Any, inputs: tuple) -> tuple[float, str | None]:
    rtol = ROUTED_RTOL["cpu" if jax.default_backend() == "cpu" else "accelerator"]
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))
    return err, None if err <= rtol else f"max rel err {err:.2e} vs float64, beyond {rtol:.0e}"


# --- part_b's requantization -------------------------------------------------------------------


def _requant_inputs(rng: np.random.Generator) -> tuple[np.ndarray]:
    """A shared-expert down projection's shape in small ([96, 256]), one block all zeros and
    one of codes at exact halves (where a rounding rule shows)."""
    values = (rng.standard_normal((96, 256)) * 0.02).astype(np.float32)
    values[0, :32] = 0.0
    values[1, :32] = (np.arange(32) - 15.5) / 15.5 * 0.03
    return (values,)


def _requant(values: np.ndarray, platform: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    raw, stored = requantize_on_device("doctor", jax.numpy.asarray(values), TensorType.Q8_0)
    return raw, np.asarray(stored)


def _requant_reference(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    raw = quantize(values, TensorType.Q8_0)
    return raw, np.asarray(dequantize(raw, TensorType.Q8_0), np.float32).reshape(values.shape)


# --- ridge_basis -------------------------------------------------------------------------------


def _gram_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """A float32 Gram of cond ~1e10 (columns over 5 decades, as tests/test_ridge.py), a
    right-hand side B = Z'ᵀdY and lambda at rho 0.3."""
    z = (rng.standard_normal((400, 48)) * np.exp(-0.25 * np.arange(48))).astype(np.float32)
    dy = rng.standard_normal((400, 16)).astype(np.float32)
    gram = z.T @ z
    return gram, z.T @ dy, float(0.3 * np.trace(gram) / gram.shape[0])


def _ridge_solve(basis: np.ndarray, sigma: np.ndarray, rhs: np.ndarray, lam: float) -> np.ndarray:
    """dW = V diag(1 / (sigma + lambda)) Vᵀ B, in float64 from the float32 basis."""
    v = basis.astype(np.float64)
    weights = 1.0 / (np.maximum(sigma.astype(np.float64), 0.0) + lam)
    return v @ (weights[:, None] * (v.T @ rhs.astype(np.float64)))


def _basis_fit(gram, rhs, lam, platform: str = "cpu", on: str = "host") -> np.ndarray:
    basis, sigma = ridge.eigen_basis(jax.numpy.asarray(gram), on=on)
    return _ridge_solve(basis, sigma, rhs, lam)


def _direct_solve(gram, rhs, lam) -> np.ndarray:
    g = np.asarray(gram, np.float64)
    return np.linalg.solve(g + lam * np.eye(len(g)), np.asarray(rhs, np.float64))


def _ridge_check(on: str) -> Any:
    def check(got: Any, want: Any, inputs: tuple) -> tuple[float, str | None]:
        errors = {"float64": _frobenius(got, want)}
        if on == "device":  # the host path it replaces on CUDA
            errors["host path"] = _frobenius(got, _basis_fit(*inputs, on="host"))
        bad = [f"{k} {v:.1e}" for k, v in errors.items() if v > RIDGE_RTOL]
        return max(errors.values()), (f"dW off {', '.join(bad)}" if bad else None)

    return check


def _frobenius(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def phase_cases() -> list[KernelCase]:
    """The device phases' checks, in pipeline order (see the module docstring)."""
    ridge_cases = [
        KernelCase(
            f"phase.ridge_basis[{on}]",
            partial(_basis_fit, on=on),
            _gram_inputs,
            _direct_solve,
            check=_ridge_check(on),
            device_rtol=RIDGE_RTOL,
            driver=True,
            path=lambda platform, on=on: f"{on}, {'float64' if on == 'device' else 'float32'}",
        )
        for on in ("host", "device")
    ]
    return [
        KernelCase(
            "phase.teacher_record",
            _record,
            _record_inputs,
            _record_reference,
            check=_record_check,
            device_rtol=None,  # a draw at a token's edge may move by backend: float64 judges
            driver=True,
        ),
        KernelCase(
            "phase.routed_q",
            _routed,
            _routed_inputs,
            lambda x, ids, w, g, u, d: ref.routed_experts(x, ids, w, g, u, d),
            check=_routed_check,
            device_rtol=None,  # TF32 on NVIDIA: the float64 reference judges each run
            driver=True,
        ),
        KernelCase(
            "phase.part_b_requant",
            _requant,
            _requant_inputs,
            _requant_reference,
            rtol=0.0,  # bytes and values exactly gguf-py's
            device_rtol=0.0,
            driver=True,
            path=lambda platform: "Q8_0 on the device",
        ),
        *ridge_cases,
    ]


__all__ = ["RIDGE_RTOL", "phase_cases"]
