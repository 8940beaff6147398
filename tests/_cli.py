"""The real CLI in a subprocess: the one runner of ``python -m healsweep`` for every test file.

:func:`run_cli` runs it to completion with its output captured as text; ``cache`` points
``HEALSWEEP_CACHE`` at a private stage cache (a test never shares the user's); ``env`` replaces
the environment (``cli_env`` builds one); any other keyword goes to :func:`subprocess.run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HEALSWEEP = (sys.executable, "-m", "healsweep")


def cli_env(cache: Path | str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment, with ``HEALSWEEP_CACHE`` at ``cache`` and ``extra`` set."""
    env = dict(os.environ)
    if cache is not None:
        env["HEALSWEEP_CACHE"] = str(cache)
    return {**env, **extra}


def run_cli(
    *args: object,
    cache: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``python -m healsweep ARGS`` to completion (stdout and stderr captured as text)."""
    if cache is not None:
        env = {**(env if env is not None else os.environ), "HEALSWEEP_CACHE": str(cache)}
    return subprocess.run(
        [*HEALSWEEP, *map(str, args)],
        capture_output=True, text=True, env=env, timeout=timeout, **kwargs,
    )  # fmt: skip
