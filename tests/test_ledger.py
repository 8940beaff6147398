"""The ledger: hash chain, grants, refusals, tamper detection, crash states, concurrent appends."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import pickle
import re
from types import SimpleNamespace

import pytest

from healsweep.cli import main
from healsweep.errors import LedgerError, TestSplitSealed
from healsweep.ledger import Grant, Ledger, require_grant, require_split_unchanged, split_drift

LOCK_A = hashlib.sha256(b"split A").hexdigest()
LOCK_B = hashlib.sha256(b"split B").hexdigest()
CFG = [hashlib.sha256(b"baseline").hexdigest(), hashlib.sha256(b"best").hexdigest()]
RESULT = hashlib.sha256(b"result").hexdigest()


@pytest.fixture()
def ledger(tmp_path) -> Ledger:
    return Ledger.in_results(tmp_path / "results")


def _independent_hash(entry: dict) -> str:
    """The documented entry hash, recomputed here: sha256 of sorted, compact JSON without hash."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _lines(ledger: Ledger) -> list[str]:
    return ledger.path.read_text().splitlines(keepends=True)


def _three_entries(ledger: Ledger) -> Grant:
    g1 = ledger.open_milestone(LOCK_A, "m1", CFG, ["t0", "t3"], user="ana")
    ledger.record_result(g1, RESULT, user="ana")
    return ledger.open_milestone(LOCK_A, "m2", CFG[:1], ["t0"], user="bo")


def test_entries_form_a_hash_chain_checked_independently(ledger):
    _three_entries(ledger)
    raw = [json.loads(line) for line in _lines(ledger)]
    assert [e["kind"] for e in raw] == ["confirm-open", "confirm-result", "confirm-open"]
    prev = "0" * 64
    for seq, entry in enumerate(raw):
        assert entry["seq"] == seq and entry["prev_hash"] == prev
        assert entry["hash"] == _independent_hash(entry)
        prev = entry["hash"]
    first = raw[0]
    assert (first["split_lock_id"], first["milestone"], first["user"]) == (LOCK_A, "m1", "ana")
    assert first["config_hashes"] == CFG and first["trial_ids"] == ["t0", "t3"]
    assert first["time"].endswith("+00:00")
    assert raw[1]["open_hash"] == first["hash"] and raw[1]["result_hash"] == RESULT
    assert ledger.verify() == 3 and ledger.entries() == raw
    ms = ledger.milestones_for(LOCK_A)
    assert [(m.milestone, m.closed) for m in ms] == [("m1", True), ("m2", False)]
    assert ledger.milestones_for(LOCK_B) == []


def test_grant_opens_the_test_split_once(ledger):
    grant = ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    require_grant(grant, LOCK_A)
    require_grant(grant, LOCK_A, ledger=ledger)
    ledger.record_result(grant, RESULT)
    with pytest.raises(TestSplitSealed, match="already has its result recorded"):
        require_grant(grant, LOCK_A)
    with pytest.raises(LedgerError, match="already has its result"):
        ledger.record_result(grant, RESULT)


def test_second_confirm_of_the_same_milestone_is_refused(ledger):
    ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    with pytest.raises(LedgerError, match="'m1' was already confirmed.*once per milestone"):
        ledger.open_milestone(LOCK_A, "m1", CFG[:1], ["t1"])
    assert ledger.verify() == 1


@pytest.mark.parametrize("case", ["none", "namespace", "constructor", "unknown_entry", "mismatch"])
def test_missing_or_forged_grants_are_refused(ledger, case):
    real = ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    fields = {s: getattr(real, s) for s in Grant.__slots__}
    if case == "none":
        forged = None
    elif case == "namespace":
        forged = SimpleNamespace(**fields)
    elif case == "constructor":
        with pytest.raises(TestSplitSealed, match="issued only by the ledger"):
            Grant(**fields)
        return
    else:
        forged = object.__new__(Grant)
        if case == "unknown_entry":
            fields["entry_hash"] = hashlib.sha256(b"made up").hexdigest()
        else:
            fields["milestone"] = "m2"  # names a real entry, claims another milestone
        for name, value in fields.items():
            object.__setattr__(forged, name, value)
    with pytest.raises(TestSplitSealed) as info:
        require_grant(forged, LOCK_A)
    message = str(info.value)
    assert "healsweep confirm RESULTS/<sweep> --milestone NAME" in message and "\n" not in message


