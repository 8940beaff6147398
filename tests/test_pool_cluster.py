"""Placement on a real local pool (slow tier): `healsweep bench night`'s runs, each a real
`healsweep sweep run --address` on Ray nodes started with `ray start` on this host.

- Two nodes, each with its own stage cache: under ``placement: cache`` the follow-up trials (a
  rho or eta change of a quantization a node already holds) run on a node holding it (>= 90%,
  the acceptance line; one goes elsewhere only when a node is free and waiting for its busy
  holder would cost more than rebuilding there, which the grid's order seldom gives), every
  trial completes and the stage-cache hits are recorded per trial; under ``placement: ray`` the
  same grid runs to the end with its placement recorded too.
  In both runs a quantization is computed again only by a follow-up run off its holder: the
  cause of placement's saving, counted rather than timed (wall times go to docs/sizing.md).
- Two nodes sharing one cache root: no entry is computed twice (every stage's computations
  equal the entries on disk), whatever node each trial ran on.
- One node declaring two GPUs it does not have (Ray allows it): a sweep with ``resources:
  {gpu: 1}`` runs its two concurrent trials with distinct ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from healsweep.bench.night import run_night

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

GRID = {"gain_d": 2, "rho": 2, "eta": 2}  # 8 configs: 2 quantizations, then 6 follow-ups
WINDOWS = 4
DEMO_LAYERS = 4


def _rows(figures):
    return pq.read_table(f"{figures['sweep_dir']}/trials.parquet").to_pylist()


def test_follow_ups_run_where_their_quantization_is_on_a_two_node_pool(tmp_path):
    night = run_night("demo", tmp_path, nodes=2, placements=("ray", "cache"), grid=GRID,
                      windows=WINDOWS)  # fmt: skip
    cache, ray = night["placements"]["cache"], night["placements"]["ray"]
    for figures in (cache, ray):
        assert figures["trials"] == 8 and figures["trials_failed"] == 0, figures
        rows = _rows(figures)
        assert all(r["placed_node"] and r["cache_detail"] for r in rows), rows
        assert figures["cache_hits"] > 0 and figures["cache_computed"] > 0
    assert len(cache["trials_per_node"]) == 2  # both nodes took work
    assert cache["follow_ups"] >= 4, cache
    assert cache["follow_up_on_holder"] >= 0.9, cache
    on_holder = [r for r in _rows(cache) if r["holders"]]
    assert all(r["placed_node"] in r["holders"].split(",") for r in on_holder if r["on_holder"])
    assert night["follow_up_on_holder"] == ray["follow_up_on_holder"]  # the first run's keys
    assert night["trials"] == ray["trials"] and "wall_ratio_cache_vs_ray" in night
    # What placement saves, without timing it: a quantization is computed again only by a
    # follow-up run off its holder. Per layer, each node that worked quantizes gate/up once
    # (gain_d does not read it) and each quantization's down once; each follow-up off its
    # holder adds at most its down again.
    for figures in (cache, ray):
        rows = _rows(figures)
        nodes = len({r["placed_node"] for r in rows})
        off = sum(1 for r in rows if r["holders"] and not r["on_holder"])
        built = figures["computed_by_stage"]["quantize"]
        least = DEMO_LAYERS * (nodes + GRID["gain_d"])
        assert least <= built <= least + DEMO_LAYERS * off, (figures, off)
    assert {"busy_share", "queued_s"} <= set(cache)  # where the wall time went (docs/sizing.md)


def test_with_a_shared_cache_root_no_entry_is_computed_twice(tmp_path):
    night = run_night("demo", tmp_path, nodes=2, placements=("ray",), grid=GRID,
                      windows=WINDOWS, shared=True)  # fmt: skip
    figures = night["placements"]["ray"]
    assert figures["trials"] == 8, figures
    shared = figures["shared_cache"]
    # per layer: one gate/up quantization (gain_d does not read it) and two of down
    assert shared["computed"]["quantize"] == 3 * DEMO_LAYERS, shared
    assert shared["computed"]["calib_trace"] == 1, shared
    for stage, computed in shared["computed"].items():  # each entry on disk computed once
        assert computed == shared["entries"][stage], (stage, shared)
    assert figures["entries_computed_twice"] == 0, shared


def test_one_trial_per_gpu_each_with_its_own_cuda_visible_devices(tmp_path):
    night = run_night("demo", tmp_path, nodes=1, cpus_per_node=2, gpus_per_node=2, gpu=True,
                      grid={"gain_d": 2, "rho": 1, "eta": 1}, windows=WINDOWS)  # fmt: skip
    figures = night["placements"]["cache"]
    assert figures["trials"] == 2, figures
    rows = _rows(figures)
    assert sorted(r["gpus"] for r in rows) == ["0", "1"], rows
    first, second = sorted(rows, key=lambda r: r["started_at"])
    assert second["started_at"] < first["ended_at"]  # they ran at once, on distinct GPUs
