"""The pieces of a pool that need no cluster: where a trial is asked to run (holders), what a
trial process is given (its GPU share, the resident budget per GPU), the pool figures of trial
rows, the night's grid and trial kinds, the GPU cell of `cluster status`. The placement itself
runs on a real two-node local cluster in tests/test_pool_cluster.py (slow tier)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from healsweep.errors import SettingError
from healsweep.heal.knobs import Knobs


def test_a_quantization_is_named_by_the_knobs_the_quantize_stage_reads():
    from healsweep.sweep.holders import quantization_of

    base = quantization_of(Knobs())
    assert base == quantization_of(Knobs(rho=24.0, eta=0.5))  # follow-ups: the same entries
    assert base == quantization_of(Knobs(gptq_damp=0.5))  # inert under `search`
    assert base != quantization_of(Knobs(gain_d=0.0))
    assert base != quantization_of(Knobs(quantizer="gptq"))
    assert quantization_of(Knobs(quantizer="plain", gain_d=0.0)) == quantization_of(
        Knobs(quantizer="plain")
    )


def test_a_node_holds_what_its_caches_served_or_computed():
    from healsweep.sweep.holders import TRACE, held_keys

    detail = {"hits": {"calib_trace": 1}, "computed": {"quantize": 2}, "waited": {}}
    assert held_keys("q-1", detail) == ["q-1", TRACE]
    assert held_keys("q-1", {"hits": {"part_b": 3}, "computed": {}, "waited": {}}) == []
    assert held_keys(None, detail) == [TRACE]  # an external row has no quantization


NODE_A, NODE_B = "a" * 56, "b" * 56  # Ray node ids are 28 bytes of hex


def _ask(holders=(), traces=(), loads=None, rebuild_s=None, building=()):
    from healsweep.sweep.holders import Ask, NodeLoad

    idle = {NODE_A: NodeLoad(1, 0.0, 0), NODE_B: NodeLoad(1, 0.0, 0)}
    loads = {node: NodeLoad(*load) for node, load in (loads or {}).items()}
    return Ask(list(holders), list(building), list(traces), {**idle, **loads}, rebuild_s)


def test_placement_asks_ray_for_the_holder_softly_and_never_under_ray_placement():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from healsweep.sweep.holders import placement_for

    on_holder = placement_for("cache", _ask([NODE_A, NODE_B], [NODE_B]))
    assert isinstance(on_holder.strategy, NodeAffinitySchedulingStrategy)
    assert on_holder.strategy.node_id == NODE_A and on_holder.strategy.soft
    assert not on_holder.strategy._spill_on_unavailable  # waits for its holder while it lives
    assert (on_holder.target, on_holder.holders) == (NODE_A, (NODE_A, NODE_B))
    busy_a = {NODE_A: (0, 30.0, 1)}  # of two holders, the one with a free slot
    assert placement_for("cache", _ask([NODE_A, NODE_B], loads=busy_a)).target == NODE_B

    traced = placement_for("cache", _ask([], [NODE_B]))  # a new quantization: near the trace
    assert traced.strategy.node_id == NODE_B and traced.strategy._spill_on_unavailable
    assert traced.holders == ()  # not a follow-up
    both = placement_for("cache", _ask([], [NODE_A, NODE_B], loads=busy_a))
    assert both.target == NODE_B  # the trace holder with room

    assert placement_for("cache", _ask()).strategy == "DEFAULT"
    by_ray = placement_for("ray", _ask([NODE_A], [NODE_A], loads=busy_a, rebuild_s=1.0))
    assert by_ray.strategy == "DEFAULT" and by_ray.target is None
    assert by_ray.holders == (NODE_A,)  # still a follow-up: its on_holder is measured


def test_a_follow_up_waits_for_its_busy_holder_only_while_that_costs_less_than_a_rebuild():
    from healsweep.sweep.holders import placement_for

    traces = [NODE_A, NODE_B]

    def target(holder_wait, rebuild_s, free_b=1, building=()):
        loads = {NODE_A: (0, holder_wait, 1), NODE_B: (free_b, 0.0 if free_b else 50.0, 1)}
        holders = [] if building else [NODE_A]
        placed = placement_for("cache", _ask(holders, traces, loads, rebuild_s, building))
        assert placed.holders == (NODE_A,)  # a follow-up either way: on_holder tells
        return placed.target, placed.strategy._spill_on_unavailable

    assert target(holder_wait=20.0, rebuild_s=60.0) == (NODE_A, False)  # wait: cheaper
    assert target(holder_wait=90.0, rebuild_s=60.0) == (NODE_B, True)  # B idle: rebuild there
    assert target(holder_wait=90.0, rebuild_s=60.0, free_b=0) == (NODE_A, False)  # none idle
    assert target(holder_wait=None, rebuild_s=60.0) == (NODE_A, False)  # unmeasured: wait
    assert target(holder_wait=90.0, rebuild_s=None) == (NODE_A, False)
    # a node still building it, nothing measured: trials started together spread
    assert target(holder_wait=None, rebuild_s=None, building=[NODE_A]) == (NODE_B, True)
    assert target(holder_wait=20.0, rebuild_s=60.0, building=[NODE_A]) == (NODE_A, False)


def test_the_holders_estimate_a_rebuild_and_a_works_length_from_what_the_sweep_measured():
    from healsweep.sweep.holders import BUILD, COLD, FOLLOW, _Durations

    durations = _Durations()
    assert durations.rebuild_s() is None and durations.expected_s(FOLLOW) is None
    durations.first[COLD].append(100.0)
    durations.total[COLD].append(130.0)
    assert durations.rebuild_s() == 100.0  # a cold build alone: an upper bound
    assert durations.expected_s(BUILD) == 130.0
    assert durations.expected_s(FOLLOW) == 30.0  # a build less what building adds
    durations.first[BUILD] += [50.0, 70.0]
    durations.first[FOLLOW].append(5.0)
    durations.total[FOLLOW].append(25.0)
    assert durations.rebuild_s() == 55.0  # builds on a traced node, less a follow-up's start
    assert durations.expected_s(FOLLOW) == 25.0 and durations.expected_s(COLD) == 130.0


def test_a_trial_process_gets_its_share_of_a_gpu_and_the_budget_is_per_gpu(monkeypatch):
    from healsweep.model.resident import SHARE_ENV, gpu_share, resident_budget
    from healsweep.sweep.devices import PREALLOCATED, trial_device_env

    assert trial_device_env({"cpu": 1}) == {}
    assert trial_device_env({"cpu": 1, "gpu": 1}) == {SHARE_ENV: "1"}
    half = trial_device_env({"cpu": 1, "gpu": 0.5})
    assert half[SHARE_ENV] == "0.5"
    assert float(half["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(PREALLOCATED / 2)
    assert trial_device_env({"gpu": 2}) == {SHARE_ENV: "1"}  # several GPUs: the first, whole

    monkeypatch.setenv("HEALSWEEP_RESIDENT_GB", "8")
    monkeypatch.delenv(SHARE_ENV, raising=False)
    assert gpu_share() == 1.0 and resident_budget() == 8 * 2**30  # one trial per GPU: all of it
    for share, processes in (("0.5", 2), ("0.25", 4), ("0.3333", 3)):
        monkeypatch.setenv(SHARE_ENV, share)
        # the processes sharing one GPU keep at most its budget between them
        assert processes * resident_budget() <= 8 * 2**30
        assert processes * resident_budget() > 7.99 * 2**30
    for bad in ("0", "1.5", "half"):
        monkeypatch.setenv(SHARE_ENV, bad)
        with pytest.raises(SettingError, match=f"HEALSWEEP_GPU_SHARE='{bad}' is not a number in"):
            resident_budget()


def _row(trial, node, *, holders="", on_holder=None, hits=0, computed=0, waited=0, **more):
    return {"trial_id": trial, "placed_node": node, "holders": holders, "on_holder": on_holder,
            "cache_hits": hits, "cache_computed": computed, "cache_waited": waited, **more}  # fmt: skip


def test_the_pool_summary_counts_hits_and_follow_ups_on_their_holder():
    from healsweep.results.placement import pool_line, pool_summary

    assert pool_summary([{"trial_id": "old"}]) is None  # rows from before placement
    rows = [
        _row("a", "n1" * 8, computed=5),
        _row("b", "n2" * 8, computed=5),
        _row("c", "n1" * 8, holders="n1", on_holder=True, hits=4, computed=1, gpus="0"),
        _row("d", "n2" * 8, holders="n1", on_holder=False, hits=1, computed=4, waited=1, gpus="1"),
        _row("e", "n1" * 8, holders="n1,n2", on_holder=True, hits=5),
        {"trial_id": "old"},
    ]
    pool = pool_summary(rows)
    assert pool["placed"] == 5 and pool["nodes"] == {"n1" * 8: 3, "n2" * 8: 2}
    assert (pool["cache_hits"], pool["cache_computed"], pool["cache_waited"]) == (10, 15, 1)
    assert pool["cache_hit_rate"] == pytest.approx(10 / 25)
    assert pool["follow_ups"] == 3 and pool["follow_up_on_holder"] == pytest.approx(2 / 3)
    assert pool["gpus"] == {"0": 1, "1": 1}
    line = pool_line(pool)
    assert "stage-cache hit rate 40% (10 hits, 15 computed, 1 after waiting)" in line
    assert "2 of 3 follow-ups (67%) ran on the node holding their quantization" in line
    assert "5 rows placed on 2 node(s)" in line and "GPUs 0: 1, 1: 1" in line


def test_the_night_grid_varies_the_quantization_first():
    from healsweep.bench.night import NightError, night_spec, parse_grid
    from healsweep.sweep.space import grid_configs
    from healsweep.sweep.spec_files import spec_from_dict

    grid = parse_grid("3x2x2")
    assert grid == {"gain_d": 3, "rho": 2, "eta": 2}
    for bad in ("3x2", "0x1x1", "9x1x1", "axbxc"):
        with pytest.raises(NightError, match="expected QxRxE"):
            parse_grid(bad)
    raw = night_spec("demo", grid=grid, windows=8, placement="ray", resources={"cpu": 1},
                     max_concurrent=2, cache_root="/pool/cache")  # fmt: skip
    spec = spec_from_dict(raw)
    assert (spec.placement, spec.cache_root, spec.scoring.max_windows) == ("ray", "/pool/cache", 8)
    configs = grid_configs(spec)
    assert len(configs) == 12 and configs[0] == spec.baseline == Knobs()
    assert [k.gain_d for k in configs[:3]] == [0.3, 0.0, 0.6]  # three quantizations first
    assert {(k.rho, k.eta) for k in configs[:3]} == {(6.0, 0.15)}
    assert {(k.gain_d, k.rho, k.eta) for k in configs} == {
        (q, r, e) for q in (0.3, 0.0, 0.6) for r in (6.0, 24.0) for e in (0.15, 0.5)
    }
    # gate's and up's gain instead: the same grid over the costlier re-quantization
    grid = parse_grid("2x1x2", "gain_gu")
    assert grid == {"gain_gu": 2, "rho": 1, "eta": 2}
    raw = night_spec("demo", grid=grid, windows=8, placement="cache", resources={"cpu": 1},
                     max_concurrent=2)  # fmt: skip
    configs = grid_configs(spec_from_dict(raw))
    expected = [(0.3, 0.3, 0.15), (0.0, 0.3, 0.15), (0.3, 0.3, 0.5), (0.0, 0.3, 0.5)]
    assert [(k.gain_gu, k.gain_d, k.eta) for k in configs] == expected
    assert parse_grid("3x1x1", "type_d") == {"type_d": 3, "rho": 1, "eta": 1}
    with pytest.raises(NightError, match="--quant-knob 'gamma'.*gain_d, gain_gu, type_d"):
        parse_grid("2x1x2", "gamma")


def test_trial_kinds_follow_what_earlier_trials_built():
    from healsweep.bench.night import trial_kinds

    t0 = dt.datetime(2026, 12, 5, tzinfo=dt.UTC)

    def row(i, q, rho, role="trial"):
        return {"trial_id": f"t{i}", "role": role, "quantization": q, "knob_rho": rho,
                "started_at": t0 + dt.timedelta(seconds=i)}  # fmt: skip

    rows = [row(0, "q1", 6, "baseline"), row(1, "q2", 6), row(2, "q1", 24), row(3, "q1", 24),
            row(4, "q2", 6), row(5, "q3", 24), row(6, "x", 6, "reference")]  # fmt: skip
    assert trial_kinds(list(reversed(rows))) == {
        "t0": "cold", "t1": "quant-change", "t2": "rho-only", "t3": "eta-only",
        "t4": "eta-only", "t5": "quant-change",
    }  # fmt: skip


def test_entries_on_disk_count_stage_entries_not_compiled_code(tmp_path):
    from healsweep.bench.night import entries_on_disk
    from healsweep.cache import StageCache

    cache = StageCache(tmp_path)
    for key in ("ab" * 32, "cd" * 32):
        cache.put("quantize", key, {"x": __import__("numpy").zeros(3)}, {"k": key})
    cache.flush()
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "x.hsc").write_text("not an entry")
    assert entries_on_disk(tmp_path) == {"quantize": 2}
    assert entries_on_disk(tmp_path / "absent") == {}


def test_cluster_status_lists_the_gpus_of_a_node():
    from healsweep.cli.cluster_cmd import gpu_cell, node_lines
    from healsweep.cluster import NodeInfo

    h200 = ("cuda:0 NVIDIA H200", "cuda:1 NVIDIA H200")
    gpu = NodeInfo("a" * 56, "10.0.0.5", True, {"CPU": 16.0, "GPU": 2.0}, "gpu", "0.11.2", h200)
    declared = NodeInfo("b" * 56, "10.0.0.6", True, {"CPU": 2.0, "GPU": 2.0}, "cpu", "0.10.2")
    cpu = NodeInfo("c" * 56, "10.0.0.7", True, {"CPU": 2.0}, "cpu", "0.10.2")
    assert gpu_cell(gpu) == "; gpus: cuda:0 NVIDIA H200, cuda:1 NVIDIA H200"
    assert gpu_cell(declared) == "; gpus: none seen by JAX (2 declared to Ray)"
    assert gpu_cell(cpu) == ""
    lines = node_lines([gpu, declared, cpu])
    assert lines[1].startswith("aaaaaaaa") and lines[1].endswith(gpu_cell(gpu))
    assert "gpus" not in lines[3]


def test_placement_columns_are_in_the_trial_schema():
    from healsweep.results.schema import PLACEMENT_COLUMNS, trial_schema

    names = trial_schema().names
    assert set(PLACEMENT_COLUMNS) <= set(names)
    assert {"placed_node", "on_holder", "cache_hits", "cache_computed", "gpus"} <= set(names)
    assert json.loads(json.dumps(list(PLACEMENT_COLUMNS)))  # plain names


def test_a_running_works_remaining_seconds_come_from_its_own_pace_once_it_scores():
    from healsweep.sweep.holders import BUILD, COLD, _Durations, _Work

    durations = _Durations()
    durations.first[COLD].append(100.0)
    durations.total[COLD].append(130.0)
    durations.scoring.append(30.0)
    durations.windows.append(10)
    work = _Work("q-1", None, node="a", started=0.0, kind=BUILD)
    assert durations.remaining_s(_Work("q-1", "a"), 50.0) is None  # not started
    assert durations.remaining_s(work, 50.0) == 80.0  # a build's expected length less 50 s
    assert durations.remaining_s(work, 400.0) == 30.0  # overran, still building: its scoring
    work.first_s, work.taken, work.second_at, work.last_at = 380.0, 2, 380.0, 380.0
    assert durations.remaining_s(work, 400.0) == 0.0  # scoring, pace unknown: as expected
    work.taken, work.last_at = 6, 400.0  # 4 windows in 20 s: 5 s a window, 5 windows to go
    assert durations.remaining_s(work, 400.0) == 25.0
    assert durations.remaining_s(work, 410.0) == 15.0


def test_the_night_reports_bytes_written_per_stage_and_the_caches_on_disk(tmp_path):
    """Bytes written and evicted come from the rows' cache activity; the size on disk from the
    caches' entries at the end, JAX's compilation cache beside them; the spec carries the limit."""
    import json

    import numpy as np

    from healsweep.bench.night import cache_bytes, cache_on_disk, cache_table, night_spec
    from healsweep.cache import StageCache
    from healsweep.sweep.spec_files import spec_from_dict

    raw = night_spec("demo", grid={"gain_d": 1, "rho": 1, "eta": 1}, windows=2, placement="cache",
                     resources={"cpu": 1}, max_concurrent=1, cache_max_gb=16)  # fmt: skip
    assert spec_from_dict(raw).cache_max_gb == 16
    caches = [tmp_path / "node0", tmp_path / "node1"]
    for n, root in enumerate(caches):
        StageCache(root).put("quantize", f"{n}" * 64, {"x": np.zeros(1000)}, {})
    StageCache(caches[1]).put("part_b", "ab" * 32, {"x": np.zeros(10)}, {})
    (caches[0] / "jax").mkdir()
    (caches[0] / "jax" / "compiled").write_bytes(b"x" * 100)
    found = cache_on_disk(caches)
    sizes = {s: sum(p.stat().st_size for r in caches for p in (r / s).rglob("*.hsc"))
             for s in ("quantize", "part_b")}  # fmt: skip
    assert found == {"entry_bytes": sum(sizes.values()), "entry_bytes_by_stage": sizes,
                     "jax_compilation_cache_bytes": 100}  # fmt: skip

    details = [{"computed": {"quantize": 1}, "bytes_written": {"quantize": 5_000_000},
                "bytes_evicted": {"part_b": 2_000_000}},
               {"bytes_written": {"quantize": 1_000_000, "part_b": 500_000}}, {}]  # fmt: skip
    written = cache_bytes([{"cache_detail": json.dumps(d)} for d in details] + [{}])
    assert written == {"cache_bytes_written_by_stage": {"part_b": 500_000, "quantize": 6_000_000},
                       "cache_bytes_written": 6_500_000, "cache_bytes_evicted": 2_000_000}  # fmt: skip
    table = cache_table({"cache_max_gb": 16, "placements": {"cache": {**written,
                                                                      "cache_on_disk": found}}})  # fmt: skip
    assert "| cache | quantize | 6.0 |" in table and "| cache | all | 6.5 |" in table
    assert "cache: limit 16 GiB, 2.0 MB evicted, JAX's compilation cache 0.0 MB" in table
