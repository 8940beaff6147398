"""A sweep's size budget on a real Ray cluster with real Tune and Optuna: a config over the budget
is never scored (grid and TPE) and is counted in the report; the report's size columns, tiers and
plot; the spec's budget and external llama recipes (one line when ggml is missing; a recipe is
built once and reused on resume).

The orchestration tests score with ``toy_work`` (test_sweep_tune: a deterministic function of
the knobs with ``run_trial_work``'s signature, which logs every window it scores), so "never
scored" is read from that log; the sizes come from a real GGUF whose expert rows fill blocks of
256 (heal.size, checked against real exports in test_config_size). The recipe test runs the real
healer, llama.cpp's quantizer and scorer through the CLI.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import test_sweep_tune
from healsweep.errors import SpecError
from healsweep.heal.knobs import Knobs, load_knobs
from healsweep.heal.size import ModelShapes
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model
from healsweep.sweep.spec_files import spec_from_dict
from test_sweep_tune import _log_lines, toy_identity, toy_work

ROOT = Path(__file__).resolve().parents[1]
ray_cluster = test_sweep_tune.ray_cluster  # one embedded Ray cluster for this module
TIERS = [2.0625, 2.3125]  # llama.cpp's IQ2_XXS and IQ2_XS
ROWS256 = dict(n_layer=2, n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=4, n_expert_used=2)


# A spec with a ggml type or a llama recipe needs ggml's quantizer at load (the [ggml] extra,
# llama-cpp-python, built from source): CI installs it for the slow tier, not the default one.
needs_ggml = pytest.mark.slow


@pytest.fixture(scope="module")
def rows256(tmp_path_factory, tiny_tokenizer):
    """A random qwen2moe whose routed expert rows fill blocks of 256."""
    root = tmp_path_factory.mktemp("budget")
    return write_random_model(root / "m.gguf", tokenizer=tiny_tokenizer, seed=3, **ROWS256)


def _spec(model, **extra):
    return spec_from_dict({"name": "budget", "model": str(model), "max_concurrent": 2,
                           "budget": {"routed_bpw": TIERS}, **extra})  # fmt: skip


def _trials(sweep_dir: Path) -> list[dict]:
    return pq.read_table(sweep_dir / "trials.parquet").to_pylist()


def test_the_budget_is_one_measure_stored_only_when_given():
    spec = _spec("m.gguf")
    assert spec.budget.budget().limits == tuple(TIERS)
    assert "budget" not in spec_from_dict({"name": "x"}).model_dump()  # earlier hashes hold
    assert _spec("m.gguf", budget={"file_mib": 12}).budget.budget().limits == (12 * 2**20,)
    whole = _spec("m.gguf", budget={"file_gib": [1.5, 0.25]}).budget.budget()  # the whole file
    assert whole.limits == (2**28, 3 * 2**29) and whole.measure == "file_bytes"
    assert (whole.label(3 * 2**29), whole.label(2**28)) == ("1.50 GiB", "256.00 MiB")
    for bad, why in (
        ({"routed_bpw": 2, "file_bytes": 9}, "a budget names one of routed_bpw, file_bytes"),
        ({"routed_bpw": [2.0, 2.0]}, "it lists a limit twice"),
        ({"routed_bpw": 0}, "field 'budget.routed_bpw[0]' = 0 is not allowed"),
        ({"bpw": 2}, "unknown field 'budget.bpw'; known fields: routed_bpw, file_bytes, "
                     "file_mib, file_gib"),
        ({"file_mib": 9, "file_gib": 1}, "a budget names one of routed_bpw, file_bytes, file_mib, "
                                         "file_gib"),
    ):
        with pytest.raises(SpecError, match=re.escape(why)):
            spec_from_dict({"name": "x", "budget": bad})
    path_entry = {"name": "q2k", "path": "q2k.gguf"}
    stored = spec_from_dict({"name": "x", "external": [path_entry]}).model_dump()["external"]
    assert stored == [path_entry]  # as before recipes: a sweep recorded then still resumes
    recipe = {"name": "iq2xxs", "llama": {"type": "iq2_xxs", "imatrix": True}}
    stored = spec_from_dict({"name": "x", "external": [recipe]}).model_dump()["external"]
    assert stored == [recipe]  # no `tensors`: stored (and hashed) as before it existed
    every = {"name": "all", "llama": {"type": "iq2_xxs", "tensors": "all"}}
    entry = spec_from_dict({"name": "x", "external": [every]}).external[0]
    assert entry.llama.all_tensors and entry.model_dump()["llama"]["tensors"] == "all"
    with pytest.raises(SpecError, match="tensors"):
        spec_from_dict({"name": "x", "external": [{"name": "a", "llama": {"type": "q2_k",
                                                                          "tensors": "some"}}]})
    with pytest.raises(SpecError, match="either a path or a llama recipe, not both"):
        spec_from_dict({"name": "x", "external": [{**path_entry, "llama": {"type": "q2_k"}}]})


@needs_ggml
def test_a_grid_config_over_the_budget_is_never_scored_and_is_counted(
    ray_cluster, rows256, tmp_path
):
    from healsweep.results.report import write_report
    from healsweep.sweep.budget import planned_trials
    from healsweep.sweep.driver import run_sweep
    from healsweep.sweep.space import config_hash

    log = tmp_path / "scored.log"
    spec = _spec(rows256, fixed={"ridge": False}, references=False,
                 search_space={"type_gu": ["iq2_xxs", "q2_0", "q2_k"],
                               "type_d": ["iq2_xxs", "iq2_xs"], "alpha": ["mse", "none"]})  # fmt: skip
    shapes = ModelShapes.of(open_model(rows256))
    budget = spec.budget.budget()
    assert planned_trials(spec) == 1 + 8  # the baseline and 12 - 4 (q2_k gate/up: over 2.3125)
    run = run_sweep(spec, results_root=tmp_path, identity_fn=toy_identity,
                    work_fn=functools.partial(toy_work, log=str(log)))  # fmt: skip
    trials = _trials(run.sweep_dir)
    assert len(trials) == 9 and all(t["status"] == "completed" for t in trials)
    scored = {chash for chash, _ in _log_lines(log)}
    for row in trials:
        knobs = Knobs(**{k[5:]: v for k, v in row.items() if k.startswith("knob_")})
        size = shapes.size(knobs)
        assert budget.admits(size) and row["config_hash"] in scored
        assert (row["routed_bpw"], row["file_bytes"]) == (size.routed_bpw, size.file_bytes)
    over = json.loads((run.sweep_dir / "over_budget.json").read_text())
    assert len(over) == 4 and not set(over) & scored  # recorded, never scored
    for chash, entry in over.items():
        knobs = Knobs(**entry["knobs"])
        assert knobs.type_gu == "q2_k" and config_hash(knobs) == chash
        assert entry["routed_bpw"] == shapes.size(knobs).routed_bpw > TIERS[-1]

    paths = write_report(run.sweep_dir, n_boot=200)
    report = paths["markdown"].read_text()
    assert "4 configs over budget, not scored (budget: 2.0625 bpw, 2.3125 bpw)." in report
    assert "| bpw | file MiB | pooled KLD |" in report
    assert "## Configs within 2.0625 bpw" in report and "## Configs within 2.3125 bpw" in report
    tier1 = report.split("## Configs within 2.0625 bpw")[1].split("##")[0]
    assert "type_gu=iq2_xxs, type_d=iq2_xxs" in tier1 and "iq2_xs" not in tier1
    assert "## What healing adds on top of each allocation" in report  # alpha mse vs none
    assert "## Best config per budget against llama.cpp" in report
    plot = next(p for p in paths.values() if p.name == "kld_vs_bpw.png")
    assert plot.stat().st_size > 10_000


@needs_ggml
def test_tpe_never_scores_a_point_over_the_budget_nor_spends_a_trial_on_it(
    ray_cluster, rows256, tmp_path
):
    from healsweep.sweep.driver import run_sweep

    log = tmp_path / "scored.log"
    spec = _spec(rows256, sampler={"type": "tpe", "seed": 1}, num_samples=5, references=False,
                 search_space={"type_gu": {"choices": ["q2_0", "q2_k", "q4_k"]},
                               "type_d": {"choices": ["q2_0", "iq2_xxs", "q4_k"]},
                               "gain_d": {"low": 0.0, "high": 0.6}})  # fmt: skip
    run = run_sweep(spec, results_root=tmp_path, identity_fn=toy_identity,
                    work_fn=functools.partial(toy_work, log=str(log)))  # fmt: skip
    trials = _trials(run.sweep_dir)
    assert len(trials) == 5  # num_samples trials, each inside the budget
    assert all(t["routed_bpw"] <= TIERS[-1] for t in trials)
    scored = {chash for chash, _ in _log_lines(log)}  # (a trial of a student scored: replays)
    assert scored <= {t["config_hash"] for t in trials}
    assert all(t["status"] == "completed" for t in trials)
    over = json.loads((run.sweep_dir / "over_budget.json").read_text())
    assert over and not set(over) & scored
    assert all(entry["routed_bpw"] > TIERS[-1] for entry in over.values())


@needs_ggml
def test_a_sampled_point_over_the_budget_is_told_pruned_without_a_value(rows256, tmp_path):
    """The driver's searcher, alone: each point it hands Tune fits; each one refused is a
    PRUNED trial of the study with no intermediate value (TPE's worst rank), and recorded."""
    import optuna
    from optuna.trial import TrialState

    from healsweep.sweep.budget import BudgetGate
    from healsweep.sweep.driver import PruneAwareOptunaSearch
    from healsweep.sweep.sizes import config_size
    from healsweep.sweep.space import optuna_space, with_point

    spec = _spec(rows256, sampler="random", num_samples=8,
                 search_space={"type_gu": {"choices": ["q2_0", "q2_k", "q4_k"]},
                               "type_d": {"choices": ["q2_0", "iq2_xxs", "q4_k"]}})  # fmt: skip
    search = PruneAwareOptunaSearch(
        space=optuna_space(spec), metric="m", mode="min",
        sampler=optuna.samplers.RandomSampler(seed=0), gate=BudgetGate(spec, tmp_path),
    )  # fmt: skip
    budget = spec.budget.budget()
    for i in range(6):
        point = search.suggest(f"t{i}")
        assert budget.admits(config_size(spec.model, with_point(spec, point)))
    study = search._ot_study
    refused = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert refused and all(not t.intermediate_values for t in refused)
    for t in refused:
        assert not budget.admits(config_size(spec.model, with_point(spec, t.params)))
    over = json.loads((tmp_path / "over_budget.json").read_text())
    assert len(over) == len({tuple(sorted(t.params.items())) for t in refused})


def _cli(*args: str, env: dict | None = None, hide_ggml: bool = False):
    head = "import sys; sys.modules['llama_cpp'] = None; " if hide_ggml else "import sys; "
    code = head + "from healsweep.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=900, env=env)  # fmt: skip


@needs_ggml
def test_a_llama_recipe_without_ggml_is_one_line_at_spec_load(rows256, tmp_path):
    # a real process whose import system has no llama_cpp: ggml's quantizer cannot be found
    spec = {"name": "r", "model": str(rows256),
            "external": [{"name": "llama-iq2_xxs", "llama": {"type": "iq2_xxs"}}]}  # fmt: skip
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    run = _cli("sweep", "run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"),
               hide_ggml=True)  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "field 'external[0]' (llama-iq2_xxs): " in run.stderr
    assert "ggml's quantizer (libggml-base) was not found: build it with tools/build-ggml.sh" in (
        run.stderr
    )
    assert not (tmp_path / "r").exists()  # nothing started
    spec["external"][0]["llama"]["imatrix"] = False  # with ggml: IQ2_XXS needs an imatrix
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    run = _cli("sweep", "run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"))
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "iq2_xxs cannot be made without an importance matrix" in run.stderr


