"""Model building blocks and captures against float64 numpy re-implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from healsweep.conformance import backend_violations
from healsweep.conformance.references import routed_experts as _routed_reference
from healsweep.model import LayerReplacement, forward, matmul, open_model, router_topk
from healsweep.model.forward import _block
from healsweep.model.layers import expert_tile_rows, rope_neox, routed_experts


@jax.tree_util.register_pytree_node_class
class RowScaled:
    """A quantized-weight pytree (int8 codes, one scale per row) with ``.dequantize()``.

    Stands in for any quantized expert weight: the forward's contract is only that such a
    pytree has ``.shape`` and ``.dequantize()``.
    """

    def __init__(self, scale, codes):
        self.scale, self.codes = scale, codes

    @classmethod
    def quantize(cls, w: np.ndarray) -> RowScaled:
        scale = np.abs(w).max(axis=-1) / 127.0
        return cls(scale.astype(np.float32), np.round(w / scale[..., None]).astype(np.int8))

    @property
    def shape(self):
        return self.codes.shape

    def dequantize(self):
        return self.codes.astype(jnp.float32) * self.scale[..., None]

    def tree_flatten(self):
        return (self.scale, self.codes), None

    @classmethod
    def tree_unflatten(cls, _, leaves):
        return cls(*leaves)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("skewed", [False, True], ids=["spread", "two-experts-only"])
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "pytree"])
def test_routed_experts_match_a_token_loop(skewed, quantized):
    rng = np.random.default_rng(0)
    n, d, f, e, k = 53, 16, 12, 6, 2
    x = rng.standard_normal((n, d)).astype(np.float32)
    wg, wu = (rng.standard_normal((e, f, d)).astype(np.float32) / 4 for _ in range(2))
    wd = rng.standard_normal((e, d, f)).astype(np.float32) / 4
    ids = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    if skewed:  # experts 2..5 get nothing: empty groups and a long run for one expert
        ids = np.tile(np.array([[1, 0]], np.int32), (n, 1))
    weights = rng.random((n, k)).astype(np.float32)
    weights_in = [RowScaled.quantize(w) for w in (wg, wu, wd)] if quantized else [wg, wu, wd]
    dense = [np.asarray(w.dequantize()) for w in weights_in] if quantized else [wg, wu, wd]
    ref = _routed_reference(x, ids, weights, *dense)
    jitted = jax.jit(routed_experts, static_argnums=(6, 7))
    for tile in (8, expert_tile_rows(n * k, e), 64):
        got = jitted(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), *weights_in, e, tile)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5)


def test_router_topk_softmax_and_renormalization():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((20, 8)).astype(np.float32) * 3
    probs = _softmax(logits.astype(np.float64))
    ids, weights = router_topk(jnp.asarray(logits), 3, normalize=False)
    ids, weights = np.asarray(ids), np.asarray(weights)
    np.testing.assert_array_equal(ids, np.argsort(-probs, axis=1)[:, :3])
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids, 1), rtol=1e-5)
    assert np.all(weights.sum(1) < 1)
    _, normed = router_topk(jnp.asarray(logits), 3, normalize=True)
    np.testing.assert_allclose(np.asarray(normed).sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(normed), weights / weights.sum(1, keepdims=True), rtol=1e-5
    )


def test_rope_neox_rotates_halves_and_preserves_norms():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 3, 8)).astype(np.float32)
    pos = np.arange(9)
    got = np.asarray(rope_neox(jnp.asarray(x), jnp.asarray(pos), 10000.0))
    inv = 10000.0 ** (-np.arange(4) * 2 / 8)
    ang = pos[:, None, None] * inv[None, None, :]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
    ref = np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1
    )
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_matmul_accepts_dense_and_quantized_pytrees():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal((7, 16))
    q = RowScaled.quantize(w.astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(matmul(jnp.asarray(x), w.astype(np.float32))), x @ w.T, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(matmul(jnp.asarray(x), q)),
        x @ np.asarray(q.dequantize()).T,
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_captures_match_numpy_from_the_layer_weights(random_gguf, arch):
    model = open_model(random_gguf(arch, n_layer=2, seed=4))
    hp = model.hparams
    seqs = [np.arange(3, 40, dtype=np.int32), np.arange(100, 170, dtype=np.int32)]
    result = forward(model, seqs, capture=True)
    assert len(result.captures) == hp.n_layer
    for i, cap in enumerate(result.captures):
        w = {k: v.astype(np.float64) for k, v in model.layer(i).items()}
        x = cap.ffn_input.astype(np.float64)
        assert x.shape == (37 + 70, hp.n_embd)
        logits = x @ w["ffn_gate_inp.weight"].T
        np.testing.assert_allclose(cap.router_logits, logits, rtol=1e-4, atol=1e-4)
        probs = _softmax(logits)
        np.testing.assert_array_equal(
            np.sort(cap.topk_ids, 1), np.sort(np.argsort(-probs, 1)[:, : hp.n_expert_used], 1)
        )
        chosen = np.take_along_axis(probs, cap.topk_ids, 1)
        if hp.norm_topk_prob:
            chosen = chosen / chosen.sum(1, keepdims=True)
        np.testing.assert_allclose(cap.topk_weights, chosen, rtol=1e-4, atol=1e-6)
        routed = _routed_reference(
            x,
            cap.topk_ids,
            chosen,
            w["ffn_gate_exps.weight"],
            w["ffn_up_exps.weight"],
            w["ffn_down_exps.weight"],
        )
        np.testing.assert_allclose(cap.routed_output, routed, rtol=1e-3, atol=1e-4)
        np.testing.assert_array_equal(result.router[1][:, i], cap.topk_ids[37:])
        if arch == "qwen2moe":
            gate = 1 / (1 + np.exp(-(x @ w["ffn_gate_inp_shexp.weight"])))
            np.testing.assert_allclose(cap.shexp_gate, gate, rtol=1e-4, atol=1e-6)
        else:
            assert cap.shexp_gate.size == 0


def test_padding_and_batching_do_not_change_a_sequence(random_gguf):
    model = open_model(random_gguf("qwen2moe", seed=6))
    short = np.arange(5, 30, dtype=np.int32)
    alone = forward(model, [short]).logits[0]
    batched = forward(model, [np.arange(200, dtype=np.int32) % 300, short]).logits[1]
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)


def test_replacements_swap_expert_and_shared_weights(random_gguf):
    model = open_model(random_gguf("qwen2moe", seed=7))
    seq = [np.arange(10, 60, dtype=np.int32)]
    base = forward(model, seq, capture=True)
    layer = model.layer(1)
    same = {
        1: LayerReplacement(
            gate_exps=layer["ffn_gate_exps.weight"],
            up_exps=layer["ffn_up_exps.weight"],
            down_exps=layer["ffn_down_exps.weight"],
            down_shexp=layer["ffn_down_shexp.weight"],
        )
    }
    np.testing.assert_allclose(
        forward(model, seq, replacements=same).logits[0], base.logits[0], rtol=1e-5, atol=1e-5
    )
    quantized = {1: LayerReplacement(down_exps=RowScaled.quantize(layer["ffn_down_exps.weight"]))}
    q_run = forward(model, seq, replacements=quantized, capture=True)
    np.testing.assert_array_equal(q_run.captures[0].routed_output, base.captures[0].routed_output)
    cap = q_run.captures[1]
    dense_q = np.asarray(quantized[1].down_exps.dequantize())
    ref = _routed_reference(
        cap.ffn_input,
        cap.topk_ids,
        cap.topk_weights,
        layer["ffn_gate_exps.weight"],
        layer["ffn_up_exps.weight"],
        dense_q,
    )
    np.testing.assert_allclose(cap.routed_output, ref, rtol=1e-3, atol=1e-4)
    zero = {0: LayerReplacement(down_shexp=np.zeros_like(layer["ffn_down_shexp.weight"]))}
    assert np.abs(forward(model, seq, replacements=zero).logits[0] - base.logits[0]).max() > 1e-3
    with pytest.raises(ValueError, match="expected"):
        forward(model, seq, replacements={0: LayerReplacement(down_exps=np.zeros((2, 2)))})


@pytest.mark.parametrize(
    "arch, layer, shape",
    [
        ("qwen3moe", 0, {}),
        ("olmoe", 0, {"n_head_kv": 4}),
        ("glm4moe", 0, {"n_leading_dense": 1}),  # the dense layer
        ("glm4moe", 1, {"n_leading_dense": 1, "n_expert_groups": 4, "n_group_used": 2}),
        ("deepseek2", 1, {"kv_b_split": True, "yarn_factor": 40.0, "yarn_orig_ctx": 64}),
    ],
)
def test_layer_function_stays_inside_the_metal_rules(random_gguf, arch, layer, shape):
    model = open_model(random_gguf(arch, seed=8, **shape))
    hp = model.hparams
    weights = {k: jnp.asarray(v) for k, v in model.layer(layer).items()}
    h = jnp.zeros((2, 64, hp.n_embd), jnp.float32)
    dense = layer < hp.n_leading_dense
    fn = lambda w, h: _block(hp, 16, True, dense, w, h, jnp.arange(64, dtype=jnp.int32))  # noqa: E731
    assert backend_violations(fn, weights, h) == []
