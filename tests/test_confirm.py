"""`healsweep confirm`: the once-per-milestone opening of the test split, on real sweeps.

A small real sweep (embedded Ray, real heal and score stages, a tiny random GGUF) is run once
through the CLI; every test works on its own copy of the sweep folder, so each has its own ledger.
Figures in ``confirm.json`` are re-derived in float64 from the Parquet rows; the ledger is read
as raw JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from _raycluster import local_ray
from _tiny_corpus import write_tiny_corpus
from healsweep.confirm import confirm, frozen_hash, read_confirmed
from healsweep.data.corpus import Document, load_corpus, write_corpus
from healsweep.errors import LedgerError, ResultsError, SpecError, SplitError, TestSplitSealed
from healsweep.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
SWEEP = "tiny"


def _cli(*args: str, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_tokenizer):
    """A finished 2-config sweep (baseline gain_d=0 and gain_d=0.3, with the unhealed and plain
    reference rows) on a tiny model, run by the CLI. On this model gain_d=0.3 beats gain_d=0 on
    dev, so the sweep's best trial is not its baseline and confirm has a config to test."""
    from healsweep.model.synthetic import write_random_model

    root = tmp_path_factory.mktemp("confirm")
    model = write_random_model(
        root / "m.gguf", n_layer=2, n_ff_exp=64, seed=5, tokenizer=tiny_tokenizer
    )
    spec = {
        "name": SWEEP,
        "model": str(model),
        "corpus": str(write_tiny_corpus(root / "corpus.jsonl")),
        "calibration": {"chunk_length": 64, "min_tokens_per_expert": 4},
        "baseline": {"gain_d": 0.0},
        "search_space": {"gain_d": [0.0, 0.3]},
        "max_concurrent": 1,
        "scoring": {"max_scored": 24, "max_context": 40, "batch": 4},
    }
    (root / "spec.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(root / "cache")}
    run = _cli("sweep", "run", str(root / "spec.yaml"), "--results", str(root / "results"),
               "--json", "--quiet", env=env)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    # --json: one object on stdout (the final summary); --quiet: no progress lines on stderr
    done = json.loads(run.stdout)
    assert done["sweep"] == SWEEP and done["trials"] == 2 and done["by_status"] == {"completed": 2}
    assert done["best"]["trial_id"] and done["unfinished"] == 0
    assert {row["label"] for row in done["fixed"]} == {"unhealed", "plain"}
    assert done["windows"]["scored"] > 0 and done["next"].startswith("healsweep report ")
    assert "trials " not in run.stderr and "reference and external rows" not in run.stderr
    return {"root": root, "sweep": root / "results" / SWEEP, "env": env, "spec": spec}


@pytest.fixture()
def sweep_copy(swept, tmp_path, monkeypatch):
    """The sweep folder copied into a fresh results root (so the test has its own ledger)."""
    monkeypatch.setenv("HEALSWEEP_CACHE", swept["env"]["HEALSWEEP_CACHE"])
    target = tmp_path / "results" / SWEEP
    shutil.copytree(swept["sweep"], target)
    return target


def _ledger_lines(results: Path) -> list[dict]:
    path = results / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _trials(sweep_dir: Path) -> list[dict]:
    return pq.read_table(sweep_dir / "trials.parquet").to_pylist()


def _pooled_kld(rows: list[dict]) -> float:
    return float(
        np.sum([r["kld_sum"] for r in rows], dtype=np.float64)
        / np.sum([r["kld_count"] for r in rows], dtype=np.float64)
    )


def test_confirm_opens_before_scoring_records_the_result_and_refuses_a_second(
    sweep_copy, swept, capsys
):
    from healsweep.cli import main
    from healsweep.results.report import write_report

    results = sweep_copy.parent
    kinds_at_first_window: list[list[str]] = []

    def progress(message: str) -> None:
        if message.startswith("  window") and not kinds_at_first_window:
            kinds_at_first_window.append([e["kind"] for e in _ledger_lines(results)])

    summary = confirm(sweep_copy, "m1", n_boot=2000, progress=progress)
    assert kinds_at_first_window == [["confirm-open"]]  # on record before any window is scored
    opened, result = _ledger_lines(results)
    assert (opened["kind"], result["kind"]) == ("confirm-open", "confirm-result")
    trials = _trials(sweep_copy)
    base = next(t for t in trials if t["is_baseline"])
    best = min((t for t in trials if t["role"] == "trial"), key=lambda t: t["kld_mean"])
    assert best["kld_mean"] < base["kld_mean"]  # the fixture's premise: a config beats it
    assert opened["trial_ids"] == [base["trial_id"], best["trial_id"]]  # never a reference
    manifest = json.loads((sweep_copy / "manifest.json").read_text())
    assert opened["split_lock_id"] == manifest["split_lock_id"] == summary["split_lock_id"]
    frozen = [c["frozen_hash"] for c in summary["configs"]]
    assert opened["config_hashes"] == frozen and len(set(frozen)) == 2

    out = sweep_copy / "test" / "m1"
    digest = hashlib.sha256((out / "windows.parquet").read_bytes()).hexdigest()
    assert result["result_hash"] == digest == summary["result_hash"]
    assert result["open_hash"] == opened["hash"]
    assert json.loads((out / "confirm.json").read_text())["result_hash"] == digest

    rows = pq.read_table(out / "windows.parquet").to_pylist()
    corpus = load_corpus(swept["spec"]["corpus"])
    test_docs = {d.doc_id for d in corpus.documents if d.pool == "eval" and d.index % 2 == 0}
    assert {r["doc_id"] for r in rows} == test_docs  # the even-index documents, all of them
    dev_ids = set(
        pq.read_table(sweep_copy / "windows", columns=["window_id"])["window_id"].to_pylist()
    )
    assert not dev_ids & {r["window_id"] for r in rows}
    assert len(rows) == 2 * summary["windows"] and {r["milestone"] for r in rows} == {"m1"}

    by_config = {
        c: [r for r in rows if r["config_hash"] == c] for c in {r["config_hash"] for r in rows}
    }
    for config in summary["configs"]:
        kld = _pooled_kld(by_config[config["config_hash"]])
        assert config["pooled"]["kld_mean"] == pytest.approx(kld, rel=1e-9)
    base_kld = _pooled_kld(by_config[base["config_hash"]])
    best_kld = _pooled_kld(by_config[best["config_hash"]])
    comp, verdict = summary["configs"][1]["comparison"], summary["configs"][1]["verdict"]
    assert comp["rel_change"] == pytest.approx(best_kld / base_kld - 1, rel=1e-9)
    lo, hi = comp["rel_change_ci"]
    assert lo <= comp["rel_change"] <= hi
    assert verdict["checks"]["kld_improves"] == (hi < 0)

    before = (results / "ledger.jsonl").read_bytes()
    with pytest.raises(LedgerError, match="'m1' was already confirmed.*once per milestone"):
        confirm(sweep_copy, "m1")
    with pytest.raises(SystemExit) as exit_info:
        main(["confirm", str(sweep_copy), "--milestone", "m1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and "already confirmed" in err
    assert (results / "ledger.jsonl").read_bytes() == before

    paths = write_report(sweep_copy, n_boot=500, confirmed=read_confirmed(sweep_copy))
    report = paths["markdown"].read_text()
    section = report.split("## Dev and test (milestone m1)")[1].split("## ")[0]
    assert (
        "dev pooled KLD" in section and f"test pooled KLD ({summary['windows']} windows)" in section
    )
    base_row = next(line for line in section.splitlines() if line.startswith("| baseline |"))
    assert f"| {base_kld:.5f} | - | - | baseline | recorded |" in base_row
    best_row = next(line for line in section.splitlines() if line.startswith("| gain_d=0.3 |"))
    assert f"| {best_kld:.5f} | {comp['rel_change']:+.2%} [{lo:+.2%}, {hi:+.2%}] |" in best_row

    pq.write_table(pq.read_table(out / "windows.parquet").slice(1), out / "windows.parquet")
    paths = write_report(sweep_copy, n_boot=500, confirmed=read_confirmed(sweep_copy))
    report = paths["markdown"].read_text()
    assert "| file changed |" in report  # the result no longer matches its ledger hash


def test_confirm_prints_progress_by_config_and_windows_only_when_verbose(swept, tmp_path):
    """By default a config's progress and the result, no window lines; --verbose adds every
    window; --quiet prints the result alone; --quiet with --verbose is refused."""
    outputs = {}
    for flag in ("", "--verbose", "--quiet"):
        target = tmp_path / (flag.strip("-") or "default") / "results" / SWEEP
        shutil.copytree(swept["sweep"], target)
        args = ["confirm", str(target), "--milestone", "m1", "--max-windows", "2",
                "--n-boot", "200", *([flag] if flag else [])]  # fmt: skip
        run = _cli(*args, env=swept["env"])
        assert run.returncode == 0, run.stdout + run.stderr
        outputs[flag] = run.stdout.splitlines()
    for lines in outputs.values():
        assert any(line.startswith("milestone 'm1': 2 test windows") for line in lines)
    default, verbose, quiet = outputs[""], outputs["--verbose"], outputs["--quiet"]
    assert any(line.startswith("config 1/") for line in default)
    assert not any(line.startswith("  window") for line in default)
    assert sum(line.startswith("  window") for line in verbose) == 2 * 2  # 2 configs x 2 windows
    assert not any(line.startswith(("config ", "  window", "recorded result")) for line in quiet)
    both = _cli("confirm", str(target), "--milestone", "m2", "--quiet", "--verbose",
                env=swept["env"])  # fmt: skip
    assert both.returncode == 2 and "not both" in both.stderr


def test_a_pair_compares_two_confirmed_trials_and_a_bad_pair_is_refused_first(sweep_copy):
    """--pair TRIAL:OTHER: the paired comparison of two confirmed trials on the test windows
    (here the best trial against the baseline, named as a trial: it must equal the comparison
    against the baseline); a pair naming a trial not confirmed, or malformed, is one line
    before the ledger is touched."""
    results = sweep_copy.parent
    trials = _trials(sweep_copy)
    base = next(t["trial_id"] for t in trials if t["is_baseline"])
    best = min((t for t in trials if t["role"] == "trial"), key=lambda t: t["kld_mean"])
    best = best["trial_id"]
    for pair, trial_ids, message in (
        (f"{best}:{base}", [best], f"{base} not confirmed here; name every trial"),
        (f"{best}-{base}", [best, base], "expected TRIAL:OTHER"),
        (f"{best}:{best}", [best], "expected TRIAL:OTHER"),
    ):
        with pytest.raises(ResultsError, match=message):
            confirm(sweep_copy, "m1", trial_ids=trial_ids, pairs=[pair])
    assert _ledger_lines(results) == []
    summary = confirm(
        sweep_copy, "m1", trial_ids=[best, base], pairs=[f"{best}:{base}"], n_boot=2000
    )
    [pair] = summary["pairs"]
    against_base = next(c for c in summary["configs"] if c["trial_id"] == best)
    assert (pair["trial_id"], pair["against"]) == (best, base)
    assert pair["comparison"] == against_base["comparison"]
    assert pair["verdict"] == against_base["verdict"]
    stored = json.loads((sweep_copy / "test" / "m1" / "confirm.json").read_text())
    assert stored["pairs"][0]["comparison"]["rel_change"] == pair["comparison"]["rel_change"]


def _edited_corpus(sweep_dir: Path, source: Path, doc_id: str) -> str:
    """Point the sweep's stored spec at a copy of its corpus in which ``doc_id`` was edited (as if
    the corpus had been edited after the sweep); return the new split lock id."""
    from healsweep.data.split import parity_split, split_lock_id

    docs = [
        Document(d.doc_id, d.source, d.index, d.stratum, messages=d.messages,
                 text=(d.text + " Edited.") if d.doc_id == doc_id else d.text, pool=d.pool)
        for d in load_corpus(source).documents
    ]  # fmt: skip
    edited = write_corpus(docs, sweep_dir.parent / f"edited-{sweep_dir.name}.jsonl")
    spec = json.loads((sweep_dir / "spec.json").read_text())
    spec["corpus"] = str(edited)
    (sweep_dir / "spec.json").write_text(json.dumps(spec))
    corpus = load_corpus(edited)
    return split_lock_id(parity_split(corpus), corpus.documents)


def test_the_frozen_hash_covers_the_full_knobs_the_model_and_the_calibration():
    from healsweep.heal.knobs import Knobs

    calib = {"chunk_length": 64, "corpus_content": "ab" * 32}
    first = frozen_hash(Knobs(alpha="mse"), "model-a", calib)
    # the ledger holds frozen hashes: these two were computed by b05fe56 (knobs as dicts then)
    assert first == "bb73a4b7f74b0ef93ca83b2c932f2249ff61562b1408a8a010a5b3aad03df653"
    gptq = frozen_hash(Knobs(quantizer="gptq", ridge=False), "model-a", calib)
    assert gptq == "37c855b7b23dc0947347d0943e5ea331074f9e7ebfa5c57f3eba8dc7d35a1258"
    assert frozen_hash(Knobs(alpha="mse", gain_d=0.3), "model-a", calib) == first  # defaults
    others = {
        frozen_hash(Knobs(alpha="mse", gain_d=0.0), "model-a", calib),
        frozen_hash(Knobs(alpha="mse"), "model-b", calib),
        frozen_hash(Knobs(alpha="mse"), "model-a", {**calib, "chunk_length": 128}),
        frozen_hash(Knobs(alpha="mse"), "model-a", {**calib, "corpus_content": "cd" * 32}),
    }
    assert len(others) == 4 and first not in others


def test_a_tampered_ledger_refuses_confirm_before_anything_is_written(sweep_copy):
    results = sweep_copy.parent
    lock = json.loads((sweep_copy / "manifest.json").read_text())["split_lock_id"]
    ledger = Ledger.in_results(results)
    grant = ledger.open_milestone(lock, "m0", ["ab" * 32], ["t0"], user="ana")
    ledger.record_result(grant, "cd" * 32, user="ana")
    lines = (results / "ledger.jsonl").read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace('"user": "ana"', '"user": "bo"')
    (results / "ledger.jsonl").write_text("".join(lines))
    tampered = (results / "ledger.jsonl").read_bytes()
    with pytest.raises(LedgerError, match=r"ledger.jsonl line 1: .*edited.*restore the ledger"):
        confirm(sweep_copy, "m1")
    assert (results / "ledger.jsonl").read_bytes() == tampered
    assert not (sweep_copy / "test").exists()


def test_a_reference_row_is_refused_by_name_before_the_ledger_is_touched(sweep_copy):
    from healsweep.errors import ResultsError

    with pytest.raises(ResultsError, match="ref-plain is the reference row 'plain', not a trial"):
        confirm(sweep_copy, "m1", trial_ids=["ref-plain"])
    assert _ledger_lines(sweep_copy.parent) == []


def test_a_running_sweep_is_not_confirmed(sweep_copy):
    from healsweep.errors import ResultsError
    from healsweep.sweep.driver import sweep_lock

    with sweep_lock(sweep_copy), pytest.raises(ResultsError, match="the sweep is still running"):
        confirm(sweep_copy, "m1")
    assert _ledger_lines(sweep_copy.parent) == []


def test_a_split_changed_after_the_sweep_is_refused(sweep_copy, swept):
    _edited_corpus(sweep_copy, Path(swept["spec"]["corpus"]), "docs-2")
    with pytest.raises(SplitError, match="the split changed after the sweep.*restore that split"):
        confirm(sweep_copy, "m1")
    assert _ledger_lines(sweep_copy.parent) == [] and not (sweep_copy / "test").exists()


def test_a_split_changed_after_a_confirm_is_refused_unless_declared(sweep_copy, swept):
    old = confirm(sweep_copy, "m1", max_windows=2, n_boot=500)["split_lock_id"]
    # a second sweep of the same configs on an edited corpus: its manifest records the new lock
    second = sweep_copy.parent / "tiny2"
    shutil.copytree(sweep_copy, second, ignore=shutil.ignore_patterns("test"))
    new = _edited_corpus(second, Path(swept["spec"]["corpus"]), "docs-4")
    manifest = json.loads((second / "manifest.json").read_text())
    (second / "manifest.json").write_text(json.dumps({**manifest, "split_lock_id": new}))
    assert new != old
    with pytest.raises(LedgerError, match="the split changed after a confirm: milestone 'm1'"):
        confirm(second, "m2", max_windows=2)
    assert len(_ledger_lines(sweep_copy.parent)) == 2 and not (second / "test").exists()
    confirm(second, "m2", max_windows=2, n_boot=500, allow_split_change=True)
    opened = _ledger_lines(sweep_copy.parent)[2]
    assert (opened["milestone"], opened["replaces_split_lock_id"]) == ("m2", old)
    assert opened["split_lock_id"] == new and Ledger.in_results(sweep_copy.parent).verify() == 4


class _Crash(Exception):
    pass


def test_a_crashed_confirm_resumes_only_for_the_same_frozen_configs(sweep_copy):
    results = sweep_copy.parent

    def crash(message: str) -> None:
        if message.startswith("  window"):
            raise _Crash("killed while scoring")

    with pytest.raises(_Crash):
        confirm(sweep_copy, "m1", max_windows=2, progress=crash)
    assert [e["kind"] for e in _ledger_lines(results)] == ["confirm-open"]
    with pytest.raises(LedgerError, match="'m1' was opened at .* no result.*--resume"):
        confirm(sweep_copy, "m1", max_windows=2)
    baseline = next(t["trial_id"] for t in _trials(sweep_copy) if t["is_baseline"])
    with pytest.raises(LedgerError, match="opened for other configs"):
        confirm(sweep_copy, "m1", trial_ids=[baseline], resume=True)
    summary = confirm(sweep_copy, "m1", max_windows=2, n_boot=500, resume=True)
    entries = _ledger_lines(results)
    assert [e["kind"] for e in entries] == ["confirm-open", "confirm-resume", "confirm-result"]
    assert entries[1]["open_hash"] == entries[2]["open_hash"] == entries[0]["hash"]
    assert summary["resumed"] and summary["open_hash"] == entries[0]["hash"]
    with pytest.raises(LedgerError, match="'m1' is closed"):
        confirm(sweep_copy, "m1", resume=True)


def _cli_error(*args: str, env: dict) -> str:
    run = _cli(*args, env=env)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    [line] = run.stderr.strip().splitlines()
    return line


def test_a_ledger_cannot_be_silently_reset(sweep_copy, swept, tmp_path):
    """Issue 40: after a sweep and a confirm, removing the ledger, pointing confirm at an empty
    results root, or dropping the last entry and rewriting .head to match each used to pass
    `ledger verify` and let the same milestone open the test split again. The sweep's manifest
    and confirm.json record the heads they saw; a ledger that does not extend them is refused."""
    results, env = sweep_copy.parent, swept["env"]
    ledger = results / "ledger.jsonl"
    summary = confirm(sweep_copy, "m1", max_windows=2, n_boot=200)
    manifest = json.loads((sweep_copy / "manifest.json").read_text())
    assert "/session_" in manifest["runs"][0]["ray_session"]  # what a resume would clean up
    heads = manifest["ledger_heads"]
    assert [(h["at"], h["entries"], h["path"]) for h in heads] == [
        ("run", 0, "../ledger.jsonl"), ("confirm m1 opened", 1, "../ledger.jsonl"),
        ("confirm m1 result", 2, "../ledger.jsonl")]  # fmt: skip
    entries = _ledger_lines(results)
    assert heads[-1]["hash"] == entries[-1]["hash"] == summary["result_entry_hash"]
    assert summary["ledger_head"] == {"path": "../../../ledger.jsonl", "entries": 2,
                                      "hash": entries[-1]["hash"]}  # fmt: skip
    assert "ledger OK: 2 entries" in _cli("ledger", "verify", "--results", str(results),
                                          env=env).stdout  # fmt: skip
    saved = {p: p.read_bytes() for p in results.glob("ledger.jsonl*") if p.suffix != ".lock"}

    # 1. the ledger moved away: verify and confirm refuse (the same milestone stays closed)
    for path in saved:
        path.unlink()
    message = _cli_error("ledger", "verify", "--results", str(results), env=env)
    assert message.startswith(f"error: {ledger} is missing, but {sweep_copy / 'manifest.json'} "
                              "recorded it with ")  # fmt: skip
    with pytest.raises(LedgerError, match="is missing, but .* recorded it with 2 entries"):
        confirm(sweep_copy, "m1", max_windows=2)
    assert not ledger.exists()

    # 2. confirm pointed at an empty results root: the sweep is bound to the chain it saw
    for path, blob in saved.items():
        path.write_bytes(blob)
    empty = tmp_path / "empty"
    empty.mkdir()
    message = _cli_error("confirm", str(sweep_copy), "--milestone", "m1", "--results-root",
                         str(empty), "--max-windows", "2", env=env)  # fmt: skip
    assert message.startswith(f"error: {empty / 'ledger.jsonl'} is missing, but ")
    assert not (empty / "ledger.jsonl").exists()

    # 3. the last entry dropped and .head rewritten to match: a valid chain, but shorter
    lines = ledger.read_text().splitlines(keepends=True)
    ledger.write_text("".join(lines[:-1]))
    head = {"entries": 1, "hash": json.loads(lines[0])["hash"]}
    (results / "ledger.jsonl.head").write_text(json.dumps(head))
    assert Ledger(ledger).verify() == 1  # the chain alone cannot tell
    message = _cli_error("ledger", "verify", "--results", str(results), env=env)
    assert message.startswith(f"error: {ledger} has 1 entries, but ")
    assert "entries were removed or the ledger was replaced" in message
    with pytest.raises(LedgerError, match="has 1 entries, but .* recorded it with 2"):
        confirm(sweep_copy, "m1", max_windows=2, resume=True)
    assert ledger.read_text() == lines[0]  # nothing appended


def sealed_work(spec, knobs, done, seed, *, log: str, grant=None):
    """A trainable body that asks for the test windows (what a hand-written sweep might try)."""
    from healsweep.data.split import load_split
    from healsweep.data.windows import make_windows
    from healsweep.model import open_model

    corpus = load_corpus(spec.corpus)
    try:
        make_windows(corpus, open_model(spec.model).tokenizer(), load_split(spec.split),
                     split="test", grant=grant)  # fmt: skip
    except TestSplitSealed as exc:
        Path(log).write_text(str(exc))
        raise
    yield from ()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # ray.init after JAX loaded
def test_a_sweep_can_never_open_the_test_split(swept, tmp_path):
    import functools

    from healsweep.data.split import dump_split, parity_split
    from healsweep.sweep.driver import run_sweep
    from healsweep.sweep.spec_files import load_spec, spec_from_dict

    base = {"model": swept["spec"]["model"], "corpus": swept["spec"]["corpus"]}
    (tmp_path / "named.yaml").write_text(json.dumps({"name": "named", "split": "test", **base}))
    with pytest.raises(SpecError, match="field 'split'"):
        load_spec(tmp_path / "named.yaml")
    with pytest.raises(SpecError, match="unknown field 'scoring.split'"):
        spec_from_dict({"name": "s", "scoring": {"split": "test"}})

    corpus = load_corpus(base["corpus"])
    split_path = tmp_path / "split.yaml"
    split_path.write_text(dump_split(parity_split(corpus)))
    spec = spec_from_dict({"name": "sealed", "split": str(split_path), "max_failures": 0, **base})
    log = tmp_path / "sealed.log"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with local_ray(1):
        run = run_sweep(spec, results_root=tmp_path / "res",
                        work_fn=functools.partial(sealed_work, log=str(log)))  # fmt: skip
        # the baseline trial and both reference rows: each failed, none opened the test split
        assert sorted((t["role"], t["status"]) for t in run.trials) == [
            ("baseline", "error"), ("reference", "error"), ("reference", "error")
        ]  # fmt: skip
        message = log.read_text()
        assert message.startswith("the test split is sealed") and "healsweep confirm" in message

        lock = json.loads((run.sweep_dir / "manifest.json").read_text())["split_lock_id"]
        grant = Ledger.in_results(tmp_path / "res").open_milestone(lock, "m1", ["ab" * 32], ["t"])
        work = functools.partial(sealed_work, log=str(log), grant=grant)
        with pytest.raises(TestSplitSealed, match="cannot be pickled or sent to another process"):
            run_sweep(spec.model_copy(update={"name": "sealed2"}), results_root=tmp_path / "res",
                      work_fn=work)  # fmt: skip


def _launch(sweep_dir: Path, milestone: str, env: dict) -> subprocess.Popen:
    args = ["confirm", str(sweep_dir), "--milestone", milestone, "--max-windows", "2",
            "--n-boot", "200", "--quiet"]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_concurrent_confirms_in_two_processes_are_serialized(swept, tmp_path):
    for name in ("a", "b"):
        shutil.copytree(swept["sweep"], tmp_path / name / SWEEP)
    env = swept["env"]

    procs = [_launch(tmp_path / "a" / SWEEP, m, env) for m in ("m1", "m2")]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    entries = _ledger_lines(tmp_path / "a")
    assert Ledger.in_results(tmp_path / "a").verify() == 4
    opens = {e["hash"]: e["milestone"] for e in entries if e["kind"] == "confirm-open"}
    results = [opens[e["open_hash"]] for e in entries if e["kind"] == "confirm-result"]
    assert sorted(opens.values()) == sorted(results) == ["m1", "m2"]
    for milestone in ("m1", "m2"):
        summary = json.loads(
            (tmp_path / "a" / SWEEP / "test" / milestone / "confirm.json").read_text()
        )
        assert summary["milestone"] == milestone and summary["windows"] == 2

    procs = [_launch(tmp_path / "b" / SWEEP, "m1", env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 1], outs
    loser = outs[[p.returncode for p in procs].index(1)][1]
    assert loser.count("\n") == 1 and loser.startswith("error: milestone 'm1'")
    kinds = [e["kind"] for e in _ledger_lines(tmp_path / "b")]
    assert kinds == ["confirm-open", "confirm-result"]
    assert Ledger.in_results(tmp_path / "b").verify() == 2


@pytest.mark.slow
def test_demo_ablation_then_confirm_then_report_with_dev_and_test(tmp_path):
    spec = {
        "name": "demo-confirm",
        "split": str(ROOT / "configs" / "splits" / "demo.yaml"),
        "calibration": {"max_tokens": 4096},
        "search_space": {"alpha": ["gaussian", "mse"], "ridge": [True, False]},
        "max_concurrent": 1,
        "scoring": {"max_windows": 8, "max_scored": 64, "batch": 4},
    }
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache")}
    results = tmp_path / "results"
    run = _cli("sweep", "run", str(tmp_path / "spec.yaml"), "--results", str(results), env=env)
    assert run.returncode == 0 and "4 trials (4 completed)" in run.stdout, run.stdout + run.stderr
    sweep_dir = results / "demo-confirm"
    tuned = [t for t in _trials(sweep_dir) if t["role"] == "trial"]  # (the baseline may win)
    pick = min(tuned, key=lambda t: t["kld_mean"])["trial_id"]
    done = _cli("confirm", str(sweep_dir), "--milestone", "v1", "--max-windows", "8",
                "--trial", pick, "--verbose", env=env)  # fmt: skip  (--verbose: every window)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "opened milestone 'v1'" in done.stdout and "window 8/8" in done.stdout
    summary = json.loads((sweep_dir / "test" / "v1" / "confirm.json").read_text())
    rows = pq.read_table(sweep_dir / "test" / "v1" / "windows.parquet").to_pylist()
    assert len(rows) == 16 and all(r["split_lock_id"] == summary["split_lock_id"] for r in rows)
    demo = {d.doc_id: d for d in load_corpus("demo").documents}
    assert all(demo[r["doc_id"]].index % 2 == 0 for r in rows)  # test = even index
    for config in summary["configs"]:
        mine = [r for r in rows if r["config_hash"] == config["config_hash"]]
        assert config["pooled"]["kld_mean"] == pytest.approx(_pooled_kld(mine), rel=1e-9)

    report = _cli("report", str(sweep_dir), "--n-boot", "500", env=env)
    assert report.returncode == 0, report.stderr
    text = (sweep_dir / "report" / "report.md").read_text()
    assert "## Leaderboard against the baseline" in text
    section = text.split("## Dev and test (milestone v1)")[1].split("## ")[0]
    table = [line for line in section.splitlines() if line.startswith("| ") and "recorded" in line]
    assert len(table) == 2 and table[0].startswith("| baseline |")
    assert "test pooled KLD (8 windows)" in section
    verify = _cli("ledger", "verify", "--results", str(results), env=env)
    assert verify.returncode == 0 and "ledger OK: 2 entries" in verify.stdout
