"""The split config: parity assignment, named exclusions, canary, lock id, errors and the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from healsweep.cli import main
from healsweep.data.corpus import load_corpus
from healsweep.data.split import (
    SplitConfig,
    assign,
    dump_split,
    load_split,
    on_test_side,
    parity_split,
    require_access,
    resolve_split,
    split_from_dict,
    split_lock_id,
)
from healsweep.errors import LedgerError, SplitError, TestSplitSealed
from healsweep.ledger import Ledger

SOURCES = {"ops": "code", "chat": "json", "ja": "docs"}


def _records(n_per_source: int = 7) -> list[dict]:
    records = []
    for source, stratum in SOURCES.items():
        for index in range(n_per_source):
            records.append(
                {
                    "doc_id": f"{source}-{index}",
                    "source": source,
                    "index": index,
                    "stratum": stratum,
                    "messages": [
                        {"role": "user", "content": f"question {index} about {source}"},
                        {"role": "assistant", "content": f"<think>\nhm {index}\n</think>\n\n ok"},
                    ],
                }
            )
    for index in range(3):
        records.append(
            {
                "doc_id": f"cal-{index}",
                "source": "cal",
                "index": index,
                "stratum": "cal",
                "pool": "calibration",
                "text": f"calibration text {index}",
            }
        )
    records.append(
        {
            "doc_id": "train-0",
            "source": "train",
            "index": 0,
            "stratum": "train",
            "pool": "train",
            "text": "training text",
        }
    )
    return records


def _write(tmp_path: Path, records: list[dict], name: str = "corpus.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture()
def corpus(tmp_path):
    return load_corpus(_write(tmp_path, _records()))


def _config(**extra) -> SplitConfig:
    raw = {"sources": {s: "parity" for s in [*SOURCES, "cal", "train"]}, **extra}
    return split_from_dict(raw)


def test_parity_rule_odd_dev_even_test_per_source(corpus):
    resolved = resolve_split(_config(), corpus)
    for doc in corpus.documents:
        expected = {"calibration": "calibration", "train": "excluded"}.get(doc.pool)
        if expected is None:
            expected = "dev" if doc.index % 2 == 1 else "test"
        assert assign(_config(), doc) == expected == resolved.assignments[doc.doc_id]
    counts = resolved.counts()
    for source, stratum in SOURCES.items():
        assert counts[(source, stratum)] == {"dev": 3, "test": 4}
    assert resolved.doc_ids("calibration") == ["cal-0", "cal-1", "cal-2"]


def test_named_exclusions_canary_and_calibration_ids_take_precedence(corpus):
    config = _config(
        canary=["ops-3"],
        exclusions={
            "chat-1": {"reason": "burned", "note": "tuned on in 2024"},
            "chat-2": {"reason": "burned", "note": "a test document seen by a tuner"},
            "chat-3": {"reason": "canary"},
            "ja-5": {"reason": "calibration"},
        },
        calibration={"doc_ids": ["ja-3"]},
    )
    got = {d.doc_id: config.assign(d) for d in corpus.documents}
    assert got["ops-3"] == "canary" and got["chat-3"] == "canary"
    assert got["chat-1"] == "excluded" and got["chat-2"] == "excluded"
    assert got["ja-5"] == "calibration" and got["ja-3"] == "calibration"
    assert got["ops-1"] == "dev" and got["ops-2"] == "test"
    resolved = resolve_split(config, corpus)
    # Canaries are outside both dev and test.
    assert set(resolved.doc_ids("canary")) == {"ops-3", "chat-3"}
    assert not set(resolved.doc_ids("canary")) & set(
        resolved.doc_ids("dev") + resolved.doc_ids("test")
    )


@pytest.mark.parametrize(
    "named",
    [
        {"canary": ["ops-2"]},
        {"exclusions": {"ops-2": {"reason": "canary"}}},
        {"exclusions": {"ops-2": {"reason": "calibration"}}},
        {"calibration": {"doc_ids": ["ops-2"]}},
    ],
)
def test_a_test_document_named_in_another_pool_is_refused(corpus, named):
    """Test membership is the parity rule's: a role in the file cannot take a test document
    out to be scored (canary) or tuned on (calibration) without a grant (issue 40)."""
    config = _config(**named)
    role = "canary" if "canary" in str(named) else "calibration"
    expected = (
        f"the split config names 'ops-2' as {role}, but it is a test document (index 2 of "
        f"parity source 'ops'); the parity rule fixes the test split, so a test document can "
        f"only be burned: pick a dev-side (odd index) document as {role}, or burn this one"
    )
    with pytest.raises(SplitError) as info:
        resolve_split(config, corpus)
    assert str(info.value) == expected
    with pytest.raises(SplitError):
        config.assign(corpus.get("ops-2"))


def test_a_test_documents_text_under_another_id_is_refused(tmp_path):
    records = _records()
    twin = dict(next(r for r in records if r["doc_id"] == "ops-2"))
    records.append({**twin, "doc_id": "ops-copy", "index": 9})  # odd: dev, same text as ops-2
    corpus = load_corpus(_write(tmp_path, records, "twins.jsonl"))
    with pytest.raises(SplitError, match="'ops-copy' \\(dev\\) has the same text as test "
                                         "document 'ops-2'"):  # fmt: skip
        resolve_split(_config(), corpus)
    burned = _config(exclusions={"ops-copy": {"reason": "burned"}})
    assert resolve_split(burned, corpus).assignments["ops-copy"] == "excluded"


def test_calibration_pool_can_be_switched_off_and_source_excluded(corpus):
    config = _config(calibration={"from_corpus_pool": False})
    assert config.assign(corpus.get("cal-0")) == "test"  # index 0 of source `cal`, parity
    config = split_from_dict(
        {
            "sources": {**{s: "parity" for s in SOURCES}, "cal": "exclude", "train": "parity"},
            "calibration": {"from_corpus_pool": False},
        }
    )
    assert config.assign(corpus.get("cal-1")) == "excluded"


def test_unlisted_source_is_an_error(corpus):
    config = split_from_dict({"sources": {"ops": "parity"}})
    with pytest.raises(SplitError, match="source 'chat'.*split make"):
        resolve_split(config, corpus)


def test_lock_id_is_stable(tmp_path, corpus):
    config = _config(canary=["ops-3"])
    first = split_lock_id(config, corpus)
    assert len(first) == 64 and int(first, 16) >= 0
    # Same config and corpus read again; documents in another file order; YAML round trip.
    assert split_lock_id(config, load_corpus(tmp_path / "corpus.jsonl")) == first
    shuffled = _records()
    random.Random(3).shuffle(shuffled)
    assert split_lock_id(config, load_corpus(_write(tmp_path, shuffled, "shuffled.jsonl"))) == first
    (tmp_path / "s.yaml").write_text(dump_split(config))
    assert split_lock_id(load_split(tmp_path / "s.yaml"), corpus) == first
    # A note is commentary: it does not move any document, so it does not change the lock.
    burned = _config(exclusions={"ja-1": {"reason": "burned", "note": "seen"}})
    renoted = _config(exclusions={"ja-1": {"reason": "burned", "note": "seen while tuning"}})
    assert split_lock_id(burned, corpus) == split_lock_id(renoted, corpus) != first


@pytest.mark.parametrize(
    "edit",
    ["content", "index", "stratum", "add_doc", "drop_doc", "pool"],
)
def test_lock_id_changes_with_any_corpus_edit(tmp_path, edit):
    records = _records()
    base = split_lock_id(_config(), load_corpus(_write(tmp_path, records, "a.jsonl")))
    changed = [dict(r) for r in records]
    if edit == "content":
        changed[4]["messages"] = [{"role": "user", "content": "question 4 about ops!"}]
    elif edit == "index":
        changed[6]["index"] = 100
    elif edit == "stratum":
        changed[0]["stratum"] = "other"
    elif edit == "add_doc":
        added = {"role": "user", "content": "a new question about ops"}
        changed.append({**changed[0], "doc_id": "ops-99", "index": 99, "messages": [added]})
    elif edit == "drop_doc":
        del changed[5]
    elif edit == "pool":
        changed[2]["pool"] = "calibration"
    assert split_lock_id(_config(), load_corpus(_write(tmp_path, changed, "b.jsonl"))) != base


def test_lock_id_changes_with_any_assignment_edit(corpus):
    base = split_lock_id(_config(), corpus)
    variants = [
        _config(canary=["ops-1"]),
        _config(exclusions={"ops-1": {"reason": "burned"}}),
        _config(exclusions={"ops-1": {"reason": "calibration"}}),
        _config(calibration={"doc_ids": ["ja-3"]}),
        _config(calibration={"from_corpus_pool": False}),
        split_from_dict(
            {
                "sources": {
                    "ops": "exclude",
                    "chat": "parity",
                    "ja": "parity",
                    "cal": "parity",
                    "train": "parity",
                }
            }
        ),
    ]
    ids = {split_lock_id(v, corpus) for v in variants}
    assert base not in ids and len(ids) == len(variants)
    # Burned and calibration both move ops-1 out of dev, yet they are different splits.
    burned, cal = (split_lock_id(v, corpus) for v in variants[1:3])
    assert burned != cal


def test_empty_dev_set_is_refused(tmp_path):
    even_only = [r for r in _records() if r.get("pool", "eval") != "eval" or r["index"] % 2 == 0]
    docs = load_corpus(_write(tmp_path, even_only))
    with pytest.raises(SplitError, match="dev set empty"):
        resolve_split(_config(), docs)


def test_config_naming_missing_or_clashing_docs_is_refused(corpus):
    with pytest.raises(SplitError, match="does not contain.*nope"):
        resolve_split(_config(canary=["nope"]), corpus)
    clash = _config(canary=["ops-1"], exclusions={"ops-1": {"reason": "burned"}})
    with pytest.raises(SplitError, match="two roles"):
        resolve_split(clash, corpus)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("sources: {ops: parity\n", r"line \d+: .*fix the YAML syntax"),
        ("sources: {ops: parity}\nsplits: 2\n", "unknown field 'splits'"),
        (
            "sources: {ops: parity}\nexclusions: {ops-1: {reason: burned, notes: x}}\n",
            "unknown field 'exclusions.ops-1.notes'",
        ),
        (
            "sources: {ops: parity}\nexclusions: {ops-1: {reason: lost}}\n",
            "field 'exclusions.ops-1.reason'",
        ),
        ("sources: {ops: alternate}\n", "field 'sources.ops.rule'"),
        ("- a\n- b\n", "a split config is a YAML mapping"),
        ("canary: [ops-1]\n", "field 'sources'"),
    ],
)
def test_malformed_split_files_raise_one_line_split_errors(tmp_path, text, pattern):
    path = tmp_path / "split.yaml"
    path.write_text(text)
    with pytest.raises(SplitError, match=pattern) as info:
        load_split(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_only_test_needs_a_grant_and_a_real_grant_opens_it(tmp_path, corpus):
    lock = split_lock_id(_config(), corpus)
    require_access("dev", None, lock)
    require_access("canary", None, lock)
    with pytest.raises(TestSplitSealed, match="healsweep confirm RESULTS/<sweep> --milestone"):
        require_access("test", None, lock)
    with pytest.raises(SplitError, match="not an eval split"):
        require_access("calibration", None, lock)
    grant = Ledger.in_results(tmp_path / "results").open_milestone(lock, "m1", ["a" * 64], ["t0"])
    require_access("test", grant, lock)
    other = split_lock_id(_config(canary=["ops-1"]), corpus)
    with pytest.raises(TestSplitSealed, match="split or corpus changed"):
        require_access("test", grant, other)


def test_parity_split_is_the_auto_split(corpus):
    config = parity_split(corpus, corpus="demo")
    assert set(config.sources) == {*SOURCES, "cal", "train"}
    assert split_lock_id(config, corpus) == split_lock_id(_config(), corpus)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_cli_make_then_show(tmp_path, capsys, corpus):
    corpus_path = tmp_path / "corpus.jsonl"
    out = tmp_path / "splits" / "s.yaml"
    code, stdout, _ = _cli(
        capsys,
        "split",
        "make",
        str(corpus_path),
        "--out",
        str(out),
        "--canary",
        "ops-3",
        "--burned",
        "chat-1",
    )
    assert code == 0
    config = load_split(out)
    resolved = resolve_split(config, corpus)
    assert resolved.lock_id in stdout
    assert yaml.safe_load(out.read_text())["corpus"] == "../corpus.jsonl"
    assert config.assign(corpus.get("ops-3")) == "canary"
    assert config.assign(corpus.get("chat-1")) == "excluded"

    code, stdout, _ = _cli(capsys, "split", "show", str(out))
    assert code == 0 and f"split lock id: {resolved.lock_id}" in stdout
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in stdout.splitlines()}
    # columns: dev test calibration canary excluded
    assert rows[("ops", "code")] == ["2", "4", "0", "1", "0"]
    assert rows[("chat", "json")] == ["2", "4", "0", "0", "1"]
    assert rows[("cal", "cal")] == ["0", "0", "3", "0", "0"]
    assert stdout.splitlines()[-2].split() == ["total", "7", "12", "3", "1", "2"]


def test_cli_errors_are_one_line_with_exit_code_1(tmp_path, capsys, corpus):
    out = tmp_path / "s.yaml"
    assert _cli(capsys, "split", "make", str(tmp_path / "corpus.jsonl"), "--out", str(out))[0] == 0
    code, _, err = _cli(capsys, "split", "make", str(tmp_path / "corpus.jsonl"), "--out", str(out))
    assert code == 1 and "--force" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: {ops: parity}\nextra: 1\n")
    code, _, err = _cli(
        capsys, "split", "show", str(bad), "--corpus", str(tmp_path / "corpus.jsonl")
    )
    assert code == 1 and "unknown field 'extra'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_shipped_demo_split(tmp_path, capsys):
    root = Path(__file__).resolve().parents[1]
    shipped = load_split(root / "configs" / "splits" / "demo.yaml")
    demo = load_corpus("demo")
    resolved = resolve_split(shipped, demo)
    dev, test, canary = (set(resolved.doc_ids(s)) for s in ("dev", "test", "canary"))
    assert len(dev) >= 40 and len(test) >= 40 and len(canary) >= 1
    assert not (dev & test) and not (canary & (dev | test))
    for doc in demo.documents:
        split = resolved.assignments[doc.doc_id]
        if split in ("dev", "test"):
            assert doc.pool == "eval" and doc.index % 2 == (1 if split == "dev" else 0)
        if split == "calibration":
            assert doc.pool == "calibration"
    strata = {(d.stratum, resolved.assignments[d.doc_id]) for d in demo.documents}
    for stratum in {d.stratum for d in demo.documents if d.pool == "eval"}:
        assert (stratum, "dev") in strata and (stratum, "test") in strata
    # `split make demo` with the same canaries and burned documents reproduces the shipped
    # config (but for the burned documents' notes).
    out = tmp_path / "demo.yaml"
    canaries = [arg for doc_id in shipped.canary for arg in ("--canary", doc_id)]
    burned = [arg for doc_id in shipped.exclusions for arg in ("--burned", doc_id)]
    assert _cli(capsys, "split", "make", "demo", "--out", str(out), *canaries, *burned)[0] == 0
    made = load_split(out)
    assert made.model_copy(update={"exclusions": {}}) == shipped.model_copy(
        update={"exclusions": {}}
    )
    assert {k: v.reason for k, v in made.exclusions.items()} == {
        k: v.reason for k, v in shipped.exclusions.items()
    }
    assert resolve_split(made, demo).lock_id == resolved.lock_id  # notes do not enter the id
    # No canary and no burned document is on the test side, and no test text sits elsewhere.
    for doc_id in shipped.canary:
        assert not on_test_side(shipped, demo.get(doc_id))


def test_editing_the_split_after_a_confirm_is_caught(tmp_path, corpus):
    ledger = Ledger.in_results(tmp_path / "results")
    before = split_lock_id(_config(), corpus)
    grant = ledger.open_milestone(before, "m1", ["a" * 64], ["t0"])
    # Burning a test document after seeing test results makes a new split, and a new lock id.
    after = split_lock_id(_config(exclusions={"ops-2": {"reason": "burned"}}), corpus)
    with pytest.raises(TestSplitSealed):
        require_access("test", grant, after)
    with pytest.raises(LedgerError, match="split changed after a confirm"):
        ledger.open_milestone(after, "m2", ["a" * 64], ["t0"])
