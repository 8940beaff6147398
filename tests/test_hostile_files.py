"""Hostile files (issue 40): small crafted inputs that used to cost unbounded time or memory, a
traceback, or a way around the sealed test split. Each goes through the real CLI in a subprocess
and must end in one ``error:`` line and exit 1 (or be refused where it is loaded); the child's
peak RSS (taken by a small wrapper process) must stay under 1 GB. The wall-clock limit of the subprocess (120 s) is a
safety net, not a timing assertion (a shared machine can stall a process for a minute); each
refusal records its wall seconds and peak RSS as test properties (``--junitxml``), the figures of
``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from _cli import HEALSWEEP
from healsweep.model.synthetic import write_random_model

RSS_LIMIT = 1 << 30  # bytes


class Run(NamedTuple):
    """A finished CLI run: exit code, output, wall seconds and the child's peak RSS in bytes."""

    code: int
    stdout: str
    stderr: str
    seconds: float
    peak_rss: int


# Runs the command and writes its peak RSS (KiB) to argv[1]. A child forked from this test
# process would count the test process's pages in its own peak until it execs (the long-running
# pytest process holds GBs late in a run); forked from this small wrapper it counts only its own.
_MEASURED = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)
"""


def run_cli(*args: str, tmp_path: Path, env: dict | None = None, timeout: float = 120) -> Run:
    """Run ``healsweep ARGS`` as a child with a private stage cache and measure it (its own peak
    RSS through a small wrapper process); fails the test when it runs past ``timeout``."""
    full_env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache"), **(env or {}),
                "PYTHONFAULTHANDLER": "1"}  # fmt: skip  (SIGABRT on a stall prints its stacks)
    rss_file = tmp_path / f"rss-{time.monotonic_ns()}.txt"
    command = [sys.executable, "-c", _MEASURED, str(rss_file), *HEALSWEEP]
    start = time.monotonic()
    proc = subprocess.Popen([*command, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # faulthandler writes every thread's stack
        time.sleep(5)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"healsweep {' '.join(map(str, args))} ran past {timeout} s; its stacks:\n"
                    + err[-6000:])  # fmt: skip
    seconds = time.monotonic() - start
    peak = int(rss_file.read_text()) * 1024 if rss_file.exists() else 0
    return Run(proc.returncode, out, err, seconds, peak)


def refused(run: Run, record_property=None) -> str:
    """The message after ``error: `` of a run that failed as a user error should, within the
    memory bound (its figures recorded as test properties when ``record_property`` is given)."""
    if record_property is not None:
        record_property("seconds", round(run.seconds, 2))
        record_property("peak_rss_mib", round(run.peak_rss / 2**20, 1))
    assert 0 < run.peak_rss < RSS_LIMIT, f"peak RSS {run.peak_rss / 2**20:.0f} MiB"
    return one_line_error(run.code, run.stderr)


def one_line_error(code: int, stderr: str) -> str:
    """The message after ``error: `` of a CLI that failed as a user error should."""
    assert code == 1, (code, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    return lines[0][len("error: ") :]


# --- 1. hparams checked before anything is sized by them ---------------------------------------

HPARAM_CASES = {
    # name: (metadata override, message fragment after "PATH: ")
    "absurd block_count": ({"qwen2moe.block_count": 10**9},
                           "qwen2moe.block_count is 1000000000; expected at most the 2 blocks "
                           "the file has tensors for (blk.0 to blk.1)"),
    "zero heads": ({"qwen2moe.attention.head_count": 0},
                   "qwen2moe.attention.head_count is 0; expected a positive integer"),
    "a string for a count": ({"qwen2moe.attention.head_count": "four"},
                             "qwen2moe.attention.head_count is 'four'; expected an integer"),
    "heads that do not divide the width": (  # and no key_length states another head size
        {"qwen2moe.attention.head_count": 3, "qwen2moe.attention.head_count_kv": 3,
         "drop_keys": ("attention.key_length",)},
        "qwen2moe.attention.head_count is 3; expected a divisor of "
        "qwen2moe.embedding_length = 64"),
    "kv heads that do not divide the heads": (
        {"qwen2moe.attention.head_count_kv": 3},
        "qwen2moe.attention.head_count_kv is 3; expected a divisor of "
        "qwen2moe.attention.head_count = 4"),
    "more experts used than there are": (
        {"qwen2moe.expert_used_count": 20},
        "qwen2moe.expert_used_count is 20; expected at most qwen2moe.expert_count = 8"),
    "a per-layer array for a count": (
        {"qwen2moe.attention.head_count_kv": [2, 2]},
        "qwen2moe.attention.head_count_kv is an array of 2 values; expected an integer "
        "(per-layer values are not supported)"),
    "a negative norm epsilon": (
        {"qwen2moe.attention.layer_norm_rms_epsilon": -1.0},
        "qwen2moe.attention.layer_norm_rms_epsilon is -1.0; expected a positive number"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HPARAM_CASES))
def test_hparams_are_checked_before_anything_is_sized_by_them(
    case, tmp_path, tiny_tokenizer, record_property
):
    override, expected = HPARAM_CASES[case]
    override = dict(override)
    drop = override.pop("drop_keys", ())
    path = write_random_model(tmp_path / "hostile.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                              extra_metadata=override, drop_keys=drop)  # fmt: skip
    assert path.stat().st_size < 1 << 20
    message = refused(run_cli("model", "info", path, tmp_path=tmp_path), record_property)
    assert message.startswith(f"{path}: {expected}"), message
    assert message.endswith("the metadata is inconsistent, re-export the file")


def test_hparams_of_a_sound_file_pass_every_check(random_gguf):
    """Every architecture's random file opens: the checks refuse only what is inconsistent."""
    from healsweep.model import SUPPORTED_ARCHS, open_model

    for arch in SUPPORTED_ARCHS:
        extra = {"n_head_kv": 4} if arch != "qwen2moe" else {}
        assert open_model(random_gguf(arch, **extra)).hparams.arch == arch


