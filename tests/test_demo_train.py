"""The demo model's training code: its forward against transformers and the runtime, AdamW,
determinism."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from healsweep.demo import train as tr

SMALL = tr.MoEConfig(
    n_vocab=96,
    n_layer=2,
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=16,
    n_expert=8,
    n_expert_used=2,
    n_ff_exp=64,
    n_ff_shexp=32,
    rope_freq_base=10000.0,
    context_length=64,
)


def _scaled_params(cfg: tr.MoEConfig, seed: int, scale: float) -> tr.Params:
    """Random parameters, enlarged so attention, routing and gates are far from uniform."""
    params = tr.init_params(cfg, seed)
    rng = np.random.default_rng(seed)

    def grow(name: str, value: jax.Array) -> jax.Array:
        if name.endswith("norm.weight"):
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(value.shape), jnp.float32)
        if name.endswith(".bias"):
            return jnp.asarray(0.1 * rng.standard_normal(value.shape), jnp.float32)
        return value * scale

    out = {n: grow(n, v) for n, v in params.items() if n != "blk"}
    out["blk"] = [{n: grow(n, v) for n, v in layer.items()} for layer in params["blk"]]
    return out


def _hf_model(
    params: tr.Params, cfg: tr.MoEConfig, renormalize: bool = False
) -> Qwen2MoeForCausalLM:
    """A transformers Qwen2-MoE holding the same weights (an independent forward)."""
    hf_cfg = Qwen2MoeConfig(
        vocab_size=cfg.n_vocab,
        hidden_size=cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head_kv,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.n_ff_shexp,
        moe_intermediate_size=cfg.n_ff_exp,
        shared_expert_intermediate_size=cfg.n_ff_shexp,
        num_experts=cfg.n_expert,
        num_experts_per_tok=cfg.n_expert_used,
        norm_topk_prob=renormalize,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.context_length,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_freq_base},
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        qkv_bias=True,
    )
    model = Qwen2MoeForCausalLM(hf_cfg).eval()
    model.config._attn_implementation = "eager"

    def t(x: jax.Array) -> torch.Tensor:
        return torch.from_numpy(np.asarray(x, np.float32).copy())

    state = {
        "model.embed_tokens.weight": t(params["token_embd.weight"]),
        "model.norm.weight": t(params["output_norm.weight"]),
        "lm_head.weight": t(params["output.weight"]),
    }
    for i, p in enumerate(params["blk"]):
        pre = f"model.layers.{i}."
        state.update(
            {
                pre + "input_layernorm.weight": t(p["attn_norm.weight"]),
                pre + "post_attention_layernorm.weight": t(p["ffn_norm.weight"]),
                pre + "self_attn.o_proj.weight": t(p["attn_output.weight"]),
                pre + "mlp.gate.weight": t(p["ffn_gate_inp.weight"]),
                pre + "mlp.experts.gate_up_proj": t(
                    np.concatenate([p["ffn_gate_exps.weight"], p["ffn_up_exps.weight"]], axis=1)
                ),
                pre + "mlp.experts.down_proj": t(p["ffn_down_exps.weight"]),
                pre + "mlp.shared_expert.gate_proj.weight": t(p["ffn_gate_shexp.weight"]),
                pre + "mlp.shared_expert.up_proj.weight": t(p["ffn_up_shexp.weight"]),
                pre + "mlp.shared_expert.down_proj.weight": t(p["ffn_down_shexp.weight"]),
                pre + "mlp.shared_expert_gate.weight": t(p["ffn_gate_inp_shexp.weight"][None, :]),
            }
        )
        for proj in "qkv":
            state[pre + f"self_attn.{proj}_proj.weight"] = t(p[f"attn_{proj}.weight"])
            state[pre + f"self_attn.{proj}_proj.bias"] = t(p[f"attn_{proj}.bias"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def test_training_forward_matches_transformers_qwen2moe() -> None:
    params = _scaled_params(SMALL, seed=3, scale=8.0)
    tokens = np.random.default_rng(0).integers(0, SMALL.n_vocab, size=(2, 40)).astype(np.int32)
    ours, moe = tr.forward(params, jnp.asarray(tokens), SMALL)
    with torch.no_grad():
        ref = _hf_model(params, SMALL)(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    ours = np.asarray(ours)
    assert np.max(np.abs(ours - ref)) <= 2e-4 * np.max(np.abs(ref))
    # The comparison is not vacuous: routing is far from uniform and logits are spread out,
    # and the qwen3moe rule (top-k weights renormalized) misses by far.
    assert np.std(ref) > 0.5
    assert float(jnp.max(moe[0].router_probs)) > 0.5
    with torch.no_grad():
        wrong = _hf_model(params, SMALL, renormalize=True)(
            torch.from_numpy(tokens.astype(np.int64))
        ).logits.numpy()
    assert np.max(np.abs(ours - wrong)) > 1e-2 * np.max(np.abs(ref))


def test_load_balance_loss_is_one_when_uniform_and_larger_when_collapsed() -> None:
    e, k = 8, 2
    uniform_probs = jnp.full((1, e, e), 1.0 / e)
    mask = jnp.stack([jax.nn.one_hot(jnp.array([i, (i + 1) % e]), e).sum(0) for i in range(e)])
    balanced = tr.MoEOutput(jnp.zeros(1), uniform_probs, mask[None])
    assert float(tr.load_balance_loss(balanced, k)) == pytest.approx(1.0, rel=1e-6)
    collapsed_probs = jnp.zeros((1, e, e)).at[..., :2].set(0.5)
    collapsed_mask = jnp.zeros((1, e, e)).at[..., :2].set(1.0)
    collapsed = tr.MoEOutput(jnp.zeros(1), collapsed_probs, collapsed_mask)
    assert float(tr.load_balance_loss(collapsed, k)) == pytest.approx(e / 2, rel=1e-6)


def test_adamw_steps_match_numpy_float64() -> None:
    """Two steps of the trainer's optax AdamW, against a float64 numpy re-implementation."""
    tcfg = tr.TrainConfig(
        steps=10, warmup_steps=0, learning_rate=1e-2, grad_clip=0.5, weight_decay=0.1
    )
    rng = np.random.default_rng(1)
    params = {
        "w.weight": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
        "b.bias": jnp.asarray(rng.standard_normal(4), jnp.float32),
        "blk": [],
    }
    grads = {
        "w.weight": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
        "b.bias": jnp.asarray(rng.standard_normal(4), jnp.float32),
        "blk": [],
    }
    opt = tr.optimizer(tcfg, tr.decay_mask(params))
    state = opt.init(params)
    new = params
    for _ in range(2):
        updates, state = opt.update(grads, state, new)
        new = optax.apply_updates(new, updates)
    norm = np.sqrt(sum(np.sum(np.float64(grads[n]) ** 2) for n in ("w.weight", "b.bias")))
    assert norm > 0.5  # the clipping bites
    for name, decay in (("w.weight", True), ("b.bias", False)):
        p, g = np.float64(params[name]), np.float64(grads[name]) * 0.5 / norm
        m = v = np.zeros_like(p)
        for t in (1, 2):
            lr = 1e-2 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (t - 1) / 10)))
            m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g
            upd = (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.95**t)) + 1e-8)
            p = p - lr * (upd + (0.1 * p if decay else 0.0))
        np.testing.assert_allclose(np.asarray(new[name]), p, rtol=1e-5, atol=1e-6)


