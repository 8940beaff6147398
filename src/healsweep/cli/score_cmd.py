"""`healsweep score` commands."""

from __future__ import annotations

from healsweep.cli._apps import score_app  # noqa: F401
