"""`healsweep model info|logits` and `bench forward` through the real entry point (subprocess)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _cli import run_cli
from healsweep.model import forward, open_model


def _run(*args, tmp_path):
    return run_cli(*args, cache=tmp_path / "cache")


def test_model_info_describes_arch_types_and_tokenizer(random_gguf, tmp_path):
    path = random_gguf("qwen3moe", types={"ffn_down_exps.weight": "Q8_0"})
    done = _run("model", "info", path, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    for expected in ("qwen3moe", "softmax over 8, top-2, renormalized", "per-head q/k RMSNorm",
                     "Q8_0", "F16", "F32", "ChatML yes",
                     "'<|im_end|>'", "no chat template in the file: documents are rendered as ChatML"):
        assert expected in done.stdout
    as_json = json.loads(_run("model", "info", path, "--json", tmp_path=tmp_path).stdout)
    model = open_model(path)
    assert as_json["tensor_types"]["Q8_0"]["bytes"] == sum(
        model.tensor_nbytes(n) for n in model.tensor_names if model.tensor_type(n).name == "Q8_0"
    )
    assert as_json["layers"] == model.hparams.n_layer


ARCH_SHAPES = {
    "olmoe": dict(n_head_kv=4),
    "llama": dict(n_head_kv=2),
    "glm4moe": dict(n_head_kv=2, n_leading_dense=2, n_rot=8, n_expert_groups=4, n_group_used=2,
                    expert_weights_scale=2.5),
    "deepseek2": dict(n_leading_dense=2, kv_b_split=True, yarn_factor=40.0, yarn_orig_ctx=64,
                      yarn_log_mul=0.1),
}
ARCH_INFO = {
    "olmoe": ("softmax over 8, top-2, weights as is", "q/k RMSNorm over the whole projection",
              "neox RoPE"),
    "llama": ("softmax over 8, top-2, renormalized", "GQA, 4/2 heads, norm RoPE"),
    "glm4moe": ("sigmoid over 8, top-2, in 2 of 4 groups, weights as is, scaled x2.5",
                "GQA with q/k/v bias", "neox RoPE on 8 of 16 head dims",
                "layers 0..1 have a dense FFN (healing skips them)"),
    "deepseek2": ("sigmoid over 8, top-2, renormalized",
                  "MLA (q_lora 48, kv_lora 64, attn_k_b/attn_v_b), 4 heads of 32 no-rope + 16 "
                  "rope dims, v 32, norm RoPE, YaRN x40 from 64"),
}


@pytest.mark.parametrize("arch", sorted(ARCH_SHAPES))
def test_model_info_and_slice_of_each_architecture(random_gguf, tmp_path, arch):
    path = random_gguf(arch, n_layer=3, **ARCH_SHAPES[arch])
    done = _run("model", "info", path, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"arch         {arch}" in done.stdout
    for expected in ARCH_INFO[arch]:
        assert expected in done.stdout
    out = tmp_path / f"{arch}-slice.gguf"
    done = _run("model", "slice", path, "--layers", "1:3", "--out", out, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    sliced, whole = open_model(out), open_model(path)
    dense = max(whole.hparams.n_leading_dense - 1, 0)  # layer 1 stays dense in glm4moe's slice
    assert sliced.hparams == whole.hparams.replace(n_layer=2, n_leading_dense=dense)
    np.testing.assert_array_equal(sliced.tensor("blk.1.ffn_up_exps.weight"),
                                  whole.tensor("blk.2.ffn_up_exps.weight"))
    logits = forward(sliced, [np.arange(5, 30, dtype=np.int32)]).logits[0]
    assert np.isfinite(logits).all()


def test_model_logits_writes_the_forward_logits(random_gguf, tmp_path):
    path = random_gguf("qwen2moe")
    ids = np.arange(7, 90, dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    done = _run("model", "logits", path, "--tokens", tmp_path / "ids.npy", "--out",
                tmp_path / "logits.npy", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    written = np.load(tmp_path / "logits.npy")
    assert written.dtype == np.float32
    expected = forward(open_model(path), [ids.astype(np.int32)]).logits[0]
    np.testing.assert_allclose(written, expected, rtol=1e-5, atol=1e-5)
    np.save(tmp_path / "bad.npy", ids.reshape(1, -1))
    bad = _run("model", "logits", path, "--tokens", tmp_path / "bad.npy", "--out",
               tmp_path / "x.npy", tmp_path=tmp_path)
    assert bad.returncode == 2 and "1-D integer ids" in bad.stderr


@pytest.mark.parametrize("broken", ["truncated", "not-gguf", "gpt2", "missing-tensor"])
def test_broken_models_give_one_line_and_exit_1(random_gguf, tmp_path, broken):
    path = tmp_path / "broken.gguf"
    if broken == "truncated":
        path.write_bytes(random_gguf("qwen2moe").read_bytes()[:-1000])
    elif broken == "not-gguf":
        path.write_text("just some text\n")
    elif broken == "gpt2":
        path = random_gguf("gpt2")
    else:
        path = random_gguf("qwen3moe", drop_tensors=("blk.0.attn_k_norm.weight",))
    done = _run("model", "info", path, tmp_path=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
    assert "Traceback" not in done.stderr
    debug = _run("--debug", "model", "info", path, tmp_path=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_bench_forward_reports_throughput_and_peak_rss(random_gguf, tmp_path):
    from healsweep.bench.forward import format_table

    path = random_gguf("qwen2moe")
    done = _run("bench", "forward", path, "--tokens", 96, "--seq-len", 64, "--repeats", 1,
                "--json", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["tokens"] == 96 and row["sequences"] == 2 and row["tokens_per_s"] > 0
    assert row["layers"] == open_model(path).hparams.n_layer
    assert 50 < row["peak_rss_mib"] < 8192
    header, line = format_table([row]).splitlines()
    assert header.split() == ["layers", "file_mib", "layer_mib", "layer_f32_mib", "tokens",
                              "first_call_s", "tokens_per_s", "peak_rss_mib"]
    assert line.split()[0] == str(row["layers"])