def test_grant_for_another_split_or_ledger_is_refused(tmp_path, ledger):
    grant = ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    with pytest.raises(TestSplitSealed, match="split or corpus changed"):
        require_grant(grant, LOCK_B)
    other = Ledger.in_results(tmp_path / "elsewhere")
    with pytest.raises(TestSplitSealed, match="not from"):
        require_grant(grant, LOCK_A, ledger=other)
    with pytest.raises(LedgerError, match="not issued by the ledger"):
        other.record_result(grant, RESULT)


def test_grant_cannot_reach_another_process(ledger):
    from ray import cloudpickle  # what Ray uses to ship a trainable's config to a worker

    grant = ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    with pytest.raises(TestSplitSealed, match="cannot be pickled"):
        pickle.dumps(grant)
    with pytest.raises(TestSplitSealed, match="cannot be pickled"):
        cloudpickle.dumps({"knobs": {"rho": 6.0}, "grant": grant})
    with pytest.raises(AttributeError):
        grant.split_lock_id = LOCK_B


def _tamper(ledger: Ledger, how: str) -> None:
    lines = _lines(ledger)
    if how == "edit":
        lines[0] = lines[0].replace('"ana"', '"eve"')
    elif how == "edit_rehashed":
        entry = json.loads(lines[0])
        entry["trial_ids"] = ["t9"]
        entry["hash"] = _independent_hash(entry)
        lines[0] = json.dumps(entry) + "\n"
    elif how == "edit_last_rehashed":
        entry = json.loads(lines[-1])
        entry["user"] = "eve"
        entry["hash"] = _independent_hash(entry)
        lines[-1] = json.dumps(entry) + "\n"
    elif how == "reorder":
        lines[0], lines[1] = lines[1], lines[0]
    elif how == "delete":
        del lines[1]
    elif how == "delete_last":
        del lines[-1]
    elif how == "truncate_last":
        lines[-1] = lines[-1][:40]
    elif how == "append_forged":
        last = json.loads(lines[-1])
        extra = {
            "kind": "confirm-resume",
            "time": last["time"],
            "user": "eve",
            "open_hash": last["hash"],
            "seq": 3,
            "prev_hash": last["hash"],
        }
        extra["hash"] = _independent_hash(extra)
        lines.append(json.dumps(extra) + "\n")
    elif how == "head_removed":
        ledger.path.with_name(ledger.path.name + ".head").unlink()
        return
    ledger.path.write_text("".join(lines))


TAMPER = {
    "edit": "line 1: its hash does not match",
    "edit_rehashed": "line 2: prev_hash does not match",
    "edit_last_rehashed": "line 3: the last entry is not the one its head records",
    "reorder": "line 1: sequence number 1 where 0 belongs",
    "delete": "line 2: sequence number 2 where 1 belongs",
    "delete_last": "line 3: the ledger ends after 2 entries but its head records 3",
    "truncate_last": "line 3: the last line is cut off",
    "append_forged": "line 4: entries beyond the 3 its head records",
    "head_removed": "head record ledger.jsonl.head is missing",
}


