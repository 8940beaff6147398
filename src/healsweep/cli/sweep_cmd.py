"""`healsweep sweep` commands."""

from __future__ import annotations

from healsweep.cli._apps import sweep_app  # noqa: F401
