"""`healsweep split` commands."""

from __future__ import annotations

from healsweep.cli._apps import split_app  # noqa: F401
