"""`healsweep corpus` commands."""

from __future__ import annotations

from healsweep.cli._apps import corpus_app  # noqa: F401
