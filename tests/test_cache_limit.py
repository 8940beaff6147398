"""The bounded stage cache: a size limit (CLI > spec > environment > none), eviction (least worth
per byte first: recompute seconds over bytes, recency breaking ties) of the
entries no running trial holds, held entries surviving another process's eviction, and the
per-stage byte counters (``cache.activity``) against the files on disk.

Processes are spawned (no fork of a process with threads), each with its own StageCache on the
same root, as two trial processes of a host are.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import re
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from _cli import cli_env, run_cli
from _heal_fixtures import heal_setup
from healsweep import _cache_disk as disk
from healsweep.cache import (
    RecentEntries,
    StageCache,
    activity,
    activity_since,
    content_key,
    entry_seconds,
    recompute_seconds,
    stage_bytes,
)
from healsweep.errors import SettingError
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.stage_names import Stage

SPAWN = multiprocessing.get_context("spawn")
MIB = 2**20
ENTRY = MIB // 4  # float32 elements: 1 MiB of data per entry


def _key(name: str) -> str:
    return content_key("stage", 1, {"name": name})


def _put(cache: StageCache, name: str, stage: str = "stage") -> None:
    cache.put(stage, _key(name), {"w": np.full(ENTRY, len(name), np.float32)}, {"name": name})


def _present(root: Path, *names: str, stage: str = "stage") -> list[str]:
    probe = StageCache(root, max_gb=math.inf)
    return [n for n in names if probe.path(stage, _key(n)).exists()]


def _gib(mib: float) -> float:
    return mib * MIB / 2**30


def _tick() -> None:
    time.sleep(0.02)  # file times of a coarse clock: one event per tick keeps the order exact


def test_eviction_deletes_the_least_recently_used_entries_down_to_the_margin(tmp_path):
    cache = StageCache(tmp_path, max_gb=_gib(3.5))  # three entries fit, four do not
    for name in ("a", "b", "c"):
        _put(cache, name)
        _tick()
    assert cache.get("stage", _key("a")) is not None  # read: now the most recently used
    _tick()
    before = activity()
    _put(cache, "d")
    assert _present(tmp_path, "a", "b", "c", "d") == ["a", "c", "d"]  # b: least recently used
    assert cache.evicted["stage"] == 1
    changed = activity_since(before)
    assert changed["evicted"] == {"stage": 1} and changed["bytes_evicted"]["stage"] > MIB
    total = sum(e.size for e in disk.entries(tmp_path))
    assert total <= (1 - disk.MARGIN) * cache.max_bytes

    _tick()
    for name in ("e", "f"):  # each write over the limit evicts the oldest, nothing else
        _put(cache, name)
        _tick()
    assert _present(tmp_path, "a", "c", "d", "e", "f") == ["d", "e", "f"]


def test_the_entries_every_trial_reads_go_last_while_fresh(tmp_path):
    """The teacher's trace (written first, so least recently used) outlives the per-config
    entries written after it, unless it went unused for longer than a night: on the 24-layer
    GPU night plain LRU deleted it after the cold trial and every next trial refilled the disk."""
    cache = StageCache(tmp_path, max_gb=_gib(3.5))  # three entries fit, four do not
    _put(cache, "trace", stage="calib_trace_layer")
    _put(cache, "stale", stage="teacher_logits")
    stale = cache.path("teacher_logits", _key("stale"))
    two_nights_ago = time.time_ns() - int(2 * disk.SHARED_FRESH_S * 1e9)
    os.utime(stale, ns=(two_nights_ago, two_nights_ago))  # last used (and written) then
    _tick()
    _put(cache, "q1", stage="routed_q")
    _tick()
    _put(cache, "q2", stage="routed_q")  # four: the stale shared entry goes (oldest of all)
    assert not stale.exists()
    _tick()
    _put(cache, "q3", stage="routed_q")  # four again: q1 goes, not the older fresh trace
    assert _present(tmp_path, "trace", stage="calib_trace_layer") == ["trace"]
    assert _present(tmp_path, "q1", "q2", "q3", stage="routed_q") == ["q2", "q3"]


def _put_worth(cache: StageCache, name: str, seconds: float | None, stage: str = "stage") -> None:
    cache.put(stage, _key(name), {"w": np.full(ENTRY, len(name), np.float32)}, seconds=seconds)


def test_eviction_weighs_recompute_seconds_against_bytes(tmp_path):
    """Issue 46: a ridge basis (127 MB, 4 s of 16 cores on the A2.7B night) must outlive
    scratch that is cheap to redo, although plain LRU would delete it first (written first,
    and a follow-up reads it only when a stage after it computes)."""
    cache = StageCache(tmp_path, max_gb=_gib(3.5))  # three entries of 1 MiB fit, four do not
    _put_worth(cache, "basis", 4.0)
    _tick()
    _put_worth(cache, "q1", 0.05)
    _tick()
    _put_worth(cache, "q2", 0.05)
    _tick()
    _put_worth(cache, "q3", 0.05)  # four: the cheapest per byte goes, the oldest of them first
    assert _present(tmp_path, "basis", "q1", "q2", "q3") == ["basis", "q2", "q3"]
    _tick()
    _put_worth(cache, "dear", 2.0)  # dearer than the scratch left: the scratch goes
    assert _present(tmp_path, "basis", "q2", "q3", "dear") == ["basis", "q3", "dear"]


def test_the_entries_fewer_configs_read_go_first(tmp_path):
    """Issue 46: on the H100 night each rho/eta follow-up wrote 1.6 GB of ridge_fit and part_b,
    and eviction by worth alone deleted the other quantization's `quantize` entries (cheap per
    byte on a GPU), which its next trial recomputed. Part B (one rho/eta point's) goes first,
    then the ridge fits (one rho's, read by every eta at it), then a quantization's entries."""
    cache = StageCache(tmp_path, max_gb=_gib(3.5))  # three entries of 1 MiB fit, four do not
    _put_worth(cache, "quant", 0.05, stage="quantize")
    _tick()
    _put_worth(cache, "fit1", 0.5, stage="ridge_fit")
    _tick()
    _put_worth(cache, "partb1", 2.0, stage="part_b")
    _tick()
    _put_worth(cache, "partb2", 2.0, stage="part_b")  # four: the older Part B goes
    assert _present(tmp_path, "partb1", "partb2", stage="part_b") == ["partb2"]
    _tick()
    _put_worth(cache, "fit2", 5.0, stage="ridge_fit")  # four: the last Part B goes
    assert _present(tmp_path, "partb2", stage="part_b") == []
    _tick()
    _put_worth(cache, "fit3", 5.0, stage="ridge_fit")  # four: the cheapest fit, not the quant
    assert _present(tmp_path, "quant", stage="quantize") == ["quant"]
    assert _present(tmp_path, "fit1", "fit2", "fit3", stage="ridge_fit") == ["fit2", "fit3"]
    assert set(disk.POINT_TIERS) <= {stage.value for stage in Stage}


def _earlier_trials(root: Path, name: str, stage: str) -> None:
    """Three entries of 1 MiB that finished trials left, held by nobody now: one of ``stage``
    worth 4 s, then two cheap ridge fits (a bounded cache's limit fits three of them, not four)."""
    done = StageCache(root, max_gb=_gib(3.5))
    _put_worth(done, name, 4.0, stage=stage)
    for fit in ("fit1", "fit2"):
        _tick()
        _put_worth(done, fit, 0.5, stage="ridge_fit")
    _tick()


def _left(root: Path, name: str, stage: str) -> tuple[list[str], list[str]]:
    """Which of :func:`_earlier_trials`' entries an eviction left: its ``stage`` one, the fits."""
    return _present(root, name, stage=stage), _present(root, "fit1", "fit2", stage="ridge_fit")


@pytest.mark.parametrize(
    ("axes", "beside", "routed_q_goes"),
    [
        ({"gain_d", "rho", "eta"}, None, True),  # the night's grid: nobody reads y_q again
        ({"gain_d", "gamma"}, None, False),  # a new gamma's Part A reads the same y_q
        ({"gain_d", "rho"}, {"ridge"}, False),  # another sweep on the root switches the ridge
        ({"gain_d", "rho"}, "plain", False),  # a `heal` at work beside: it may read anything
    ],
)
def test_a_sweep_that_no_reader_of_an_entry_varies_lets_it_go_first(
    tmp_path, axes, beside, routed_q_goes
):
    """Issue 46: on the H100 night (grid over gain_d, rho, eta) the routed outputs of the two
    quantizations (5.3 GB of the 28 GB cache) were never read after their trials, yet outlived
    the ridge fits the eta follow-ups then recomputed: no stage after routed_q reads a knob the
    night varies. A sweep trial states the knobs its sweep varies in its holds; while every live
    holder does and none varies a knob of SPENT_UNLESS, routed_q goes first whatever its worth."""
    _earlier_trials(tmp_path, "rq", "routed_q")
    other = StageCache(tmp_path, axes=None if beside == "plain" else beside)
    trial = StageCache(tmp_path, max_gb=_gib(3.5), axes=axes)
    with other.holding(), trial.holding():
        if beside is not None:
            other.hold("stage", _key("elsewhere"))  # a live holds file, naming no entry here
        _put_worth(trial, "partb", 2.0, stage="part_b")  # four entries: one goes
        holders = disk.held(tmp_path)
        assert holders.holders == (2 if beside is not None else 1)
    rq, fits = _left(tmp_path, "rq", "routed_q")
    if routed_q_goes:
        assert rq == [] and fits == ["fit1", "fit2"]
    else:  # the order without axes: the ridge fits before a quantization's entries
        assert rq == ["rq"] and fits == ["fit2"]
    assert all(knob in Knobs.model_fields for opens in disk.SPENT_UNLESS.values() for knob in opens)
    assert set(disk.SPENT_UNLESS) <= {stage.value for stage in Stage}


@pytest.mark.parametrize(
    ("axes", "rhs_goes"),
    [({"type_gu", "type_d"}, True), ({"type_d", "rho"}, False), ({"type_d", "eta"}, False)],
)
def test_a_sweep_over_types_alone_lets_its_ridge_right_hand_sides_go_first(
    tmp_path, axes, rhs_goes
):
    """A ridge_rhs is read by the ridge fits (rho) and by Part B (eta): a sweep that varies the
    experts' types alone makes each quantization's fit and Part B once, and its B is spent after
    that; one that varies rho or eta reads it again."""
    _earlier_trials(tmp_path, "rhs", "ridge_rhs")
    trial = StageCache(tmp_path, max_gb=_gib(3.5), axes=axes)
    with trial.holding():
        _put_worth(trial, "partb", 2.0, stage="part_b")  # four entries: one goes
    rhs, fits = _left(tmp_path, "rhs", "ridge_rhs")
    assert (rhs, fits) == (([], ["fit1", "fit2"]) if rhs_goes else (["rhs"], ["fit2"]))


def test_the_knobs_that_open_routed_q_cover_part_a(tmp_path):
    """Every knob Part A's key reads, under each alpha setting, is one that makes a sweep read
    an old routed_q again (SPENT_UNLESS): a Part A knob added later must be added there."""
    for knobs in (Knobs(), Knobs(alpha="mse"), Knobs(alpha="mse", alpha_granularity="expert")):
        assert set(knobs.for_stage(Stage.PART_A)) <= disk.SPENT_UNLESS["routed_q"]


def test_an_entry_unused_for_hours_loses_its_worth(tmp_path):
    cache = StageCache(tmp_path, max_gb=_gib(3.5))
    _put_worth(cache, "old", 4.0)
    path = cache.path("stage", _key("old"))
    hours_ago = time.time_ns() - int(30 * disk.HALF_LIFE_S * 1e9)  # 2^-30 of its worth left
    os.utime(path, ns=(hours_ago, hours_ago))
    for name in ("q1", "q2", "q3"):
        _put_worth(cache, name, 0.05)
        _tick()
    assert not path.exists() and _present(tmp_path, "q1", "q2", "q3") == ["q1", "q2", "q3"]


def test_an_entry_that_records_no_seconds_goes_first(tmp_path):
    """Entries written before recompute seconds were recorded (or by a plain put) are worth
    nothing: they go, least recently used first, before any entry that records its cost."""
    cache = StageCache(tmp_path, max_gb=_gib(3.5))
    _put_worth(cache, "costed", 0.01)
    _tick()
    _put_worth(cache, "a", None)
    _tick()
    _put_worth(cache, "b", None)
    _tick()
    _put_worth(cache, "c", 0.01)
    assert _present(tmp_path, "costed", "a", "b", "c") == ["costed", "b", "c"]
    assert disk.value(1.0, 2**20, 0.0) == 2 * disk.value(1.0, 2**20, disk.HALF_LIFE_S)


def test_an_entry_records_its_own_compute_seconds_not_the_stages_it_computed_inside(tmp_path):
    """The recompute seconds of get_or_compute are the compute's wall time less that of the
    entries computed inside it (each records its own), or what the compute stated (work shared
    out over several entries, as the teacher's forward over a batch of windows)."""
    cache = StageCache(tmp_path)

    def inner():
        time.sleep(0.3)
        return {"w": np.zeros(4)}, {}

    def outer():
        time.sleep(0.05)
        cache.get_or_compute("inner", _key("inner"), inner)
        return {"w": np.ones(4)}, {}

    def shared():
        recompute_seconds(7.5)
        return {"w": np.ones(4)}, {}

    cache.get_or_compute("outer", _key("outer"), outer)
    cache.get_or_compute("shared", _key("shared"), shared)
    seconds = {
        e.stage: entry_seconds(tmp_path / e.relpath, e.size) for e in disk.entries(tmp_path)
    }
    assert seconds["inner"] >= 0.3 and 0.05 <= seconds["outer"] < 0.25
    assert seconds["shared"] == 7.5
    assert cache.get("outer", _key("outer"))[1] == {}  # the seconds are the header's, not meta's


def test_the_shared_stages_are_stages():
    assert disk.SHARED_STAGES <= {stage.value for stage in Stage}


def test_recency_survives_the_process_and_leaves_the_mtime_alone(tmp_path):
    cache = StageCache(tmp_path)
    _put(cache, "a")
    path = cache.path("stage", _key("a"))
    old = os.stat(path)
    os.utime(path, ns=(old.st_atime_ns - 10**12, old.st_mtime_ns))  # a day-old read, say
    _tick()
    StageCache(tmp_path).get("stage", _key("a"))  # another cache (a later trial) reads it
    now = os.stat(path)
    assert now.st_mtime_ns == old.st_mtime_ns  # the in-memory identity of the entry
    assert now.st_atime_ns > old.st_mtime_ns
    (used,) = disk.entries(tmp_path)
    assert used.used_ns == now.st_atime_ns and used.stage == "stage"


def test_without_a_limit_nothing_is_evicted(tmp_path, monkeypatch):
    monkeypatch.delenv(disk.LIMIT_ENV, raising=False)
    cache = StageCache(tmp_path)
    assert cache.max_bytes is None
    for name in "abcd":
        _put(cache, name)
    assert len(disk.entries(tmp_path)) == 4 and not (tmp_path / disk.HOLDS_DIR).exists()


def test_an_entry_held_in_a_block_survives_until_the_block_ends(tmp_path, caplog):
    cache = StageCache(tmp_path, max_gb=0)  # keep only what is held
    _put(cache, "old")
    with cache.holding():
        _put(cache, "mine")  # written inside the block
        _tick()
        assert cache.get("stage", _key("mine")) is not None
        cache.hold("stage", _key("later"))  # named before it exists: held once written
        with caplog.at_level(logging.WARNING, logger="healsweep.cache"):
            _put(cache, "later")
            _put(cache, "later2")  # the warning is given once
        assert _present(tmp_path, "old", "mine", "later", "later2") == ["mine", "later", "later2"]
        warnings = [r.message for r in caplog.records if "do not fit" in r.message]
        assert len(warnings) == 1 and str(tmp_path) in warnings[0]
    assert not list((tmp_path / disk.HOLDS_DIR).glob("*.holds"))  # released
    _tick()
    StageCache(tmp_path, max_gb=0).put("other", _key("x"), {"w": np.zeros(4)})
    assert _present(tmp_path, "mine", "later", "later2") == []


def test_blocks_nest_and_the_outermost_lets_go(tmp_path):
    cache = StageCache(tmp_path)
    with cache.holding():
        _put(cache, "outer")
        with cache.holding():
            _put(cache, "inner")
        (holds,) = (tmp_path / disk.HOLDS_DIR).glob("*.holds")  # one file, still held
        assert disk.held(tmp_path) == (
            {f"stage/{k[:2]}/{k}.hsc" for k in map(_key, ("outer", "inner"))},
            1,
            None,  # not a sweep trial: it states no axes
        )
    assert disk.held(tmp_path) == (set(), 0, None) and not holds.exists()


def test_a_block_never_left_lets_go_when_collected(tmp_path):
    import gc

    cache = StageCache(tmp_path)
    block = cache.holding()
    block.__enter__()
    _put(cache, "a")
    assert disk.held(tmp_path).holders == 1
    del block, cache
    gc.collect()
    assert disk.held(tmp_path) == (set(), 0, None)


def test_a_root_that_takes_no_holds_is_still_read_with_one_warning(tmp_path, caplog):
    _put(StageCache(tmp_path), "a")
    (tmp_path / disk.HOLDS_DIR).write_text("not a folder")  # as a root this process cannot write
    cache = StageCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="healsweep.cache"), cache.holding():
        assert cache.get("stage", _key("a")) is not None
        assert cache.get("stage", _key("a")) is not None
    warned = [r.message for r in caplog.records if "cannot record the entries" in r.message]
    assert len(warned) == 1


def _holder(root: str, names: list[str], ready, release, die: bool) -> None:
    """Hold ``names`` (write the first, read the others) until ``release`` is set; ``die``:
    exit inside the block, as a killed trial does (its holds file stays behind, unlocked)."""
    cache = StageCache(root)
    with cache.holding():
        _put(cache, names[0])
        for name in names[1:]:
            assert cache.get("stage", _key(name)) is not None
        ready.set()
        if die:
            os._exit(0)
        release.wait(60)


def test_entries_a_live_process_holds_survive_another_process_eviction(tmp_path):
    writer = StageCache(tmp_path)
    for name in ("shared", "old", "dead-held"):
        _put(writer, name)
    dead_ready, live_ready, release = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    dead = SPAWN.Process(
        target=_holder, args=(str(tmp_path), ["dead-own", "dead-held"], dead_ready, release, True)
    )
    dead.start()
    dead.join(60)
    assert dead.exitcode == 0 and dead_ready.is_set()
    live = SPAWN.Process(
        target=_holder, args=(str(tmp_path), ["live-own", "shared"], live_ready, release, False)
    )
    live.start()
    try:
        assert live_ready.wait(60)
        evictor = StageCache(tmp_path, max_gb=0)  # this process keeps nothing unheld
        _put(evictor, "new")
        kept = _present(tmp_path, "shared", "old", "dead-held", "dead-own", "live-own", "new")
        # the live process's entries survive; the dead one's holds file is removed, its
        # entries and everything unheld go
        assert kept == ["shared", "live-own"]
        assert len(list((tmp_path / disk.HOLDS_DIR).glob("*.holds"))) == 1
    finally:
        release.set()
        live.join(60)
    assert live.exitcode == 0
    _tick()
    _put(StageCache(tmp_path, max_gb=0), "newer")
    assert _present(tmp_path, "shared", "live-own") == []  # released when its block ended


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("", None), (2, 2 * 2**30), ("0.5", 2**29), (0, 0), ("inf", None)],
)
def test_a_limit_is_a_number_of_gib(value, expected):
    assert disk.parse_limit(value, "--cache-max-gb") == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("-1", "is negative"),
        ("nan", "is NaN"),
        ("lots", "is not a number"),
        (True, "is not a number"),
    ],  # fmt: skip
)
def test_a_bad_limit_is_one_clear_error(value, problem):
    with pytest.raises(SettingError, match=re.escape(f"--cache-max-gb {value!r} {problem}: give")):
        disk.parse_limit(value, "--cache-max-gb")