@pytest.mark.slow
def test_a_llama_recipe_is_built_once_into_the_sweep_and_reused_on_resume(rows256, tmp_path):
    from _tiny_corpus import write_tiny_corpus

    corpus = write_tiny_corpus(tmp_path / "corpus.jsonl")
    spec = {"name": "recipe", "model": str(rows256), "corpus": str(corpus),
            "calibration": {"chunk_length": 64, "min_tokens_per_expert": 4},
            "references": False, "max_concurrent": 1,
            "scoring": {"max_scored": 24, "max_context": 40, "batch": 4, "max_windows": 3},
            "external": [{"name": "llama-q2_k", "llama": {"type": "q2_k", "imatrix": True}}]}  # fmt: skip
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache")}
    run = _cli("sweep", "run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    sweep_dir = tmp_path / "r" / "recipe"
    built = sweep_dir / "external" / "llama-q2_k.gguf"
    stat = built.stat()
    ext = next(t for t in _trials(sweep_dir) if t["role"] == "external")
    assert ext["external_path"] == str(built) and ext["status"] == "completed"
    size = ModelShapes.of(open_model(rows256)).size(Knobs(type_gu="q2_k", type_d="q2_k"))
    assert ext["routed_bpw"] == size.routed_bpw == 2.625
    assert ext["file_bytes"] == size.file_bytes < stat.st_size  # as a config's: no metadata
    model = open_model(built)
    assert model.metadata("healsweep.imatrix").startswith("calibration")
    rows = pq.read_table(sweep_dir / "windows").num_rows
    again = _cli("sweep", "resume", str(sweep_dir), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)  # not rebuilt
    assert pq.read_table(sweep_dir / "windows").num_rows == rows  # nothing scored again


@needs_ggml
def test_the_grid_drops_q2_0_knobs_of_groups_stored_in_a_ggml_type():
    """gain/importance/quantizer are read by the q2_0 quantizers only: with both groups in a
    ggml type the grid over them is one config; with down in q2_0, only its own knobs count."""
    from healsweep.sweep.space import grid_configs

    space = {"gain_gu": [0.3, 0.0], "gain_d": [0.3, 0.0], "importance": ["norm_proxy", "act"]}
    ggml = spec_from_dict({"name": "x", "baseline": {"type_gu": "iq2_xs", "type_d": "iq2_xs"},
                           "search_space": space})  # fmt: skip
    assert grid_configs(ggml) == [ggml.baseline]
    mixed = spec_from_dict({"name": "x", "baseline": {"type_gu": "iq2_xs"}, "search_space": space})
    assert [k.gain_d for k in grid_configs(mixed)] == [0.3, 0.0]  # down is q2_0: gain_d counts
    both = spec_from_dict({"name": "x", "search_space": {**space, "type_gu": ["q2_0", "q2_k"]}})
    assert len(grid_configs(both)) == 8 + 2  # q2_0 gate/up: all 8; q2_k: gain_d only


@needs_ggml
@pytest.mark.parametrize("name", ["medium-budget", "medium-cpu-budget"])
def test_the_budget_sweeps_hold_llama_cpps_iq2_files_inside_their_budgets(name, rows256):
    from healsweep.kernels.ggml_types import ggml_type
    from healsweep.sweep.budget import split_grid
    from healsweep.sweep.spec_files import load_spec

    spec = load_spec(ROOT / "sweeps" / f"{name}.yaml", check_paths=False)
    limits = spec.budget.budget().limits
    assert limits == (ggml_type("iq2_xxs").bits_per_weight, ggml_type("iq2_xs").bits_per_weight)
    assert {e.name: e.llama.type for e in spec.external} == {
        "llama-iq2_xxs": "iq2_xxs", "llama-iq2_xs": "iq2_xs", "llama-q2_k": "q2_k"}  # fmt: skip
    assert all(e.llama.imatrix for e in spec.external)
    if name == "medium-cpu-budget":  # sizes depend on the shapes' ratios only (rows of 256)
        inside, over = split_grid(spec.model_copy(update={"model": str(rows256)}))
        assert (len(inside), len(over)) == (40, 8)  # 5 of 6 type pairs x 2 quantizers x 4 healings


@needs_ggml
@pytest.mark.parametrize(
    ("name", "limit", "ladder", "grid"),
    [
        ("medium-cpu-budget-1.75", 1.80, ["iq1_s", "iq1_m", "iq2_xxs"], (3, 1)),
        ("medium-cpu-budget-2.56", 2.5625, ["iq2_xxs", "iq2_xs", "iq3_xxs"], (5, 1)),
    ],
)
def test_the_allocator_budget_sweeps_load_and_move_every_group(name, limit, ladder, grid, rows256):
    """Issue 39's dev specs: one budget limit, the allocator's ladder holding the base's types,
    the grid's uniform and type-pair recipes split by the budget, and a step down and up for
    each MoE layer's gate/up and down (the base is the ladder's middle type)."""
    from healsweep.sweep.budget import split_grid
    from healsweep.sweep.sensitivity import moves, sensitivity_base
    from healsweep.sweep.spec_files import load_spec

    spec = load_spec(ROOT / "sweeps" / f"{name}.yaml", check_paths=False)
    assert spec.sampler.type == "allocator" and spec.budget.budget().limits == (limit,)
    assert spec.allocator.ladder == ladder
    local = spec.model_copy(update={"model": str(rows256)})
    inside, over = split_grid(local)
    assert (len(inside), len(over)) == grid
    base = sensitivity_base(local)
    assert base.type_gu == base.type_d == ladder[1]
    shapes = ModelShapes.of(open_model(rows256))
    assert len(moves(base, shapes, spec.allocator.ladder)) == 4 * len(shapes.moe_layers)


@needs_ggml
def test_the_whole_file_and_pareto_sweeps_load_with_their_references():
    """Issue 39's dev specs on demo-medium-cpu: the file budget's two stages are bounded by
    llama.cpp's file with every matrix in IQ2_XXS (an external beside the routed-only one), the
    Unsloth-style size's sweep by that recipe's file as heal.size counts them (the file itself its
    external); each baseline sits inside its budget; the Pareto spec's references are llama.cpp's
    seven types from IQ1_S to IQ3_XXS and its pairs span 1.625-2.896 routed bpw."""
    from healsweep.heal.size import config_size
    from healsweep.kernels.ggml_types import ggml_type
    from healsweep.sweep.spec_files import load_spec

    def sweep(name):
        return load_spec(ROOT / "sweeps" / f"{name}.yaml", check_paths=False)

    model = open_model("demo-medium-cpu")
    uniform = Knobs(type_gu="iq2_xxs", type_d="iq2_xxs",
                    **dict.fromkeys(Knobs.FILE_TYPES, "iq2_xxs"))  # fmt: skip
    unsloth = load_knobs(ROOT / "configs" / "knobs" / "unsloth-style-iq2_xxs.yaml")
    sizes = {"medium-cpu-file-budget": uniform, "medium-cpu-file-budget-refine": uniform,
             "medium-cpu-file-budget-ud": unsloth}  # fmt: skip
    for name, reference in sizes.items():
        spec = sweep(name)
        assert spec.model == "demo-medium-cpu"
        assert spec.budget.budget().limits == (config_size(model, reference).file_bytes,)
        assert spec.budget.budget().admits(config_size(model, spec.baseline))
    every = {e.name: e.llama.all_tensors for e in sweep("medium-cpu-file-budget").external}
    assert every == {"llama-all-iq2_xxs": True, "llama-iq2_xxs": False}
    (ud,) = sweep("medium-cpu-file-budget-ud").external
    assert ud.path and "unsloth-style" in ud.path
    pareto = load_spec(ROOT / "sweeps" / "medium-cpu-pareto.yaml", check_paths=False)
    assert [e.llama.type for e in pareto.external] == [
        "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "q2_k", "iq3_xxs"]  # fmt: skip
    bpw = [(2 * ggml_type(g).bits_per_weight + ggml_type(d).bits_per_weight) / 3
           for g in pareto.search_space.type_gu for d in pareto.search_space.type_d]  # fmt: skip
    assert (min(bpw), round(max(bpw), 3)) == (1.625, 2.896)


@needs_ggml
@pytest.mark.parametrize(
    ("size", "type_name", "inside"), [("iq3", "iq3_xxs", 7), ("iq4", "iq4_xs", 5)]
)
def test_the_iq3_and_iq4_file_budget_sweeps_hold_llama_cpps_file_of_that_type(
    size, type_name, inside
):
    """Issue 49's whole-file sizes: each sweep's budget is the teacher's file with every matrix
    in the type (llama.cpp's --pure file less its metadata, its external row), its allocator's
    base is that file healed, the ladder steps every routed group and every other group one type
    down and up, and its grid's trades lie partly inside the budget."""
    from healsweep.heal.size import config_size
    from healsweep.sweep.budget import split_grid
    from healsweep.sweep.sensitivity import moves, sensitivity_base
    from healsweep.sweep.spec_files import load_spec

    spec = load_spec(ROOT / "sweeps" / f"medium-cpu-file-budget-{size}.yaml", check_paths=False)
    model = open_model("demo-medium-cpu")
    uniform = Knobs(type_gu=type_name, type_d=type_name,
                    **dict.fromkeys(Knobs.FILE_TYPES, type_name))  # fmt: skip
    assert spec.budget.budget().limits == (config_size(model, uniform).file_bytes,)
    (llama,) = spec.external
    recipe = llama.llama
    assert (recipe.type, recipe.all_tensors, recipe.imatrix) == (type_name, True, True)
    base = sensitivity_base(spec)
    assert {getattr(base, f"type_{g}") for g in ("gu", "d", "attn", "shexp", "embd", "output")} == {
        type_name}  # fmt: skip
    shapes = ModelShapes.of(model)
    assert len(moves(base, shapes, spec.allocator.ladder, whole_file=True)) == 2 * (
        2 * len(shapes.moe_layers) + 4)  # fmt: skip
    assert len(split_grid(spec)[0]) == inside  # the baseline and the grid points that fit


@needs_ggml
def test_readme_command_1_runs_the_two_recipes_against_llama_cpps_files_of_their_sizes():
    """sweeps/medium-cpu-recipes.yaml (README command (1)): its baseline is
    configs/knobs/budget-2.06.yaml, its one grid point budget-2.31.yaml, its tiers the two sizes
    and its external files llama.cpp's IQ2_XXS and IQ2_XS with an importance matrix; the 2.06
    recipe unhealed is its reference row."""
    from healsweep.heal.knobs import load_knobs
    from healsweep.kernels.ggml_types import ggml_type
    from healsweep.sweep.space import grid_configs
    from healsweep.sweep.spec_files import load_spec

    spec = load_spec(ROOT / "sweeps" / "medium-cpu-recipes.yaml", check_paths=False)
    recipes = [load_knobs(ROOT / "configs" / "knobs" / f"budget-{b}.yaml") for b in ("2.06", "2.31")]
    assert grid_configs(spec) == recipes  # the baseline first, then the grid's one point
    assert spec.budget.budget().limits == tuple(
        ggml_type(t).bits_per_weight for t in ("iq2_xxs", "iq2_xs"))  # fmt: skip
    assert {e.name: (e.llama.type, e.llama.imatrix) for e in spec.external} == {
        "llama-iq2_xxs": ("iq2_xxs", True), "llama-iq2_xs": ("iq2_xs", True)}  # fmt: skip
    assert list(spec.reference_names()) == ["unhealed"] and spec.model == "demo-medium-cpu"
