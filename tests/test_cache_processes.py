"""One stage-cache root shared by several real processes (the trials of a multi-GPU host, or the
workers of a pool on shared storage): writers racing on one entry leave one whole entry, and an
entry two processes need at once is computed by one of them while the other waits and reads it.

The processes are spawned (no fork of a process with threads); each opens its own StageCache on
the same folder, as two trial processes do.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from healsweep.cache import StageCache, activity, activity_since, content_key

KEY = content_key("stage", 1, {"shared": True})
SPAWN = multiprocessing.get_context("spawn")
WRITES = 25
ELEMENTS = 1 << 20  # 4 MiB of float32 per entry: writes of the two processes overlap


def _writer(root: str, tag: float, start, rounds: int) -> None:
    """Write the entry ``rounds`` times, every element equal to ``tag``."""
    cache = StageCache(root)
    start.wait()
    for i in range(rounds):
        cache.put("stage", KEY, {"w": np.full(ELEMENTS, tag, np.float32)}, {"tag": tag, "i": i})


def test_two_processes_racing_to_write_one_entry_leave_one_whole_entry(tmp_path):
    start = SPAWN.Barrier(3)
    writers = [
        SPAWN.Process(target=_writer, args=(str(tmp_path), tag, start, WRITES)) for tag in (1, 2)
    ]
    for proc in writers:
        proc.start()
    start.wait()
    reads = []
    while any(proc.is_alive() for proc in writers):
        # Read the file itself each time (a fresh cache, and the file's identity changes with
        # each rename, so nothing is served from memory): whole, or not there yet.
        found = StageCache(tmp_path).get("stage", KEY)
        if found is not None:
            arrays, meta = found
            values = np.unique(arrays["w"])
            assert values.tolist() == [meta["tag"]], "an entry mixing two writers' bytes"
            reads.append(meta["tag"])
    for proc in writers:
        proc.join(60)
        assert proc.exitcode == 0
    entry = StageCache(tmp_path).path("stage", KEY)
    files = sorted(p.name for p in entry.parent.iterdir())
    assert files == [entry.name], files  # one entry, no temp file left behind
    arrays, meta = StageCache(tmp_path).get("stage", KEY)
    assert meta["i"] == WRITES - 1 and np.all(arrays["w"] == meta["tag"])
    assert StageCache(tmp_path).corrupt["stage"] == 0
    assert reads, "the reader never saw the entry while it was being rewritten"


def _needs_entry(root: str, log: str, start, out, fail: bool = False) -> None:
    """get_or_compute the shared entry; the compute takes a second and logs who ran it.
    ``start``: a barrier to pass, "now", or "after" (once another process is computing)."""
    cache = StageCache(root)

    def compute():
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        if fail:
            raise RuntimeError("injected failure")
        return {"w": np.arange(1000, dtype=np.float32) * 3}, {"by": os.getpid()}

    if start == "after":
        while not Path(log).exists():
            time.sleep(0.01)
    elif start != "now":
        start.wait()
    try:
        arrays, meta = cache.get_or_compute("stage", KEY, compute)
    except RuntimeError:
        out.put(("failed", os.getpid()))
        return
    out.put(
        (
            float(arrays["w"].sum()),
            meta["by"],
            cache.computed["stage"],
            cache.hits["stage"],
            cache.waited["stage"],
        )
    )


def _run_pair(tmp_path: Path, fail_first: bool = False) -> tuple[list, list[str]]:
    log = tmp_path / "computed.log"
    start, out = SPAWN.Barrier(2), SPAWN.Queue()
    procs = []
    for i in range(2):
        fail = fail_first and i == 0
        # With fail_first, the second process begins once the first (failing) one computes.
        begin = ("now", "after")[i] if fail_first else start
        args = (str(tmp_path / "cache"), str(log), begin, out, fail)
        procs.append(SPAWN.Process(target=_needs_entry, args=args))
        procs[-1].start()
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    return results, log.read_text().split()


def test_an_entry_two_processes_need_at_once_is_computed_once_and_the_other_waits(tmp_path):
    results, computed_by = _run_pair(tmp_path)
    assert len(computed_by) == 1, f"computed by {computed_by}"
    expected = float(np.arange(1000, dtype=np.float64).sum() * 3)
    assert [r[0] for r in results] == [expected, expected]
    assert {r[1] for r in results} == {int(computed_by[0])}  # both read the one computation
    counts = sorted((computed, hits, waited) for _, _, computed, hits, waited in results)
    assert counts == [(0, 1, 1), (1, 0, 0)], counts
    lock = StageCache(tmp_path / "cache").path("stage", KEY).with_suffix(".hsc.lock")
    assert lock.exists()  # kept: removing it could let two processes hold two different locks


def test_a_computation_that_fails_releases_the_entry_to_the_process_waiting_for_it(tmp_path):
    results, computed_by = _run_pair(tmp_path, fail_first=True)
    assert len(computed_by) == 2  # the waiter computed it after the first one failed
    done = [r for r in results if r[0] != "failed"]
    assert len(done) == 1 and done[0][2:] == (1, 0, 0)
    assert StageCache(tmp_path / "cache").get("stage", KEY) is not None


def test_activity_counts_what_every_cache_of_the_process_did(tmp_path):
    before = activity()
    first, second = StageCache(tmp_path / "a"), StageCache(tmp_path / "b")
    make = lambda: ({"w": np.zeros(3)}, {})  # noqa: E731
    first.get_or_compute("x", KEY, make)
    second.get_or_compute("x", KEY, make)
    second.get_or_compute("x", KEY, make)
    first.computed["y"] += 2  # a stage that counts a recomputation itself (the trace does)
    size = first.path("x", KEY).stat().st_size  # the same entry under both roots
    assert activity_since(before) == {
        "hits": {"x": 1},
        "computed": {"x": 2, "y": 2},
        "waited": {},
        "bytes_written": {"x": 2 * size},
        "bytes_read": {},  # the hit was served from memory (the entry written just before)
        "evicted": {},
        "bytes_evicted": {},
    }


@pytest.mark.parametrize("behind", [False, True])
def test_the_lock_is_held_until_the_entry_is_on_disk(tmp_path, behind):
    """A second thread asking for the entry while it is being written behind waits for the
    write, then reads it (from memory or disk), never computing it again."""
    import threading

    cache = StageCache(tmp_path)
    calls = []

    def compute():
        calls.append(threading.current_thread().name)
        return {"w": np.ones(ELEMENTS, np.float32)}, {}

    def other():
        calls.append(("other", StageCache(tmp_path).get_or_compute("stage", KEY, compute)[1]))

    if behind:
        with cache.writing_behind():
            cache.get_or_compute("stage", KEY, compute)
            thread = threading.Thread(target=other)
            thread.start()
            thread.join(60)
    else:
        cache.get_or_compute("stage", KEY, compute)
        other()
    assert len([c for c in calls if not isinstance(c, tuple)]) == 1
    assert cache.path("stage", KEY).exists()
