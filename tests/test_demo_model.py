"""The shipped demo model: shape, tokenizer, transformers cross-check, acceptance figures, CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cli import run_cli


@pytest.fixture(scope="module")
def demo():
    from healsweep.bundled import demo_corpus_path, demo_model_path
    from healsweep.data.corpus import load_corpus
    from healsweep.model import open_model

    return open_model(demo_model_path()), load_corpus(demo_corpus_path())


def test_demo_model_has_the_promised_shape(demo) -> None:
    from healsweep.bundled import demo_model_path

    model, _ = demo
    hp = model.hparams
    assert hp.arch == "qwen2moe" and not hp.norm_topk_prob
    assert hp.n_layer >= 4 and hp.n_expert >= 16 and hp.n_expert_used >= 2
    assert hp.n_embd % 64 == 0 and hp.n_ff_exp % 64 == 0 and hp.n_ff_shexp % 32 == 0
    assert hp.n_head_kv < hp.n_head  # GQA
    assert demo_model_path().stat().st_size <= 24 * 2**20
    for name in model.tensor_names:
        expected = (
            "F32" if name.endswith((".bias", "norm.weight", "gate_inp_shexp.weight")) else "F16"
        )
        assert model.tensor_type(name).name == expected, name


def test_demo_gguf_tokenizer_is_the_demo_tokenizer_on_the_whole_corpus(demo) -> None:
    from tokenizers import Tokenizer

    from healsweep.bundled import demo_tokenizer_path

    model, corpus = demo
    ours, shipped = model.tokenizer(), Tokenizer.from_file(str(demo_tokenizer_path()))
    assert ours.get_vocab(with_added_tokens=True) == shipped.get_vocab(with_added_tokens=True)
    texts = [doc.render() for doc in corpus.documents]
    for a, b in zip(ours.encode_batch(texts), shipped.encode_batch(texts), strict=True):
        assert a.ids == b.ids
    sample = texts[0]
    assert ours.decode(shipped.encode(sample).ids, skip_special_tokens=False) == sample


def test_demo_gguf_matches_transformers_on_a_dev_document(demo) -> None:
    """transformers loading the shipped GGUF agrees with healsweep.model.forward."""
    from transformers import AutoModelForCausalLM

    from healsweep.bundled import demo_model_path
    from healsweep.demo.build import dev_documents, encode_documents
    from healsweep.model import forward

    model, corpus = demo
    hp = model.hparams
    ids = encode_documents(dev_documents(corpus)[:1], model.tokenizer())[0][:300]
    assert len(ids) == 300
    path = demo_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        moe_intermediate_size=hp.n_ff_exp,
        shared_expert_intermediate_size=hp.n_ff_shexp,
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    ours = forward(model, [ids]).logits[0]
    assert np.max(np.abs(ours - ref)) <= 2e-3 * np.max(np.abs(ref))
    assert np.mean(np.argmax(ours, -1) == np.argmax(ref, -1)) > 0.99


def test_demo_model_is_far_better_than_unigram_on_dev_documents(demo) -> None:
    """Six dev documents (512 tokens each): perplexity far below the unigram baseline, and
    peaked output distributions (the full dev half is in the slow test below)."""
    from healsweep.demo.build import dev_documents, encode_documents, training_stream, unigram_nll
    from healsweep.model import forward

    model, corpus = demo
    tok = model.tokenizer()
    dev = [ids[:512] for ids in encode_documents(dev_documents(corpus)[::20], tok)]
    logits = forward(model, dev).logits
    nll, top1 = [], []
    for ids, z in zip(dev, logits, strict=True):
        z = z[:-1].astype(np.float64)
        logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        nll.append(logz - z[np.arange(len(ids) - 1), ids[1:]])
        top1.append(np.exp(z.max(-1) - logz))
    baseline = unigram_nll(training_stream(corpus, tok), dev, model.hparams.n_vocab)
    assert np.exp(np.mean(np.concatenate(nll))) < np.exp(baseline) / 5
    assert np.mean(np.concatenate(top1)) > 0.5


def test_model_info_demo_cli() -> None:
    done = run_cli("model", "info", "demo", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "qwen2moe" in done.stdout and "16" in done.stdout


def test_the_packaged_medium_cpu_model_opens_by_name_with_rows_for_ggml_types(tmp_path) -> None:
    """`demo-medium-cpu` (issue 29): the medium-cpu preset's seed-0 file, shipped; rows of 256
    (llama.cpp's K- and IQ-quant super-block), a shared expert, Q8_0 experts, the demo tokenizer;
    a spec names it like `demo` and keeps the name."""
    from tokenizers import Tokenizer

    from healsweep.bundled import demo_model_path, demo_tokenizer_path, resolve_model
    from healsweep.model import open_model
    from healsweep.sweep.spec_files import load_spec

    path = resolve_model("demo-medium-cpu")
    assert path == demo_model_path("demo-medium-cpu") and path.stat().st_size <= 25 * 10**6
    model = open_model("demo-medium-cpu")
    hp = model.hparams
    assert (hp.n_layer, hp.n_embd, hp.n_expert, hp.n_expert_used) == (4, 256, 8, 2)
    assert hp.n_ff_exp == 256 and hp.n_ff_shexp == 512
    assert model.tensor_type("blk.0.ffn_down_exps.weight").name == "Q8_0"
    text = "def f(x):\n    return x + 1\n"
    ids = Tokenizer.from_file(str(demo_tokenizer_path())).encode(text).ids
    assert model.tokenizer().encode(text).ids == ids
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("name: s\nmodel: demo-medium-cpu\n")
    assert load_spec(spec_file).model == "demo-medium-cpu"


@pytest.mark.slow
def test_demo_figures_full_dev_and_calibration(demo) -> None:
    """Acceptance figures on the whole dev half and the whole calibration pool."""
    from healsweep.demo.build import demo_figures

    model, corpus = demo
    found = demo_figures(model, corpus, model.tokenizer())
    assert found.calibration_tokens >= 8000
    assert found.dev_perplexity < found.unigram_perplexity / 5
    assert found.window_tokens > 10_000
    assert found.window_perplexity < found.window_unigram_perplexity / 5
    assert found.expert_load.shape == (model.hparams.n_layer, model.hparams.n_expert)
    np.testing.assert_allclose(found.expert_load.sum(axis=1), 1.0, rtol=1e-9)
    assert found.expert_load.min() >= 0.01  # every routed expert gets >= 1% of routed tokens


@pytest.mark.slow
def test_demo_build_cli_end_to_end(tmp_path) -> None:
    """`healsweep demo build --steps 2` writes corpus, tokenizer and a GGUF that opens."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from healsweep.model import open_model

    out = tmp_path / "build"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "healsweep",
            "demo",
            "build",
            "--steps",
            "2",
            "--no-figures",
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr
    model = open_model(out / "demo-moe.gguf")
    shipped = Tokenizer.from_file(str(out / "demo-tokenizer.json"))
    text = "<|im_start|>user\nShow `json.dumps`.<|im_end|>\n"
    assert model.tokenizer().encode(text).ids == shipped.encode(text).ids
    assert model.hparams.n_vocab == shipped.get_vocab_size()
