"""`healsweep cluster` commands."""

from __future__ import annotations

from healsweep.cli._apps import cluster_app  # noqa: F401
