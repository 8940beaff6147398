"""The phases a CUDA device does (issue 46): the compact record's draws, routed_q and the ridge
basis, down the device path against the host path and float64 references.

The default tier runs every device path on the CPU backend (the same code, one switch); the
``device`` tests (``pytest -m device`` on a GPU machine: benchmarks/device/phases.sh) run them
where JAX has an accelerator, against the CPU and the host paths, at real-size shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.conformance import references as ref
from healsweep.conformance import run_case
from healsweep.heal import ridge, stages
from healsweep.heal.device_phases import RIDGE_RTOL, phase_cases
from healsweep.kernels.kld import log_softmax
from healsweep.kernels.q2_0 import Q2Packed
from healsweep.score.compact import TeacherCacheFormat, compact_record, tail_strata, window_seed


def _trace(rng, n_tokens=64 * 5 + 17, n_embd=64, n_expert=6, k=2) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((n_tokens, n_embd)).astype(np.float16),
        "ids": np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tokens)]).astype(np.int32),
        "weights": rng.dirichlet(np.ones(k), n_tokens).astype(np.float32),
    }


def _packed(rng, n_expert, out, inp) -> Q2Packed:
    scale = (rng.standard_normal((n_expert, out, inp // 64)) * 0.05).astype(np.float16)
    return Q2Packed(scale, rng.integers(0, 256, (n_expert, out, inp // 4), dtype=np.uint8))


def test_routed_q_widens_f16_on_the_device_to_the_same_bits_and_matches_float64():
    """Several chunks in flight, the trace's f16 inputs widened on the device: the same bits as
    inputs widened on the host first (the path before), and the float64 routed experts."""
    rng = np.random.default_rng(0)
    trace = _trace(rng)
    experts = stages.ExpertStacks(_packed(rng, 6, 128, 64), _packed(rng, 6, 128, 64),
                                  _packed(rng, 6, 64, 128))  # fmt: skip
    got = stages.routed_output(experts, trace, 6, chunk_tokens=64)  # 6 chunks, 3 in flight
    widened = {**trace, "x": trace["x"].astype(np.float32)}
    np.testing.assert_array_equal(got, stages.routed_output(experts, widened, 6, chunk_tokens=64))
    dense = [np.asarray(w.dequantize() if hasattr(w, "dequantize") else w) for w in experts]
    want = ref.routed_experts(trace["x"], trace["ids"], trace["weights"], *dense)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_routed_q_is_one_function_of_the_tokens_whatever_the_chunks_in_flight():
    """Chunks are dispatched ahead of the copies back: the order results arrive in cannot move
    a row (every chunk size gives rows equal to float64 within rounding, all chunks present)."""
    rng = np.random.default_rng(1)
    trace = _trace(rng, n_tokens=64 * 9 + 5)
    experts = stages.ExpertStacks(*(rng.standard_normal(s).astype(np.float32) / 8
                                    for s in ((6, 96, 64), (6, 96, 64), (6, 64, 96))))  # fmt: skip
    want = ref.routed_experts(trace["x"], trace["ids"], trace["weights"], *experts)
    for chunk in (64, 128, 2048):
        got = stages.routed_output(experts, trace, 6, chunk_tokens=chunk)
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), chunk


def _ill_conditioned(rng, t=500, fs=48):
    z = (rng.standard_normal((t, fs)) * np.exp(-0.25 * np.arange(fs))).astype(np.float32)
    dy = rng.standard_normal((t, 8)).astype(np.float32)
    return z, dy


@pytest.mark.parametrize("rho", [0.05, 0.3, 6.0])
def test_ridge_basis_device_path_agrees_with_host_path_and_float64(monkeypatch, rho):
    """The device path (float64 eigh, here on the CPU backend) and the host path (LAPACK
    float32) give fits within the ridge's tolerance of each other and of a float64 solve at
    cond(G) ~ 1e10; both keep one cache key (the basis key does not name the path)."""
    z, dy = _ill_conditioned(np.random.default_rng(int(rho * 100)))
    fits = {}
    for on in ("host", "device"):
        monkeypatch.setenv(ridge.BASIS_ON_ENV, on)
        assert ridge.basis_on() == on
        design = lambda a, b: jnp.asarray(z[a:b])  # noqa: E731
        basis = ridge.basis_from_design(design, len(z))
        assert basis.basis.dtype == np.float32 and basis.sigma.dtype == np.float32
        fits[on] = ridge.fit_from_rhs(ridge.rhs_from_design(design, dy, basis), basis, rho).delta
    g = z.astype(np.float64).T @ z
    lam = rho * np.trace(g) / len(g)
    want = np.linalg.solve(g + lam * np.eye(len(g)), z.astype(np.float64).T @ dy)
    for on, got in fits.items():
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < RIDGE_RTOL, on
    diff = np.linalg.norm(fits["device"] - fits["host"]) / np.linalg.norm(fits["host"])
    assert diff < RIDGE_RTOL


def test_the_basis_switch_follows_the_backend_unless_told(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.delenv(ridge.BASIS_ON_ENV, raising=False)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    assert ridge.basis_on() == ("device" if gpu else "host")  # Metal and the CPU: the host
    model = SimpleNamespace(fingerprint="f" * 64)
    keys = set()
    for on in ("host", "device", "auto"):
        monkeypatch.setenv(ridge.BASIS_ON_ENV, on)
        keys.add(ridge.basis_key(model, "trace", 3))
    assert len(keys) == 1  # the paths agree within tolerance: one key, shared entries


def test_x64_is_on_only_inside_the_device_basis_and_only_on_its_thread():
    gram = np.eye(4, dtype=np.float32) * np.arange(1, 5, dtype=np.float32)
    basis, sigma = ridge.eigen_basis(jnp.asarray(gram), on="device")
    assert basis.dtype == np.float32 and sigma.dtype == np.float32
    np.testing.assert_allclose(sigma, [1, 2, 3, 4], rtol=1e-6)
    assert jnp.asarray(1.0).dtype == jnp.float32  # x64 did not leak out of the call


def test_every_device_phase_passes_its_checks_on_this_backend():
    for case in phase_cases():
        result = run_case(case)
        assert result.ok, result


# --- on an accelerator (pytest -m device) -------------------------------------------------------


def _on_accelerator() -> None:
    assert jax.default_backend() != "cpu", "a device test: run it where JAX has an accelerator"


@pytest.mark.device
def test_device_phases_agree_with_float64_the_host_paths_and_the_cpu():
    _on_accelerator()
    results = [run_case(case) for case in phase_cases()]
    assert all(r.ok and r.backend == jax.default_backend() for r in results), results
    assert all(np.isfinite(r.cpu_err) for r in results)  # the CPU run was judged too
    assert ridge.basis_on() == "device" or jax.default_backend() not in ("gpu", "cuda", "rocm")


@pytest.mark.device
def test_teacher_record_at_a_real_vocabulary_on_the_device():
    """128 positions of a 151,936-token vocabulary: top-K exact against float64, every draw the
    float64 inverse CDF's but for moves within float32 rounding of a token edge."""
    _on_accelerator()
    rng = np.random.default_rng(2)
    n, vocab = 128, 151_936
    logits = (rng.standard_normal((n, vocab)) * 4).astype(np.float32)
    next_ids = rng.integers(0, vocab, n).astype(np.int32)
    fmt = TeacherCacheFormat()
    rows = log_softmax(jnp.asarray(logits))
    record = compact_record(rows, next_ids, np.zeros((n, 1, 1), np.int32), "w", fmt)
    logp, top_ids, _, _ = ref.teacher_top(logits, next_ids, fmt.top_k)
    np.testing.assert_array_equal(record.top_ids, top_ids)
    strata = tail_strata(window_seed("w"), n, fmt.tail_samples)
    moved, bad = ref.tail_edge_misses(record.tail_ids, logp.astype(np.float32), top_ids, strata)
    assert bad == 0 and moved <= 0.01, (bad, moved)
    _, _, mass, _ = ref.tail_draws(logp.astype(np.float32), top_ids, strata)
    np.testing.assert_allclose(record.tail_mass, mass, rtol=1e-5)


