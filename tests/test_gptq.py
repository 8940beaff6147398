"""quantizer: gptq — Q2_0 with error feedback over each expert's input second moment (issue 16)."""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import correlated_layer, heal_setup
from healsweep.cache import StageCache
from healsweep.conformance import references
from healsweep.errors import KnobError
from healsweep.heal import stages
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student, needs_trace
from healsweep.heal.quantize import reads_trace
from healsweep.heal.reads import stage_reads
from healsweep.kernels import gptq as gptq_kernel
from healsweep.kernels import q2_0
from healsweep.quant import gptq

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


def test_identity_second_moment_equals_search_bit_for_bit():
    # H = I without damping: V = I, nothing propagates and the block importance is uniform, so
    # every code and every fp16 scale must be the codec's own (importance none); 320 columns
    # make a full span and a short one.
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 32, 320)).astype(np.float32)
    w[1, :, :64] *= 1e-3  # small and mixed-magnitude blocks take other seeds
    w[2, 5] = 0.0  # an all-zero row: d = 0, q = 0
    h = np.broadcast_to(np.eye(320, dtype=np.float32), (3, 320, 320))
    for gain in (0.0, 0.3, 1.1):
        d, q, ok = gptq.quantize_stack(w, h, gain, damp=0.0)
        ref = q2_0.quantize_matrix(w, None, gain)
        assert ok.all()
        np.testing.assert_array_equal(d.view(np.uint16), np.asarray(ref.d).view(np.uint16))
        np.testing.assert_array_equal(q, np.asarray(ref.q))


@pytest.mark.parametrize("seed", range(4))
def test_h_weighted_error_never_above_search(seed):
    w, h = correlated_layer(seed)
    importance = np.einsum("eii->ei", h)  # search's best importance for this objective
    for gain in (0.0, 0.3):
        d, q, ok = gptq.quantize_stack(w, h, gain, damp=0.01)
        ref = q2_0.quantize_matrix(w, importance, gain)
        assert ok.all()
        err_gptq = references.h_objective(w, d, q, h).sum(1)
        err_search = references.h_objective(w, np.asarray(ref.d), np.asarray(ref.q), h).sum(1)
        assert np.all(err_gptq <= err_search), (err_gptq, err_search)
        assert np.all(err_gptq < 0.9 * err_search)  # and clearly below on correlated inputs


def _with_float64_reference(w, h, gain=0.3, damp=0.01):
    """``(d, q, ok)`` of :func:`gptq.quantize_stack` and ``(d, q)`` of the float64 textbook
    GPTQ (``references.gptq``, through the Cholesky factor of the damped H⁻¹) on ``w``, ``h``."""
    d, q, ok = gptq.quantize_stack(w, h, gain, damp=damp)
    hd = gptq.damped(h, damp).astype(np.float64)
    u = np.linalg.cholesky(np.linalg.inv(hd)).transpose(0, 2, 1)
    return (d, q, ok), references.gptq(w, u, np.einsum("eii->ei", hd), gain)


def test_matches_a_float64_reference():
    # The kernel runs in float32 with lazy block updates; the reference in float64, column by
    # column, each block's scale by the float64 search. Their weights drift apart by ~1e-6
    # relative, so a code sitting within that of a rounding boundary may differ, and a
    # different code changes every later error in its row.
    # On these 3 x 16 x 192 weights that is at most a few in a thousand codes (measured: 0).
    w, h = correlated_layer(7, n_out=16)
    (d, q, ok), (d_ref, q_ref) = _with_float64_reference(w, h)
    assert ok.all()
    assert np.mean(q != q_ref) <= 5e-3
    assert np.mean(d.view(np.uint16) != d_ref.view(np.uint16)) <= 2e-2
    # and both are equally good by the objective they minimize
    np.testing.assert_allclose(
        references.h_objective(w, d, q, h).sum(1),
        references.h_objective(w, d_ref, q_ref, h).sum(1),
        rtol=1e-3,
    )