# --- 2. chat template renders bounded in time and memory ---------------------------------------

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s }}")  # fmt: skip
TEMPLATE_CASES = {
    # name: (template, message fragment, wall seconds when the limit is time)
    "nested loops inside range's limit": (NESTED_LOOPS, "it ran past 1 s of wall time"),
    "nested loops whose items are all filtered out": (
        "{% for i in range(100000) %}{% for j in range(100000) if false %}{% endfor %}"
        "{% endfor %}", "it ran past 1 s of wall time"),
    "a string doubled in a loop": (DOUBLING, "a '~' concatenation would bring what it built to"),
    "a string multiplied at once": ("{{ 'x' * 10**10 }}", "'*' would bring what it built to"),
    "a padded format": ("{{ '{:>9999999999}'.format('x') }}",
                        "'format' would bring what it built to"),
    "a join of many references": ("{% set l = ['x' * 1000000] * 1000 %}{{ l|join }}",
                                  "'*' would bring what it built to"),
    "output in a loop": ("{% set x %}{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}"
                         "{% endset %}{{ x }}", "its output would bring what it built to"),
    "a macro calling itself": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                               "its calls nest more than 64 deep"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_a_hostile_chat_template_is_stopped_in_one_line(
    case, tmp_path, tiny_tokenizer, record_property
):
    template, expected = TEMPLATE_CASES[case]
    path = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                              chat_template=template)  # fmt: skip
    run = run_cli("score", "--model", path, "--ref", path, "--max-scored", "16",
                  "--max-context", "16", tmp_path=tmp_path,
                  env={"HEALSWEEP_TEMPLATE_SECONDS": "1"})  # fmt: skip
    message = refused(run, record_property)
    assert message.startswith(f"{path}: tokenizer.chat_template was stopped on document "), message
    assert expected in message
    assert "the limits of one render are 1 s and 32 MiB" in message
    assert "raise HEALSWEEP_TEMPLATE_SECONDS / HEALSWEEP_TEMPLATE_MIB" in message


def test_template_limits_are_settings(tmp_path, tiny_tokenizer):
    """A larger budget lets a legitimate large render through; a bad setting is one line."""
    from healsweep.data._template_sandbox import budgeted, render_limits
    from healsweep.data.chat_template import ChatFormat, RenderLimits
    from healsweep.errors import ChatTemplateError, SettingError

    big = "{{ 'x' * 3000000 }}"  # 3 M characters built, then 3 M output
    with pytest.raises(ChatTemplateError, match="over 2,097,152 \\(2 MiB\\)"):
        ChatFormat(big, source="T", limits=RenderLimits(mib=2)).render([])
    assert len(ChatFormat(big, source="T", limits=RenderLimits(mib=8)).render([])) == 3000000
    os.environ["HEALSWEEP_TEMPLATE_MIB"] = "lots"
    try:
        with pytest.raises(SettingError, match="HEALSWEEP_TEMPLATE_MIB='lots' is not a positive"):
            render_limits()
    finally:
        del os.environ["HEALSWEEP_TEMPLATE_MIB"]
    with budgeted(RenderLimits()):  # the limits apply per render, nested or not
        assert ChatFormat(big, source="T", limits=RenderLimits(mib=8)).render([])


