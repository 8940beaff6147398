"""The state a healsweep process keeps between calls, in one object: :class:`Runtime`.

A trial reads what the trial before it in the same process read (stage-cache entries kept in
memory, layers kept on the device), writes cache entries behind on a thread, hashes on threads,
and counts what its caches did. All of that lives in one :class:`Runtime`, never in module
globals, so a test or a tool can make a fresh one, and closing it shuts its threads down:

- thread pools by name (:meth:`Runtime.executor`: the cache writer and hashers, the ridge
  held-out solves), made at first use and shut down by :meth:`Runtime.close`;
- one instance per class of the stores a module defines (:meth:`Runtime.owned`: the
  stage-cache entries kept in memory, ``cache.RecentEntries``, and the layers kept on the device,
  ``model.resident.ResidentLayers``; their budgets are read as before, at each insertion);
- the per-stage cache counters (:attr:`Runtime.activity`), the per-entry locks among threads
  (:meth:`Runtime.entry_lock`), values computed once (:meth:`Runtime.memo`: file fingerprints,
  the GPUs the JAX backend started with), notices given once (:meth:`Runtime.first_time`), and
  the progress sinks of running sweeps (:attr:`Runtime.progress_sinks`).

Who makes one: every CLI command gets a fresh runtime, installed by the root callback for the
command and closed when it ends (``cli/_apps.py``). Library calls find it through
:func:`current` instead of taking it as a parameter: the stages, the forward and the cache are
reached through many layers (a cache lookup inside a stage inside a trial inside a Ray task), and
a runtime argument on each of them would say nothing a reader needs. A process with none
installed (a Ray worker, a script, a test) gets its own at its first :func:`current`, kept for
the process's life, so a worker that runs trial after trial keeps its warm state, as before. A
test that needs isolation installs its own: ``with Runtime() as rt, use(rt): ...``.

The module holds one slot, the process's current runtime (``_SLOT``), and nothing else mutable.
A runtime never crosses a process: pickling one is refused, and a forked child forgets its
parent's (whose threads did not come along) and makes its own.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from healsweep.errors import HealsweepError

T = TypeVar("T")
V = TypeVar("V")
ProgressSink = Callable[[Any], None]  # sweep.progress.ProgressSink: called with a Progress


class RuntimeClosedError(HealsweepError):
    """A closed :class:`Runtime` was used."""


class Activity:
    """What the stage caches of one runtime did, per stage: entries served (``hits``),
    ``computed``, hits that first ``waited`` for another process computing them, the bytes of
    entry files written and read (``bytes_written``, ``bytes_read``: reads from disk, not
    from memory), and the entries an eviction deleted (``evicted``, ``bytes_evicted``)."""

    KINDS = ("hits", "computed", "waited", "bytes_written", "bytes_read", "evicted",
             "bytes_evicted")  # fmt: skip

    def __init__(self) -> None:
        self._counts: dict[str, Counter[str]] = {kind: Counter() for kind in self.KINDS}
        self._lock = threading.Lock()

    def add(self, kind: str, stage: str, n: int) -> None:
        """Count ``n`` more ``kind`` events of ``stage``."""
        with self._lock:
            self._counts[kind][stage] += n

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{kind: {stage: count}}`` now."""
        with self._lock:
            return {kind: dict(counts) for kind, counts in self._counts.items()}


