"""The stage cache on disk: its size limit, the entries running trials hold, and eviction by
the seconds an entry saves per byte it takes.

**The limit.** A cache root may be given a size limit, in GiB of its entries (the ``*.hsc``
files; JAX's compilation cache in ``jax/``, lock files and the trace's scratch folders are not
counted): ``--cache-max-gb`` on a command, else ``cache_max_gb`` of the sweep spec, else
``HEALSWEEP_CACHE_MAX_GB``, else none (:func:`cache_limit`). After a write that takes the
entries over the limit, entries that no running trial holds are deleted, least valuable first,
until they fit in ``1 - MARGIN`` of it (:func:`evict`). An eviction costs a later trial that
needs the entry its recomputation, never a wrong result: every entry is content-keyed and
checks itself when read.

**What an entry is worth.** Its value is what it saves per byte it takes: the wall seconds its
recomputation would cost (recorded in its header when it was computed:
:meth:`healsweep.cache.StageCache.get_or_compute`), over its size, halved for every
:data:`HALF_LIFE_S` since it was last used (:func:`value`). The least valuable goes first, the
least recently used first among equals (an entry that records no seconds is worth nothing: it
goes by recency alone). A ridge basis of the 24-layer A2.7B night (127 MB, 4 s of the host's 16
cores) is worth about 30 ms/MB; a layer's routed_q (770 MB of y_q, 4 s) 5 ms/MB; so when the
cache is full the routed outputs of the quantization configs tried go before the bases every
config reads, where plain LRU deleted the bases a follow-up had not read yet (they are read only
when a stage after them computes), and the gain_d trial recomputed all 24 of them (107 s).

**What goes last.** The entries of :data:`SHARED_STAGES` (the teacher's calibration trace, its
layers, the other matrices' importance, the teacher's record of each window: keyed by the model
and the data alone, so every trial of a sweep reads them whatever its knobs) are deleted only
after every other entry no trial holds, as long as one was used in the last :data:`SHARED_FRESH_S`;
older ones are ranked by value with the rest (an old sweep's trace does not outstay its welcome). On
the 24-layer A2.7B night on an H100 (64 GB disk, 17 GB model, limit 28 GB) plain LRU deleted the
trace (22.6 GB, written first) after the cold trial, and every next trial's recomputation of it
filled the disk.

**Recency.** Every read of an entry sets its access time explicitly (``os.utime``, so it
survives the process and does not depend on how the file system is mounted: ``noatime`` only
stops the kernel's own updates); its modification time is left alone, since it is part of the
identity under which the cache keeps entries in memory. A new entry's access time is its
creation.

**What goes first.** Part B's entries (one rho and eta point's) are read by one config, the
ridge fits (:data:`POINT_TIERS`) by the eta points of one rho, where a quantization's entries are
read by every rho/eta point tried on it: Part B goes before any other entry no trial holds, then
the fits, each by value among themselves. On the H100 night each rho/eta follow-up wrote 1.6 GB
of them, and eviction by value alone deleted the other quantization's `quantize` entries (cheap
per byte on a GPU), so every switch of quantization recomputed 9-22 layers of it; with the fits
and Part B in one tier, the fit an eta follow-up was about to read went first (cheapest per byte).

**What is spent.** Before even Part B go the entries no trial to come reads: a sweep trial states
the knobs its sweep varies (:class:`Holds`' ``axes``), and an entry whose readers add none of them
(:data:`SPENT_UNLESS`: a quantization's ``routed_q`` when no Part A knob, the ridge switch nor the
shared expert's type varies; its ``ridge_rhs`` when neither rho nor eta does) is read again only
if those readers are evicted. This holds only while every live holder is such a trial: a ``heal``
or ``confirm`` at work on the root states no axes, and nothing is spent while it lives.

**Holds.** A process that works on entries holds them (:meth:`healsweep.cache.StageCache.holding`):
each holding block has its own file ``.holds/<host>-<pid>-<random>.holds`` under the root, on
which it keeps an exclusive ``flock`` while the block lasts, and to which it appends the path of
every entry it reads or writes before it reads or writes it. An evictor lists the entries, then
reads every holds file whose owner is alive (its lock cannot be taken) and skips what they name;
a holds file whose lock it can take belongs to a process that died and is deleted. An entry
written is held from the moment it appears (its path is in the holds file before the rename), an
entry being computed has no file yet, and an entry held before a pass started survives it; a
hold written while a pass runs may lose the race, which costs a recomputation (the reader has the
entry's bytes once it has read them). One eviction runs at a time per root (``.holds/evict.lock``;
a process that finds it taken leaves the pass to the other). When the entries held exceed the
limit by themselves, they are all kept and one warning says so: a trial is never failed, nor
made to recompute what it holds.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import secrets
import socket
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from healsweep.errors import SettingError

LIMIT_ENV = "HEALSWEEP_CACHE_MAX_GB"
MARGIN = 0.1  # an eviction frees down to 90% of the limit, so the next writes do not evict again
# A pass lists every entry (about 20 us an entry on a busy 2-core host: 0.1 s for 5,000), so a
# cache runs one when its own writes since the last may have used up its share of the room then
# left under the limit (the room over the processes holding entries), else at most this often.
RESCAN_S = 30.0
HOLDS_DIR = ".holds"
ENTRY_SUFFIX = ".hsc"
AXES_LINE = "#axes "  # a holds file's first line: the knobs its sweep varies (not a path)
# A holds file on a file system that cannot lock is taken for a live process's until it is this
# old without a new line (no trial holds an entry for a day without reading another).
STALE_S = 24 * 3600.0
# Stage folders every trial of a sweep reads whatever its knobs (stage_names.py names
# them; tests/test_cache_limit.py checks they are stages): evicted last while fresh (docstring).
SHARED_STAGES = frozenset({"calib_trace", "calib_trace_layer", "tensor_importance", "teacher_logits"})
SHARED_FRESH_S = 24 * 3600.0  # a night: a shared entry unused for longer is evicted like any
# Stage folders whose entries fewer configs read than a quantization's (its quantize, routed_q,
# part_a, residuals, ridge_rhs; the bases): Part B, one (rho, eta) point's, first, then the ridge
# fit (and its held-out check), one rho's, which every eta tried at that rho reads. The H100
# night's follow-ups each wrote 1.6 GB of them, and eviction by worth alone deleted the other
# quantization's `quantize`, which its next trial recomputed (docstring, "What goes first").
POINT_TIERS = {"part_b": 0, "ridge_fit": 1, "ridge_heldout": 1}
# Stage folders whose entries only stages after them read, with the knobs that make such a
# reader read an entry again once the readers of its own config are cached: a `routed_q` (y_q of
# one quantization) is read by `part_a`, `residuals` and `ridge_rhs`, whose keys add Part A's
# knobs, the ridge switch and the shared expert's type (through the basis) to its own. While every
# process at work on the root is a sweep trial that states the knobs its sweep varies
# (:class:`Holds`' ``axes``) and none of them varies one of these, no trial to come reads such an
# entry unless its readers are evicted: it is *spent* and goes before any other entry no trial
# holds. On the H100 night (grid over gain_d, rho and eta) the routed outputs of the two
# quantizations took 5.3 GB of the 28 GB cache and were never read after their trials, while the
# ridge fits an eta follow-up was about to read (1.1 GB a rho) were evicted. A sweep trial
# builds its students without Part B's held-out diagnostic, which reads routed_q at every rho.
# A `ridge_rhs` (B = Z'ᵀdY of one quantization) is read by the ridge fits (their keys add rho)
# and by Part B (eta, and the shared expert's storage type): in a sweep that varies none of
# these, e.g. over the experts' types alone, it is spent once its Part B is made.
SPENT_UNLESS = {
    "routed_q": frozenset({"alpha", "gamma", "alpha_granularity", "ridge", "type_shexp"}),
    "ridge_rhs": frozenset({"rho", "eta", "ridge", "type_shexp"}),
}
# An entry's value halves for every hour unused: within a night's trials (seconds to minutes
# apart) the seconds per byte decide; an entry of a sweep that ended hours ago goes first.
HALF_LIFE_S = 3600.0
_NO_LOCKING = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
_GIB = 2**30


def parse_gb(value: object, source: str) -> float | None:
    """A size limit in GiB as given by ``source`` (``--cache-max-gb``, ``cache_max_gb``,
    ``HEALSWEEP_CACHE_MAX_GB=``): None for ``None`` or ``""`` (not given), a float >= 0 (``inf``:
    no limit); :class:`~healsweep.errors.SettingError` for a negative number, NaN or anything
    that is not a number."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        gib = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        gib = math.nan
        problem = "is not a number"
    else:
        problem = "is NaN" if math.isnan(gib) else "is negative" if gib < 0 else ""
    if problem:
        named = f"{source}{value!r}" if source.endswith("=") else f"{source} {value!r}"
        raise SettingError(
            f"{named} {problem}: give the stage cache's size limit in GiB (a number >= 0; 0 "
            "keeps only what running trials hold), or leave it out for no limit"
        )
    return gib