def test_a_sweep_stops_on_a_hostile_template_before_ray_starts(tmp_path, tiny_tokenizer,
                                                                record_property):  # fmt: skip
    """The render runs in every trial: the sweep renders once before any starts."""
    model = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                               chat_template=NESTED_LOOPS)  # fmt: skip
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: hostile\nmodel: {model}\nsearch_space:\n  gain_d: [0.3]\n"
                    "scoring: {max_windows: 1, max_scored: 16, max_context: 16}\n")  # fmt: skip
    run = run_cli("sweep", "run", spec, "--results", tmp_path / "results", tmp_path=tmp_path,
                  env={"HEALSWEEP_TEMPLATE_SECONDS": "1"})  # fmt: skip
    message = refused(run, record_property)
    assert message.startswith(f"{model}: tokenizer.chat_template was stopped on document ")
    assert not (tmp_path / "results" / "hostile").exists()


# --- 5. every path of a spec checked where it is loaded ----------------------------------------


def _spec(tmp_path: Path, body: str, name: str = "paths") -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\nsearch_space:\n  gain_d: [0.3]\nscoring:\n  max_windows: 1\n"
                    + body)  # fmt: skip
    return spec


@pytest.mark.parametrize("field", ["calibration.corpus", "corpus", "split"])
def test_a_spec_path_that_is_not_of_its_kind_is_refused_at_load(field, tmp_path):
    wrong = tmp_path / "notes.txt"
    wrong.write_text("these are not the documents you are looking for\n")
    body = {"calibration.corpus": f"calibration:\n  corpus: {wrong.name}\n",
            "corpus": f"corpus: {wrong.name}\n", "split": f"split: {wrong.name}\n"}[field]
    run = run_cli("sweep", "run", _spec(tmp_path, body), "--results", tmp_path / "results",
                  tmp_path=tmp_path)  # fmt: skip
    message = refused(run)
    assert message.startswith(f"{tmp_path / 'paths.yaml'}: field '{field}' = '{wrong}': ")
    assert not (tmp_path / "results").exists()


def test_a_missing_calibration_corpus_is_refused_at_load(tmp_path):
    run = run_cli("sweep", "run", _spec(tmp_path, "calibration:\n  corpus: gone.jsonl\n"),
                  "--results", tmp_path / "results", tmp_path=tmp_path)  # fmt: skip
    assert refused(run) == (
        f"{tmp_path / 'paths.yaml'}: field 'calibration.corpus' = '{tmp_path / 'gone.jsonl'}': "
        "no such file; allowed: a corpus JSONL path or 'demo'"
    )


def test_a_results_folder_that_is_a_symlink_is_refused(tmp_path):
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "thesis.tex").write_text("years of work\n")
    results = tmp_path / "results"
    results.mkdir()
    (results / "paths").symlink_to(elsewhere)
    run = run_cli("sweep", "run", _spec(tmp_path, ""), "--results", results, tmp_path=tmp_path)
    assert refused(run) == (
        f"{results / 'paths'} is a symbolic link (to {elsewhere}); a sweep writes only into a "
        "folder of its own under the results root: remove the link or give the sweep another name"
    )
    assert sorted(p.name for p in elsewhere.iterdir()) == ["thesis.tex"]
    (results / "paths").unlink()
    (results / "paths").mkdir()
    (results / "paths" / "notes.md").write_text("mine\n")
    run = run_cli("sweep", "run", _spec(tmp_path, ""), "--results", results, tmp_path=tmp_path)
    assert refused(run).startswith(f"{results / 'paths'} already exists and is not a sweep folder")
    assert sorted(p.name for p in (results / "paths").iterdir()) == ["notes.md"]


# --- 3. a split file cannot take a test document out of test ----------------------------------


