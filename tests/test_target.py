"""One allocator for the whole file, and ``healsweep heal --target-bpw / --target-size-mib``.

The knapsack over every group (the routed experts per layer and projection, and the file's other
groups, one each) is checked against an enumeration of every allocation, each sized by
``ModelShapes.size`` on knobs the test spells itself (the sizing of budgets, checked against
written files in test_config_size). The command runs end to end on a random model: with the
``q2_0`` ladder (healsweep's own quantizer, so no ggml: the default tier), its sensitivity pass
scored by the real healer and scorer through Ray; with ggml's types (slow tier: ggml's quantizer)
under a routed-bpw and a file target. The written file is read back with gguf-py.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import test_sweep_tune
from _tiny_corpus import write_tiny_corpus
from healsweep.cli import _register
from healsweep.cli._apps import app
from healsweep.gguf_io import routed_expert_bpw
from healsweep.heal.knobs import Knobs
from healsweep.heal.size import MIB, Budget, ModelShapes
from healsweep.model import open_model
from healsweep.sweep.allocator import Group, Option, allocate, file_groups_of, group_size
from healsweep.sweep.sensitivity import (
    STAGE,
    MoveResult,
    Scores,
    SensitivityTable,
    file_steps,
    moved_knobs,
    moves,
)

ray_cluster = test_sweep_tune.ray_cluster  # one embedded Ray cluster for this module

ROWS256 = dict(n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4, n_expert_used=2)
LADDER = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs")
CALIBRATION = ["--chunk-length", "64", "--min-tokens-per-expert", "4"]


@pytest.fixture(scope="module")
def model(random_gguf):
    return random_gguf("qwen2moe", seed=7, **ROWS256)


def _fields(path: Path) -> dict[str, str]:
    """The target and allocation fields, read by gguf-py (which names no type 42: a file with
    Q2_0 experts is read by healsweep's reader)."""
    keys = ("healsweep.target", "healsweep.allocation")
    try:
        reader = gguf.GGUFReader(path)
    except ValueError:  # "42 is not a valid GGMLQuantizationType"
        return {k: open_model(path).metadata(k) for k in keys}
    return {k: bytes(f.parts[f.data[0]]).decode() for k, f in reader.fields.items() if k in keys}


def test_the_whole_file_knapsack_is_the_brute_force_optimum(model):
    shapes = ModelShapes.of(open_model(model))
    others = file_groups_of(shapes)
    assert others == ("attn", "shexp", "embd", "output")  # no leading dense layer here
    base = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs",
                 **{f"type_{g}": "iq2_xxs" for g in others})  # fmt: skip
    rng = random.Random(3)
    groups = []
    for layer, group in [(0, "gu"), (0, "d"), (1, "gu"), (1, "d"), *((None, g) for g in others)]:
        here = group_size(shapes, layer, group, "iq2_xxs", "file_bytes")
        targets = ("iq1_m", "iq2_xs") if layer is None else (rng.choice(("iq1_m", "iq2_xs")),)
        options = [Option("iq2_xxs", 0, 0.0)]
        for t in targets:
            size = group_size(shapes, layer, group, t, "file_bytes") - here
            options.append(Option(t, size, rng.uniform(-0.02, 0.03)))
        groups.append(Group(layer, group, tuple(options)))
    budget = Budget("file_bytes", ())
    limit = shapes.size(base).file_bytes + 9_000

    best = None
    for picks in itertools.product(*(range(len(g.options)) for g in groups)):
        chosen = [g.options[p] for g, p in zip(groups, picks, strict=True)]
        routed = chosen[:4]
        layer_types = ",".join(f"{i}:{routed[2 * i].type}/{routed[2 * i + 1].type}" for i in (0, 1))
        knobs = base.replace(layer_types=layer_types,
                             **{f"type_{g}": o.type for g, o in zip(others, chosen[4:], strict=True)})  # fmt: skip
        size = shapes.size(knobs).file_bytes  # the budget's own sizing, not group_size's
        kld = sum(o.kld for o in chosen)
        if size <= limit and (best is None or kld < best[0]):
            best = (kld, knobs)
    found = allocate(base, shapes, budget, groups, limit)
    assert found is not None and found.predicted_kld == pytest.approx(best[0], abs=1e-12)
    assert found.size.file_bytes <= limit
    moe, n = shapes.moe_layers, shapes.n_layer
    assert found.knobs.expert_types(moe, n) == best[1].expert_types(moe, n)
    assert found.knobs.file_types() == best[1].file_types()
    # under routed bpw the other groups hold no routed bit: no room for them to take
    assert all(group_size(shapes, None, g, "iq1_s", "routed_bpw") == 0 for g in others)


