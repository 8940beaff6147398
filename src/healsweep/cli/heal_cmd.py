"""`healsweep heal` commands."""

from __future__ import annotations

from healsweep.cli._apps import heal_app  # noqa: F401
