"""The driver-side book of finished windows, shared by every trial of one sweep run.

Trials record each window they finish (``add``) and a trial that starts or restarts asks for
the windows its config already has (``done``), so a trial retried on another machine, which
cannot read a checkpoint left on the first machine's disk, still scores no window twice. The
book lives as a small Ray actor on the head node and dies with the driver; a resumed sweep
fills a new book from the Parquet rows before any trial starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

from healsweep.score.record import WindowRecord


@ray.remote(num_cpus=0, max_restarts=0)
class WindowBook:
    """``{config_hash: {window_id: WindowRecord}}`` behind two remote methods."""

    def __init__(self, prior: Mapping[str, Mapping[str, WindowRecord]]) -> None:
        self._done = {chash: dict(windows) for chash, windows in prior.items()}

    def add(self, chash: str, record: WindowRecord) -> None:
        """Record one finished window of config ``chash``."""
        self._done.setdefault(chash, {})[record.window_id] = record

    def done(self, chash: str) -> dict[str, WindowRecord]:
        """Every finished window of config ``chash`` (by window id)."""
        return self._done.get(chash, {})


# Ray gives the head node this resource; Ray Train pins its own state actor the same way.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def open_book(prior: Mapping[str, Mapping[str, WindowRecord]]) -> Any:
    """Start the book on the head node with the windows finished so far.

    Not on "the driver's node": a driver on a machine that hosts several nodes (or a worker)
    may be attached to a worker node, and a book there dies with that worker, failing every
    retry of the trials it was meant to rescue. The cluster cannot outlive its head anyway.
    """
    return WindowBook.options(resources={HEAD_NODE_RESOURCE: 0.001}).remote(dict(prior))


__all__ = ["WindowBook", "open_book"]