def test_the_other_groups_move_only_under_a_file_budget(model):
    shapes = ModelShapes.of(open_model(model))
    base = Knobs(type_gu="iq1_m", type_d="iq1_m", type_attn="iq1_m", type_embd="iq2_xs")
    assert all(m.layer is not None for m in moves(base, shapes, LADDER))
    found = [(m.group, m.target) for m in moves(base, shapes, LADDER, whole_file=True)
             if m.layer is None]  # fmt: skip
    assert found == [("attn", "iq1_s"), ("attn", "iq2_xxs"), ("shexp", "iq2_xs"),
                     ("embd", "iq2_xxs"), ("output", "iq2_xs")]  # fmt: skip
    # from the teacher's bytes: one step down, to the ladder's largest; q2_0 is routed-only
    assert file_steps("teacher", LADDER) == ("iq2_xs",)
    assert file_steps("iq2_xxs", None) == ("iq1_m", "iq2_xs")


def test_the_table_offers_the_other_groups_to_a_file_budget_only(model):
    shapes = ModelShapes.of(open_model(model))
    base = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs", type_attn="iq2_xxs", type_embd="iq2_xxs")
    ids = ("w0", "w1")
    base_scores = Scores(ids, np.array([1.0, 2.0]), np.array([10, 10]), np.array([9, 9]))
    results = []
    for n, m in enumerate(moves(base, shapes, LADDER, whole_file=True)):
        scores = base_scores._replace(kld_sum=base_scores.kld_sum + 0.1 * (n + 1))
        results.append(MoveResult(m, moved_knobs(base, shapes, m), 0, 0, scores, base_scores))
    table = SensitivityTable(base, base_scores, LADDER, tuple(results), 1)
    routed = table.groups(shapes, "routed_bpw")
    assert [(g.layer, g.group) for g in routed] == [(0, "gu"), (0, "d"), (1, "gu"), (1, "d")]
    whole = table.groups(shapes, "file_bytes")
    assert [(g.layer, g.group) for g in whole][4:] == [(None, g) for g in file_groups_of(shapes)]
    attn = whole[4]
    assert [o.type for o in attn.options] == ["iq2_xxs", "iq1_m", "iq2_xs"]
    for option in attn.options[1:]:  # the size change is the whole file's, by ModelShapes.size
        moved = shapes.size(base.replace(type_attn=option.type)).file_bytes
        assert option.size == moved - shapes.size(base).file_bytes
    shexp = whole[5]  # the teacher's bytes: one move, down to the ladder's largest
    assert [o.type for o in shexp.options] == ["teacher", "iq2_xs"] and shexp.options[1].size < 0
    assert table.to_dict()["moves"][-1]["layer"] is None


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "from healsweep.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_a_target_out_of_reach_is_one_line_before_any_work(model, tmp_path):
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text("alpha: mse\n")
    out = tmp_path / "out.gguf"
    started = time.time()
    run = _cli("heal", str(model), "--knobs", str(knobs), "--out", str(out), "--target-bpw",
               "1.5", "--ladder", ",".join(LADDER), "--cache", str(tmp_path / "cache"))  # fmt: skip
    assert run.returncode == 1 and time.time() - started < 60
    assert run.stderr.strip().splitlines() == [
        "error: --target-bpw 1.5 is outside what the ladder iq1_s ... iq2_xs reaches on this "
        "model: 1.5625 to 2.3125 routed bpw (every group in the smallest type, or in the "
        "largest); give a target in that range"
    ]  # fmt: skip
    assert not out.exists() and not (tmp_path / "cache").exists()
    # above the largest file: the whole file's range, every group in the ladder's types
    shapes = ModelShapes.of(open_model(model))
    high = shapes.size(Knobs(type_gu="iq2_xs", type_d="iq2_xs", type_attn="iq2_xs",
                             type_shexp="iq2_xs", type_embd="iq2_xs",
                             type_output="iq2_xs")).file_bytes  # fmt: skip
    run = _cli("heal", str(model), "--knobs", str(knobs), "--out", str(out),
               "--target-size-mib", f"{high / MIB + 0.01:.4f}", "--ladder", ",".join(LADDER))
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1
    assert f"to {high / MIB:.4f} MiB (every group" in run.stderr and not out.exists()


