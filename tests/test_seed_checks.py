"""Issue 49's seed checks (docs/demo-model.md, "Checked on other seeds"): each spec scores the
recipe or the target's allocation it names against the config that writes llama.cpp's bytes of
that size, on a sibling model of demo-medium-cpu, exactly as the shipped model's confirm spec
does. The sibling files are not shipped, so the specs load without checking their paths; the
sizes are the shipped model's (the same architecture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from healsweep.heal.knobs import load_knobs
from healsweep.heal.size import ModelShapes
from healsweep.model import open_model
from healsweep.sweep.space import grid_configs
from healsweep.sweep.spec_files import load_spec

# The specs' configs load ggml types (IQ1_S ... IQ4_XS), which need ggml's quantizer at load:
# the slow tier, where CI installs the [bench] extra (as test_knobs' recipes and test_budget_sweep)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (1, 2)


def _spec(name: str):
    return load_spec(ROOT / "sweeps" / f"{name}.yaml", check_paths=False)


def _model_as_written(name: str) -> str:
    """The spec's ``model`` as written (load_spec resolves it, through a link to the file)."""
    return yaml.safe_load((ROOT / "sweeps" / f"{name}.yaml").read_text())["model"]


def _pair(name: str):
    """The spec's two configs: the baseline (llama.cpp's bytes) and the checked config."""
    spec = _spec(name)
    configs = grid_configs(spec)
    assert len(configs) == 2 and configs[0] == spec.baseline
    return spec, configs[0], configs[1]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("recipe", ["3.06", "4.25"])
def test_a_uniform_recipes_seed_check_is_its_shipped_confirm_on_the_seed_model(seed, recipe):
    spec, baseline, checked = _pair(f"medium-cpu-seed{seed}-{recipe}")
    shipped = _spec(f"medium-cpu-confirm-{recipe}")
    assert _model_as_written(spec.name) == f"../build/seed{seed}/demo-moe-medium-cpu.gguf"
    assert checked == load_knobs(ROOT / "configs" / "knobs" / f"budget-{recipe}.yaml")
    assert baseline == shipped.baseline and spec.budget == shipped.budget


@pytest.mark.parametrize("seed", SEEDS)
def test_the_1_56_target_check_heals_iq1_s_as_budget_2_06_against_llama_cpps_iq2_xxs(seed):
    spec, baseline, checked = _pair(f"medium-cpu-seed{seed}-1.56")
    assert _model_as_written(spec.name) == f"../build/seed{seed}/demo-moe-medium-cpu.gguf"
    assert baseline == _spec("medium-cpu-confirm-1.75").baseline  # llama.cpp's IQ2_XXS bytes
    recipe = load_knobs(ROOT / "configs" / "knobs" / "budget-2.06.yaml")
    assert checked == recipe.replace(type_gu="iq1_s", type_d="iq1_s")
    shapes = ModelShapes.of(open_model("demo-medium-cpu"))
    assert shapes.size(checked).routed_bpw == 1.5625


@pytest.mark.parametrize("seed", SEEDS)
def test_the_file_target_check_fits_the_all_iq2_xxs_file_with_budget_2_06s_healing(seed):
    spec, baseline, checked = _pair(f"medium-cpu-seed{seed}-file-3.13mib")
    shipped = _spec("medium-cpu-confirm-file-3.13mib")
    assert baseline == shipped.baseline and spec.budget == shipped.budget
    shapes = ModelShapes.of(open_model("demo-medium-cpu"))
    assert shapes.size(baseline).file_bytes == spec.budget.file_bytes[0] == 3286656
    assert shapes.size(checked).file_bytes <= spec.budget.file_bytes[0]
    healing = load_knobs(ROOT / "configs" / "knobs" / "budget-2.06.yaml")
    types = {k: getattr(checked, k) for k in checked.TYPES}
    assert checked == healing.replace(**types) and checked.layer_types