def parse_limit(value: object, source: str) -> int | None:
    """Bytes of a size limit given in GiB (:func:`parse_gb`): None when not given or infinite."""
    gib = parse_gb(value, source)
    return None if gib is None or math.isinf(gib) else int(gib * _GIB)


def cache_limit(max_gb: float | str | None = None, source: str = "--cache-max-gb") -> int | None:
    """The size limit of a stage cache in bytes: ``max_gb`` when given (a command's option, or
    the sweep spec's ``cache_max_gb``), else ``HEALSWEEP_CACHE_MAX_GB``, else None (no limit)."""
    if max_gb is not None:
        return parse_limit(max_gb, source)
    return parse_limit(os.environ.get(LIMIT_ENV), f"{LIMIT_ENV}=")


def touch(path: Path, mtime_ns: int) -> None:
    """Mark an entry used now: its access time set, its modification time kept."""
    try:
        os.utime(path, ns=(time.time_ns(), mtime_ns))
    except OSError:  # another user's file on shared storage, say: recency is then its write
        pass


class Entry(NamedTuple):
    """One entry file: when it was last used (ns), its size, its path under the root."""

    used_ns: int
    size: int
    relpath: str

    @property
    def stage(self) -> str:
        return self.relpath.split("/", 1)[0]


def entries(root: Path) -> list[Entry]:
    """Every entry under ``root`` (``<stage>/<xx>/<key>.hsc``), in no particular order."""
    found: list[Entry] = []
    for stage in _subdirs(root):
        if stage.name.startswith(".") or stage.name == "jax":
            continue
        for prefix in _subdirs(Path(stage.path)):
            try:
                files = list(os.scandir(prefix.path))
            except OSError:  # removed meanwhile
                continue
            for item in files:
                if not item.name.endswith(ENTRY_SUFFIX):
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                used = max(st.st_atime_ns, st.st_mtime_ns)
                found.append(Entry(used, st.st_size, f"{stage.name}/{prefix.name}/{item.name}"))
    return found


