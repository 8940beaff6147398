"""The stage cache: content keys, atomic checksummed entries, corrupt entries recomputed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from healsweep.cache import StageCache, content_key
from healsweep.errors import CacheError


def _compute(value: float):
    def run():
        return {"w": np.full((3, 4), value, dtype=np.float32)}, {"value": value}

    return run


def test_key_depends_on_exactly_its_inputs():
    base = content_key("quantize", 1, {"model": "abc", "gain_d": 0.3})
    assert base == content_key("quantize", 1, {"gain_d": 0.3, "model": "abc"})
    assert base != content_key("quantize", 1, {"model": "abc", "gain_d": 0.31})
    assert base != content_key("quantize", 2, {"model": "abc", "gain_d": 0.3})
    assert base != content_key("part_b", 1, {"model": "abc", "gain_d": 0.3})


def test_second_request_is_served_from_disk(tmp_path):
    cache = StageCache(tmp_path)
    key = content_key("stage", 1, {"x": 1})
    arrays, meta = cache.get_or_compute("stage", key, _compute(2.0))
    again, meta_again = StageCache(tmp_path).get_or_compute("stage", key, _compute(99.0))
    np.testing.assert_array_equal(again["w"], arrays["w"])
    assert meta_again == meta == {"value": 2.0}
    assert cache.computed["stage"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entry_is_recomputed_never_used(tmp_path, damage):
    cache = StageCache(tmp_path)
    key = content_key("stage", 1, {"x": 2})
    cache.get_or_compute("stage", key, _compute(1.0))
    path = cache.path("stage", key)
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    else:
        path.write_bytes(b"")
    fresh = StageCache(tmp_path)
    arrays, _ = fresh.get_or_compute("stage", key, _compute(5.0))
    assert fresh.corrupt["stage"] == 1 and fresh.computed["stage"] == 1
    assert float(arrays["w"][0, 0]) == 5.0
    assert StageCache(tmp_path).get("stage", key)[1] == {"value": 5.0}


def test_meta_reads_the_header_alone_and_refuses_a_damaged_one(tmp_path):
    cache = StageCache(tmp_path)
    key = content_key("stage", 1, {"x": 3})
    assert cache.meta("stage", key) is None
    cache.get_or_compute("stage", key, _compute(2.0))
    assert cache.meta("stage", key) == {"value": 2.0}
    path = cache.path("stage", key)
    blob = path.read_bytes()
    path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])  # data, not header
    assert cache.meta("stage", key) == {"value": 2.0}
    at = blob.index(b'"value"')  # a byte of the header itself
    path.write_bytes(blob[:at] + b"X" + blob[at + 1 :])
    assert cache.meta("stage", key) is None
    path.write_bytes(blob[:40])
    assert cache.meta("stage", key) is None


def test_entries_keep_dtype_shape_and_bytes(tmp_path):
    """Every kind of array a stage stores comes back equal: 0-d, empty, non-contiguous, float16,
    bool, several checksum pieces (PIECE made small)."""
    import healsweep.cache as cache_module

    rng = np.random.default_rng(0)
    arrays = {
        "scalar": np.float32(0.25),
        "empty": np.zeros((0, 3), np.int64),
        "strided": rng.standard_normal((6, 8)).astype(np.float32)[:, ::2],
        "half": rng.standard_normal((5, 7)).astype(np.float16),
        "mask": rng.random(13) > 0.5,
        "big": rng.integers(0, 255, 10_000, dtype=np.uint8),
    }
    old = cache_module.PIECE
    cache_module.PIECE = 4096
    try:
        cache = StageCache(tmp_path)
        cache.put("stage", "ab" * 32, arrays, {"n": 1})
        got, meta = cache.get("stage", "ab" * 32)
        assert meta == {"n": 1} and set(got) == set(arrays)
        for name, value in arrays.items():
            value = np.asarray(value)
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            np.testing.assert_array_equal(got[name], value)
        blob = bytearray(cache.path("stage", "ab" * 32).read_bytes())
        blob[-5000] ^= 1  # a byte of the big array's second-to-last piece
        cache.path("stage", "ab" * 32).write_bytes(bytes(blob))
        assert cache.get("stage", "ab" * 32) is None and cache.corrupt["stage"] == 1
    finally:
        cache_module.PIECE = old


def test_entries_read_lately_are_served_from_memory_until_their_file_changes(
    tmp_path, monkeypatch, own_runtime
):
    """A second read (another StageCache, as the next trial of a sweep worker builds) is served
    from memory, read-only; a rewritten file is read again; a budget of 0 keeps nothing."""
    from healsweep.cache import RecentEntries

    recent = own_runtime.owned(RecentEntries)
    monkeypatch.setenv("HEALSWEEP_RECENT_GB", "1")
    key = content_key("stage", 1, {"x": 3})
    StageCache(tmp_path).put("stage", key, {"w": np.arange(12.0).reshape(3, 4)}, {"m": [1]})
    first, meta = StageCache(tmp_path).get("stage", key)
    second, meta_again = StageCache(tmp_path).get("stage", key)
    assert np.shares_memory(first["w"], second["w"]) and not first["w"].flags.writeable
    meta["m"].append(2)  # a caller's change to its metadata does not reach the next caller
    assert meta_again == {"m": [1]} and StageCache(tmp_path).get("stage", key)[1] == {"m": [1]}
    with pytest.raises(ValueError, match="read-only"):
        first["w"][0, 0] = 5.0

    StageCache(tmp_path).put("stage", key, {"w": np.zeros((3, 4))}, {"m": [0]})  # new inode
    again, meta = StageCache(tmp_path).get("stage", key)
    assert not again["w"].any() and meta == {"m": [0]}

    monkeypatch.setenv("HEALSWEEP_RECENT_GB", "0")
    recent.clear()
    a, _ = StageCache(tmp_path).get("stage", key)
    b, _ = StageCache(tmp_path).get("stage", key)
    assert not np.shares_memory(a["w"], b["w"]) and len(recent) == 0

    monkeypatch.setenv("HEALSWEEP_RECENT_GB", "lots")
    from healsweep.errors import SettingError

    with pytest.raises(SettingError, match="HEALSWEEP_RECENT_GB='lots' is not a number"):
        StageCache(tmp_path).get("stage", key)


def test_unwritable_cache_dir_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits: use a path whose parent is a regular file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        cache = StageCache(blocker / "cache")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cache = StageCache(locked)
    with pytest.raises(CacheError, match="cannot write cache entry"):
        cache.put("stage", content_key("stage", 1, {}), {"w": np.zeros(2)})


def test_writing_behind_serves_pending_entries_and_has_all_on_disk_after(tmp_path):
    cache = StageCache(tmp_path)
    keys = [content_key("stage", 1, {"i": i}) for i in range(6)]
    with cache.writing_behind():
        for i, key in enumerate(keys):
            arrays, _ = cache.get_or_compute("stage", key, _compute(float(i)))
            assert not arrays["w"].flags.writeable  # what a later read gets must not change
            again, meta = cache.get_or_compute("stage", key, _compute(-1.0))
            assert float(again["w"][0, 0]) == float(i) and meta == {"value": float(i)}
            assert cache.meta("stage", key) == {"value": float(i)}
    assert cache.computed["stage"] == 6 and cache.hits["stage"] == 6
    fresh = StageCache(tmp_path)
    for i, key in enumerate(keys):
        assert cache.path("stage", key).exists()
        assert float(fresh.get("stage", key)[0]["w"][0, 0]) == float(i)


def test_a_write_behind_that_fails_is_raised_when_the_block_ends(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = StageCache(blocker / "cache")  # its folder cannot be made: a regular file is there
    with pytest.raises(CacheError, match="cannot write cache entry"):  # noqa: PT012
        with cache.writing_behind():
            cache.put("stage", content_key("stage", 1, {}), {"w": np.zeros(2)})
    cache.flush()  # reported once
