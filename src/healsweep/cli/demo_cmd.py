"""`healsweep demo` commands."""

from __future__ import annotations

from healsweep.cli._apps import demo_app  # noqa: F401
