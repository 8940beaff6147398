"""Ray processes a killed driver left behind: found by their session, and stopped.

A sweep's embedded Ray (``ray.init()`` in the driver) lives in a session folder,
``<temp>/ray/session_<date>_<time>_<micro>_<pid>``, named after the process that started it. When
the driver is killed with SIGKILL its GCS and raylet go with it, but Ray's dashboard agent and
runtime-env agent (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), and sometimes workers, are
left running under init, ignoring SIGTERM, each holding memory and files of the dead session.

A session is *dead* when the process that started it is gone and none of its core processes (its
``gcs_server`` or ``raylet``) runs; a ``ray start`` cluster, whose starter exits at once, keeps its
core processes and so is never dead while it serves. The processes of a dead session (those whose
command line names its folder or that hold a file open in it) are orphans: :func:`stop` ends them,
SIGTERM first and SIGKILL for those still running after a grace period. Only processes of the
current user are touched. A sweep's manifest records the session of each run
(:func:`current_session`), so ``sweep resume`` stops the orphans of its own sessions only;
``cluster status --stop-orphans`` stops those of every dead session on the machine.
"""

from __future__ import annotations

import getpass
import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

_SESSION = re.compile(r"^session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_(?P<pid>\d+)$")
_CORE = ("gcs_server", "raylet")
GRACE_S = 3.0


@dataclass(frozen=True)
class Orphans:
    """The processes a dead session left: ``(pid, name)`` pairs, and the driver's pid."""

    session: Path
    driver_pid: int
    processes: tuple[tuple[int, str], ...]

    def describe(self) -> str:
        """``3 Ray processes (ray::DashboardAgent 812, ...) of session_..._715``."""
        shown = ", ".join(f"{name} {pid}" for pid, name in self.processes[:4])
        more = f", +{len(self.processes) - 4} more" if len(self.processes) > 4 else ""
        return (f"{len(self.processes)} Ray process(es) ({shown}{more}) of {self.session.name}, "
                f"whose driver (pid {self.driver_pid}) is gone")  # fmt: skip


def ray_temp_root() -> Path:
    """Where Ray keeps its sessions: ``<temp>/ray``, ``<temp>`` being ``RAY_TMPDIR``, else
    ``TMPDIR`` on Linux, else ``/tmp`` (as Ray chooses it)."""
    temp = os.environ.get("RAY_TMPDIR")
    if temp is None and sys.platform.startswith("linux"):
        temp = os.environ.get("TMPDIR")
    return Path(temp or "/tmp") / "ray"


def _started_by(session: Path) -> int | None:
    match = _SESSION.match(session.name)
    return int(match.group("pid")) if match else None


def _alive(pid: int, since: float) -> bool:
    """Whether the process ``pid`` runs and was started before ``since`` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() <= since + 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _session_of(proc: psutil.Process, sessions: dict[str, Path]) -> Path | None:
    """The session folder ``proc`` belongs to: named on its command line, else holding one of
    its files open (the agents rename their process title and drop the folder from it)."""
    try:
        cmdline = " ".join(proc.cmdline())
        for text, session in sessions.items():
            if text in cmdline:
                return session
        for opened in proc.open_files():
            for text, session in sessions.items():
                if opened.path.startswith(text + os.sep):
                    return session
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return None


def current_session() -> str | None:
    """The session folder of the Ray this process started (``ray.init()`` names it after the
    starting process's pid), if any: what a sweep's manifest records, so that a resume knows
    which session a killed driver left. None for a driver that joined a cluster."""
    root = ray_temp_root()
    mine = sorted(root.glob(f"session_*_{os.getpid()}")) if root.is_dir() else []
    return str(mine[-1]) if mine else None


def find(root: Path | None = None, sessions: list[str] | None = None) -> list[Orphans]:
    """The orphans of every dead session under ``root`` (default :func:`ray_temp_root`), or
    only of the session folders listed in ``sessions`` (what a sweep's manifest recorded)."""
    if sessions is not None:
        candidates = [Path(s) for s in sessions]
    else:
        root = root or ray_temp_root()
        candidates = list(root.iterdir()) if root.is_dir() else []
    return _orphans_of(candidates)


def _orphans_of(candidates: list[Path]) -> list[Orphans]:
    sessions: dict[str, Path] = {}
    drivers: dict[Path, int] = {}
    for session in candidates:
        pid = _started_by(session)
        if pid is not None and session.is_dir() and not session.is_symlink():
            sessions[str(session.resolve())] = session
            drivers[session] = pid
    if not sessions:
        return []
    me, own = os.getpid(), _user()
    members: dict[Path, list[psutil.Process]] = {s: [] for s in drivers}
    for proc in psutil.process_iter(["pid", "username"]):
        if proc.info["pid"] == me or proc.info["username"] != own:
            continue
        session = _session_of(proc, sessions)
        if session is not None:
            members[session].append(proc)
    found = []
    for session, procs in members.items():
        since = session.stat().st_ctime
        if not procs or _alive(drivers[session], since) or any(_is_core(p) for p in procs):
            continue
        processes = tuple(sorted((p.pid, _name(p)) for p in procs))
        found.append(Orphans(session, drivers[session], processes))
    return sorted(found, key=lambda o: o.session.name)


def _user() -> str:
    try:
        return psutil.Process().username()
    except psutil.Error:
        return getpass.getuser()


def _is_core(proc: psutil.Process) -> bool:
    try:
        return proc.name() in _CORE and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
        return cmdline[0].split()[0] if cmdline and cmdline[0].startswith("ray::") else proc.name()
    except psutil.Error:
        return "?"


def stop(orphans: list[Orphans], grace_s: float = GRACE_S) -> int:
    """End the processes of ``orphans``: SIGTERM, then SIGKILL for those still running after
    ``grace_s`` seconds (Ray's agents ignore SIGTERM). Returns how many were running."""
    procs = []
    for group in orphans:
        for pid, _ in group.processes:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def stop_sessions(sessions: list[str]) -> list[str]:
    """Find and stop the orphans of the given session folders; one line per session."""
    found = find(sessions=sessions)
    stop(found)
    return [f"stopped {group.describe()}" for group in found]