def test_heal_to_a_target_records_it_and_reads_its_sensitivity_back(ray_cluster, tmp_path):
    # q2_0 alone: healsweep's own quantizer, so this runs without ggml (the pass scores the base)
    from healsweep.model.synthetic import write_random_model

    model = write_random_model(tmp_path / "teacher.gguf", n_layer=2, n_ff_exp=64, seed=5)
    corpus = write_tiny_corpus(tmp_path / "corpus.jsonl")
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text(yaml.safe_dump({"alpha": "mse", "ridge": False}))
    cache = tmp_path / "cache"
    _register()

    def heal(out: str, target: str) -> str:
        result = CliRunner().invoke(app, [
            "heal", str(model), "--knobs", str(knobs), "--out", str(tmp_path / out),
            "--corpus", str(corpus), *CALIBRATION, "--cache", str(cache), "--target-bpw", target,
            "--ladder", "q2_0", "--windows", "1", "--max-tokens", "128",
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        return result.output

    first = heal("a.gguf", "2.25")
    assert "[sensitivity] sensitivity of 0 moves around q2_0/q2_0" in first
    assert "0 of 1 configs cached, 1 to score on 1 dev windows" in first
    assert "[sensitivity] [1/1] base: pooled KLD" in first and "[allocate] routed q2_0/q2_0" in first
    written = tmp_path / "a.gguf"
    assert routed_expert_bpw(open_model(written)) <= 2.25
    fields = _fields(written)
    assert fields["healsweep.target"] == "routed_bpw=2.25"
    record = json.loads(fields["healsweep.allocation"])
    assert record["types"]["type_gu"] == record["types"]["type_d"] == "q2_0"
    assert record["moves"] == [] and record["dev_windows"] == 1 and record["routed_bpw"] == 2.25
    entries = sorted((cache / STAGE).rglob("*.hsc"))
    assert len(entries) == 1

    again = heal("b.gguf", "2.25")  # the same model and base: its pass read back, not scored
    assert "1 of 1 configs cached, 0 to score" in again and "[1/1]" not in again
    assert sorted((cache / STAGE).rglob("*.hsc")) == entries


# --- the slow tier: ggml's quantizer --------------------------------------------------------------


@pytest.mark.slow
def test_heal_to_a_routed_and_a_file_target_on_ggml_types(ray_cluster, model, tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus.jsonl")
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text(yaml.safe_dump({"alpha": "mse", "ridge": False}))
    cache = tmp_path / "cache"
    teacher = open_model(model)
    shapes = ModelShapes.of(teacher)
    _register()

    def heal(out: str, *target: str) -> str:  # one pass (the rounds: test_target_rounds)
        result = CliRunner().invoke(app, [
            "heal", str(model), "--knobs", str(knobs), "--out", str(tmp_path / out),
            "--corpus", str(corpus), *CALIBRATION, "--cache", str(cache), *target,
            "--ladder", "iq1_m,iq2_xxs,iq2_xs", "--windows", "2", "--rounds", "1",
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        return result.output

    first = heal("bpw.gguf", "--target-bpw", "2.2")
    assert "sensitivity of 8 moves around iq2_xxs/iq2_xxs" in first and "9 to score" in first
    written = tmp_path / "bpw.gguf"
    assert routed_expert_bpw(open_model(written)) <= 2.2
    record = json.loads(_fields(written)["healsweep.allocation"])
    assert record["moves"] and record["routed_bpw"] <= 2.2
    assert all(layer != "all" for layer, _, _ in record["moves"])  # routed groups only
    second = heal("bpw2.gguf", "--target-bpw", "2.1")  # same base: nothing scored again
    assert "9 of 9 configs cached, 0 to score" in second

    limit = 0.65 * MIB
    third = heal("file.gguf", "--target-size-mib", "0.65")
    assert "attention iq1_m→iq2_xxs" in third
    file = open_model(tmp_path / "file.gguf")
    assert shapes.file_bytes_of(teacher, file) <= limit
    fields = _fields(tmp_path / "file.gguf")
    assert fields["healsweep.target"] == f"file_bytes={int(limit)}"
    assert json.loads(fields["healsweep.allocation"])["file_bytes"] <= limit