@pytest.mark.parametrize("how", list(TAMPER))
def test_tampered_ledger_is_detected_and_refuses_every_mutation(ledger, capsys, how):
    grant = _three_entries(ledger)
    _tamper(ledger, how)
    with pytest.raises(LedgerError, match=TAMPER[how]) as info:
        ledger.verify()
    assert "restore the ledger" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(LedgerError, match=TAMPER[how]):
        ledger.open_milestone(LOCK_A, "m3", CFG, ["t0"])
    with pytest.raises(LedgerError, match=TAMPER[how]):
        ledger.record_result(grant, RESULT)
    with pytest.raises(TestSplitSealed, match="does not verify"):
        require_grant(grant, LOCK_A)
    code, out, err = _cli(capsys, "ledger", "verify", "--results", str(ledger.path.parent))
    assert code == 1 and out == "" and re.search(TAMPER[how], err)
    assert len(err.strip().splitlines()) == 1


def test_crash_between_append_and_head_update_still_verifies(ledger):
    """The head carries a `pending` record during an append; both crash states verify."""
    from healsweep.ledger._chain import head_of

    ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    before = ledger.entries()
    head_file = ledger.path.with_name(ledger.path.name + ".head")
    saved_text = ledger.path.read_text()
    ledger.open_milestone(LOCK_A, "m2", CFG, ["t0"])
    after = ledger.entries()
    # Crash after the line was appended, before the final head was written:
    head_file.write_text(json.dumps({**head_of(before), "pending": head_of(after)}))
    assert ledger.verify() == 2
    ledger.open_milestone(LOCK_A, "m3", CFG, ["t0"])  # the next append finalizes the head
    assert json.loads(head_file.read_text()) == head_of(ledger.entries())
    # Crash after the pending head was written, before the line was appended:
    ledger.path.write_text(saved_text)
    head_file.write_text(json.dumps({**head_of(before), "pending": head_of(after)}))
    assert ledger.verify() == 1
    # Without a pending record the same short ledger is a removed tail.
    head_file.write_text(json.dumps(head_of(after)))
    with pytest.raises(LedgerError, match="lines were removed"):
        ledger.verify()


def test_changed_split_after_a_confirm_is_refused_unless_declared(ledger):
    ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    assert split_drift(ledger, LOCK_A) is None
    assert split_drift(ledger, LOCK_B).milestone == "m1"
    with pytest.raises(LedgerError, match="split changed after a confirm.*--new-split"):
        require_split_unchanged(ledger, LOCK_B)
    with pytest.raises(LedgerError, match="split changed after a confirm"):
        ledger.open_milestone(LOCK_B, "m2", CFG, ["t0"])
    ledger.open_milestone(LOCK_B, "m2", CFG, ["t0"], allow_split_change=True)
    assert ledger.entries()[-1]["replaces_split_lock_id"] == LOCK_A
    ledger.open_milestone(LOCK_B, "m3", CFG, ["t0"])  # B is now the lineage's split
    with pytest.raises(LedgerError, match="split changed"):
        ledger.open_milestone(LOCK_A, "m4", CFG, ["t0"])
    # The same milestone name under a different split lock is a different opening.
    assert [m.milestone for m in ledger.milestones_for(LOCK_B)] == ["m2", "m3"]


def test_a_crashed_confirm_can_resume_only_its_frozen_configs(ledger):
    ledger.open_milestone(LOCK_A, "m1", CFG, ["t0"])
    with pytest.raises(LedgerError, match="opened for other configs"):
        ledger.resume_milestone(LOCK_A, "m1", CFG[:1])
    with pytest.raises(LedgerError, match="never opened"):
        ledger.resume_milestone(LOCK_A, "m9", CFG)
    grant = ledger.resume_milestone(LOCK_A, "m1", CFG)
    require_grant(grant, LOCK_A)
    assert ledger.entries()[-1]["kind"] == "confirm-resume"
    ledger.record_result(grant, RESULT)
    with pytest.raises(LedgerError, match="is closed"):
        ledger.resume_milestone(LOCK_A, "m1", CFG)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("not-hex", "m1", CFG, []), "not a hex digest"),
        ((LOCK_A, "bad name/..", CFG, []), "milestone name"),
        ((LOCK_A, "m1", [], []), "at least one config hash"),
        ((LOCK_A, "m1", CFG, "t0"), "trial ids must be a list"),
    ],
)
def test_open_validates_its_arguments(ledger, args, pattern):
    with pytest.raises(LedgerError, match=pattern):
        ledger.open_milestone(*args)
    assert ledger.verify() == 0