@pytest.mark.device
def test_routed_q_on_the_device_equals_the_cpu_within_the_forwards_tolerance():
    _on_accelerator()
    rng = np.random.default_rng(3)
    trace = _trace(rng, n_tokens=5000, n_embd=256, n_expert=16, k=4)
    experts = stages.ExpertStacks(_packed(rng, 16, 192, 256), _packed(rng, 16, 192, 256),
                                  _packed(rng, 16, 256, 192))  # fmt: skip
    got = stages.routed_output(experts, trace, 16)
    with jax.default_device(jax.devices("cpu")[0]):
        on_cpu = stages.routed_output(experts, trace, 16)
    assert np.max(np.abs(got - on_cpu)) <= 2e-3 * np.max(np.abs(on_cpu))  # TF32 products


@pytest.mark.device
def test_ridge_basis_at_a_real_width_on_the_device_matches_the_host_path():
    _on_accelerator()
    rng = np.random.default_rng(4)
    fs = 2048
    z = jnp.asarray(rng.standard_normal((3 * fs, fs), np.float32))
    gram = np.asarray(jax.jit(lambda a: jnp.matmul(a.T, a, precision="highest"))(z))
    rhs = rng.standard_normal((fs, 16))
    lam = 0.3 * float(np.trace(gram)) / fs
    fits = {}
    for on in ("host", "device"):
        v, s = ridge.eigen_basis(jnp.asarray(gram), on=on)
        v = v.astype(np.float64)
        fits[on] = v @ ((v.T @ rhs) / (np.maximum(s, 0) + lam)[:, None])
    want = np.linalg.solve(gram.astype(np.float64) + lam * np.eye(fs), rhs)
    for on, got in fits.items():
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < RIDGE_RTOL, on
