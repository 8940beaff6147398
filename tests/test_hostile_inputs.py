"""Hostile inputs, second round (issue 47, items 1, 2, 5, 6 and 8): every byte the CLI reads is
bounded. YAML (knob files, specs, splits) through one loader whose expansion, depth and value
length are counted before anything is built; only regular files are read; spec resources are
finite and non-negative; corpora have a per-document limit, and lone surrogates, bad UTF-8 and a
split naming absent documents are one line; output paths are checked before the work.

Each class goes through the real CLI as a child process (``run_cli`` of
``tests/test_hostile_files.py``: one ``error:`` line, exit 1, peak RSS under 1 GB, wall seconds
and peak RSS recorded as test properties); the variants of a class run in-process against every
loader that shares the check, so a loader added later without it fails here too.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from healsweep.errors import HealsweepError, KnobError, SpecError, SplitError
from healsweep.model.synthetic import write_random_model
from test_bad_inputs import read_only
from test_hostile_files import refused, run_cli

FIFO_TIMEOUT = 60  # a FIFO that is opened blocks for ever; the run must end long before this
MESSAGE_LIMIT = 700  # characters: a message quotes at most a few hundred of the input


def _bomb(levels: int = 9) -> str:
    """The billion laughs: 9 names of 9 aliases each, 9^9 = 387 M values in 0.6 KB."""
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    names = "abcdefghijklmnop"
    for before, name in zip(names, names[1 : levels + 1], strict=False):
        text += f"{name}: &{name} [{', '.join([f'*{before}'] * 9)}]\n"
    return text


HOSTILE_YAML = {
    # name: (file bytes, what the message says)
    "alias bomb": (_bomb().encode(), "the YAML holds more than 100,000 values"),
    "alias bomb of long strings": (
        b"a: &a " + b"x" * 60000 + b"\nb: [" + b", ".join([b"*a"] * 300) + b"]\n",
        "holds more than 16,777,216 characters of values",
    ),
    "recursive alias": (b"a: &x [1, *x]\n", "alias *'x' stands inside the collection it names"),
    "deep nesting": (b"a: " + b"[" * 500 + b"]" * 500 + b"\n", "nests more than 64 levels"),
    "a huge value": (b"a: " + b"x" * 100_000 + b"\n", "a value of 100,000 characters"),
    "an integer of 5000 digits": (b"a: 1" + b"0" * 5000 + b"\n", "cannot read this value"),
    "a date out of range": (b"a: 0000-01-01\n", "cannot read this value ('year 0 is out of range"),
    "a Latin-1 byte": (b"a: 1\nname: caf\xe9\n", "not UTF-8 text: byte 14 (line 2) is 0xe9"),
}


def _load_knobs(path):
    from healsweep.heal.knobs import load_knobs

    return load_knobs(path)


def _load_spec(path):
    from healsweep.sweep.spec_files import load_spec

    return load_spec(path)


def _load_split(path):
    from healsweep.data.split import load_split

    return load_split(path)


YAML_LOADERS = {"knob file": (_load_knobs, KnobError), "sweep spec": (_load_spec, SpecError),
                "split config": (_load_split, SplitError)}  # fmt: skip


@pytest.mark.parametrize("loader", list(YAML_LOADERS))
@pytest.mark.parametrize("case", list(HOSTILE_YAML))
def test_every_yaml_loader_bounds_what_a_file_expands_to(case, loader, tmp_path):
    body, expected = HOSTILE_YAML[case]
    path = tmp_path / "hostile.yaml"
    path.write_bytes(body)
    load, error = YAML_LOADERS[loader]
    start = time.monotonic()
    with pytest.raises(error) as caught:
        load(path)
    assert time.monotonic() - start < 5
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert expected in message, message
    assert len(message) < MESSAGE_LIMIT and "\n" not in message, message


def test_aliases_within_bounds_still_load(tmp_path):
    """Anchors, aliases and merge keys are YAML a careful user writes: they load as before."""
    from healsweep.heal.knobs import load_knobs

    path = tmp_path / "k.yaml"
    path.write_text("gain_d: &g 0.5\ngain_gu: *g\n")
    knobs = load_knobs(path)
    assert (knobs.gain_d, knobs.gain_gu) == (0.5, 0.5)
    from healsweep._yaml_input import YAMLBounds, parse_yaml

    text = "defaults: &d {x: 1, y: [1, 2]}\nfirst: {<<: *d, z: 3}\nsecond: *d\n"
    loaded = parse_yaml(text, "T", "test", YAMLBounds.for_bytes(1 << 20)).value
    assert loaded == yaml.safe_load(text)


def test_a_value_quoted_in_a_message_is_cut(tmp_path):
    """The knob path put repr(input) in its message; a 60,000-character value is cut."""
    path = tmp_path / "k.yaml"
    path.write_text("gain_d: " + "9" * 60000 + "x\n")
    with pytest.raises(KnobError) as caught:
        _load_knobs(path)
    assert "knob 'gain_d' = '9999" in str(caught.value)
    assert len(str(caught.value)) < MESSAGE_LIMIT
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nresources: {" + ", ".join(f"r{i}: -1" for i in range(5000)) + "}\n")
    with pytest.raises(SpecError) as caught:
        _load_spec(spec)
    assert "field 'resources.r0' = -1 is not allowed" in str(caught.value)
    key = tmp_path / "key.yaml"
    key.write_text("name: s\n? " + "k" * 50000 + "\n: 1\n")  # an explicit key: any length
    with pytest.raises(SpecError) as caught:
        _load_spec(key)
    assert "unknown field 'kkkk" in str(caught.value)
    assert len(str(caught.value)) < 2 * MESSAGE_LIMIT  # the known fields are listed too


def test_quoted_is_bounded_whatever_the_value():
    from healsweep._inputs import quoted

    shared = ["x" * 1000] * 1000
    for value in ("x" * 10**7, [shared] * 1000, {"k" * 10**6: shared}, 10**4000, b"y" * 10**6):
        start = time.monotonic()
        text = quoted(value)
        assert len(text) <= 200 and time.monotonic() - start < 1, text


def _knob_file(tmp_path: Path, body: bytes) -> list:
    knobs = tmp_path / "knobs.yaml"
    knobs.write_bytes(body)
    return ["heal", "demo", "--knobs", knobs, "--out", tmp_path / "out.gguf"]


def _spec_file(tmp_path: Path, body: bytes) -> list:
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(body)
    return ["sweep", "run", spec, "--results", tmp_path / "results"]


def _split_file(tmp_path: Path, body: bytes) -> list:
    split = tmp_path / "split.yaml"
    split.write_bytes(body)
    return ["split", "show", split]


CLI_YAML = {
    "alias bomb in a knob file": (_knob_file, _bomb().encode(), "holds more than 100,000 values"),
    "alias bomb in a spec": (_spec_file, b"name: bomb\n" + _bomb().encode(),
                             "holds more than 100,000 values"),
    "Latin-1 byte in a split": (_split_file, b"corpus: demo\n# caf\xe9\n",
                                "not UTF-8 text: byte 18 (line 2) is 0xe9"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLI_YAML))
def test_hostile_yaml_through_the_cli(case, tmp_path, record_property):
    make, body, expected = CLI_YAML[case]
    run = run_cli(*make(tmp_path, body), tmp_path=tmp_path)
    message = refused(run, record_property)
    assert expected in message and len(message) < MESSAGE_LIMIT, message
    assert not (tmp_path / "results").exists() and not (tmp_path / "out.gguf").exists()
    assert not (tmp_path / "cache").exists()  # refused before any work


# --- only regular files are read ---------------------------------------------------------------


@pytest.fixture
def irregular(tmp_path):
    """Paths that are not regular files on disk: a FIFO (no writer: an open would block), a
    folder, a character device and a /proc file (size 0, gives more)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return {"FIFO": fifo, "folder": folder, "device": Path("/dev/zero"),
            "/proc file": Path("/proc/self/status")}  # fmt: skip