def _append_opens(path: str, worker: int, count: int, start) -> None:
    start.wait()
    book = Ledger(path)
    for i in range(count):
        grant = book.open_milestone(LOCK_A, f"w{worker}-m{i}", CFG, [f"t{worker}"])
        book.record_result(grant, RESULT)


def _open_same(path: str, start, outcomes) -> None:
    start.wait()
    try:
        Ledger(path).open_milestone(LOCK_A, "race", CFG, ["t0"])
        outcomes.put("opened")
    except LedgerError as exc:
        outcomes.put(str(exc))


@pytest.mark.parametrize("workers", [2, 4])
def test_concurrent_appends_from_real_processes_lose_nothing(ledger, workers):
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(workers)
    per_worker = 5
    procs = [
        ctx.Process(target=_append_opens, args=(str(ledger.path), w, per_worker, start))
        for w in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    entries = ledger.entries()
    assert len(entries) == 2 * workers * per_worker == ledger.verify()
    opened = {e["milestone"] for e in entries if e["kind"] == "confirm-open"}
    assert opened == {f"w{w}-m{i}" for w in range(workers) for i in range(per_worker)}
    assert all(m.closed for m in ledger.milestones())


def test_two_concurrent_confirms_of_one_milestone_one_wins(ledger):
    ctx = mp.get_context("spawn")
    start, outcomes = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_open_same, args=(str(ledger.path), start, outcomes)) for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    got = sorted((outcomes.get(timeout=120) for _ in procs), key=lambda o: o != "opened")
    for proc in procs:
        proc.join(60)
    assert got[0] == "opened" and "already confirmed" in got[1]
    assert ledger.verify() == 1


def _open_with_short_timeout(path: str, outcomes) -> None:
    try:
        Ledger(path, lock_timeout=0.3).open_milestone(LOCK_A, "m1", CFG, ["t0"])
        outcomes.put("opened")
    except LedgerError as exc:
        outcomes.put(str(exc))


def test_an_append_waits_for_the_lock_held_by_another_process(ledger):
    from healsweep.ledger._store import locked

    ctx = mp.get_context("spawn")
    outcomes = ctx.Queue()
    with locked(ledger.path, exclusive=True, timeout=1.0):
        proc = ctx.Process(target=_open_with_short_timeout, args=(str(ledger.path), outcomes))
        proc.start()
        message = outcomes.get(timeout=120)
        proc.join(60)
    assert "stayed locked by another process" in message
    assert ledger.verify() == 0


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_cli_show_and_verify(ledger, capsys):
    results = str(ledger.path.parent)
    assert _cli(capsys, "ledger", "verify", "--results", results)[1] == "ledger OK: 0 entries\n"
    _three_entries(ledger)
    code, out, _ = _cli(capsys, "ledger", "verify", "--results", results)
    assert code == 0 and out == "ledger OK: 3 entries\n"
    code, out, _ = _cli(capsys, "ledger", "show", "--results", results)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["seq", "time", "kind"]
    assert [line.split()[2] for line in lines[1:4]] == [
        "confirm-open",
        "confirm-result",
        "confirm-open",
    ]
    assert "m1" in lines[1] and LOCK_A[:12] in lines[1] and "2 configs" in lines[1]
    assert RESULT[:12] in lines[2]
    assert lines[-1].startswith("ledger OK: 3 entries")


def test_ledger_in_a_missing_results_dir_is_empty(tmp_path):
    book = Ledger.in_results(tmp_path / "never-made")
    assert book.entries() == [] and book.milestones() == []
    assert not (tmp_path / "never-made").exists()
