"""`healsweep heal` end to end: the healed GGUF (type-42 or F16 experts) read back, the sidecar,
clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from _cli import run_cli
from healsweep.cli import _register
from healsweep.cli._apps import app
from healsweep.gguf_io import read_header
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "configs" / "knobs"


def _corpus(path: Path) -> Path:
    texts = ["The quick brown fox jumps over the lazy dog. " * 5,
             "Mixture-of-experts models route every token to a few experts. " * 4,
             '{"name": "launch retro", "items": [1, 2, 3]} ' * 6]
    rows = [{"doc_id": f"cal-{i}", "source": "cal", "index": i, "stratum": "s",
             "pool": "calibration", "text": t} for i, t in enumerate(texts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = write_random_model(root / "teacher.gguf", n_layer=2, n_ff_exp=64,
                               types={"ffn_down_shexp.weight": "Q8_0", "attn_q.weight": "Q8_0"})
    _register()
    result = CliRunner().invoke(app, [
        "heal", str(model), "--knobs", str(PRESETS / "shipped-audit.yaml"),
        "--out", str(root / "healed.gguf"), "--q2", str(root / "side.npz"),
        "--report", str(root / "report.json"), "--corpus", str(_corpus(root / "c.jsonl")),
        "--chunk-length", "64", "--cache", str(root / "cache"),
    ])
    assert result.exit_code == 0, result.output
    f16 = CliRunner().invoke(app, [
        "heal", str(model), "--knobs", str(PRESETS / "shipped-audit.yaml"),
        "--out", str(root / "healed-f16.gguf"), "--experts", "f16",
        "--corpus", str(root / "c.jsonl"), "--chunk-length", "64", "--cache", str(root / "cache"),
    ])
    assert f16.exit_code == 0, f16.output
    assert "computed (not from cache): nothing" in f16.output
    return root, result.output


def test_progress_is_printed_per_stage(healed):
    _, output = healed
    for marker in ("[calib_trace]", "[layer 1/2]", "[layer 2/2]", "[stages]", "[write]"):
        assert marker in output
    assert "tokens per stratum: s " in output


@pytest.mark.parametrize(("name", "expert_type"), [("healed.gguf", 42), ("healed-f16.gguf", 1)])
def test_healed_gguf_copies_the_teacher_and_replaces_only_healed_tensors(
    healed, name, expert_type
):
    root, _ = healed
    teacher = gguf.GGUFReader(root / "teacher.gguf")  # gguf-py's own reading of the teacher
    student = read_header(root / name)  # gguf-py 0.19 cannot open type 42: healsweep's reader
    student_model = open_model(root / name)
    t_fields = {k: f for k, f in teacher.fields.items() if not k.startswith("GGUF.")}
    s_fields = student.fields
    assert set(s_fields) - set(t_fields) == {
        "healsweep.knobs", "healsweep.student_key", "healsweep.alphas",
        "healsweep.teacher_fingerprint", "healsweep.experts", "healsweep.expert_types",
        "healsweep.routed_bpw"}
    assert s_fields["healsweep.expert_types"].value == "0:q2_0/q2_0,1:q2_0/q2_0"
    assert s_fields["healsweep.routed_bpw"].value == (2.25 if expert_type == 42 else 16.0)
    assert s_fields["healsweep.experts"].value == ("q2_0" if expert_type == 42 else "f16")
    for key, field in t_fields.items():
        item_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        assert (s_fields[key].type, s_fields[key].item_type) == (field.types[0], item_type), key
        assert s_fields[key].value == field.contents(), key
    s_tensors = {t.name: t for t in student.tensors}
    assert [t.name for t in student.tensors] == [t.name for t in teacher.tensors]
    for tensor in teacher.tensors:
        got = s_tensors[tensor.name]
        _, got_data = student_model.raw_tensor(tensor.name)
        if tensor.name.endswith(("_exps.weight",)):
            assert int(got.type) == expert_type
            assert got.dims == tuple(tensor.shape.tolist())
        elif tensor.name.endswith("ffn_down_shexp.weight"):
            assert got.type == tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
            assert not np.array_equal(got_data, tensor.data)  # the ridge moved it
        else:
            assert got.type == tensor.tensor_type
            np.testing.assert_array_equal(np.asarray(got_data), np.asarray(tensor.data))
    assert open_model(root / name).hparams == open_model(root / "teacher.gguf").hparams


def test_sidecar_blocks_decode_to_the_f16_experts_and_alphas_fold_into_down(healed):
    root, _ = healed
    side = np.load(root / "side.npz")
    report = json.loads((root / "report.json").read_text())
    alphas = [layer["alpha"] for layer in report["layers"]]
    np.testing.assert_allclose(side["alphas"], alphas, rtol=1e-6)
    student = open_model(root / "healed.gguf")
    f16 = open_model(root / "healed-f16.gguf")
    np.testing.assert_allclose(student.metadata("healsweep.alphas"), alphas, rtol=1e-6)
    for layer in range(2):
        for suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            packed = side[f"blk.{layer}.{suffix}"]  # [E, out, in/64, 18]
            d = packed[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
            codes = np.unpackbits(packed[..., 2:, None], axis=-1, bitorder="little")
            codes = codes.reshape(*codes.shape[:-2], 64, 2)
            values = (codes[..., 0] + 2 * codes[..., 1]).astype(np.float32) - 1  # (c - 1)
            dense = (values * d[..., None]).reshape(*packed.shape[:-2], -1)
            np.testing.assert_array_equal(dense, student.tensor(f"blk.{layer}.{suffix}"))
            want = f16.tensor(f"blk.{layer}.{suffix}")
            np.testing.assert_allclose(dense.astype(np.float16).astype(np.float32), want)


def test_bad_knob_file_is_one_line_and_exit_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("alpha: mse\ngain_d: 5\n")
    run = run_cli("heal", "x.gguf", "--knobs", bad, "--out", tmp_path / "o.gguf", timeout=None)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert "gain_d" in run.stderr and "[0, 2]" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
