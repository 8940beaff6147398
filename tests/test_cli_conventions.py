"""The command line's conventions: ``--version``, boolean options that are plain switches, help
text on every option, ``--json`` on ``sweep status`` and ``report`` (``sweep run --json --quiet``
is run for real in test_confirm's sweep), and a progress line from the first second that shows
no ETA before a trial has finished. Commands run as a user runs them, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import typer.core
import typer.main

from healsweep.cli import _register, app
from healsweep.sweep.progress import Phase, Progress
from test_results_report import CONFIGS, N, _folder

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _commands(command, path: str = "healsweep"):
    yield path, command
    if isinstance(command, typer.core.TyperGroup):
        for name, sub in command.commands.items():
            yield from _commands(sub, f"{path} {name}")


def test_version():
    run = _cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"healsweep {version('healsweep')}"


def test_every_option_has_help_and_every_boolean_is_a_plain_switch():
    _register()  # every command module decorates its commands onto the app
    root = typer.main.get_command(app)
    seen = 0
    for path, command in _commands(root):
        for param in command.params:
            if not isinstance(param, typer.core.TyperOption) or param.name == "help":
                continue
            seen += 1
            assert param.help and param.help.strip(), f"{path} {param.opts[0]} has no help text"
            if param.bare_type() is bool or param.is_flag:
                assert param.is_flag, f"{path} {param.opts[0]} takes a value: make it a switch"
                assert all(o.startswith("--no-") for o in param.secondary_opts), (path, param.opts)
    assert seen > 50  # the walk reached the subcommands
    shown = _cli("sweep", "run", "--help").stdout
    assert "--quiet " in shown and "<bool>" not in shown and "--json " in shown
    bad = _cli("sweep", "status", "somewhere", "--json", "true")  # a switch takes no value
    assert bad.returncode != 0


def test_status_and_report_as_json(tmp_path):
    folder = _folder(tmp_path)
    status = _cli("sweep", "status", str(folder), "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["trials"] == {"completed": 4, "pruned": 1} and info["driver"] is None
    assert info["progress"]["best_trial"] == "better" and info["progress"]["eta_s"] is None
    scored = 4 * N + 8 + 3 * N  # 4 complete trials, one pruned after 8, 3 fixed rows
    assert info["windows"] == {"scored": scored, "recorded": scored, "replayed": 0}
    assert info["fixed"]["q2k"]["trial_id"] == "ext-q2k"
    report = _cli("report", str(folder), "--json", "--n-boot", "200")
    assert report.returncode == 0, report.stderr
    out = json.loads(report.stdout)  # nothing but the object on stdout
    assert out["counts"]["windows"]["scored"] == scored  # the same count as status
    assert {row["trial"] for row in out["leaderboard"]} >= set(CONFIGS)
    text = _cli("sweep", "status", str(folder)).stdout
    assert f"windows scored: {scored}" in text and "q2k (ext-q2k)" in text


def _row(trial_id, role, status, kld=None, scored=0, total=8, label=None):
    return {"trial_id": trial_id, "role": role, "is_baseline": role == "baseline",
            "status": status, "kld_mean": kld, "config_hash": f"h-{trial_id}", "label": label,
            "windows_scored": scored, "windows_total": total}  # fmt: skip


def test_progress_shows_the_reference_rows_and_no_eta_before_a_trial_has_finished():
    building = Progress(planned=0, phase=Phase.EXTERNALS, note="building llama.cpp's iq2_xxs file",
                        elapsed_s=3)  # fmt: skip
    assert building.line() == "building llama.cpp's iq2_xxs file | elapsed 0m03s"
    fixed = [_row("ref-unhealed", "reference", "running", label="unhealed"),
             _row("ext-llama", "external", "completed", 0.2, 8, label="llama")]  # fmt: skip
    line = Progress.of(fixed, 4, 8, 2.0, phase=Phase.FIXED).line()
    assert line.startswith("reference and external rows 1/2 done (running: unhealed)")
    assert "windows scored 8" in line and "elapsed 0m02s" in line
    # trials running, none finished: the rate is the cold start's, so no ETA yet
    rows = [*fixed, _row("base", "baseline", "running", None, 4), _row("t1", "trial", "running")]
    early = Progress.of(rows, 4, 12, 19.0, scored_now=4)
    assert early.eta_s != early.eta_s and "ETA after the first trial" in early.line()
    rows[2] = _row("base", "baseline", "completed", 0.3, 8)
    later = Progress.of(rows, 4, 16, 60.0, scored_now=8)
    # left: t1's 8 windows and 2 trials not started (16), at 8 windows a minute
    assert later.eta_s == 24 * 60.0 / 8 and "ETA 3m00s" in later.line()
    assert "ETA" not in Progress.of(rows, 4, 16, 60.0, final=True).line()


def test_progress_in_a_log_is_one_plain_line_per_change(capsys):
    """Not on a terminal (a log, CI): a line per change, no cursor codes, nothing repeated."""
    from healsweep.cli.sweep_cmd import _Printer

    printer = _Printer()
    assert not printer.tty
    fixed = [_row("ref-unhealed", "reference", "running", label="unhealed")]
    first = Progress(planned=0, phase=Phase.EXTERNALS, note="building llama.cpp's iq2_xs file")
    for progress in (first, first, Progress.of(fixed, 2, 0, 1.0, phase=Phase.FIXED)):
        printer(progress)
    printer.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "\033" not in "".join(lines) and "\r" not in "".join(lines)
    assert lines[0].startswith("building llama.cpp's iq2_xs file | elapsed ")
    assert lines[1].startswith("reference and external rows 0/1 done (running: unhealed)")