class Runtime:
    """Executors, in-memory stores and counters of one process's work; see the module docstring.

    Usable as a context manager, which closes it on leaving. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._executors: dict[str, tuple[ThreadPoolExecutor, int]] = {}  # name -> (pool, threads)
        self._owned: dict[type, Any] = {}
        self._memo: dict[Hashable, Any] = {}
        self._told: set[Hashable] = set()
        self._entry_locks: dict[str, threading.Lock] = {}
        self._activity = Activity()
        self._sinks: dict[str, ProgressSink] = {}

    def _open(self) -> None:
        if self._closed:
            raise RuntimeClosedError(
                "this healsweep Runtime was closed; make a new one (and install it with "
                "healsweep.runtime.use) instead of using it after close()"
            )

    def executor(self, name: str, max_workers: int) -> ThreadPoolExecutor:
        """The runtime's thread pool ``name`` (its threads are named after it), made with
        ``max_workers`` threads at the first call."""
        with self._lock:
            self._open()
            if name not in self._executors:
                pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
                self._executors[name] = (pool, max_workers)
            pool, threads = self._executors[name]
        if threads != max_workers:
            raise ValueError(
                f"Runtime.executor: pool {name!r} has {threads} threads, asked for {max_workers}"
            )
        return pool

    def owned(self, kind: type[T]) -> T:
        """The runtime's one instance of ``kind`` (made by ``kind()`` at the first call): the
        stores that modules above this one define, such as the LRUs of recent cache entries
        and of resident layers. :meth:`close` calls their ``clear()``."""
        with self._lock:
            self._open()
            found = self._owned.get(kind)
            if found is None:
                found = self._owned[kind] = kind()
            return found

    def memo(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value of ``key``, computed by ``compute()`` at the first call and kept (two
        threads may both compute it; the first to finish is kept)."""
        with self._lock:
            self._open()
            if key in self._memo:
                return self._memo[key]
        value = compute()
        with self._lock:
            return self._memo.setdefault(key, value)

    def first_time(self, tag: Hashable) -> bool:
        """True at the first call with ``tag``, False after: for notices given once."""
        with self._lock:
            self._open()
            if tag in self._told:
                return False
            self._told.add(tag)
            return True

    def entry_lock(self, path: str) -> threading.Lock:
        """The lock among this runtime's threads of the cache entry at ``path``."""
        with self._lock:
            self._open()
            return self._entry_locks.setdefault(path, threading.Lock())

    @property
    def activity(self) -> Activity:
        """The per-stage counters of the stage caches used under this runtime."""
        self._open()
        return self._activity

    @property
    def progress_sinks(self) -> dict[str, ProgressSink]:
        """Progress sinks by resolved sweep folder (:mod:`healsweep.sweep.progress`)."""
        self._open()
        return self._sinks

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Wait for the pools' work and shut them down, drop what the stores keep; any later
        use raises :class:`RuntimeClosedError`. Closing twice is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pools = [pool for pool, _ in self._executors.values()]
            self._executors = {}
            stores, self._owned = list(self._owned.values()), {}
            self._memo.clear()
            self._entry_locks.clear()
        for pool in pools:
            pool.shutdown(wait=True)
        for store in stores:
            clear = getattr(store, "clear", None)
            if clear is not None:
                clear()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a healsweep Runtime belongs to the process that made it (threads, device "
            "buffers); another process uses its own, from healsweep.runtime.current()"
        )


class _Slot:
    """The one mutable thing at module level: this process's current runtime."""

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.lock = threading.Lock()

    def forget(self) -> None:
        """In a forked child: the parent's runtime (its threads stayed behind) is not ours."""
        self.runtime = None
        self.lock = threading.Lock()


_SLOT = _Slot()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SLOT.forget)


def current() -> Runtime:
    """This process's runtime: the one installed (:func:`use`), else a new one, installed now
    and kept for the process's life."""
    found = _SLOT.runtime
    if found is not None:
        return found
    with _SLOT.lock:
        if _SLOT.runtime is None:
            _SLOT.runtime = Runtime()
        return _SLOT.runtime


@contextmanager
def use(rt: Runtime) -> Iterator[Runtime]:
    """Install ``rt`` as this process's runtime for the block, then put back the one before.
    ``rt`` stays open: its owner closes it (``with Runtime() as rt, use(rt):``)."""
    previous = install(rt)
    try:
        yield rt
    finally:
        install(previous)


def install(rt: Runtime | None) -> Runtime | None:
    """Make ``rt`` this process's runtime (None: none until the next :func:`current`); return
    the one it replaces. Prefer :func:`use`, which puts the previous one back."""
    with _SLOT.lock:
        previous, _SLOT.runtime = _SLOT.runtime, rt
    return previous


__all__ = ["Activity", "Runtime", "RuntimeClosedError", "current", "install", "use"]
