"""Content-keyed, checksummed, atomically written cache of pipeline stages.

A stage's output is stored under ``sha256(canonical JSON of (stage, version, inputs))``; the inputs
are the model fingerprint, the keys of upstream artifacts and exactly the knobs the stage reads.
An entry is one file: a magic line, the sha256 of a JSON header, the header's length and the
header (the metadata record, each array's dtype, shape and offset, and the sha256 of every piece of
at most ``PIECE`` bytes of its data), then the arrays' raw bytes, each at a 64-byte-aligned offset.
It is written to a temp file and renamed into place, so a reader sees a whole entry or none; a
truncated or corrupt entry fails a checksum, is deleted and recomputed, never used.

Reading maps the file (read-only; a file under a MiB is read instead) and checks the pieces on
several threads; the arrays are read-only views of that mapping, so a hit costs one parallel
pass of sha256 over pages the OS keeps in its page cache, and no memory of the process's own:
a streamed trial reads each layer's entries back when it scores, and what it holds stays one
layer's, however deep the model (a quantized layer of a real-size model is hundreds of MB). An entry is never changed in
place (written to a temp file and renamed, deleted by unlink, which leaves a mapping whole), so
the bytes a mapping serves stay the ones that were checked. Entries read or written lately stay
mapped, least recently used first out, up to ``HEALSWEEP_RECENT_GB`` of mapped bytes (default:
an eighth of the machine's memory; a deleted entry's disk space is freed when its mapping
goes), keyed by the file's path, inode, size and mtime: a sweep worker runs trial after trial in
one process, and a trial that changes only ``rho`` or ``eta`` reads what the one before it read,
without checking it again. A file rewritten or damaged since is read again (and checked), never
served from memory.

An entry is computed once per cache root, however many processes share it (the trials of a
multi-GPU host, or every worker of a pool whose root is on shared storage): a process that misses
takes the entry's lock file (a POSIX record lock, ``<key>.hsc.lock`` beside the entry) before it
computes, and a second process that misses the same entry meanwhile waits on that lock, then
finds the entry written. The kernel drops a dead process's lock, so none goes stale; the lock is
released only once the entry is on disk (after a write behind, too). Two processes writing one
entry without the lock (``put``) still leave one whole entry: each writes its own temp file and
renames it into place.

A cache root may have a size limit (``--cache-max-gb``, the sweep spec's ``cache_max_gb``,
``HEALSWEEP_CACHE_MAX_GB``): after a write that takes its entries over it, the entries that no
running trial holds and that are cheapest to redo for the room they take are deleted
(:mod:`healsweep._cache_disk`): each entry's header records its recompute seconds, the wall time
its ``compute`` took less the time of the entries computed inside it (:func:`recompute_seconds`
states it for work shared by several entries). Inside
:meth:`StageCache.holding` every entry a cache reads or writes is held, across processes, until
the block ends; every read marks its entry used. The bytes of entry files written and read are
counted per stage beside the hits (:func:`activity`, :func:`stage_bytes`).
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from healsweep import _cache_disk as disk
from healsweep._atomic import atomic_file
from healsweep._cache_disk import LIMIT_ENV as LIMIT_ENV
from healsweep._cache_disk import cache_limit as cache_limit
from healsweep._cache_disk import parse_gb as parse_gb
from healsweep._lru import BoundedLRU, gib_setting
from healsweep.errors import CacheError
from healsweep.profile import active as active_profile
from healsweep.runtime import current

_MAGIC = b"HEALSWEEP-CACHE-2\n"
_DIGEST_BYTES = 32
_HEAD = len(_MAGIC) + _DIGEST_BYTES + 8  # magic, sha256 of the header, header length (u64 LE)
_ALIGN = 64
PIECE = 32 << 20  # bytes of array data per checksum (pieces are checked in parallel)
# Entries of at least this many bytes are mapped, smaller ones read: a worker may keep many
# thousands of small entries (teacher records), and each mapping counts against the kernel's
# limit on a process's mappings (vm.max_map_count, 65,530 by default).
MAP_MIN_BYTES = 1 << 20
log = logging.getLogger(__name__)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace; floats in repr form so keys are stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot put {type(obj).__name__} into a cache key")


def content_key(stage: str, version: int, inputs: Mapping[str, Any]) -> str:
    """The content key of a stage: sha256 over (stage, version, inputs) as canonical JSON."""
    payload = canonical_json({"stage": stage, "version": version, "inputs": dict(inputs)})
    return hashlib.sha256(payload.encode()).hexdigest()


def default_cache_dir() -> Path:
    """``$HEALSWEEP_CACHE`` or ``~/.cache/healsweep``."""
    env = os.environ.get("HEALSWEEP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "healsweep"


_RECENT_ENV = "HEALSWEEP_RECENT_GB"


def recent_budget() -> int:
    """Bytes of stage-cache entries kept in memory: ``HEALSWEEP_RECENT_GB``, else an eighth of
    the machine's memory."""
    configured = gib_setting(_RECENT_ENV, "stage-cache entries to keep in memory")
    if configured is not None:
        return configured
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):  # no sysconf: keep nothing
        return 0