def test_the_limit_given_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(disk.LIMIT_ENV, "3")
    assert StageCache(tmp_path).max_bytes == 3 * 2**30  # the environment, with nothing given
    assert StageCache(tmp_path, max_gb=1).max_bytes == 2**30  # the CLI's or the spec's
    monkeypatch.setenv(disk.LIMIT_ENV, "-3")
    with pytest.raises(SettingError, match=r"HEALSWEEP_CACHE_MAX_GB='-3' is negative"):
        StageCache(tmp_path)
    assert StageCache(tmp_path, max_gb=1).max_bytes == 2**30  # not read when a limit is given


def test_per_stage_bytes_are_the_sizes_of_the_files_written_and_read(tmp_path, own_runtime):
    before = activity()
    cache = StageCache(tmp_path)
    with cache.writing_behind():
        _put(cache, "a", stage="one")
        _put(cache, "bb", stage="one")
        cache.get_or_compute("two", _key("c"), lambda: ({"x": np.arange(1000)}, {}))
    on_disk = {
        stage: sum(p.stat().st_size for p in (tmp_path / stage).rglob("*.hsc"))
        for stage in ("one", "two")
    }
    assert stage_bytes(activity_since(before)) == {
        stage: {"written": size, "read": 0} for stage, size in on_disk.items()
    }
    assert dict(cache.bytes_written) == on_disk

    own_runtime.owned(RecentEntries).clear()
    before = activity()
    reader = StageCache(tmp_path)
    reader.get("one", _key("a"))
    reader.get("one", _key("a"))  # the second from memory: no bytes read
    size_a = reader.path("one", _key("a")).stat().st_size
    assert stage_bytes(activity_since(before)) == {"one": {"written": 0, "read": size_a}}