def _read_corpus(path):
    from healsweep.data.corpus import load_corpus

    return load_corpus(path)


def _read_gguf(path):
    from healsweep.gguf_io import read_gguf

    return read_gguf(path)


def _read_tokenizer(path):
    from healsweep.gguf_io._tokenizer import load_tokenizer_file

    return load_tokenizer_file(path)


def _read_ledger(path):
    from healsweep.ledger import Ledger

    return Ledger(path).entries()


def _read_chatml(path):
    from healsweep.data.chatml import import_chatml_files

    return import_chatml_files([path])


FILE_LOADERS = {**{name: load for name, (load, _) in YAML_LOADERS.items()},
                "corpus": _read_corpus, "GGUF model": _read_gguf, "tokenizer.json": _read_tokenizer,
                "ledger": _read_ledger, "ChatML file": _read_chatml}  # fmt: skip


@pytest.mark.parametrize("kind", ["FIFO", "folder", "device", "/proc file"])
@pytest.mark.parametrize("loader", list(FILE_LOADERS))
def test_every_loader_reads_only_regular_files(loader, kind, irregular):
    path = irregular[kind]
    start = time.monotonic()
    with pytest.raises(HealsweepError) as caught:
        FILE_LOADERS[loader](path)
    assert time.monotonic() - start < 5
    message = str(caught.value)
    if kind == "/proc file":
        if loader == "GGUF model":  # a GGUF's magic is read first: /proc/self/status is not one
            assert "is not a GGUF file" in message, message
        else:
            assert "is a /proc or /sys file" in message, message
    else:
        what = {"FIFO": "a FIFO (named pipe)", "folder": "a folder", "device": "a character device"}[kind]
        assert message.startswith(f"{path} is {what}, not a regular file; a "), message


