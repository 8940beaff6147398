"""`healsweep ledger` commands."""

from __future__ import annotations

from healsweep.cli._apps import ledger_app  # noqa: F401
