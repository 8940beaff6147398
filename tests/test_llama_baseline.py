"""`healsweep baseline llama`: the routed experts quantized by ggml (slow tier: needs the
``[bench]`` extra, whose libggml-base holds the quantizer).

References: ggml's own ``to_float`` for what the stored blocks mean, the teacher file's bytes for
everything that must not change, and per-expert E[x²] recomputed in float64 numpy from the
calibration trace's stored inputs for the importance rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from _cli import run_cli
from _heal_fixtures import _corpus_file
from healsweep.gguf_io._ggml_lib import dequantize_rows, quantize_rows
from healsweep.model import open_model

pytestmark = pytest.mark.slow
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _cli(*args, tmp_path):

    return run_cli("baseline", "llama", *args, cache=tmp_path / "cache", timeout=600)


def test_q2_0_baseline_of_the_demo_changes_only_the_routed_experts(tmp_path):
    run = _cli("demo", "--type", "q2_0", "--out", tmp_path / "b.gguf", tmp_path=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    teacher, base = open_model("demo"), open_model(tmp_path / "b.gguf")
    assert base.metadata("healsweep.baseline_type") == "q2_0"
    assert base.metadata("healsweep.baseline_bits_per_weight") == 2.25
    assert base.metadata("healsweep.imatrix") == "none"
    codes = np.zeros(4, np.int64)
    for name in teacher.tensor_names:
        if name.endswith(EXPERTS):
            assert int(base.tensor_type(name)) == 42
            raw = base.raw_rows(name)
            n_in = base.tensor_shape(name)[-1]
            dense = dequantize_rows(raw, 42, n_in)
            np.testing.assert_array_equal(base.tensor(name), dense)  # we read what ggml wrote
            want = teacher.tensor(name)
            err = np.sqrt(np.mean((dense - want) ** 2) / np.mean(want**2))
            assert err < 0.9, name  # a 2-bit approximation of this tensor, not another one
            body = raw.reshape(-1, 18)[:, 2:]
            codes += np.bincount(np.unpackbits(body[..., None], axis=-1, bitorder="little")
                                 .reshape(-1, 2) @ np.array([1, 2]), minlength=4)  # fmt: skip
        else:
            assert base.tensor_type(name) == teacher.tensor_type(name)
            np.testing.assert_array_equal(base.raw_tensor(name)[1], teacher.raw_tensor(name)[1])
    print(f"ggml Q2_0 code histogram on the demo's experts: {codes.tolist()}")
    assert codes[3] < 0.01 * codes.sum()  # ggml's Q2_0 quantizer is ternary (q = +2 unused)


def test_types_whose_blocks_do_not_divide_the_rows_or_need_an_imatrix_are_one_line(
    tmp_path, random_gguf
):
    run = _cli("demo", "--type", "q2_k", "--out", tmp_path / "b.gguf", tmp_path=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    line = run.stderr.strip()
    assert len(line.splitlines()) == 1 and "128 values" in line and "block of 256" in line
    assert not (tmp_path / "b.gguf").exists()
    wide = random_gguf("qwen2moe", n_embd=256, n_ff_exp=256, n_head=4, seed=3)
    run = _cli(wide, "--type", "iq2_xxs", "--out", tmp_path / "c.gguf", tmp_path=tmp_path)
    assert run.returncode == 1 and "--imatrix-from-calibration" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("type_name", ["q2_k", "iq2_xxs", "iq2_xs", "iq2_s"])
def test_imatrix_rows_are_each_experts_calibration_statistics(tmp_path, random_gguf, type_name):
    from healsweep.cache import StageCache
    from healsweep.heal.knobs import CalibrationConfig
    from healsweep.heal.llama_baseline import LLAMA_TYPES
    from healsweep.heal.trace import calibration_trace

    wide = random_gguf("qwen2moe", n_embd=256, n_ff_exp=256, n_head=4, seed=3)
    corpus = _corpus_file(tmp_path / "c.jsonl")
    run = _cli(wide, "--type", type_name, "--out", tmp_path / "b.gguf", "--imatrix-from-calibration",
               "--corpus", corpus, "--chunk-length", "64", "--min-tokens-per-expert", "1",
               tmp_path=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    base, teacher = open_model(tmp_path / "b.gguf"), open_model(wide)
    assert base.metadata("healsweep.imatrix").startswith("calibration")
    qtype = LLAMA_TYPES[type_name]
    cal = CalibrationConfig(corpus=str(corpus), chunk_length=64, min_tokens_per_expert=1)
    layer = calibration_trace(teacher, cal, StageCache(tmp_path / "cache")).layer(0)
    x = np.asarray(layer["x"], np.float64)  # [T, D] the FFN input of every traced token
    ids = np.asarray(layer["ids"])
    name = "blk.0.ffn_up_exps.weight"
    stored = base.raw_rows(name)
    weights = teacher.tensor(name)
    matches, wrong_row = [], []
    for e in range(weights.shape[0]):
        routed = np.any(ids == e, axis=1)
        assert routed.sum() >= 1
        imatrix = (x[routed] ** 2).mean(axis=0).astype(np.float32)  # E[x²] of expert e's tokens
        matches.append(np.mean(quantize_rows(weights[e], qtype, imatrix) == stored[e]))
        other = (x[~routed] ** 2).mean(axis=0).astype(np.float32)
        wrong_row.append(np.mean(quantize_rows(weights[e], qtype, other) == stored[e]))
    print(f"{type_name}: bytes equal with own E[x²] {np.mean(matches):.4f}, "
          f"with other tokens' {np.mean(wrong_row):.4f}")  # fmt: skip
    assert np.mean(matches) > 0.99
    assert np.mean(wrong_row) < np.mean(matches) - 0.02  # the rows do matter for this type
    without = quantize_rows(weights[0], qtype, None) if type_name in ("q2_k", "iq2_s") else None
    if without is not None:
        assert not np.array_equal(without, stored[0])
    assert base.metadata("healsweep.baseline_bits_per_weight") > 2.0