def _subdirs(folder: Path) -> Iterable[os.DirEntry]:
    try:
        with os.scandir(folder) as items:
            return [item for item in items if item.is_dir(follow_symlinks=False)]
    except OSError:
        return []


class Holds:
    """The entries one holding block holds: its holds file, locked for as long as it lives
    (see the module docstring). Thread-safe through its owner's lock. ``axes``: the knobs the
    sweep of the trial holding varies, stated on the file's first line (:data:`SPENT_UNLESS`);
    None for a process that is not a sweep trial (nothing is then spent while it lives)."""

    def __init__(self, root: Path, axes: Iterable[str] | None = None) -> None:
        folder = root / HOLDS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        # Locked under a name evictors do not read, then renamed: an evictor never finds it
        # unlocked and takes it for a dead process's.
        making = folder / f".tmp-{name}"
        self.path = folder / f"{name}.holds"
        self._held: set[str] = set()
        self._fd: int | None = os.open(
            making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o666
        )
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in _NO_LOCKING:
                    raise
            if axes is not None:  # before the rename: an evictor reads whole files only
                os.write(self._fd, (AXES_LINE + ",".join(sorted(axes)) + "\n").encode())
            os.rename(making, self.path)
        except OSError:
            os.close(self._fd)
            self._fd = None
            making.unlink(missing_ok=True)
            raise
        # a block left without closing (a generator never finished): let go when collected
        self._release = weakref.finalize(self, _let_go, self._fd, self.path)

    def add(self, relpath: str) -> None:
        """Hold the entry at ``relpath`` (under the root) until :meth:`close`."""
        if relpath in self._held or self._fd is None:
            return
        os.write(self._fd, (relpath + "\n").encode())
        self._held.add(relpath)

    def close(self) -> None:
        """Let go of every entry held (the file is removed before its lock goes)."""
        if self._fd is not None:
            self._fd = None
            self._release()