def test_a_split_naming_a_test_document_as_canary_cannot_score_it(tmp_path, tiny_tokenizer):
    """It used to: canary took precedence over parity, and `score --split canary` scored test
    text with no grant."""
    from healsweep.data.corpus import load_corpus

    demo = load_corpus("demo")
    test_doc = next(d for d in demo.documents if d.pool == "eval" and d.index % 2 == 0)
    split = tmp_path / "leaky.yaml"
    sources = "".join(f"  {s}: parity\n" for s in sorted({d.source for d in demo.documents}))
    split.write_text(f"corpus: demo\nsources:\n{sources}canary: [{test_doc.doc_id}]\n")
    model = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer)
    run = run_cli("score", "--model", model, "--ref", model, "--split", "canary",
                  "--split-config", split, "--max-scored", "16", "--max-context", "16",
                  tmp_path=tmp_path)  # fmt: skip
    assert refused(run) == (
        f"the split config names {test_doc.doc_id!r} as canary, but it is a test document "
        f"(index {test_doc.index} of parity source {test_doc.source!r}); the parity rule fixes "
        "the test split, so a test document can only be burned: pick a dev-side (odd index) "
        "document as canary, or burn this one"
    )
    assert "windows" not in run.stdout
    # a sweep over that split is refused before Ray starts (confirm and export read a sweep's
    # split the same way, so none of them can hold it)
    spec = tmp_path / "leaky-sweep.yaml"
    spec.write_text(f"name: leaky\nmodel: {model}\nsplit: {split}\nsearch_space:\n"
                    "  gain_d: [0.3]\nscoring: {max_windows: 1, max_scored: 16}\n")  # fmt: skip
    run = run_cli("sweep", "run", spec, "--results", tmp_path / "results", tmp_path=tmp_path)
    assert f"names {test_doc.doc_id!r} as canary, but it is a test document" in refused(run)
    assert not (tmp_path / "results" / "leaky").exists()


# --- 4. the ledger a sweep records in (the rest: tests/test_confirm.py) ------------------------


def test_a_spec_names_its_ledger_and_the_manifest_records_its_head(tmp_path):
    """The project's specs name the tracked ledger; the path is a location, not the spec's
    identity (its hash is unchanged), and a manifest records the head relative to the sweep."""
    from healsweep.ledger import Ledger
    from healsweep.sweep.manifest import ledger_head, recorded_ledger, spec_hash, sweep_ledger
    from healsweep.sweep.spec_files import load_spec

    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "sweeps" / "demo-ablation.yaml")
    assert Path(spec.ledger) == root / "ledger" / "ledger.jsonl"
    assert spec_hash(spec) == spec_hash(spec.model_copy(update={"ledger": None}))
    own = tmp_path / "kept" / "ledger.jsonl"
    own.parent.mkdir()
    Ledger(own).open_milestone("a" * 64, "m0", ["c" * 64], ["t"], user="tester")
    sweep_dir = tmp_path / "results" / "s"
    sweep_dir.mkdir(parents=True)
    ledger = sweep_ledger(spec.model_copy(update={"ledger": str(own)}), sweep_dir)
    head = ledger_head(ledger, sweep_dir, "run")
    assert (head["path"], head["entries"]) == ("../../kept/ledger.jsonl", 1)
    assert recorded_ledger(sweep_dir, {"ledger_heads": [head]}).path == own
    assert sweep_ledger(spec.model_copy(update={"ledger": None}), sweep_dir).path == (
        tmp_path / "results" / "ledger.jsonl")  # fmt: skip
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nledger: nowhere/ledger.jsonl\n")
    run = run_cli("sweep", "run", bad, "--results", tmp_path / "results", tmp_path=tmp_path)
    assert refused(run).startswith(f"{bad}: field 'ledger' = '{tmp_path / 'nowhere'}")


# --- 6. no orphans after a driver crash --------------------------------------------------------

EMBEDDED_DRIVER = """
import os, sys, time, logging, ray
ray.init(num_cpus=1, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
@ray.remote
def pid():
    return os.getpid()
print(ray.get(pid.remote()), ray._private.worker.global_worker.node.get_session_dir_path(),
      flush=True)
time.sleep(600)
"""


def _session_processes(session: Path) -> list[int]:
    import psutil

    text = str(session.resolve())
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if text in " ".join(proc.info["cmdline"] or ()) or any(
                f.path.startswith(text) for f in proc.open_files()
            ):
                found.append(proc.info["pid"])
        except psutil.Error:
            continue
    return found


