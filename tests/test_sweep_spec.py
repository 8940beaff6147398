"""The sweep spec: every error names field, value and what is allowed; the search space expands
into the trials the sweep will run (baseline first, no repeats); shipped specs are valid."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from healsweep.errors import GGUFFormatError, SpecError
from healsweep.heal.knobs import Knobs
from healsweep.heal.reads import student_key
from healsweep.sweep.budget import planned_trials
from healsweep.sweep.space import (
    baseline_point,
    config_hash,
    grid_configs,
    optuna_space,
    trial_identity,
    varied_knobs,
)
from healsweep.sweep.spec import FutilitySpec
from healsweep.sweep.spec_files import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_shipped_ablation_spec_is_the_audits_twelve_configs():
    spec = load_spec(ROOT / "sweeps" / "demo-ablation.yaml")
    configs = grid_configs(spec)
    assert len(configs) == 12 == planned_trials(spec)
    assert configs[0] == Knobs()  # the shipped healer is the baseline, run first
    expected = set(itertools.product(["gaussian", "mse", "none"], [True, False], [0.3, 0.0]))
    assert {(c.alpha, c.ridge, c.gain_d) for c in configs} == expected
    assert spec.pruner.type == "none" and spec.model == "demo" and spec.corpus == "demo"
    assert Path(spec.split).is_file()  # resolved against the spec's folder


def test_shipped_tune_spec_searches_five_knobs_with_wilcoxon():
    spec = load_spec(ROOT / "sweeps" / "demo-tune.yaml")
    assert set(spec.search_space.dimensions()) == {"gamma", "gain_gu", "gain_d", "rho", "eta"}
    assert spec.sampler.type == "tpe" and spec.pruner.type == "wilcoxon"
    space = optuna_space(spec)
    assert space["rho"].log and space["rho"].low == 0.5
    base = Knobs()
    for knob, value in baseline_point(spec).items():  # the baseline is a legal first point
        assert space[knob].low <= value <= space[knob].high
        assert value == getattr(base, knob)


def test_futility_is_on_with_wilcoxon_unless_turned_off():
    def pruner(value):
        return spec_from_dict({"name": "x", "pruner": value}).pruner

    assert pruner("wilcoxon").futility == FutilitySpec()
    assert pruner({"type": "wilcoxon", "futility": {"min_windows": 20}}).futility.min_windows == 20
    assert pruner({"type": "wilcoxon", "futility": False}).futility is None
    assert pruner("median").futility is None and pruner("none").futility is None


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "name: x\nsearch_space:\n  alpha: [gaussian, mse\n")
    with pytest.raises(SpecError, match=r"spec\.yaml:\d+: YAML syntax error"):
        load_spec(path)


def test_unknown_field_names_it_its_line_and_the_known_fields(tmp_path):
    path = _write(tmp_path, "name: x\nsampler: grid\nprunner: none\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert "spec.yaml:3" in message and "'prunner'" in message and "pruner" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("raw", "pieces"),
    [
        ({"name": "../escape"}, ["'name'", "'../escape'", "letters, digits"]),
        ({"name": "x", "sampler": "bayes"}, ["'sampler.type'", "'bayes'", "grid, tpe, random or allocator"]),
        (
            {"name": "x", "pruner": {"type": "wilcoxon", "p_threshold": 1.5}},
            ["'pruner.p_threshold'", "1.5", "(0, 1)"],
        ),
        (
            {"name": "x", "pruner": {"type": "wilcoxon", "futility": {"confidence": 1.0}}},
            ["'pruner.futility.confidence'", "1.0", "[0.5, 1)"],
        ),
        (
            {"name": "x", "pruner": {"type": "wilcoxon", "futility": {"min_windows": 1}}},
            ["'pruner.futility.min_windows'", "1", ">= 2"],
        ),
        (
            {"name": "x", "pruner": {"type": "wilcoxon", "futility": {"level": 0.9}}},
            ["'pruner.futility.level'", "unknown", "confidence, min_windows"],
        ),
        (
            {"name": "x", "pruner": {"type": "median", "futility": {"confidence": 0.9}}},
            ["'pruner.futility'", "wilcoxon only"],
        ),
        ({"name": "x", "max_concurrent": 0}, ["'max_concurrent'", "0", ">= 1"]),
        ({"name": "x", "scoring": {"max_scored": 0}}, ["'scoring.max_scored'", "0", "[1, 4096]"]),
        ({"name": "x", "resources": {"cpu": "many"}}, ["'resources.cpu'", "'many'", "amount"]),
        (
            {"name": "x", "calibration": {"chunk_length": 4}},
            ["'calibration'", "chunk_length", "16"],
        ),
        ({"name": "x", "calibration": {"tokens": 4}}, ["'calibration'", "unknown", "max_tokens"]),
    ],
)
def test_field_errors_name_field_value_and_allowed(raw, pieces):
    with pytest.raises(SpecError) as err:
        spec_from_dict(raw)
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))


@pytest.mark.parametrize(
    ("space", "pieces"),
    [
        ({"gain_q": [0.1]}, ["search_space.gain_q", "unknown knob", "gain_d"]),
        ({"gain_d": [0.3, 5.0]}, ["search_space.gain_d[1]", "5.0", "[0, 2]"]),
        ({"alpha": ["gaussian", "cubic"]}, ["search_space.alpha[1]", "'cubic'", "gaussian, mse"]),
        ({"ridge": ["yes"]}, ["search_space.ridge[0]", "'yes'", "true or false"]),
        ({"gain_d": [0.3, 0.3]}, ["search_space.gain_d", "twice"]),
        ({"gain_d": {"low": 0, "high": 1}}, ["search_space.gain_d", "with sampler grid"]),
    ],
)
def test_grid_dimensions_are_checked_with_the_knob_rules(space, pieces):
    with pytest.raises(SpecError) as err:
        spec_from_dict({"name": "x", "search_space": space})
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))


@pytest.mark.parametrize(
    ("space", "extra", "pieces"),
    [
        ({"gamma": [0.1, 0.5]}, {}, ["search_space.gamma", "with sampler tpe", "choices"]),
        ({"alpha": {"low": 0, "high": 1}}, {}, ["needs a float knob", "choices"]),
        ({"gamma": {"low": 0.9, "high": 0.1}}, {}, ["low 0.9 must be below high 0.1"]),
        ({"gain_d": {"low": 0.0, "high": 1.0, "log": True}}, {}, ["log range needs low > 0"]),
        ({"rho": {"low": 0.0, "high": 10.0}}, {}, ["search_space.rho.low", "0.0", "(0, 1000]"]),
        ({"gamma": {"low": 0.0, "high": 0.5}}, {}, ["baseline's gamma = 0.75", "outside"]),
        ({"gamma": {"low": 0.0, "high": 1.0}}, {"num_samples": None}, ["'num_samples' is missing"]),
        (
            {"gamma": {"low": 0.0, "high": 1.0}},
            {"fixed": {"ridge": False}},
            ["fixed.ridge", "differs from the baseline"],
        ),
        (
            {"gamma": {"low": 0.0, "high": 1.0}},
            {"fixed": {"gamma": 0.5}},
            ["both fixed and searched"],
        ),
    ],
)
def test_tpe_dimensions_and_baseline_consistency(space, extra, pieces):
    raw = {"name": "x", "sampler": "tpe", "num_samples": 4, "search_space": space, **extra}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(SpecError) as err:
        spec_from_dict(raw)
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))


def test_grid_num_samples_must_match_the_grid():
    with pytest.raises(SpecError, match="the grid has 4 configs"):
        spec_from_dict({"name": "x", "num_samples": 6, "search_space": {"gain_d": [0.3, 0, 1, 2]}})


def test_bad_baseline_knob_names_the_field_and_line(tmp_path):
    path = _write(tmp_path, "name: x\nbaseline:\n  gamma: 3\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert (
        "spec.yaml:3" in str(err.value) and "gamma" in str(err.value) and "[0, 1]" in str(err.value)
    )


def test_missing_model_file_is_reported(tmp_path):
    path = _write(tmp_path, "name: x\nmodel: nowhere.gguf\n")
    with pytest.raises(SpecError, match=r"'model' = .*nowhere\.gguf.*no such file"):
        load_spec(path)


def test_grid_puts_baseline_first_applies_fixed_and_drops_repeats():
    spec = spec_from_dict(
        {
            "name": "x",
            "baseline": {"gamma": 0.5},
            "fixed": {"eta": 0.3},
            "search_space": {"gain_d": [0.3, 0.0], "alpha": ["gaussian", "none"]},
        }
    )
    configs = grid_configs(spec)
    assert configs[0] == Knobs(gamma=0.5)
    # baseline (eta 0.15) differs from every grid point (eta 0.3): 1 + 4 trials, all distinct
    assert len(configs) == 5 == len({config_hash(c) for c in configs})
    assert all(c.eta == 0.3 and c.gamma == 0.5 for c in configs[1:])
    # without fixed knobs, the grid point equal to the baseline is not run twice
    plain = spec_from_dict({"name": "x", "search_space": {"gain_d": [0.3, 0.0]}})
    assert [c.gain_d for c in grid_configs(plain)] == [0.3, 0.0]


def test_the_knobs_a_sweep_varies_are_its_space_and_the_fixed_ones_off_the_baseline():
    """What a sweep trial states in its cache holds (eviction's spent entries, issue 46): a
    fixed knob equal to the baseline's is the same in every trial, one set off it is not (the
    baseline runs with its own value)."""
    spec = spec_from_dict(
        {
            "name": "x",
            "baseline": {"gamma": 0.5},
            "fixed": {"eta": 0.3, "gamma": 0.5, "rho": 6.0},
            "search_space": {"gain_d": [0.3, 0.0]},
        }
    )
    assert varied_knobs(spec) == {"gain_d", "eta"}  # rho 6.0 is the baseline's default too
    assert varied_knobs(load_spec(ROOT / "sweeps" / "demo-tune.yaml")) == {
        "gamma", "gain_gu", "gain_d", "rho", "eta"}  # fmt: skip


def test_grid_drops_points_that_repeat_an_earlier_student():
    # gptq_damp is read only by gptq, gamma only when alpha is not none: crossing them with
    # search / none would score the same student again under another name.
    spec = spec_from_dict(
        {
            "name": "x",
            "search_space": {
                "quantizer": ["search", "gptq"],
                "gptq_damp": [0.01, 0.5],
                "alpha": ["gaussian", "none"],
                "gamma": [0.75, 0.5],
            },
        }
    )
    got = [(c.quantizer, c.gptq_damp, c.alpha, c.gamma) for c in grid_configs(spec)]
    assert got == [
        ("search", 0.01, "gaussian", 0.75),  # the baseline
        ("search", 0.01, "gaussian", 0.5),
        ("search", 0.01, "none", 0.75),
        ("gptq", 0.01, "gaussian", 0.75),
        ("gptq", 0.01, "gaussian", 0.5),
        ("gptq", 0.01, "none", 0.75),
        ("gptq", 0.5, "gaussian", 0.75),
        ("gptq", 0.5, "gaussian", 0.5),
        ("gptq", 0.5, "none", 0.75),
    ]
    # score-time knobs are not heal knobs, and still make distinct configs
    cache = spec_from_dict(
        {"name": "x", "fixed": {}, "search_space": {"moce_bonus": [0.0, 0.5]}, "baseline": {}}
    )
    assert [c.moce_bonus for c in grid_configs(cache)] == [0.0, 0.5]


def test_trial_identity_from_tune_configs():
    spec = spec_from_dict(
        {
            "name": "x",
            "sampler": "random",
            "num_samples": 3,
            "fixed": {"alpha": "gaussian"},
            "search_space": {"gamma": {"low": 0.0, "high": 1.0}},
        }
    )
    baseline = trial_identity({"gamma": 0.75}, spec.baseline, spec.fixed, spec.model)
    assert baseline.knobs == Knobs() and baseline.is_baseline
    assert baseline.config_hash == config_hash(Knobs()) and baseline.role == "baseline"
    other = trial_identity({"gamma": 0.2}, spec.baseline, spec.fixed, spec.model)
    assert other.knobs == Knobs(gamma=0.2) and not other.is_baseline and other.role == "trial"
    grid = trial_identity(
        {"knobs": Knobs(eta=0.5).model_dump()}, spec.baseline, spec.fixed, spec.model
    )
    assert grid.knobs == Knobs(eta=0.5) and grid.student == student_key(Knobs(eta=0.5))


def test_config_hash_is_canonical():
    assert config_hash(Knobs(gain_d=0)) == config_hash(Knobs(gain_d=0.0))
    assert config_hash(Knobs()) != config_hash(Knobs(gain_d=0.31))


# A spec with ints for float knobs and a range, as a user writes them; its hash was computed by
# b05fe56 (the spec's sections were raw dicts then): typing them must not change it. It names
# one CPU a trial, which was the default then (a spec without `resources` now means the node's
# share of the cores, so it is stored and hashed without the field).
PINNED = {
    "name": "pinned", "sampler": "tpe", "num_samples": 3,
    "baseline": {"gain_d": 0, "gamma": 1, "eta": 0}, "fixed": {"eta": 0},
    "search_space": {"rho": {"low": 1, "high": 50, "log": True},
                     "alpha": {"choices": ["gaussian", "none"]}},
    "calibration": {"max_tokens": 1000}, "resources": {"cpu": 1},
}  # fmt: skip
PINNED_HASH = "abfb986427ee28c2085f83b5de03c496e51c572dda2b437f61a1525c8fe59d2a"


def test_typed_sections_are_stored_and_hashed_as_written():
    from healsweep.sweep.manifest import spec_hash
    from healsweep.sweep.spec import SweepSpec

    spec = spec_from_dict(PINNED)
    assert spec.baseline == Knobs(gain_d=0.0, gamma=1.0, eta=0.0)  # typed where the code reads
    assert spec.fixed.model_fields_set == {"eta"} and spec.calibration.max_tokens == 1000
    assert spec.calibration.corpus == spec.corpus == "demo"  # defaults to the sweep's corpus
    stored = spec.model_dump(mode="json")
    assert {k: stored[k] for k in ("baseline", "fixed", "search_space", "calibration")} == {
        k: PINNED[k] for k in ("baseline", "fixed", "search_space", "calibration")
    }
    assert spec_hash(spec) == PINNED_HASH
    reread = SweepSpec.model_validate_json(spec.model_dump_json())  # what resume reads
    assert spec_hash(reread) == PINNED_HASH and reread.baseline == spec.baseline


def test_a_spec_field_added_later_keeps_earlier_spec_hashes():
    """A new spec field listed in ``added_later`` with its "as before" value is left out of the
    stored form at that value: specs recorded before it keep their hash (and resume)."""
    from typing import ClassVar

    from healsweep.sweep.manifest import spec_hash
    from healsweep.sweep.spec import SweepSpec

    class WithBudget(SweepSpec):
        added_later: ClassVar[dict] = {**SweepSpec.added_later, "budget": None}
        budget: float | None = None
        """routed bits per weight at most, or null"""

    assert spec_hash(WithBudget.model_validate(PINNED)) == PINNED_HASH
    assert spec_hash(WithBudget.model_validate({**PINNED, "budget": 2.5})) != PINNED_HASH


def test_placement_and_a_shared_cache_root_keep_earlier_spec_hashes(tmp_path):
    """``placement`` and ``cache_root`` came after sweeps were recorded: at their defaults a
    spec stores and hashes as before; ``placement: ray`` is a different sweep, while the cache
    root, like the results root, is a location (a resume may name another)."""
    from healsweep.sweep.manifest import spec_hash

    spec = spec_from_dict(PINNED)
    assert (spec.placement, spec.cache_root) == ("cache", None)
    assert "placement" not in spec.model_dump() and "cache_root" not in spec.model_dump()
    assert spec_hash(spec_from_dict({**PINNED, "placement": "cache"})) == PINNED_HASH
    assert spec_hash(spec_from_dict({**PINNED, "cache_root": "/pool/cache"})) == PINNED_HASH
    assert spec_hash(spec_from_dict({**PINNED, "placement": "ray"})) != PINNED_HASH
    with pytest.raises(SpecError, match="field 'placement' = 'nearest' is not allowed; expected"):
        spec_from_dict({**PINNED, "placement": "nearest"})
    path = tmp_path / "spec.yaml"
    path.write_text("name: x\ncache_root: shared/cache\n")
    assert load_spec(path).cache_root == str(tmp_path / "shared" / "cache")  # beside the spec


def test_a_range_may_have_a_step():
    spec = spec_from_dict(
        {"name": "x", "sampler": "tpe", "num_samples": 2,
         "search_space": {"eta": {"low": 0.05, "high": 0.55, "step": 0.1}}}
    )  # fmt: skip
    eta = optuna_space(spec)["eta"]
    assert (eta.low, eta.high, eta.step, eta.log) == (0.05, 0.55, 0.1, False)
    with pytest.raises(SpecError, match="log scale or a step"):
        spec_from_dict(
            {"name": "x", "sampler": "tpe", "num_samples": 2,
             "search_space": {"rho": {"low": 1, "high": 8, "log": True, "step": 1}}}
        )  # fmt: skip


def test_a_max_context_the_model_cannot_hold_is_refused_before_the_sweep_starts():
    """The sweep caps a window's context to the model's as `score` and `confirm` do
    (``context_cap``); one that cannot fit is refused with the spec's field named."""
    from healsweep.sweep.work import sweep_identity

    spec = spec_from_dict({"name": "x", "scoring": {"max_scored": 128, "max_context": 1000}})
    with pytest.raises(SpecError) as err:
        sweep_identity(spec)  # the demo model holds 1024 tokens
    assert str(err.value) == (
        "sweep x: field 'scoring.max_context': max_context 1000 + max_scored 128 exceeds the "
        "model's context length 1024; lower one of them"
    )


