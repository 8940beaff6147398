"""Command-line interface: ``healsweep`` (console script) and ``python cli.py``.

Library errors (:class:`healsweep.errors.HealsweepError`) become one line on stderr and exit
code 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import sys

from healsweep._malloc import cap_arenas
from healsweep.cli._apps import app
from healsweep.errors import HealsweepError

# Each module decorates its commands onto the groups of ``_apps``.
_COMMAND_MODULES = [
    "healsweep.cli.model_cmd",
    "healsweep.cli.quant_cmd",
    "healsweep.cli.corpus_cmd",
    "healsweep.cli.demo_cmd",
    "healsweep.cli.split_cmd",
    "healsweep.cli.ledger_cmd",
    "healsweep.cli.score_cmd",
    "healsweep.cli.heal_cmd",
    "healsweep.cli.export_cmd",
    "healsweep.cli.baseline_cmd",
    "healsweep.cli.bench_cmd",
    "healsweep.cli.sweep_cmd",
    "healsweep.cli.sensitivity_cmd",
    "healsweep.cli.report_cmd",
    "healsweep.cli.confirm_cmd",
    "healsweep.cli.cluster_cmd",
]


def _register() -> None:
    for name in _COMMAND_MODULES:
        importlib.import_module(name)


MESSAGE_LIMIT = 3000  # characters of an error line; the library quotes inputs far shorter


def _one_line(message: str) -> str:
    """The error line, of bounded length: a message that still grew with its input (a value
    quoted whole somewhere) keeps its start and its closing advice."""
    if len(message) <= MESSAGE_LIMIT:
        return message
    cut = len(message) - MESSAGE_LIMIT
    return f"{message[:2000]} [... {cut:,} characters cut ...] {message[-1000:]}"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script; never shows a traceback unless ``--debug``."""

    cap_arenas()  # before any thread starts (see healsweep._malloc)
    _register()
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        # typer handles its own usage errors (exit code 2) and --help in standalone mode.
        app(args=args, prog_name="healsweep", standalone_mode=True)
    except HealsweepError as exc:
        if debug:
            raise
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


__all__ = ["app", "main"]