@pytest.mark.parametrize("seed", range(2))
def test_h_weighted_error_over_several_spans_no_worse_than_float64_textbook_gptq(seed):
    # 640 columns: two full spans and a short one, so the span-to-span products and the short
    # last span run. The same objective as textbook GPTQ in float64 (the lazy batches and the
    # LDL form change only float32 rounding), and the codes agree but for a few near-ties.
    assert 640 > 2 * gptq_kernel.SPAN
    w, h = correlated_layer(seed, n_exp=2, n_out=8, n_in=640, n_tokens=2000)
    (d, q, ok), (d_ref, q_ref) = _with_float64_reference(w, h)
    assert ok.all()
    assert np.mean(q != q_ref) <= 1e-2
    err = references.h_objective(w, d, q, h).sum(1)
    err_ref = references.h_objective(w, d_ref, q_ref, h).sum(1)
    assert err.sum() <= err_ref.sum() * (1 + 1e-3), (err, err_ref)
    search = q2_0.quantize_matrix(w, np.einsum("eii->ei", h), 0.3)
    err_search = references.h_objective(w, np.asarray(search.d), np.asarray(search.q), h)
    assert err.sum() < 0.9 * err_search.sum()


def test_second_moments_and_factor_match_float64():
    # Each expert's H over its routed rows (and the down projection's, over h), then the factor
    # H = V·D·Vᵀ (V unit upper) as feedback V − I and the inverses of V's diagonal 64-blocks:
    # against numpy in float64.
    rng = np.random.default_rng(3)
    n_tok, dim, ffn, n_exp = 300, 128, 128, 5
    x = rng.standard_normal((n_tok, dim)).astype(np.float32)
    ids = rng.integers(0, n_exp, (n_tok, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1) % n_exp
    wg, wu = (0.2 * rng.standard_normal((n_exp, ffn, dim)).astype(np.float32) for _ in range(2))
    experts = np.array([4, 0, 2])
    h = gptq.second_moments(x, ids, experts)
    h_down = gptq.second_moments(x, ids, experts, (wg, wu))
    x64 = x.astype(np.float64)
    for i, e in enumerate(experts):
        rows = x64[np.any(ids == e, axis=1)]
        np.testing.assert_allclose(h[i], rows.T @ rows, rtol=1e-5, atol=1e-4)
        g = rows @ wg[e].T.astype(np.float64)
        hid = g / (1 + np.exp(-g)) * (rows @ wu[e].T.astype(np.float64))
        np.testing.assert_allclose(h_down[i], hid.T @ hid, rtol=1e-4, atol=1e-4)
    p = gptq.prepare(h, 0.05)
    assert p.ok.all()
    flip = slice(None, None, -1)
    for i in range(len(experts)):
        hd = h[i].astype(np.float64) + 0.05 * np.trace(h[i].astype(np.float64)) / dim * np.eye(dim)
        np.testing.assert_allclose(p.damped[i], hd, rtol=1e-12)
        r = np.linalg.cholesky(hd[flip, flip])[flip, flip]  # upper, H = R·Rᵀ
        v = r / np.diag(r)
        np.testing.assert_allclose(p.feedback[i], v - np.eye(dim), rtol=1e-5, atol=1e-6)
        assert np.array_equal(p.feedback[i], np.triu(p.feedback[i], 1))
        for b in range(dim // 64):
            block = v[64 * b : 64 * b + 64, 64 * b : 64 * b + 64]
            np.testing.assert_allclose(p.block_inverse[i, b] @ block, np.eye(64), atol=1e-4)
        np.testing.assert_allclose(p.importance[i], np.diag(hd), rtol=1e-6)


def test_host_cholesky_matches_numpy_off_the_main_thread_and_reports_failure():
    from concurrent.futures import ThreadPoolExecutor

    from healsweep.quant._lapack import cholesky_lower, one_blas_thread

    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, 96))
    a = x.T @ x + np.eye(96)
    with ThreadPoolExecutor(2, initializer=one_blas_thread) as pool:  # as quantize_experts does
        copies = [a.copy() for _ in range(3)]
        assert list(pool.map(cholesky_lower, copies)) == [0, 0, 0]
    for m in copies:
        np.testing.assert_allclose(np.tril(m), np.linalg.cholesky(a), rtol=1e-12, atol=1e-12)
        assert np.array_equal(np.triu(m, 1), np.triu(a, 1))  # the other triangle untouched
    indefinite = a.copy()
    indefinite[10, 10] = -1.0
    assert cholesky_lower(indefinite) == 11  # LAPACK's 1-based index of the failing pivot
    for bad in (a.astype(np.float32), np.asfortranarray(a)[:, :95], a[:95].copy()):
        with pytest.raises(ValueError, match="square C-contiguous float64"):
            cholesky_lower(bad)