class RecentEntries(BoundedLRU):
    """Entries read or written lately, ``(arrays, meta, file bytes)`` by the file's identity,
    up to :func:`recent_budget` bytes: the runtime's (:meth:`healsweep.runtime.Runtime.owned`)."""

    def __init__(self) -> None:
        super().__init__(recent_budget, lambda entry: entry[2])


def _recent() -> RecentEntries:
    return current().owned(RecentEntries)


def forget_recent() -> None:
    """Let go of the entries kept mapped since they were read or written (their file pages
    leave this process's resident set once nothing else holds their arrays). For work that
    moves on to other entries: ``confirm`` scores a built student, which reads its layers'
    entries back, and never again the calibration trace its build mapped (104 MiB of the demo's
    1 GB, issue 47)."""
    _recent().clear()


def _writer() -> ThreadPoolExecutor:
    """The thread that writes entries behind (:meth:`StageCache.writing_behind`)."""
    return current().executor("cache-write", 1)


class _Frames(threading.local):
    """Per thread, the computes of ``get_or_compute`` running, innermost last (the runtime owns
    the one instance: :meth:`~healsweep.runtime.Runtime.owned`)."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []

    def clear(self) -> None:
        self.stack = []


class _Frame:
    """One running ``compute``: when it began, the wall seconds of the computes nested in it,
    and the recompute seconds it stated (:func:`recompute_seconds`), if any."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.nested = 0.0
        self.stated: float | None = None

    def own(self) -> float:
        return max(0.0, time.perf_counter() - self.start - self.nested)


@contextmanager
def _computing() -> Iterator[_Frame]:
    stack = current().owned(_Frames).stack
    frame = _Frame()
    stack.append(frame)
    try:
        yield frame
    finally:
        stack.pop()
        if stack:  # the enclosing compute did not spend this time itself
            stack[-1].nested += time.perf_counter() - frame.start


def recompute_seconds(seconds: float) -> None:
    """Inside a ``compute`` of :meth:`StageCache.get_or_compute`: what recomputing this entry
    costs, in wall seconds, in place of the compute's measured own time (work done once for
    several entries, such as the teacher's forward over a batch of windows, is shared out).
    Outside a compute, nothing."""
    stack = current().owned(_Frames).stack
    if stack:
        stack[-1].stated = float(seconds)


def _hashers() -> ThreadPoolExecutor:
    """The threads that checksum an entry's pieces."""
    return current().executor("cache-sha", min(8, os.cpu_count() or 1))


