"""One layer's forward through ``healsweep.model.forward`` against a float64 numpy layer.

The shipped demo model seen with one layer (``with_hparams(n_layer=1)``): its logits then
depend on the attention, the router, the routed experts and the shared expert of layer 0, and
the forward's capture of that layer is compared too. Only the public ``healsweep.model``
interface is used. The weights reach the reference as gguf-py dequantizes them (on the host),
the forward decodes their stored bytes in the graph.

A token whose k-th and (k+1)-th expert probabilities are within ``ROUTING_TIE`` may be routed
either way in float32; its rows are left out of the comparison (at most a tenth may be).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from healsweep.conformance import references as ref
from healsweep.conformance.run import KernelCase, max_rel_err
from healsweep.gguf_io import block_prefix
from healsweep.model import forward, open_model

N_TOKENS = 48
ROUTING_TIE = 1e-4
# The forward keeps the backend's default matmul precision: TF32 on NVIDIA GPUs (relative
# errors near 1e-3, as against llama.cpp and transformers); full float32 on a CPU.
RTOL = {"cpu": 1e-4, "accelerator": 2e-3}
FIELDS = ("ffn_input", "router_logits", "topk_weights", "routed_output", "shexp_gate")


@cache
def demo_layer_model():
    """The packaged demo model, its first layer only."""

    return open_model("demo").with_hparams(n_layer=1)


def _inputs(rng: np.random.Generator) -> tuple[np.ndarray]:
    n_vocab = demo_layer_model().hparams.n_vocab
    return (rng.integers(0, n_vocab, N_TOKENS).astype(np.int32),)


def _forward(tokens: np.ndarray, platform: str) -> dict[str, np.ndarray]:
    result = forward(demo_layer_model(), [tokens], capture=True)
    cap = result.captures[0]
    return {"logits": result.logits[0], **{f: getattr(cap, f) for f in (*FIELDS, "topk_ids")}}


def _reference(tokens: np.ndarray) -> dict[str, np.ndarray]:
    model = demo_layer_model()
    hp = model.hparams
    weights = {
        name.removeprefix(block_prefix(0)): model.tensor(name)
        for name in model.tensor_names
        if name.startswith(block_prefix(0))
    }
    weights["token_embd"] = model.tensor("token_embd.weight")
    weights["output_norm"] = model.tensor("output_norm.weight")
    head = "output.weight" if "output.weight" in model.tensor_names else "token_embd.weight"
    weights["output"] = model.tensor(head)
    config = {
        "n_head": hp.n_head, "n_head_kv": hp.n_head_kv, "n_rot": hp.rope_dim,
        "rope_kind": hp.rope_kind, "rope_base": hp.rope_freq_base, "eps": hp.rms_norm_eps,
        "n_expert_used": hp.n_expert_used, "norm_topk_prob": hp.norm_topk_prob,
    }  # fmt: skip
    return ref.moe_layer_logits(tokens, weights, config)


def _by_id(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)


def _check(got, want, inputs) -> tuple[float, str | None]:
    # lazy: heavy (jax)
    import jax

    rtol = RTOL["cpu" if jax.default_backend() == "cpu" else "accelerator"]
    got = {k: np.asarray(v) for k, v in got.items()}
    ids, weights = _by_id(got["topk_ids"], got["topk_weights"])
    ids_ref, weights_ref = _by_id(want["topk_ids"], want["topk_weights"])
    same = (ids == ids_ref).all(axis=1)
    tie = want["routing_gap"] < ROUTING_TIE
    if (~same & ~tie).any():
        return np.inf, f"{int((~same & ~tie).sum())} tokens routed to other experts, no near-tie"
    if same.mean() < 0.9:
        return np.inf, f"{int((~same).sum())} of {len(same)} tokens at routing near-ties"
    got["topk_weights"], want = weights, {**want, "topk_weights": weights_ref}
    errors = {}
    for field in ("logits", *FIELDS):
        mine, theirs = got[field], want[field]
        if mine.size and theirs.size:
            mine, theirs = mine[same], theirs[same]
        errors[field] = max_rel_err(mine, theirs)
    worst = max(errors, key=errors.get)
    if errors[worst] <= rtol:
        return errors[worst], None
    return errors[worst], f"{worst} off the float64 layer by {errors[worst]:.2e} (> {rtol:.0e})"


def _path(platform: str) -> str:
    return "demo layer 0"


def layer_case() -> KernelCase:
    """Layer 0 of the demo model (attention, routing, routed and shared experts, the head)."""
    return KernelCase(
        "model.forward",
        _forward,
        _inputs,
        _reference,
        check=_check,
        device_rtol=None,  # a near-tie may route differently: the references judge each run
        driver=True,
        path=_path,
    )