@pytest.mark.parametrize("field", ["model", "corpus", "split", "calibration.corpus"])
def test_a_spec_path_that_is_a_fifo_is_named_as_one(field, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = ("calibration:\n  corpus: pipe\n" if field == "calibration.corpus"
            else f"{field}: pipe\n")  # fmt: skip
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nsearch_space:\n  gain_d: [0.3]\n{line}")
    with pytest.raises(SpecError) as caught:
        _load_spec(spec)
    assert str(caught.value).startswith(
        f"{spec}: field '{field}' = '{fifo}': it is a FIFO (named pipe), not a regular file; "
    )


FIFO_CASES = {"knob file": _knob_file, "spec": _spec_file, "split config": _split_file}


@pytest.mark.parametrize("case", list(FIFO_CASES))
def test_a_fifo_given_as_a_file_is_refused_not_waited_on(case, tmp_path, record_property):
    """A FIFO knob file, spec or split config used to hang the CLI in read_text()."""
    args = FIFO_CASES[case](tmp_path, b"")
    path = next(a for a in args if isinstance(a, Path) and a.suffix == ".yaml")
    path.unlink()
    os.mkfifo(path)
    run = run_cli(*args, tmp_path=tmp_path, timeout=FIFO_TIMEOUT)
    assert refused(run, record_property).startswith(f"{path} is a FIFO (named pipe), not a regular")


# --- spec resources ----------------------------------------------------------------------------

RESOURCES = {"cpu: .nan": "nan", "cpu: .inf": "inf", "cpu: -2": "-2", "gpu: -0.5": "-0.5",
             "metal: -1": "-1", "memory: 1.0e+400": "inf"}  # fmt: skip


@pytest.mark.parametrize("entry", list(RESOURCES))
def test_spec_resources_are_finite_and_not_negative(entry, tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: r\nsearch_space:\n  gain_d: [0.3]\nresources:\n  {entry}\n")
    with pytest.raises(SpecError) as caught:
        _load_spec(spec)
    name = entry.split(":")[0]
    assert str(caught.value).startswith(
        f"{spec}:5: field 'resources.{name}' = {RESOURCES[entry]} is not allowed; expected a "
        "mapping of resource: a finite amount >= 0"
    )


@pytest.mark.parametrize("entry", ["cpu: .nan", "cpu: -2"])
def test_bad_resources_are_refused_before_ray_and_the_results_folder(entry, tmp_path,
                                                                     record_property):  # fmt: skip
    """`cpu: -2` reached Ray, printed two tracebacks and left a results folder behind."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: r\nsearch_space:\n  gain_d: [0.3]\nresources:\n  {entry}\n")
    run = run_cli("sweep", "run", spec, "--results", tmp_path / "results", tmp_path=tmp_path,
                  env={"RAY_TMPDIR": str(tmp_path / "ray")})  # fmt: skip
    assert "field 'resources.cpu'" in refused(run, record_property)
    assert not (tmp_path / "results").exists() and not (tmp_path / "ray").exists()


# --- corpora and splits ------------------------------------------------------------------------

GOOD_DOC = ('{"doc_id": "d1", "source": "s", "index": 1, "stratum": "t", '
            '"text": "an emoji as a surrogate pair: \\ud83d\\ude00"}\n')  # fmt: skip


def _corpus(tmp_path: Path, second: bytes) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_bytes(GOOD_DOC.encode() + second)
    return path


HOSTILE_DOCS = {
    "a lone surrogate": (
        b'{"doc_id": "d2", "source": "s", "index": 3, "stratum": "t", "messages": '
        b'[{"role": "user", "content": "ok"}, {"role": "assistant", "content": "x\\udc80y"}]}\n',
        ":2: field 'messages.1.content' holds a lone surrogate (U+DC80, at character 1)"),
    "a lone surrogate in a doc_id": (
        b'{"doc_id": "\\ud800", "source": "s", "index": 3, "stratum": "t", "text": "t"}\n',
        ":2: field 'doc_id' holds a lone surrogate (U+D800"),
    "a Latin-1 byte": (
        b'{"doc_id": "d2", "source": "s", "index": 3, "stratum": "t", "text": "caf\xe9"}\n',
        f": not UTF-8 text: byte {len(GOOD_DOC) + 72} (line 2) is 0xe9"),
    "JSON nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000 + b"\n",
                                 ":2: the JSON nests too deep for Python's parser"),
    "a document over the default limit": (
        b'{"doc_id": "d2", "source": "s", "index": 3, "stratum": "t", "text": "'
        + b"x" * (2 << 20) + b'"}\n',
        ":2: the document is over the per-document limit of 1,048,576 bytes (HEALSWEEP_DOC_MIB"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE_DOCS))
def test_a_hostile_corpus_document_is_one_line(case, tmp_path):
    from healsweep.errors import CorpusError

    second, expected = HOSTILE_DOCS[case]
    path = _corpus(tmp_path, second)
    with pytest.raises(CorpusError) as caught:
        _read_corpus(path)
    assert str(caught.value).startswith(f"{path}{expected}"), str(caught.value)
    assert len(str(caught.value)) < MESSAGE_LIMIT


def test_the_document_limit_is_a_setting(tmp_path, monkeypatch):
    from healsweep.errors import CorpusError, SettingError

    path = _corpus(tmp_path, b"")
    monkeypatch.setenv("HEALSWEEP_DOC_MIB", "0.0001")  # 104 bytes: the document has 108
    with pytest.raises(CorpusError, match=r"c.jsonl:1: the document is over the per-document "
                       r"limit of 104 bytes"):  # fmt: skip
        _read_corpus(path)
    monkeypatch.setenv("HEALSWEEP_DOC_MIB", "0.001")
    assert len(_read_corpus(path).documents) == 1
    monkeypatch.setenv("HEALSWEEP_DOC_MIB", "-1")
    with pytest.raises(SettingError, match="HEALSWEEP_DOC_MIB='-1' is not a positive number"):
        _read_corpus(path)


CLI_DOCS = {
    "a lone surrogate": (HOSTILE_DOCS["a lone surrogate"], {}),
    "a 1 MB document over a 0.5 MiB limit": ((
        b'{"doc_id": "d2", "source": "s", "index": 3, "stratum": "t", "text": "'
        + b"x" * (1 << 20) + b'"}\n', ":2: the document is over the per-document limit of "
        "524,288 bytes"), {"HEALSWEEP_DOC_MIB": "0.5"}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLI_DOCS))
def test_a_hostile_corpus_through_the_cli(case, tmp_path, record_property):
    (second, expected), env = CLI_DOCS[case]
    path = _corpus(tmp_path, second)
    run = run_cli("corpus", "info", path, tmp_path=tmp_path, env=env)
    assert refused(run, record_property).startswith(f"{path}{expected}")


def test_score_checks_the_split_document_ids_as_split_show_does(tmp_path, tiny_tokenizer,
                                                                 record_property):  # fmt: skip
    """A split naming documents the corpus lacks was refused by `split show`, scored by
    `score`."""
    from healsweep.data.corpus import load_corpus

    sources = sorted({d.source for d in load_corpus("demo").documents})
    split = tmp_path / "split.yaml"
    split.write_text("corpus: demo\nsources:\n" + "".join(f"  {s}: parity\n" for s in sources)
                     + "canary: [no-such-document]\n")  # fmt: skip
    model = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer)
    expected = ("the split config names doc ids the corpus does not contain: "
                "['no-such-document']; remove them or use the matching corpus")  # fmt: skip
    assert refused(run_cli("split", "show", split, tmp_path=tmp_path)) == expected
    run = run_cli("score", "--model", model, "--ref", model, "--split-config", split,
                  "--max-scored", "16", "--max-context", "16", tmp_path=tmp_path)  # fmt: skip
    assert refused(run, record_property) == expected


# --- outputs -----------------------------------------------------------------------------------


def test_an_unwritable_out_is_refused_before_the_heal(tmp_path, record_property):
    """It used to be a traceback, on a cold cache only after the whole heal."""
    knobs = tmp_path / "k.yaml"
    knobs.write_text("gain_d: 0.5\n")
    with read_only(tmp_path / "ro") as folder:
        run = run_cli("heal", "demo", "--knobs", knobs, "--out", folder / "healed.gguf",
                      tmp_path=tmp_path)  # fmt: skip
    message = refused(run, record_property)
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert message == (f"cannot write the healed GGUF {folder / 'healed.gguf'}: {reason} in "
                       f"{folder}; pass another path, or fix the folder's permissions or free "
                       "space")  # fmt: skip
    assert not (tmp_path / "cache").exists()


def test_output_paths_are_checked(tmp_path):
    from healsweep._inputs import check_output, check_output_folder
    from healsweep.errors import HealsweepError

    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir.gguf").mkdir()
    cases = {
        tmp_path / "missing" / "o.gguf": f"output folder {tmp_path / 'missing'} does not exist; "
                                          "create it or pass another path",
        tmp_path / "file" / "o.gguf": f"{tmp_path / 'file'} is not a folder",
        tmp_path / "dir.gguf": "it is a folder, and the GGUF is a file",
        tmp_path / "fifo": "it is a FIFO (named pipe), and the GGUF is a file",
    }
    for path, expected in cases.items():
        with pytest.raises(HealsweepError, match="^cannot write the GGUF ") as caught:
            check_output(path, "GGUF")
        assert expected in str(caught.value)
    assert check_output(tmp_path / "new" / "o.gguf", "GGUF", make_folder=True).parent.is_dir()
    assert check_output_folder(tmp_path, "report") == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.gguf", "fifo", "file", "new"]


# Output options of the CLI: (command, option) pairs whose callback must check the path first.
_OUTPUT_OPTIONS = ("--out", "--out-dir", "--json", "--q2", "--report", "--tokenizer-out")


def test_every_command_with_an_output_path_checks_it_first():
    """A command added later with an --out that is not checked fails here."""
    import typer.main

    from healsweep.cli import _register, app

    _register()
    unchecked = []
    group = typer.main.get_command(app)
    pending = [((), group)]
    while pending:
        names, command = pending.pop()
        for name, sub in getattr(command, "commands", {}).items():
            pending.append(((*names, name), sub))
        for param in getattr(command, "params", []):
            if set(param.opts) & set(_OUTPUT_OPTIONS) and not getattr(param, "is_flag", False):
                source = inspect.getsource(command.callback)
                if "check_output" not in source:
                    unchecked.append(f"{' '.join(names)} {param.opts[0]}")
    assert unchecked == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writes_temp_file_is_removed_by_the_next_write(tmp_path, tiny_tokenizer,
                                                                record_property):  # fmt: skip
    """`model slice --out T` removes the `.tmp-T-PID-HEX` a killed write left, and nothing else:
    not a live writer's, not another target's, not one whose writer holds its lock."""
    import fcntl

    model = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer)
    out = tmp_path / "out" / "slice.gguf"
    out.parent.mkdir()
    dead = _dead_pid()
    stale = out.parent / f".tmp-slice.gguf-{dead}-{'a' * 12}"
    live = out.parent / f".tmp-slice.gguf-{os.getpid()}-{'b' * 12}"
    other = out.parent / f".tmp-other.gguf-{dead}-{'c' * 12}"
    locked = out.parent / f".tmp-slice.gguf-{dead}-{'d' * 12}"
    for path in (stale, live, other, locked):
        path.write_bytes(b"half a GGUF")
    with open(locked, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer on another host of a shared file system
        run = run_cli("model", "slice", model, "--layers", "0:1", "--out", out, tmp_path=tmp_path)
    assert run.code == 0, run.stderr
    record_property("seconds", round(run.seconds, 2))
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        ["slice.gguf", live.name, other.name, locked.name])  # fmt: skip


def test_a_write_holds_its_temp_files_lock(tmp_path):
    """While a write is under way its temp file is locked, so no cleaner takes it."""
    from healsweep._atomic import atomic_path, remove_stale_temps

    target = tmp_path / "t.bin"
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"partial")
        dead_name = tmp.with_name(tmp.name.replace(f"-{os.getpid()}-", f"-{_dead_pid()}-"))
        os.link(tmp, dead_name)  # the same inode under a dead writer's name: still locked
        assert remove_stale_temps(target) == []
        dead_name.unlink()
    assert target.read_bytes() == b"partial"
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]


def test_the_cli_error_line_is_bounded_and_keeps_its_advice():
    """The last net: a message that still grew with its input keeps its start and its advice."""
    from healsweep.cli import MESSAGE_LIMIT as CLI_LIMIT
    from healsweep.cli import _one_line

    message = "F:1: knob 'x' = '" + "y" * 10**6 + "' is not allowed; expected a float"
    line = _one_line(message)
    assert len(line) < CLI_LIMIT + 100
    assert line.startswith("F:1: knob 'x' = 'yyy") and line.endswith("; expected a float")
    assert "characters cut" in line
    assert _one_line("short") == "short"


def test_every_yaml_file_is_read_by_the_one_loader():
    """A loader added later that calls PyYAML itself would bypass the bounds."""
    import re

    import healsweep

    root = Path(healsweep.__file__).parent
    direct = re.compile(r"\byaml\.(safe_load|load|full_load|unsafe_load|compose|parse)\w*\(")
    callers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if p.name != "_yaml_input.py" and direct.search(p.read_text(encoding="utf-8"))]
    assert callers == []