def test_unfactorable_second_moment_is_reported_not_trusted():
    h = np.zeros((3, 64, 64), np.float32)
    h[0] = np.eye(64)
    h[1, 0, 0] = np.nan
    h[2] = -np.eye(64)  # not positive definite however damped
    p = gptq.prepare(h, 0.01)
    assert p.ok.tolist() == [True, False, False]
    np.testing.assert_array_equal(p.feedback[1:], 0.0)
    np.testing.assert_array_equal(p.block_inverse[1:], np.broadcast_to(np.eye(64), (2, 1, 64, 64)))


def test_quantizer_knobs_are_validated_and_keyed_only_when_read():
    assert Knobs().quantizer == "search" and Knobs().gptq_damp == 0.01
    for bad, allowed in (
        ({"quantizer": "rtn"}, "one of search, gptq, plain"),
        ({"gptq_damp": 0.0}, r"a float in \(0, 1\]"),
        ({"gptq_damp": 1.5}, r"a float in \(0, 1\]"),
        ({"gptq_damp": float("nan")}, r"a float in \(0, 1\]"),
        ({"gptq_damp": True}, r"a float in \(0, 1\]"),
    ):
        name, value = next(iter(bad.items()))
        with pytest.raises(
            KnobError, match=rf"^knob '{name}' = .* is not allowed: expected {allowed}$"
        ):
            Knobs(**bad)
    search = stage_reads(Knobs(), "quantize")
    assert "quantizer" not in search and "gptq_damp" not in search  # keys from before gptq
    assert stage_reads(Knobs(gptq_damp=0.5), "quantize") == search  # inert under search
    gptq_read = stage_reads(Knobs(quantizer="gptq"), "quantize")
    assert gptq_read == {**search, "quantizer": "gptq", "gptq_damp": 0.01}
    assert stage_reads(Knobs(quantizer="gptq", gptq_damp=0.1), "quantize") != gptq_read
    assert reads_trace(Knobs(quantizer="gptq"), "gu", "q2_0")


def test_build_student_with_gptq_runs_caches_and_keys_by_the_trace(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    knobs = Knobs(quantizer="gptq", alpha="none", ridge=False)
    assert needs_trace(knobs, model) and not needs_trace(Knobs(alpha="none", ridge=False), model)
    student = build_student(model, knobs, CAL, cache, corpus=corpus)
    assert student.report["calibration"] is not None
    assert cache.computed["quantize"] == 2 * model.hparams.n_layer  # gate/up and down entries
    for layer in student.report["layers"]:
        fallback = layer["quantize"]["gptq_fallback"]
        assert set(fallback) == {"gate", "up", "down"}
        assert fallback["gate"]["not_factored"] == 0
    before = dict(cache.computed)
    again = build_student(model, knobs, CAL, cache, corpus=corpus)
    assert dict(cache.computed) == before and again.key == student.key  # nothing recomputed
    assert again.report["layers"][0]["quantize"] == student.report["layers"][0]["quantize"]

    search = build_student(model, Knobs(alpha="none", ridge=False), CAL, cache, corpus=corpus)
    assert search.key != student.key
    g, s = student.replacements[0].gate_exps, search.replacements[0].gate_exps
    assert g.shape == s.shape and not np.array_equal(np.asarray(g.codes), np.asarray(s.codes))

    # gptq reads the trace, so another calibration re-quantizes; another damping too.
    other_cal = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4, max_tokens=200)
    before = dict(cache.computed)
    build_student(model, knobs, other_cal, cache, corpus=corpus)
    assert cache.computed["quantize"] - before["quantize"] == 2 * model.hparams.n_layer
    before = dict(cache.computed)
    build_student(model, knobs.replace(gptq_damp=0.1), CAL, cache, corpus=corpus)
    assert cache.computed["quantize"] - before["quantize"] == 2 * model.hparams.n_layer


def test_gptq_lowers_the_routed_output_error_of_gate_and_up(setup, tmp_path):
    # On the fixture's own trace: each expert's gate/up output error on its routed tokens.
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    trace_knobs = Knobs(quantizer="gptq", alpha="none", ridge=False)
    student = build_student(model, trace_knobs, CAL, cache, corpus=corpus)
    search = build_student(
        model, Knobs(importance="act", alpha="none", ridge=False), CAL, cache, corpus=corpus
    )
    from healsweep.heal.trace import calibration_trace

    layer = calibration_trace(model, CAL, cache, corpus).layer(0)
    w = np.asarray(stages.expert_weights(model, 0)["ffn_gate_exps.weight"])
    enough = np.nonzero(layer["counts"] >= CAL.min_tokens_per_expert)[0]
    h = gptq.second_moments(layer["x"], layer["ids"], enough)
    errors = {}
    for name, built in (("gptq", student), ("search", search)):
        gate = built.replacements[0].gate_exps
        errors[name] = (
            references.h_objective(w[enough], np.asarray(gate.d)[enough], gate.q[enough], h)
            .sum(1)
            .sum()
        )
    assert errors["gptq"] < errors["search"]


