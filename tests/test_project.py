"""Project wiring: the README's test command is what CI runs, and the CLI entry points agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from _cli import run_cli

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", quickstart, flags=re.S)
    commands = []
    for block in blocks[:2]:
        lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
        assert len(lines) == 1, f"a Quickstart command must be one line, got {lines}"
        commands.append(lines[0].strip())
    return commands


def test_readme_has_two_quickstart_commands_and_ci_runs_the_second_verbatim():
    commands = _readme_commands()
    assert len(commands) == 2
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands[1] in ci_lines


def test_cli_py_and_console_script_show_the_same_help():
    top = subprocess.run([sys.executable, str(ROOT / "cli.py"), "--help"], capture_output=True, text=True)
    mod = run_cli("--help", timeout=None)
    assert top.returncode == 0 and mod.returncode == 0, top.stderr + mod.stderr
    for group in ("model", "sweep", "ledger", "bench"):
        assert group in top.stdout and group in mod.stdout


def test_unknown_command_is_a_usage_error_without_traceback():
    run = subprocess.run([sys.executable, str(ROOT / "cli.py"), "no-such-command"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