def _running(pids) -> list[int]:
    """Those of ``pids`` that still run (not gone, not a zombie)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_ray_processes_a_killed_driver_left_are_found_and_stopped(tmp_path):
    """A real embedded Ray, its driver SIGKILLed: the dashboard and runtime-env agents outlive
    it (and ignore SIGTERM). `cluster status` names them, `sweep resume` stops those of the
    sessions its manifest recorded, `--stop-orphans` every dead session's. Ray's folder is
    private to the test (RAY_TMPDIR), so nothing else is touched."""
    import shutil
    import tempfile

    import psutil

    from healsweep import ray_orphans

    temp = Path(tempfile.mkdtemp(prefix="hsray", dir="/tmp"))  # Ray's socket paths stay short
    env = {"RAY_TMPDIR": str(temp), "RAY_ADDRESS": ""}
    driver = subprocess.Popen([sys.executable, "-c", EMBEDDED_DRIVER], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, **env})  # fmt: skip
    try:
        worker, session = driver.stdout.readline().split()
        session = Path(session)
        assert session.parent == temp / "ray"
        assert ray_orphans.find(temp / "ray") == []  # its driver runs: nothing is an orphan
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the GCS and raylet share the driver's fate
            names = [psutil.Process(p).name() for p in _session_processes(session)
                     if psutil.pid_exists(p)]  # fmt: skip
            if not {"gcs_server", "raylet"} & set(names):
                break
            time.sleep(0.2)
        left = _session_processes(session)
        assert left, "nothing outlived the driver (Ray changed?)"
        status = run_cli("cluster", "status", tmp_path=tmp_path, env=env)
        assert status.code == 1 and "no Ray cluster is running here" in status.stderr
        [line] = [x for x in status.stdout.splitlines() if x.startswith("left running: ")]
        assert f"of {session.name}, whose driver (pid {driver.pid}) is gone" in line
        assert "ray::DashboardAgent" in line and "stop them with `healsweep cluster status " \
            "--stop-orphans`" in line  # fmt: skip
        # what still runs once status has looked (a worker may still be exiting when `left` is
        # taken) must all be named
        alive = set(_running(left))
        named = {int(p) for p in re.findall(r"\b(\d+)\b", line.split("kill -9")[1])}
        assert alive and alive <= named
        # `sweep resume` stops those of the sessions its manifest recorded before it starts Ray
        # again (here a sweep folder whose run recorded this session, and no spec to resume)
        sweep_dir = tmp_path / "results" / "killed"
        sweep_dir.mkdir(parents=True)
        run = {"kind": "run", "host": platform.node(), "ray_session": str(session)}
        (sweep_dir / "manifest.json").write_text(json.dumps({"sweep": "killed", "runs": [run]}))
        resume = run_cli("sweep", "resume", sweep_dir, tmp_path=tmp_path, env=env)
        assert resume.stderr.startswith("stopped ") and "ray::RuntimeEnvAgent" in resume.stderr
        assert resume.stderr.splitlines()[1].startswith("error: ")  # then: no spec.json
        assert _running(_session_processes(session)) == []
        again = run_cli("cluster", "status", "--stop-orphans", tmp_path=tmp_path, env=env)
        assert again.code == 0 and again.stdout == "no Ray cluster is running here\n"
    finally:
        if driver.poll() is None:
            driver.kill()
        ray_orphans.stop(ray_orphans.find(temp / "ray"))
        shutil.rmtree(temp, ignore_errors=True)


def test_a_calibration_corpus_holding_test_text_is_refused_before_ray_starts(tmp_path):
    """A calibration corpus of its own (calibration.corpus) that copies a test document."""
    from healsweep.data.corpus import Document, load_corpus, write_corpus

    demo = load_corpus("demo")
    test_doc = next(d for d in demo.documents if d.pool == "eval" and d.index % 2 == 0)
    calib = [d for d in demo.documents if d.pool == "calibration"][:3]
    copied = Document("copied", "cal-copy", 0, "cal", messages=test_doc.messages,
                      text=test_doc.text, pool="calibration")  # fmt: skip
    write_corpus([*calib, copied], tmp_path / "calib.jsonl")
    spec = _spec(tmp_path, "calibration:\n  corpus: calib.jsonl\n")
    run = run_cli("sweep", "run", spec, "--results", tmp_path / "results", tmp_path=tmp_path)
    assert refused(run) == (
        f"calibration document 'copied' ({tmp_path / 'calib.jsonl'}) has the same text as test "
        f"document {test_doc.doc_id!r} (demo); calibrating on test text would tune on the test "
        "split: remove it from the calibration corpus or exclude it "
        "(calibration.exclude_doc_ids)"
    )
