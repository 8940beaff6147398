"""Routing variants, RoPE kinds and heal notices of the added architectures, against float64 numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.heal.knobs import Knobs
from healsweep.heal.pipeline import skip_notices
from healsweep.model import open_model
from healsweep.model.layers import rope
from healsweep.model.routing import select_experts


def _reference_selection(logits, k, *, normalize, gating, scale, bias, n_groups, n_used):
    """llama.cpp's build_moe_ffn selection, token by token, in float64."""
    logits = logits.astype(np.float64)
    ids_out, w_out = [], []
    for row in logits:
        if gating == "softmax":
            probs = np.exp(row - row.max())
            probs /= probs.sum()
        else:
            probs = 1 / (1 + np.exp(-row))
        sel = probs + (0 if bias is None else bias)
        if n_groups > 1:
            groups = sel.reshape(n_groups, -1)
            score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
            allowed = np.argsort(-score)[:n_used]
            mask = np.full(n_groups, -np.inf)
            mask[allowed] = 0
            sel = (groups + mask[:, None]).reshape(-1)
        ids = np.argsort(-sel)[:k]
        w = probs[ids]
        if normalize:
            w = w / w.sum()
        ids_out.append(ids)
        w_out.append(w * scale)
    return np.array(ids_out), np.array(w_out)


@pytest.mark.parametrize(
    "variant",
    [
        dict(normalize=False, gating="softmax", scale=1.0, bias=False, n_groups=0, n_used=0),
        dict(normalize=True, gating="softmax", scale=1.0, bias=False, n_groups=0, n_used=0),
        dict(normalize=True, gating="sigmoid", scale=2.5, bias=True, n_groups=0, n_used=0),
        dict(normalize=True, gating="sigmoid", scale=2.5, bias=True, n_groups=4, n_used=2),
        dict(normalize=False, gating="softmax", scale=16.0, bias=False, n_groups=8, n_used=3),
    ],
)
def test_select_experts_matches_llama_cpp_rules(variant):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32) if variant["bias"] else None
    ids, weights = select_experts(
        jnp.asarray(logits),
        4,
        normalize=variant["normalize"],
        gating=variant["gating"],
        scale=variant["scale"],
        selection_bias=None if bias is None else jnp.asarray(bias),
        n_groups=variant["n_groups"],
        n_groups_used=variant["n_used"],
    )
    ref_ids, ref_w = _reference_selection(
        logits,
        4,
        normalize=variant["normalize"],
        gating=variant["gating"],
        scale=variant["scale"],
        bias=bias,
        n_groups=variant["n_groups"],
        n_used=variant["n_used"],
    )
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=2e-6, atol=1e-7)
    if variant["n_groups"] > 1:  # every chosen expert lies in an allowed group
        per_group = 16 // variant["n_groups"]
        assert all(len(set(row // per_group)) <= variant["n_used"] for row in np.asarray(ids))


@pytest.mark.parametrize("kind", ["neox", "norm"])
@pytest.mark.parametrize("n_rot", [8, 16])
def test_rope_kinds_against_numpy(kind, n_rot):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 3, 16)).astype(np.float32)
    pos = np.arange(7)
    ref = x.astype(np.float64).copy()
    for i in range(n_rot // 2):
        theta = pos * 10000.0 ** (-2 * i / n_rot)
        a, b = (i, i + n_rot // 2) if kind == "neox" else (2 * i, 2 * i + 1)
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        xa, xb = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
        ref[..., a], ref[..., b] = xa * c - xb * s, xb * c + xa * s
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 10000.0, n_rot, kind))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["olmoe", "llama"])
def test_part_b_is_skipped_with_one_line_without_a_shared_expert(random_gguf, arch):
    model = open_model(random_gguf(arch, n_head_kv=4))
    notices = skip_notices(Knobs(ridge=True), model)
    assert len(notices) == 1 and notices[0].stage == "part_b"
    assert notices[0].text.startswith(f"Part B skipped: {arch} has no shared expert")
    assert skip_notices(Knobs(ridge=False), model) == []
    assert skip_notices(Knobs(ridge=True), open_model(random_gguf("qwen2moe"))) == []