def test_experts_with_too_few_tokens_fall_back_to_search_and_are_counted(setup, tmp_path):
    model, corpus = setup
    cache = StageCache(tmp_path / "cache")
    starved = CalibrationConfig(chunk_length=64, min_tokens_per_expert=10**6)
    gptq_student = build_student(
        model, Knobs(quantizer="gptq", alpha="none", ridge=False), starved, cache, corpus=corpus
    )
    search = build_student(model, Knobs(alpha="none", ridge=False), starved, cache, corpus=corpus)
    n_expert = model.hparams.n_expert
    for layer in gptq_student.report["layers"]:
        for counts in layer["quantize"]["gptq_fallback"].values():
            assert counts == {"few_tokens": n_expert, "not_factored": 0}
    for i in range(model.hparams.n_layer):
        for name in ("gate_exps", "up_exps", "down_exps"):
            got, ref = (
                getattr(gptq_student.replacements[i], name),
                getattr(search.replacements[i], name),
            )
            np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))
            np.testing.assert_array_equal(np.asarray(got.d), np.asarray(ref.d))


def test_stacks_sharing_an_input_give_what_each_gives_alone():
    """gate and up read the same x: quantized together (one H_e, one factorization per expert)
    each stack's codes and scales are exactly those of quantizing it alone, refine included."""
    rng = np.random.default_rng(5)
    n_exp, n_in, n_tokens = 11, 128, 600  # more experts than GROUP: a second group of 3, padded
    x = (rng.standard_normal((n_tokens, n_in)) * np.exp(rng.standard_normal(n_in))).astype(
        np.float32
    )
    ids = rng.integers(0, n_exp, size=(n_tokens, 2))
    gate = rng.standard_normal((n_exp, 16, n_in)).astype(np.float32)
    up = rng.standard_normal((n_exp, 24, n_in)).astype(np.float32)
    experts = np.arange(n_exp)
    for rounds in (0, 1):
        joint, ok = gptq.quantize_experts([gate, up], x, ids, experts, 0.3, 0.01, rounds=rounds)
        assert ok.all()
        for w, (d, q) in zip((gate, up), joint, strict=True):
            [(d1, q1)], ok1 = gptq.quantize_experts([w], x, ids, experts, 0.3, 0.01, rounds=rounds)
            assert ok1.all() and np.array_equal(q, q1)
            assert np.array_equal(d.view(np.uint16), d1.view(np.uint16))