class _Tally(Counter):
    """A cache's own per-stage counter whose every change also counts in the runtime's
    :func:`activity` (so a caller that never sees the cache, e.g. a sweep task around a trial's
    work, can tell what the trial's caches did)."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        super().__init__()

    def __setitem__(self, stage: str, value: int) -> None:
        current().activity.add(self._kind, stage, value - self.get(stage, 0))
        super().__setitem__(stage, value)

    def __reduce__(self) -> tuple:  # a copy elsewhere is a plain Counter, counting nothing here
        return Counter, (dict(self),)


def activity() -> dict[str, dict[str, int]]:
    """Per kind, then per stage, what every :class:`StageCache` has done so far under this
    process's runtime (:func:`healsweep.runtime.current`): ``hits``, ``computed``, ``waited``
    (hits that waited for another process computing the entry), ``bytes_written`` and
    ``bytes_read`` (entry files written, and read from disk: a hit served from memory reads
    none), ``evicted`` and ``bytes_evicted`` (entries this process's evictions deleted, of
    whatever stage). The difference of two snapshots (:func:`activity_since`) is what happened
    in between."""
    return current().activity.snapshot()


def disk_entries(root: str | os.PathLike) -> list[disk.Entry]:
    """Every entry file under a cache root (``<stage>/<xx>/<key>.hsc``; JAX's compilation cache
    and lock files left out): when it was last used, its size and its path under the root."""
    return disk.entries(Path(root))


def stage_bytes(detail: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, dict[str, int]]:
    """``{stage: {"written": bytes, "read": bytes}}`` of an :func:`activity` snapshot or an
    :func:`activity_since` difference (default: :func:`activity` now), stages with neither left
    out. Bytes are the entry files' sizes on disk, counted when a write has finished (a write
    behind counts when its thread finishes it: call :meth:`StageCache.flush` before a snapshot
    that must include it) and when an entry is read from disk."""
    detail = activity() if detail is None else detail
    written, read = detail.get("bytes_written", {}), detail.get("bytes_read", {})
    return {
        stage: {"written": int(written.get(stage, 0)), "read": int(read.get(stage, 0))}
        for stage in sorted(set(written) | set(read))
        if written.get(stage, 0) or read.get(stage, 0)
    }


def activity_since(before: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """:func:`activity` less the snapshot ``before`` (stages with no change left out)."""
    now = activity()
    out = {}
    for name, counts in now.items():
        was = before.get(name, {})
        out[name] = {s: n - was.get(s, 0) for s, n in counts.items() if n != was.get(s, 0)}
    return out


# Errors of a file system that cannot lock (NFS without its lock service, some FUSE mounts).
_NO_LOCKING = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})


class _EntryLock:
    """The right to compute one entry: a lock among this process's threads, then an exclusive
    POSIX record lock on the entry's lock file among processes (``lockf``: also across the hosts
    of a network file system with lock support). Released by :meth:`release`, from any thread."""

    def __init__(self, entry: Path) -> None:
        self.path = entry.with_name(entry.name + ".lock")
        self._thread = current().entry_lock(str(entry))  # among this process's threads
        self._fd: int | None = None

    def acquire(self, root: Path) -> bool:
        """Block until held; True when another holder made this call wait."""
        waited = not self._thread.acquire(blocking=False)
        if waited:
            self._thread.acquire()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            self._thread.release()
            raise CacheError(
                f"cannot write cache entry under {root}: {exc.strerror or exc}; free disk "
                "space or point HEALSWEEP_CACHE at a writable directory"
            ) from exc
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except (BlockingIOError, PermissionError):  # held by another process: wait for it
                waited = True
                fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKING:
                self._thread.release()
                raise CacheError(f"cannot lock cache entry {self.path}: {exc}") from exc
            if current().first_time(("unlocked cache root", str(root))):
                log.warning(
                    "the file system of %s cannot lock files (%s): processes sharing "
                    "it may compute one entry twice",
                    root,
                    exc.strerror,
                )
            return waited
        self._fd = fd
        return waited

    def release(self) -> None:
        """Let the next process (or thread) waiting for this entry go on."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.lockf(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._thread.release()


