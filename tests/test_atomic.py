"""The one atomic-write helper: whole new content or the old file, never a temp file left.

Failures are real: a writer that raises half-way, a ``KeyboardInterrupt``, a rename onto a
folder, pyarrow writing through :func:`atomic_path`. Durability is checked by recording which
files ``os.fsync`` was handed (through ``/proc/self/fd``, Linux only), calling the real fsync.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from healsweep._atomic import atomic_file, atomic_path, atomic_write_bytes, atomic_write_text


class WriterFailed(RuntimeError):
    pass


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_success_replaces_the_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old content")
    payload = os.urandom(3 << 20)  # several buffer flushes
    with atomic_file(target) as handle:
        for start in range(0, len(payload), 1 << 16):
            handle.write(payload[start : start + (1 << 16)])
        assert target.read_bytes() == b"old content"  # nothing visible before the rename
    assert target.read_bytes() == payload
    assert _names(tmp_path) == ["out.bin"]


def test_new_files_get_open_permissions_not_mkstemp_ones(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("exists", [True, False])
@pytest.mark.parametrize("error", [WriterFailed, KeyboardInterrupt])
def test_a_writer_that_raises_mid_write_leaves_the_old_file_and_no_temp(tmp_path, exists, error):
    target = tmp_path / "confirm.json"
    if exists:
        target.write_text('{"old": true}')
    with pytest.raises(error):
        with atomic_file(target, "w") as handle:
            handle.write('{"new": ')
            handle.flush()
            raise error("disk full, say")
    assert _names(tmp_path) == (["confirm.json"] if exists else [])
    if exists:
        assert target.read_text() == '{"old": true}'


def test_a_failed_rename_removes_the_temp(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"data")
    assert _names(tmp_path) == ["taken"]
    assert _names(target) == ["inside"]


def test_atomic_path_serves_writers_that_open_the_file_themselves(tmp_path):
    target = tmp_path / "rows.parquet"
    table = pa.table({"window": [1, 2, 3]})
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-")
        pq.write_table(table, tmp)
    assert pq.read_table(target).equals(table)
    with pytest.raises(WriterFailed):
        with atomic_path(target) as tmp:
            pq.write_table(pa.table({"window": [9]}), tmp)
            raise WriterFailed
    assert pq.read_table(target).equals(table)
    assert _names(tmp_path) == ["rows.parquet"]


def test_text_mode_writes_utf8_and_honours_newline(tmp_path):
    target = tmp_path / "c.jsonl"
    atomic_write_text(target, "é\n", newline="\n")
    assert target.read_bytes() == "é\n".encode()


def test_modes_other_than_write_are_refused(tmp_path):
    with pytest.raises(ValueError, match="atomic_file: mode must be"):
        with atomic_file(tmp_path / "x", "ab"):
            pass
    assert _names(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_the_file_then_its_folder_are_fsynced_around_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic_write_bytes(tmp_path / "head.json", b"{}")
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path and Path(synced[0]).name.startswith(".tmp-head")
    assert synced[1] == str(tmp_path)
