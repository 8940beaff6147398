"""`healsweep heal` commands."""

from __future__ import annotations

from healsweep.cli._apps import app  # noqa: F401
