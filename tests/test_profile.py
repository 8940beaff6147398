"""The phase profile of a trial (healsweep.profile) and the node share of a trial's CPUs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.heal._runner import StageRunner
from healsweep.profile import PhaseProfile, active, phase, phase_totals, profiling
from healsweep.sweep.devices import cpu_share


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_nested_phases_are_each_charged_their_own_time(own_runtime):
    profile = PhaseProfile()
    start = time.perf_counter()
    with profile.phase("outer", 0):
        _spin(0.05)
        with profile.phase("inner", 0):
            _spin(0.1)
        with profile.phase("inner", 1):
            _spin(0.02)
    wall = time.perf_counter() - start
    rows = {(r["phase"], r["layer"]): r for r in profile.rows()}
    assert set(rows) == {("outer", 0), ("inner", 0), ("inner", 1)}
    # the rows add up to the block's wall time, and each holds its own share of it
    assert sum(r["wall_s"] for r in rows.values()) == pytest.approx(wall, abs=2e-3)
    assert rows[("inner", 0)]["cpu_s"] >= 0.09 and rows[("inner", 1)]["cpu_s"] >= 0.015
    assert 0.04 <= rows[("outer", 0)]["cpu_s"] < 0.09  # its nested phases left out
    assert all(r["device_s"] is None for r in rows.values())  # no GPU sampled on a CPU
    totals = phase_totals(profile.rows())
    assert list(totals) == ["outer", "inner"] and totals["inner"]["layers"] == 2
    assert totals["inner"]["calls"] == 2
    assert totals["inner"]["wall_s"] == pytest.approx(
        rows[("inner", 0)]["wall_s"] + rows[("inner", 1)]["wall_s"], abs=2e-3
    )


def test_a_new_shape_s_compile_is_charged_to_the_phase_that_ran_it(own_runtime):
    import jax
    import jax.numpy as jnp

    # a function of its own, so no earlier test compiled it (and no persistent cache holds it)
    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) * 0.37 + 1.3e-3)
    ones, twos = (jax.device_put(np.full((96, 40), v, np.float32)) for v in (1.0, 2.0))
    with profiling() as profile:
        with phase("first", 0):
            step(ones).block_until_ready()
        with phase("again", 0):  # the same shape: compiled already
            step(twos).block_until_ready()
    rows = {r["phase"]: r for r in profile.rows()}
    assert 0 < rows["first"]["compile_s"] <= rows["first"]["wall_s"]
    assert rows["again"]["compile_s"] == 0
    totals = phase_totals([*profile.rows(), {**rows["again"], "compile_s": None}])
    assert totals["first"]["compile_s"] == pytest.approx(rows["first"]["compile_s"], abs=1e-3)
    old = {k: v for k, v in rows["first"].items() if k != "compile_s"}  # a row from before it
    assert phase_totals([old])["first"]["compile_s"] == 0


def test_stored_entries_are_charged_to_the_phase_that_computed_them(own_runtime, tmp_path):
    cache = StageCache(tmp_path)
    arrays = {"a": np.zeros(1000, np.float32), "b": np.ones((10, 10), np.float64)}
    with profiling() as profile:
        assert active() is profile
        with phase("quantize", 3):
            cache.get_or_compute("quantize", "k" * 64, lambda: (arrays, {}))
            cache.get_or_compute("quantize", "k" * 64, lambda: (arrays, {}))  # a hit: no bytes
        cache.put("ridge_heldout", "h" * 64, {"f": np.zeros(5, np.float32)})  # no phase open
    assert active() is None  # given back
    rows = {(r["phase"], r["layer"]): r for r in profile.rows()}
    assert rows[("quantize", 3)]["cache_bytes"] == 4000 + 800
    assert rows[("ridge_heldout", None)]["cache_bytes"] == 20
    entry = cache.path("quantize", "k" * 64).stat().st_size
    assert 4800 <= entry < 4800 + 4096  # the arrays, plus the entry's header and alignment


def test_a_stage_runner_charges_each_stage_to_the_layer_it_heals(own_runtime, tmp_path):
    from healsweep.heal.stages import RoutedOutput

    with profiling() as profile:
        run = StageRunner(StageCache(tmp_path))
        for layer in (0, 1):
            run.layer = layer
            run.value("routed_q", f"{layer}" * 64, RoutedOutput,
                      lambda: RoutedOutput(np.ones((4, 8), np.float32)))  # fmt: skip
        run.layer = None
        run.timed("ridge_heldout", lambda: _spin(0.01), 1)
    rows = {(r["phase"], r["layer"]) for r in profile.rows()}
    assert rows == {("routed_q", 0), ("routed_q", 1), ("ridge_heldout", 1)}
    assert set(run.seconds) == {"routed_q", "ridge_heldout"}
    assert run.seconds["ridge_heldout"] >= 0.009


CPU_NODE = {"CPU": 2.0}
GPU_NODE = {"CPU": 16.0, "GPU": 1.0}
EIGHT_GPUS = {"CPU": 128.0, "GPU": 8.0}


@pytest.mark.parametrize(
    "resources, concurrent, nodes, share",
    [
        ({}, 1, [CPU_NODE], 2),  # alone on the node: every core
        ({}, 2, [CPU_NODE], 1),
        ({}, 8, [CPU_NODE], 1),  # never below one
        ({"gpu": 1}, 1, [GPU_NODE], 16),  # cores ÷ GPUs
        ({"gpu": 1}, 8, [EIGHT_GPUS], 16),
        ({"gpu": 1}, 2, [EIGHT_GPUS], 64),  # two trials on eight GPUs: half the cores each
        ({"gpu": 0.5}, 4, [GPU_NODE], 8),  # two trials share the GPU
        ({"gpu": 1}, 2, [CPU_NODE, GPU_NODE], 16),  # only the GPU node can run it
        ({}, 4, [{"CPU": 8.0}, {"CPU": 4.0}], 2),  # the node that gives the fewest
        ({"metal": 1}, 4, [{"CPU": 10.0, "metal": 1.0}, {"CPU": 8.0, "metal": 1.0}], 8),
        ({"gpu": 1}, 1, [CPU_NODE], 1),  # nowhere to run: the cluster check says so later
        ({}, 2, [{"CPU": 0.0}, {"CPU": 4.0}, {"CPU": 4.0}], 4),  # a head of no CPUs runs none
    ],
)
def test_a_trial_takes_its_node_s_share_of_the_cores(resources, concurrent, nodes, share):
    assert cpu_share(resources, concurrent, nodes) == share


def test_a_spec_naming_its_cpus_keeps_them_and_its_stored_form():
    from healsweep.sweep.manifest import spec_hash
    from healsweep.sweep.spec_files import spec_from_dict

    auto = spec_from_dict({"name": "auto", "resources": {"gpu": 1}})
    given = spec_from_dict({"name": "given", "resources": {"cpu": 3, "gpu": 1}})
    assert auto.trial_resources() == {"cpu": 1.0, "gpu": 1.0}  # before Ray is asked
    shared = auto.with_cpu_share(16)
    assert shared.trial_resources() == {"cpu": 16.0, "gpu": 1.0}
    assert spec_hash(shared) == spec_hash(auto) and "cpu" not in shared.model_dump()["resources"]
    assert given.with_cpu_share(16).trial_resources() == {"cpu": 3.0, "gpu": 1.0}
    plain = spec_from_dict({"name": "plain"})
    assert "resources" not in plain.model_dump()  # the default: stored as it was written
