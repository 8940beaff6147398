"""`healsweep quant` commands."""

from __future__ import annotations

from healsweep.cli._apps import bench_app  # noqa: F401