def _few_rows_layer(seed, n_in=384, ffn=256, n_exp=10, n_tok=400):
    """FFN input ``x`` [n_tok, n_in] of mixed column scales routed top-2 over ``n_exp`` experts
    (each sees ~80 rows, well under ``n_in``), and gate, up, down stacks."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_tok, n_in)) * np.exp(rng.standard_normal(n_in))).astype(np.float32)
    ids = rng.integers(0, n_exp, (n_tok, 2))
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, n_exp - 1, n_tok)) % n_exp  # two distinct
    wg, wu = (0.2 * rng.standard_normal((n_exp, ffn, n_in)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((n_exp, 32, ffn)).astype(np.float32)
    return x, ids, wg, wu, wd


@pytest.mark.parametrize("seed", range(3))
def test_factor_rows_gives_the_dense_factor_in_float64(seed):
    # H = XᵀX + c·I of m < n rows: factor_rows's u gives V − I = triu(Xᵀu) (every j < k, inside
    # the diagonal blocks too), its diagonal blocks and their inverses, the importance and the
    # damped H, against numpy's Cholesky in float64
    rng = np.random.default_rng(seed)
    m, n, size = (40, 90, 64)[seed], 256, 128
    x = rng.standard_normal((m, n)) * np.exp(rng.standard_normal(n))
    f = gptq.factor_rows(x.astype(np.float32), 0.01, size, keep_damped=True)
    x64 = x.astype(np.float32).astype(np.float64)
    hd = x64.T @ x64
    hd += 0.01 * np.trace(hd) / n * np.eye(n)
    flip = slice(None, None, -1)
    r = np.linalg.cholesky(hd[flip, flip])[flip, flip]  # upper, H = R·Rᵀ
    v = r / np.diag(r)
    assert f.ok and f.u.shape == (size, n) and not f.u[m:].any()
    np.testing.assert_allclose(f.damped, hd, rtol=1e-12)
    np.testing.assert_allclose(f.importance, np.diag(hd), rtol=1e-6)
    feedback = np.triu(x64.T @ f.u[:m].astype(np.float64), 1)
    np.testing.assert_allclose(feedback, v - np.eye(n), rtol=0, atol=2e-5 * np.abs(v).max())
    for b in range(n // 64):
        block = v[64 * b : 64 * b + 64, 64 * b : 64 * b + 64]
        np.testing.assert_allclose(f.block_feedback[b], block - np.eye(64), atol=1e-5)
        np.testing.assert_allclose(f.block_inverse[b] @ block, np.eye(64), atol=1e-4)


def test_factor_rows_reports_rows_that_are_all_zero():
    f = gptq.factor_rows(np.zeros((5, 128), np.float32), 0.01, 64)
    assert not f.ok and not f.u.any() and not f.block_feedback.any()
    np.testing.assert_array_equal(f.block_inverse, np.broadcast_to(np.eye(64), (2, 64, 64)))


def test_factor_row_stack_gives_each_experts_own_factor_and_isolates_a_failure():
    # a group factored together, each expert's rows zero-padded to one size, gives each
    # expert's own factor_rows (in float64, up to the rounding of the batched products), and
    # an expert whose rows are all zero fails alone
    rng = np.random.default_rng(11)
    n, size = 192, 64
    counts = (40, 64, 0, 17)
    rows = np.zeros((len(counts), size, n), np.float32)
    for r, m in zip(rows, counts, strict=True):
        r[:m] = rng.standard_normal((m, n)) * np.exp(rng.standard_normal(n))
    stacked = gptq.factor_row_stack(rows, 0.01, keep_damped=True)
    np.testing.assert_array_equal(stacked.ok, [True, True, False, True])
    for e, m in enumerate(counts):
        alone = gptq.factor_rows(rows[e, :m], 0.01, size, keep_damped=True)
        assert alone.ok == stacked.ok[e]
        for field in ("u", "block_feedback", "block_inverse", "importance", "damped"):
            got, want = getattr(stacked, field)[e], getattr(alone, field)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("seed", range(4))
def test_low_rank_path_gives_the_dense_gptq(seed):
    """Experts with fewer routed rows than input channels, on the low-rank path
    (``low_rank_share`` 1) and the dense one (0): gate/up over x and down over the hidden h,
    with and without refine, 384 columns (two spans). The codes agree but for knife-edge
    roundings (one carries into its row's later columns), and the H-weighted error of each
    stack is the dense path's within 1%; without refine, both sit as close to the float64
    textbook GPTQ."""
    x, ids, wg, wu, wd = _few_rows_layer(seed)
    experts = np.arange(len(wg))
    rows = np.bincount(ids.ravel(), minlength=len(experts))
    assert rows.max() < min(wd.shape[2], wg.shape[2]) / 2
    for stacks, gate_up in (([wg[:, :48], wu[:, :48]], None), ([wd], (wg, wu))):
        h = gptq.second_moments(x, ids, experts, gate_up).astype(np.float64)
        for rounds in (0, 1):
            run = {
                share: gptq.quantize_experts(
                    stacks, x, ids, experts, 0.3, 0.01, gate_up, rounds, low_rank_share=share
                )
                for share in (0.0, 1.0)
            }
            assert run[0.0][1].all() and run[1.0][1].all()
            for k, w in enumerate(stacks):
                (d0, q0), (d1, q1) = run[0.0][0][k], run[1.0][0][k]
                assert np.mean(q0 != q1) < 5e-3
                err = [references.h_objective(w, d, q, h).sum() for d, q in ((d0, q0), (d1, q1))]
                assert abs(err[1] - err[0]) < 1e-2 * err[0], err
                if rounds:
                    continue
                hd = gptq.damped(h, 0.01).astype(np.float64)
                u = np.linalg.cholesky(np.linalg.inv(hd)).transpose(0, 2, 1)
                d_ref, q_ref = references.gptq(w, u, np.einsum("eii->ei", hd), 0.3)
                assert np.mean(q1 != q_ref) < 5e-3 and np.mean(q0 != q_ref) < 5e-3
                want = references.h_objective(w, d_ref, q_ref, hd).sum()
                got = references.h_objective(w, d1, q1, hd).sum()
                assert abs(got - want) < 1e-2 * want, (got, want)