def _synthetic_stream(n_vocab: int, seed: int) -> np.ndarray:
    """Documents made of repeated phrases: learnable, unlike uniform noise."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, n_vocab, size=rng.integers(4, 9)) for _ in range(12)]
    docs = [
        np.concatenate([phrases[i] for i in rng.integers(0, 12, size=10)] + [[0]])
        for _ in range(300)
    ]
    return np.concatenate(docs).astype(np.int32)


def test_training_learns_and_is_deterministic_in_the_seed() -> None:
    tiny = tr.MoEConfig(
        n_vocab=48,
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_head_kv=1,
        head_dim=16,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        n_ff_shexp=32,
    )
    stream = _synthetic_stream(tiny.n_vocab, seed=0)
    tcfg = tr.TrainConfig(steps=80, batch_size=4, seq_len=32, warmup_steps=10, seed=5)
    first = tr.train(stream, tiny, tcfg, log_every=20)
    again = tr.train(stream, tiny, tcfg, log_every=20)
    assert first.history == again.history
    for a, b in zip(
        jax.tree_util.tree_leaves(first.params),
        jax.tree_util.tree_leaves(again.params),
        strict=True,
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert first.history[-1][2] < 0.6 * np.log(tiny.n_vocab)  # well below a uniform guess
    other = dataclasses.replace(tcfg, seed=6)
    assert not np.array_equal(
        tr.batch_starts(len(stream), other), tr.batch_starts(len(stream), tcfg)
    )
    assert not np.array_equal(
        tr.init_params(tiny, 6)["output.weight"], tr.init_params(tiny, 5)["output.weight"]
    )


def test_a_stopped_training_resumes_from_its_checkpoint_bit_for_bit(tmp_path) -> None:
    """A run killed after a checkpoint continues from it and ends with the same parameters and
    history as an uninterrupted run; a checkpoint of another recipe is not resumed."""
    tiny = tr.MoEConfig(
        n_vocab=48, n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16,
        n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32,
    )  # fmt: skip
    stream = _synthetic_stream(tiny.n_vocab, seed=0)
    tcfg = tr.TrainConfig(steps=12, batch_size=2, seq_len=16, warmup_steps=3, seed=1)
    whole = tr.train(stream, tiny, tcfg, log_every=4)

    ckpt = tmp_path / "run.npz"
    stopped = dataclasses.replace(tcfg, steps=7)  # another recipe: its checkpoint is not reused
    tr.train(stream, tiny, stopped, log_every=4, checkpoint=ckpt, checkpoint_every=5)
    assert ckpt.exists()
    assert tr._read_checkpoint(ckpt, tr._run_identity(stream, tiny, tcfg), None) is None

    # the real interruption: a run of the full recipe that raises after its step-10 checkpoint
    calls = []

    def stop_at_eight(log, params):
        calls.append(log.step)
        if log.step == 8:
            raise KeyboardInterrupt  # the checkpoint of step 5 is on disk; step 10's is not yet

    with pytest.raises(KeyboardInterrupt):
        tr.train(stream, tiny, tcfg, log_every=4, checkpoint=ckpt, checkpoint_every=5,
                 progress=stop_at_eight)  # fmt: skip
    resumed = tr.train(stream, tiny, tcfg, log_every=4, checkpoint=ckpt, checkpoint_every=5)
    assert resumed.history == whole.history
    for a, b in zip(
        jax.tree_util.tree_leaves(whole.params),
        jax.tree_util.tree_leaves(resumed.params),
        strict=True,
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_gguf_tensor_names_round_trip() -> None:
    params = tr.init_params(SMALL, seed=0)
    tensors = tr.to_gguf_tensors(params)
    assert tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 64)
    assert tensors["blk.0.attn_k.weight"].shape == (32, 64)
    back = tr.from_gguf_tensors(tensors, SMALL.n_layer)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)


def _tiny_tokenizer():
    from tokenizers import Tokenizer

    from healsweep.demo.tokenizer import train_tokenizer

    texts = [
        f"<|im_start|>user\nwhat is {w}?<|im_end|>\n<|im_start|>assistant\n<think>\nabout {w}"
        f"\n</think>\n\n{w} is a word.<|im_end|>\n"
        for w in ("alpha", "beta", "gamma", "delta")
    ]
    tok = train_tokenizer(texts * 3, vocab_size=300)
    assert isinstance(tok, Tokenizer)
    return tok


def test_written_gguf_runs_the_same_in_the_runtime_forward(tmp_path) -> None:
    """Training forward == healsweep.model.forward on the GGUF written from the same params.

    The GGUF stores matrices as F16, so the training forward gets the F16-rounded matrices.
    """
    from healsweep.demo.build import write_demo_model
    from healsweep.model import forward, open_model

    tokenizer = _tiny_tokenizer()
    cfg = dataclasses.replace(SMALL, n_vocab=tokenizer.get_vocab_size())
    params = jax.tree_util.tree_map(
        lambda w: w.astype(jnp.float16).astype(jnp.float32) if w.ndim > 1 else w,
        _scaled_params(cfg, seed=7, scale=8.0),
    )
    path = write_demo_model(tmp_path / "m.gguf", params, cfg, tokenizer)
    model = open_model(path)
    assert model.hparams.n_ff_shexp == cfg.n_ff_shexp and not model.hparams.norm_topk_prob
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.n_vocab, size=n).astype(np.int32) for n in (37, 20)]
    runtime = forward(model, seqs)
    for seq, logits in zip(seqs, runtime.logits, strict=True):
        ours, moe = tr.forward(params, jnp.asarray(seq[None, :]), cfg)
        ours = np.asarray(ours[0])
        assert np.max(np.abs(ours - logits)) <= 2e-4 * np.max(np.abs(ours))
    # the same experts are chosen, token by token and layer by layer
    _, moe = tr.forward(params, jnp.asarray(seqs[0][None, :]), cfg)
    for layer, m in enumerate(moe):
        ours_ids = np.sort(np.asarray(jax.lax.top_k(m.router_probs[0], cfg.n_expert_used)[1]), -1)
        assert np.array_equal(ours_ids, np.sort(runtime.router[0][:, layer], -1))
    assert model.tokenizer().encode("what is beta?").ids == tokenizer.encode("what is beta?").ids
    # held-out scoring by the training forward == by the runtime forward (NLL and expert load)
    from healsweep.demo.build import expert_load, model_nll

    held_out = tr.evaluate(params, seqs, cfg, batch_size=2)
    assert held_out.tokens == sum(len(s) - 1 for s in seqs)
    assert held_out.nll == pytest.approx(model_nll(model, seqs), rel=1e-4)
    np.testing.assert_allclose(held_out.expert_share, expert_load(model, seqs), atol=1e-12)


def test_presets_small_is_the_shipped_model_and_medium_suits_k_quants(tmp_path) -> None:
    """``small`` is the shipped architecture and recipe; ``medium`` has rows of 256 (the K- and
    IQ-quant super-block) and writes its routed experts as Q8_0; an unknown name is one line."""
    from gguf import GGMLQuantizationType

    from healsweep.demo.build import demo_model_config, demo_preset, demo_train_config
    from healsweep.errors import SettingError

    assert demo_model_config(6144) == tr.MoEConfig(n_vocab=6144)
    assert demo_train_config(3) == tr.TrainConfig(seed=3)
    medium = demo_model_config(6144, "medium")
    assert (medium.n_layer, medium.n_embd, medium.n_expert, medium.n_expert_used) == (8, 256, 64, 4)
    assert medium.n_embd % 256 == 0 and medium.n_ff_exp % 256 == 0 and medium.n_ff_shexp > 0
    assert demo_train_config(0, 10, "medium").steps == 10
    cpu = demo_model_config(6144, "medium-cpu")
    assert (cpu.n_layer, cpu.n_embd, cpu.n_expert, cpu.n_expert_used) == (4, 256, 8, 2)
    assert cpu.n_ff_exp % 256 == 0 and cpu.n_ff_shexp > 0
    assert demo_preset("medium-cpu").expert_type == "Q8_0"
    with pytest.raises(SettingError, match="unknown demo preset 'large'.*small, medium"):
        demo_preset("large")
    # the medium layer shapes written with the preset's expert type read back as Q8_0
    from healsweep.demo.build import write_demo_model

    tokenizer = _tiny_tokenizer()
    cfg = dataclasses.replace(medium, n_vocab=tokenizer.get_vocab_size(), n_layer=1)
    qtype = GGMLQuantizationType[demo_preset("medium").expert_type]
    names = [f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    path = write_demo_model(
        tmp_path / "m.gguf",
        tr.init_params(cfg, 0),
        cfg,
        tokenizer,
        types=dict.fromkeys(names, qtype),
    )
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    assert all(tensors[n].tensor_type == GGMLQuantizationType.Q8_0 for n in names)
    assert tensors["blk.0.ffn_down_exps.weight"].shape.tolist() == [256, 256, 64]