@pytest.mark.slow  # a spec naming a ggml type needs ggml's quantizer: the slow tier installs it
def test_a_grid_type_the_model_cannot_hold_is_refused_before_the_sweep_starts():
    """A grid over ``type_d`` naming a type whose blocks do not fill the demo model's down rows
    fails in seconds, naming the tensor and the type, not as a failed trial."""
    from healsweep.sweep.work import sweep_identity

    spec = spec_from_dict({"name": "x", "search_space": {"type_d": ["q2_0", "iq2_xs"]}})
    with pytest.raises(GGUFFormatError, match="ffn_down_exps hold 128 values.*stored as iq2_xs"):
        sweep_identity(spec)
    sweep_identity(spec_from_dict({"name": "x", "search_space": {"type_d": ["q2_0", "iq4_nl"]}}))


def test_a_spec_pickled_before_its_sections_were_typed_unpickles_typed():
    """Tune keeps the results recorder, and the spec in it, in a running sweep's tuner.pkl and
    restores it on resume. This recorder was pickled by b05fe56 (the pinned spec's sections
    as raw dicts, a wilcoxon pruner): its spec comes back typed, with the same hash."""
    import pickle

    from healsweep.sweep.manifest import spec_hash

    fixture = Path(__file__).parent / "fixtures" / "pickles" / "recorder-b05fe56.pkl"
    recorder = pickle.loads(fixture.read_bytes())
    spec = recorder.spec
    assert spec.baseline == Knobs(gain_d=0.0, gamma=1.0, eta=0.0)
    assert spec.fixed.model_fields_set == {"eta"} and spec.calibration.max_tokens == 1000
    assert set(spec.search_space.dimensions()) == {"rho", "alpha"}
    assert spec.pruner.futility == FutilitySpec(min_windows=6)
    expected = spec_hash(spec_from_dict({**PINNED, "pruner": spec.pruner.model_dump()}))
    assert (
        spec_hash(spec)
        == expected
        == "80afc79c6e24c8dd6b9fa881c72a58a31076f77754f7a3298698b4fbfbcc3a03"
    )
    assert trial_identity(
        {"rho": 2.0, "alpha": "none"}, spec.baseline, spec.fixed, spec.model
    ).knobs == Knobs(gain_d=0.0, gamma=1.0, eta=0.0, rho=2.0, alpha="none")


def test_the_cache_size_limit_is_checked_and_kept_out_of_the_hash():
    """``cache_max_gb`` (issue 38): GiB >= 0 or null; like the cache's location it changes
    what is recomputed, never a result, so a spec hashes the same with any limit."""
    from healsweep.sweep.manifest import spec_hash

    spec = spec_from_dict(PINNED)
    assert spec.cache_max_gb is None and "cache_max_gb" not in spec.model_dump()
    limited = spec_from_dict({**PINNED, "cache_max_gb": 16})
    assert limited.cache_max_gb == 16.0 and spec_hash(limited) == PINNED_HASH
    for bad, piece in ((-1, ">= 0"), ("lots", "'lots'"), (float("nan"), "nan")):
        with pytest.raises(SpecError) as err:
            spec_from_dict({**PINNED, "cache_max_gb": bad})
        message = str(err.value)
        assert "'cache_max_gb'" in message and piece in message and "GiB" in message, message