def _let_go(fd: int, path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


class Held(NamedTuple):
    """What live processes hold under a root: the entries' paths, how many holds files name
    them, and the knobs their sweeps vary (the union; None when one of them states none, or
    none is alive)."""

    paths: set[str]
    holders: int
    axes: frozenset[str] | None


def held(root: Path) -> Held:
    """The entries held by live processes under ``root`` (:class:`Held`); holds files left by
    processes that died are deleted."""
    found: set[str] = set()
    live = 0
    axes: set[str] | None = set()
    folder = root / HOLDS_DIR
    try:
        files = [item for item in os.scandir(folder) if item.name.endswith(".holds")]
    except OSError:
        return found, live
    for item in files:
        try:
            fd = os.open(item.path, os.O_RDONLY)
        except OSError:  # released meanwhile
            continue
        try:
            if not _alive(fd, item):
                os.unlink(item.path)
                continue
            lines = Path(item.path).read_bytes().decode(errors="replace").splitlines()
        except OSError:
            continue
        finally:
            os.close(fd)
        stated = lines[0][len(AXES_LINE):] if lines and lines[0].startswith(AXES_LINE) else None
        if stated is None:
            axes = None
        elif axes is not None:
            axes.update(knob for knob in stated.split(",") if knob)
        found.update(line for line in lines if line and not line.startswith(AXES_LINE))
        live += 1
    return Held(found, live, frozenset(axes) if axes is not None and live else None)


def _alive(fd: int, item: os.DirEntry) -> bool:
    """Whether the owner of a holds file still holds its lock (a file system that cannot lock:
    whether the file is younger than ``STALE_S``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        if exc.errno in _NO_LOCKING:
            return time.time() - item.stat().st_mtime < STALE_S
        raise
    return False


class Eviction(NamedTuple):
    """What one pass found and did: entry bytes before and after, the bytes held, per stage
    the entries and bytes deleted, and the live holds files (the processes at work on the
    root). ``over``: still over the limit (what is held does not fit in it)."""

    before: int
    after: int
    held_bytes: int
    evicted: dict[str, tuple[int, int]]
    over: bool
    holders: int


Seconds = Callable[[Path, int], float]  # an entry file's recompute seconds, by path and size


def evict(
    root: Path, limit: int, margin: float = MARGIN, seconds: Seconds | None = None
) -> Eviction | None:
    """Delete the least valuable entries no live process holds (:func:`value`; ``seconds``
    reads an entry's recompute seconds, default none: least recently used first) until the
    entries under ``root`` fit in ``(1 - margin) * limit`` bytes; nothing when they fit in
    ``limit``. None when another process is evicting under ``root`` now (it will do it)."""
    folder = root / HOLDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    gate = os.open(folder / "evict.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in _NO_LOCKING:
                return None  # taken: another process is evicting
        return _evict(root, limit, margin, seconds or (lambda path, size: 0.0))
    finally:
        os.close(gate)


def _evict(root: Path, limit: int, margin: float, seconds: Seconds) -> Eviction:
    found = entries(root)  # before the holds are read: see the module docstring
    total = before = sum(e.size for e in found)
    holding, holders, axes = held(root)
    if total <= limit:
        return Eviction(before, total, 0, {}, False, holders)
    held_bytes = sum(e.size for e in found if e.relpath in holding)
    target = int(limit * (1.0 - margin))
    evicted: dict[str, tuple[int, int]] = {}
    candidates = [e for e in found if e.relpath not in holding]
    for entry in sorted(candidates, key=_eviction_order(root, time.time_ns(), seconds, axes)):
        if total <= target:
            break
        try:
            os.unlink(root / entry.relpath)
        except FileNotFoundError:  # deleted by someone else meanwhile
            pass
        except OSError:
            continue
        total -= entry.size
        n, size = evicted.get(entry.stage, (0, 0))
        evicted[entry.stage] = (n + 1, size + entry.size)
    return Eviction(before, total, held_bytes, evicted, total > limit, holders)


def value(recompute_s: float, size: int, idle_s: float) -> float:
    """What an entry is worth keeping: the seconds its recomputation costs per byte it takes,
    halved for every :data:`HALF_LIFE_S` it has gone unused (``idle_s``)."""
    return recompute_s / max(size, 1) * 0.5 ** (max(idle_s, 0.0) / HALF_LIFE_S)


def spent_stages(axes: frozenset[str] | None) -> frozenset[str]:
    """The stages of :data:`SPENT_UNLESS` whose entries no sweep varying ``axes`` reads again
    (while their readers are cached); none when ``axes`` is None (a process that is not a
    sweep trial is at work: it may read anything)."""
    if axes is None:
        return frozenset()
    return frozenset(stage for stage, opens in SPENT_UNLESS.items() if not opens & axes)


def _eviction_order(
    root: Path, now_ns: int, seconds: Seconds, axes: frozenset[str] | None = None
):
    """The sort key of :func:`_evict`: spent entries first (:func:`spent_stages` of the live
    sweeps' ``axes``), then the entries of :data:`POINT_TIERS` (Part B, then the ridge fits),
    then those of other stages and stale shared ones, then the fresh entries of
    :data:`SHARED_STAGES`; within each the least valuable (:func:`value`) first, then the least
    recently used."""
    fresh_after = now_ns - int(SHARED_FRESH_S * 1e9)
    spent = spent_stages(axes)

    def order(entry: Entry) -> tuple[int, float, int, str]:
        if entry.stage in spent:
            tier = -1
        elif entry.stage in SHARED_STAGES and entry.used_ns >= fresh_after:
            tier = 3
        else:
            tier = POINT_TIERS.get(entry.stage, 2)
        idle_s = (now_ns - entry.used_ns) / 1e9
        worth = value(seconds(root / entry.relpath, entry.size), entry.size, idle_s)
        return tier, worth, entry.used_ns, entry.relpath

    return order