def test_a_scan_of_thousands_of_entries_lists_each_once(tmp_path):
    """The pass's listing over a cache laid out as the stages lay it out (the time it takes is
    measured in docs/sizing.md, not here)."""
    count = 0
    for stage in ("quantize", "routed_q", "part_b"):
        for i in range(700):
            key = content_key(stage, 1, {"i": i})
            path = tmp_path / stage / key[:2] / f"{key}.hsc"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * (i % 7))
            count += 1
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "compiled.hsc").write_bytes(b"not an entry")
    found = disk.entries(tmp_path)
    assert len(found) == count and len({e.relpath for e in found}) == count
    assert sum(e.size for e in found) == sum(i % 7 for i in range(700)) * 3


setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)


def _stage_sizes(root: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for entry in disk.entries(root):
        sizes[entry.stage] = sizes.get(entry.stage, 0) + entry.size
    return sizes


def test_a_trial_in_a_cache_that_keeps_nothing_computes_each_stage_once_and_the_same_student(
    setup, tmp_path, own_runtime
):
    """With a limit of 0 every write evicts what is not held: the trial's own entries (its
    trace's layers, read one by one later, included) survive until its student is built, so
    nothing is computed twice, and the student is bit for bit the one an unbounded cache
    builds. The bytes the activity counts per stage are the sizes of the files written."""
    model, corpus = setup
    free = build_student(model, Knobs(), CAL, StageCache(tmp_path / "free"), corpus=corpus)
    own_runtime.owned(RecentEntries).clear()
    before = activity()
    cache = StageCache(tmp_path / "tight", max_gb=0)
    tight = build_student(model, Knobs(), CAL, cache, corpus=corpus)
    n = model.hparams.n_layer
    assert cache.computed["calib_trace"] == 1 and cache.computed["quantize"] == 2 * n
    assert all(v == n for s, v in cache.computed.items() if s not in ("calib_trace", "quantize"))
    done = activity_since(before)
    # nothing was evicted while the trial held it; everything is on disk, counted byte for byte
    # (counted before the students' layers are read back below: the free cache's are read from
    # its files, the recent entries having been cleared)
    assert not done["evicted"]
    assert stage_bytes(done) == {
        stage: {"written": size, "read": 0}
        for stage, size in _stage_sizes(tmp_path / "tight").items()
    }
    for i, layer in free.replacements.items():
        for name in ("gate_exps", "up_exps", "down_exps", "down_shexp"):
            want = jax.tree_util.tree_leaves(getattr(layer, name))
            got = jax.tree_util.tree_leaves(getattr(tight.replacements[i], name))
            for a, b in zip(want, got, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{i} {name}")
    assert tight.key == free.key
    # the next trial's first write evicts all of it: the trial let go when its student was built
    _tick()
    later = StageCache(tmp_path / "tight", max_gb=0)
    with later.holding():
        later.put("other", _key("x"), {"w": np.zeros(4)})
        assert set(_stage_sizes(tmp_path / "tight")) == {"other"}


def _cli(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env=cli_env(tmp_path / "cache", **env))


def _one_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


COMMANDS = {
    "sweep run": ["sweep", "run", "SPEC"],
    "sweep resume": ["sweep", "resume", "nowhere"],
    "heal": ["heal", "demo", "--knobs", "k.yaml", "--out", "o.gguf"],
    "score": ["score", "--model", "demo", "--ref", "demo"],
    "export": ["export", "nowhere", "--out", "o.gguf"],
    "confirm": ["confirm", "nowhere", "--milestone", "m"],
    "bench trial": ["bench", "trial", "demo", "--tokens", ""],
    "bench night": ["bench", "night", "demo"],
    "baseline llama": ["baseline", "llama", "demo", "--type", "q2_k", "--out", "o.gguf"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_that_uses_the_cache_refuses_a_bad_limit_in_one_line(command, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\n")
    args = [str(spec) if a == "SPEC" else a for a in COMMANDS[command]]
    bad = {"sweep run": "nan", "heal": "-1"}.get(command, "lots")
    line = _one_line(_cli(*args, "--cache-max-gb", bad, tmp_path=tmp_path))
    problem = {"nan": "is NaN", "-1": "is negative"}.get(bad, "is not a number")
    assert f"--cache-max-gb {bad!r} {problem}: give the stage cache's size limit in GiB" in line


def test_a_bad_limit_in_the_environment_is_refused_before_a_sweep_starts(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\n")
    run = _cli("sweep", "run", str(spec), "--results", str(tmp_path / "results"),
               tmp_path=tmp_path, HEALSWEEP_CACHE_MAX_GB="-2")  # fmt: skip
    assert "HEALSWEEP_CACHE_MAX_GB='-2' is negative" in _one_line(run)
    assert not (tmp_path / "results" / "x").exists()
    spec.write_text("name: x\ncache_max_gb: -2\n")
    line = _one_line(_cli("sweep", "run", str(spec), tmp_path=tmp_path))
    assert "'cache_max_gb'" in line and "GiB" in line


@pytest.mark.slow  # 26-66 s each: the default tier stays near 15 minutes (stop 44)
def test_a_sweep_whose_cache_keeps_nothing_finishes_with_the_same_numbers(tmp_path):
    """The demo model, four trials (two quantizations x two etas), run twice: with
    no limit, then with the limit from three places at once: the environment says 1000 GiB, the
    spec 50, ``--cache-max-gb`` 0 (keep only what running trials hold). The CLI's wins: every
    trial after the first evicts what the one before it left and recomputes what it needs, and
    every window records exactly what the unbounded sweep recorded."""
    import pyarrow.parquet as pq

    from healsweep.sweep.manifest import spec_hash
    from healsweep.sweep.spec_files import spec_from_dict

    spec = {
        "model": "demo",
        "corpus": "demo",
        "calibration": {"max_tokens": 512, "chunk_length": 256},
        "search_space": {"eta": [0.15, 0.5], "gain_d": [0.3, 0.0]},
        "references": False,
        "max_concurrent": 1,
        "scoring": {"max_windows": 2, "batch": 4},
    }
    runs = {}
    for name, limit in (("free", []), ("tight", ["--cache-max-gb", "0"])):
        path = tmp_path / f"{name}.yaml"
        given = {**spec, "name": name, **({"cache_max_gb": 50} if limit else {})}
        path.write_text(json.dumps(given))  # JSON is YAML
        env = {"HEALSWEEP_CACHE": str(tmp_path / name)}  # each its own stage cache
        if limit:
            env["HEALSWEEP_CACHE_MAX_GB"] = "1000"
        run = _cli("sweep", "run", str(path), "--results", str(tmp_path / "results"), *limit,
                   tmp_path=tmp_path, **env)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "4 trials (4 completed)" in run.stdout
        runs[name] = tmp_path / "results" / name
    stored = json.loads((runs["tight"] / "spec.json").read_text())
    assert stored["cache_max_gb"] == 0  # the run's limit, for a resume without the option
    assert spec_hash(spec_from_dict(stored)) == spec_hash(spec_from_dict({**spec, "name": "tight"}))

    trials = pq.read_table(runs["tight"] / "trials.parquet").to_pylist()
    details = [json.loads(t["cache_detail"]) for t in sorted(trials, key=lambda t: t["started_at"])]
    # each trial after the first evicts what the one before left (the first holds all it makes)
    assert all(sum(d["evicted"].values()) > 0 for d in details[1:])
    # a trace evicted between trials is recomputed; one read again before the next write
    # survives (a trial holds what it reads from its build to its last window)
    assert 1 <= sum(d["computed"].get("calib_trace", 0) for d in details) <= len(trials)

    def windows(sweep_dir: Path) -> dict:
        rows = pq.read_table(sweep_dir / "windows").to_pylist()
        return {(r["config_hash"], r["window_id"]): (r["kld_sum"], r["top1_count"]) for r in rows}

    free, tight = windows(runs["free"]), windows(runs["tight"])
    assert len(free) == 4 * 2 and tight == free