class StageCache:
    """A directory of content-keyed stage outputs.

    ``computed`` and ``hits`` count, per stage name, how often an entry was computed or served
    from disk in this process: tests use them to prove that a knob change re-uses upstream stages.
    ``waited`` counts the hits that first waited for another process computing the entry;
    ``bytes_written`` and ``bytes_read`` the bytes of entry files written and read from disk,
    ``evicted`` and ``bytes_evicted`` what this cache's evictions deleted. Each also counts in
    the runtime's :func:`activity`; the entries kept in memory, the writer and the hashing
    threads are the runtime's too (:mod:`healsweep.runtime`), found when used, so a cache made
    under one runtime and used under another uses the other's.

    ``max_gb``: the root's size limit in GiB (a command's ``--cache-max-gb`` or the sweep
    spec's ``cache_max_gb``); None reads ``HEALSWEEP_CACHE_MAX_GB``, unset means no limit
    (:func:`healsweep._cache_disk.cache_limit`; a bad value is a
    :class:`~healsweep.errors.SettingError` here).

    ``axes``: the knobs the sweep of the trial using this cache varies (a sweep trial's; None
    otherwise), stated in its holds (:class:`healsweep._cache_disk.Holds`) so that eviction
    knows which entries no trial of the sweep reads again (:data:`~healsweep._cache_disk.SPENT_UNLESS`).
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        max_gb: float | str | None = None,
        axes: Iterable[str] | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.max_bytes = disk.cache_limit(max_gb)
        self.axes = None if axes is None else frozenset(axes)
        self.computed: Counter[str] = _Tally("computed")
        self.hits: Counter[str] = _Tally("hits")
        self.waited: Counter[str] = _Tally("waited")
        self.bytes_written: Counter[str] = _Tally("bytes_written")
        self.bytes_read: Counter[str] = _Tally("bytes_read")
        self.evicted: Counter[str] = _Tally("evicted")
        self.bytes_evicted: Counter[str] = _Tally("bytes_evicted")
        self.corrupt: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._behind = 0  # depth of writing_behind blocks
        self._pending: dict[Path, tuple[dict[str, np.ndarray], dict]] = {}  # being written
        self._writes: list[Future] = []
        self._holds: disk.Holds | None = None  # the holding block's, while one is open
        self._holding = 0  # depth of holding blocks
        self._unheld = False  # the root took no holds file: go on without
        self._scanned_at = -math.inf  # monotonic time of the last eviction pass
        self._since_scan = 0  # bytes written since then
        self._room = 0  # this cache's share of the room left under the limit after it

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block, every entry this cache reads or writes (or names in :meth:`hold`)
        is held: no eviction, by this process or another sharing the root, deletes it until
        the block ends. Blocks nest (the outermost lets go). A sweep trial holds its stages from
        the build of its student to its last scored window (the student reads its layers back
        from them), and its teacher records while it scores."""
        with self._lock:
            self._holding += 1
        try:
            yield
        finally:
            holds = None
            with self._lock:
                self._holding -= 1
                if not self._holding:
                    holds, self._holds = self._holds, None
            if holds is not None:
                holds.close()

    def hold(self, stage: str, key: str) -> None:
        """Inside :meth:`holding`, hold ``stage/key`` (present or not) until the block ends;
        outside, nothing."""
        self._hold(self.path(stage, key))

    def _hold(self, path: Path) -> None:
        with self._lock:
            if not self._holding or self._unheld:
                return
            try:
                if self._holds is None:
                    self._holds = disk.Holds(self.root, self.axes)
                self._holds.add(path.relative_to(self.root).as_posix())
                return
            except OSError as exc:
                # A root this process cannot write to (read-only shared storage, a full disk):
                # its entries can still be read; unheld, another process's eviction may cost
                # this one a recomputation, never a wrong result.
                self._unheld = True
                failure = exc
        if current().first_time(("stage cache holds", str(self.root))):
            log.warning("stage cache %s: cannot record the entries this process holds (%s); "
                        "another process's eviction may delete them, costing recomputations",
                        self.root, failure.strerror or failure)  # fmt: skip

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key[:2] / f"{key}.hsc"

    def get(self, stage: str, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
        """The arrays and metadata of an entry, or None when absent or corrupt (then deleted).
        Held inside :meth:`holding`; marked used now."""
        path = self.path(stage, key)
        self._hold(path)
        with self._lock:
            pending = self._pending.get(path)
        if pending is not None:
            return dict(pending[0]), copy.deepcopy(pending[1])
        try:
            st = os.stat(path)
            found = _recent().get(
                (str(path), st.st_ino, st.st_size, st.st_mtime_ns), lambda: self._load(stage, path)
            )
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot read cache entry {path}: {exc}") from exc
        disk.touch(path, st.st_mtime_ns)  # the mtime is left: it is part of the key above
        if found is None:
            with self._lock:
                self.corrupt[stage] += 1
            path.unlink(missing_ok=True)
            return None
        arrays, meta, _ = found
        return dict(arrays), copy.deepcopy(meta)

    def _load(self, stage: str, path: Path) -> tuple[dict[str, np.ndarray], dict, int] | None:
        found = _read(path)
        with self._lock:
            self.bytes_read[stage] += found[2] if found is not None else 0
        return found

    def meta(self, stage: str, key: str) -> dict | None:
        """The metadata record of an entry, reading only its header (whose own checksum is
        checked), or None when absent or not whole. Held inside :meth:`holding`."""
        path = self.path(stage, key)
        self._hold(path)
        with self._lock:
            pending = self._pending.get(path)
        if pending is not None:
            return copy.deepcopy(pending[1])
        try:
            header = _header(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot read cache entry {path}: {exc}") from exc
        return None if header is None else header["meta"]

    def put(
        self,
        stage: str,
        key: str,
        arrays: Mapping[str, np.ndarray],
        meta: Mapping | None = None,
        *,
        seconds: float | None = None,
    ) -> None:
        """Write an entry atomically (:func:`healsweep._atomic.atomic_file`); inside
        :meth:`writing_behind`, on the writer thread while the caller goes on. ``seconds``:
        the wall seconds recomputing it would cost, recorded in its header for eviction
        (:mod:`healsweep._cache_disk`); None: unknown, the entry is evicted as if free to redo.

        The arrays are made read-only: what a later trial of this worker reads back from memory
        must be what was written."""
        self._store(stage, key, arrays, meta, None, seconds)

    def _store(
        self,
        stage: str,
        key: str,
        arrays: Mapping[str, np.ndarray],
        meta: Mapping | None,
        lock: _EntryLock | None,
        seconds: float | None = None,
    ) -> None:
        """:meth:`put`, releasing ``lock`` once the entry is on disk (or its write failed)."""
        for value in arrays.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        profile = active_profile()
        if profile is not None:  # the running work's phase that computed it (bench, trials)
            profile.add_bytes(sum(np.asarray(v).nbytes for v in arrays.values()), stage)
        kept = (
            {name: np.asarray(v) for name, v in arrays.items()},
            copy.deepcopy(dict(meta or {})),
        )
        path = self.path(stage, key)
        try:
            self._hold(path)  # before the file appears: held from its first moment
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if not self._behind:
            self._write(stage, path, *kept, lock, seconds)
            return
        with self._lock:
            self._pending[path] = kept
            self._writes.append(_writer().submit(self._write, stage, path, *kept, lock, seconds))

    def _write(
        self,
        stage: str,
        path: Path,
        arrays: dict[str, np.ndarray],
        meta: dict,
        lock: _EntryLock | None,
        seconds: float | None = None,
    ) -> None:
        try:
            header, data = _layout(arrays, meta, seconds)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Not fsynced: an entry checks itself when read, so a power loss can cost a
            # recomputation, never a wrong result.
            with atomic_file(path, "wb", durable=False) as fh:
                fh.write(header)
                for pad, values in data:
                    fh.write(b"\0" * pad)
                    fh.write(values)
            # The next trial of this worker reads what this one computed (a rho-only trial
            # reads the quantized experts and the trace a quant-knob trial wrote): keep the
            # file mapped (its bytes are the ones just checksummed), not the computed arrays,
            # which would stay in the process's own memory, one entry per layer.
            st = os.stat(path)
            key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
            _recent().get(key, lambda: _read(path, verify=False))
            with self._lock:
                self.bytes_written[stage] += st.st_size
                self._since_scan += st.st_size
        except OSError as exc:
            raise CacheError(
                f"cannot write cache entry under {self.root}: {exc.strerror or exc}; "
                "free disk space or point HEALSWEEP_CACHE at a writable directory"
            ) from exc
        finally:
            with self._lock:
                self._pending.pop(path, None)
            if lock is not None:
                lock.release()
        self._keep_to_limit()

    def _keep_to_limit(self) -> None:
        """After a write: when the root may be over its limit, evict (see
        :mod:`healsweep._cache_disk`). A pass lists every entry, so it runs when this cache's
        writes since the last one exceed its share of the room the last one left (the room
        over the processes holding entries, who write too), else every ``RESCAN_S`` at most."""
        if self.max_bytes is None:
            return
        now = time.monotonic()
        with self._lock:
            due = now - self._scanned_at >= disk.RESCAN_S or self._since_scan > self._room
            if not due:
                return
            self._scanned_at, self._since_scan = now, 0
        try:
            done = disk.evict(self.root, self.max_bytes, seconds=entry_seconds)
        except OSError as exc:
            log.warning("stage cache %s: eviction failed (%s); the cache may exceed its limit",
                        self.root, exc)  # fmt: skip
            return
        if done is None:
            return
        with self._lock:
            self._room = max(0, self.max_bytes - done.after) // max(1, done.holders)
            for stage, (n, size) in done.evicted.items():
                self.evicted[stage] += n
                self.bytes_evicted[stage] += size
        if done.over and current().first_time(("stage cache over its limit", str(self.root))):
            log.warning(
                "stage cache %s: the entries running trials hold (%.3g GiB) do not fit its "
                "limit of %.3g GiB; they are kept and the cache stays over the limit until they "
                "are released (raise --cache-max-gb, cache_max_gb or HEALSWEEP_CACHE_MAX_GB)",
                self.root, done.held_bytes / 2**30, self.max_bytes / 2**30)  # fmt: skip

    @contextmanager
    def writing_behind(self) -> Iterator[None]:
        """Within the block, entries are written on a writer thread while stages go on (a
        stage reading one still being written gets it from memory); on leaving, every write
        has finished, and the first that failed is raised."""
        self._behind += 1
        try:
            yield
        finally:
            self._behind -= 1
            if not self._behind:
                self.flush()

    def flush(self) -> None:
        """Wait for the writes started by :meth:`put` inside :meth:`writing_behind`."""
        with self._lock:
            writes, self._writes = self._writes, []
        errors = [exc for exc in (w.exception() for w in writes) if exc is not None]
        if errors:
            raise errors[0]

    def get_or_compute(
        self,
        stage: str,
        key: str,
        compute: Callable[[], tuple[Mapping[str, np.ndarray], Mapping]],
    ) -> tuple[dict[str, np.ndarray], dict]:
        """Serve ``stage/key`` from disk, or run ``compute() -> (arrays, meta)`` and store it
        with its recompute seconds (the compute's wall time less that of the entries computed
        inside it, or what it stated: :func:`recompute_seconds`); while one process computes
        an entry, another that needs it waits and then reads it (see the module docstring)."""
        found = self.get(stage, key)
        if found is not None:
            with self._lock:
                self.hits[stage] += 1
            return found
        lock = _EntryLock(self.path(stage, key))
        waited = lock.acquire(self.root)
        try:
            found = self.get(stage, key)  # written while this process waited, or just before
            if found is None:
                with _computing() as frame:
                    arrays, meta = compute()
                    arrays = {name: np.asarray(value) for name, value in arrays.items()}
                seconds = frame.own() if frame.stated is None else frame.stated
        except BaseException:
            lock.release()
            raise
        if found is not None:
            lock.release()
            with self._lock:
                self.hits[stage] += 1
                self.waited[stage] += waited
            return found
        self._store(stage, key, arrays, meta, lock, seconds)  # releases the lock once on disk
        with self._lock:
            self.computed[stage] += 1
        return arrays, dict(meta)


_SECONDS_KEPT = 65536  # entries whose recompute seconds an evicting process remembers


class _KnownSeconds(dict):
    """Recompute seconds read from entry headers, by (path, size): the runtime's."""


def _header(path: str | os.PathLike) -> dict | None:
    """An entry's header (its own checksum checked), or None when absent or not whole."""
    with open(path, "rb") as fh:
        head = fh.read(_HEAD)
        if len(head) < _HEAD or head[: len(_MAGIC)] != _MAGIC:
            return None
        (length,) = struct.unpack("<Q", head[-8:])
        body = fh.read(length)
    if len(body) < length or hashlib.sha256(body).digest() != head[len(_MAGIC) : -8]:
        return None
    return json.loads(body)


def entry_seconds(path: str | os.PathLike, size: int) -> float:
    """The recompute seconds an entry file's header records; 0.0 when it records none (an
    entry written before they were, or by a plain :meth:`StageCache.put`) or cannot be read.
    Remembered by (path, size) in this process: an eviction pass asks for every entry, and an
    entry's content (so its header) is fixed by its key."""
    kept = current().owned(_KnownSeconds)
    found = kept.get((str(path), size))
    if found is None:
        try:
            header = _header(path)
        except (OSError, ValueError):
            header = None
        found = float((header or {}).get("recompute_s", 0.0))
        if len(kept) >= _SECONDS_KEPT:
            kept.clear()
        kept[(str(path), size)] = found
    return found


def _pieces(data: memoryview) -> list[memoryview]:
    return [data[a : a + PIECE] for a in range(0, len(data), PIECE)] or [data]


def _digests(buffers: list[memoryview]) -> list[str]:
    """sha256 (hex) of each piece of each buffer, computed on the hashing threads (hashlib
    releases the GIL on large buffers)."""
    pieces = [piece for buf in buffers for piece in _pieces(buf)]
    return list(_hashers().map(lambda piece: hashlib.sha256(piece).hexdigest(), pieces))


def _layout(
    arrays: Mapping[str, np.ndarray], meta: dict, seconds: float | None = None
) -> tuple[bytes, list[tuple[int, memoryview]]]:
    """(magic + header digest + header, [(zero padding before it, bytes) per array]); the
    header holds ``recompute_s`` when ``seconds`` is given (readers before it ignore it)."""
    values = {name: np.asarray(value, order="C") for name, value in arrays.items()}  # keeps 0-d
    specs, data = [], []
    buffers = [
        memoryview(v.reshape(-1).view(np.uint8)) if v.size else memoryview(b"")
        for v in values.values()
    ]
    digests = iter(_digests(buffers))
    offset = 0
    for (name, value), buf in zip(values.items(), buffers, strict=True):
        if value.dtype.hasobject:
            raise CacheError(f"cannot cache array {name!r} of dtype object")
        pad = -offset % _ALIGN
        offset += pad
        n_pieces = len(_pieces(buf))
        specs.append(
            {
                "name": name,
                "dtype": value.dtype.str,
                "shape": list(value.shape),
                "offset": offset,
                "nbytes": len(buf),
                "sha256": [next(digests) for _ in range(n_pieces)],
            }
        )
        data.append((pad, buf))
        offset += len(buf)
    header: dict[str, Any] = {"meta": meta, "arrays": specs, "piece": PIECE}
    if seconds is not None:
        header["recompute_s"] = round(float(seconds), 6)
    body = canonical_json(header).encode()
    body += b" " * (-(_HEAD + len(body)) % _ALIGN)  # array offsets count from the header's end
    head = _MAGIC + hashlib.sha256(body).digest() + struct.pack("<Q", len(body))
    return head + body, data


def _read_small(fh: Any, size: int) -> np.ndarray | None:
    """A small entry file read whole into a read-only buffer (None if it ends early)."""
    buffer = np.empty(size, np.uint8)
    filled, view = 0, memoryview(buffer)
    while filled < size:
        got = fh.readinto(view[filled:])
        if not got:
            return None
        filled += got
    buffer.flags.writeable = False
    return buffer


def _read(path: Path, verify: bool = True) -> tuple[dict[str, np.ndarray], dict, int] | None:
    """The arrays (read-only views of a read-only mapping of the file, or of a copy for a file
    under :data:`MAP_MIN_BYTES`), metadata and the file's size, or None when the entry is not whole: a short file, a wrong magic or any checksum
    that does not match (``verify=False``: the data's checksums are not checked, for a file
    this process has just written from the bytes it checksummed)."""
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < _HEAD:
            return None
        if size >= MAP_MIN_BYTES:
            mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)  # outlives the fd
        else:
            mapped = _read_small(fh, size)
            if mapped is None:
                return None
    view = memoryview(mapped)
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        return None
    digest = bytes(view[len(_MAGIC) : len(_MAGIC) + _DIGEST_BYTES])
    (length,) = struct.unpack("<Q", view[_HEAD - 8 : _HEAD])
    if _HEAD + length > size:
        return None
    body = view[_HEAD : _HEAD + length]
    if hashlib.sha256(body).digest() != digest:
        return None
    header = json.loads(bytes(body))
    base = _HEAD + length
    if header.get("piece") != PIECE:
        return None
    specs = header["arrays"]
    if any(base + spec["offset"] + spec["nbytes"] > size for spec in specs):
        return None
    buffers = [view[base + s["offset"] : base + s["offset"] + s["nbytes"]] for s in specs]
    if verify and _digests(buffers) != [d for spec in specs for d in spec["sha256"]]:
        return None
    arrays = {
        spec["name"]: np.frombuffer(
            mapped,
            np.dtype(spec["dtype"]),
            count=int(np.prod(spec["shape"], dtype=np.int64)),
            offset=base + spec["offset"],
        ).reshape(spec["shape"])
        for spec in specs
    }
    return arrays, header["meta"], size
