"""GPTQ on ggml's Q2_K / Q3_K grids: the kernel against a float64 numpy loop, the grid read from
and written to ggml's bytes, and the H-weighted error against ggml's own codes.

The kernel tests need no ggml (they run in the jax 0.5.0 tier); those on ggml's bytes are slow.
"""

from __future__ import annotations

import numpy as np
import pytest

from _heal_fixtures import correlated_layer
from healsweep.conformance import references as ref
from healsweep.kernels import gptq_grid


def _damped(h: np.ndarray, damp: float = 0.01) -> np.ndarray:
    return np.stack([m + damp * np.mean(np.diag(m)) * np.eye(len(m)) for m in h.astype(float)])


def _upper_inverse_factor(h: np.ndarray) -> np.ndarray:
    """Upper ``u`` with ``uᵀu = H⁻¹`` (classic GPTQ's factor), float64 numpy, per matrix."""
    return np.stack([np.linalg.cholesky(np.linalg.inv(m)).T for m in h])


def _feedback(h: np.ndarray) -> np.ndarray:
    """``V − I`` of ``H = V·D·Vᵀ`` (``V`` unit upper; the kernel's LDLQ form), float64 numpy."""
    out = []
    for m in h:
        r = np.linalg.cholesky(m[::-1, ::-1])[::-1, ::-1]  # upper, H = R·Rᵀ
        out.append(r / np.diag(r)[None, :] - np.eye(len(m)))
    return np.stack(out)


@pytest.mark.parametrize(("shift", "n_codes"), [(0, 4), (4, 8)])
def test_kernel_codes_are_a_float64_column_loop(shift, n_codes):
    w, h = correlated_layer(3, n_exp=2, n_out=6, n_in=128, n_tokens=600)
    rng = np.random.default_rng(4)
    scale = rng.uniform(0.2, 0.6, (2, 6, 8)).astype(np.float32) * rng.choice([-1, 1], (2, 6, 8))
    offset = rng.uniform(0.0, 0.8, (2, 6, 8)).astype(np.float32) * (shift == 0)
    h = _damped(h)
    f = _feedback(h).astype(np.float32)
    got = np.asarray(gptq_grid.quantize(w, scale, offset, f, shift, n_codes))
    want = ref.gptq_grid(w, scale, offset, _upper_inverse_factor(h), shift, n_codes)
    assert got.dtype == np.int32 and got.min() >= 0 and got.max() < n_codes
    # float32 against float64 error propagation: an early flip of a near-tie changes what follows
    assert np.mean(got == want) > 0.97
    # no feedback (a diagonal H) propagates nothing: every code is the nearest one
    none = np.zeros(f.shape, np.float32)
    nearest = gptq_grid.nearest_codes(w, np.repeat(scale, 16, axis=2),
                                      np.repeat(offset, 16, axis=2), shift, n_codes)[0]  # fmt: skip
    np.testing.assert_array_equal(gptq_grid.quantize(w, scale, offset, none, shift, n_codes),
                                  nearest)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["q2_k", "q3_k"])
def test_ggml_bytes_are_the_nearest_codes_of_their_grid_and_gptq_lowers_the_h_error(name):
    from healsweep.gguf_io._ggml_lib import dequantize_rows
    from healsweep.kernels.ggml_types import ggml_type
    from healsweep.quant import kgrid
    from healsweep.quant.imatrix import quantize_expert_stack

    qtype = ggml_type(name).ggml_id
    w, h = correlated_layer(5, n_exp=3, n_out=16, n_in=256, n_tokens=2000)
    imatrix = np.einsum("eii->ei", h) / 2000
    raw = quantize_expert_stack(w, qtype, imatrix.astype(np.float32))
    ggml = dequantize_rows(raw, qtype, 256)  # ggml's own to_float
    scale, offset, shift, n_codes = kgrid.grid(raw, qtype)
    codes, values = gptq_grid.nearest_codes(w, np.repeat(scale, 16, axis=-1),
                                            np.repeat(offset, 16, axis=-1), shift, n_codes)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(values), ggml)  # the grid decodes as ggml does
    np.testing.assert_array_equal(kgrid.with_codes(raw, qtype, np.asarray(codes)), raw)
    f = _feedback(_damped(h)).astype(np.float32)
    refined = kgrid.with_codes(raw, qtype, np.asarray(gptq_grid.quantize(w, scale, offset, f,
                                                                         shift, n_codes)))  # fmt: skip
    ours = dequantize_rows(refined, qtype, 256)
    size, kept = {"q2_k": (84, np.r_[0:16, 80:84]), "q3_k": (110, np.r_[96:110])}[name]
    blocks = lambda rows: rows.reshape(*rows.shape[:-1], -1, size)[..., kept]  # noqa: E731
    np.testing.assert_array_equal(blocks(refined), blocks(raw))  # the grid's scales are kept

    def h_error(q):
        d = (w - q).astype(np.float64)
        return np.einsum("eoi,eij,eoj->e", d, h, d)

    before, after = h_error(ggml), h_error(ours)
    print(f"{name}: H-weighted error ggml {before.sum():.4g}, gptq {after.sum():.4g} "
          f"({100 * (after.sum() / before.sum() - 1):+.1f}%)")  # fmt: skip
    assert np.all(after < before)
