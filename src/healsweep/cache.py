"""Content-keyed, checksummed, atomically written cache of pipeline stages.

A stage's output is stored under ``sha256(canonical JSON of (stage, version, inputs))``; the inputs
are the model fingerprint, the keys of upstream artifacts and exactly the knobs the stage reads.
An entry is one file: a magic line, the sha256 of the payload, then the payload (an ``.npz`` of
named arrays plus a JSON metadata record). It is written to a temp file and renamed into place,
so a reader sees a whole entry or none; a truncated or corrupt entry fails its checksum, is
deleted and recomputed, never used.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from healsweep.errors import CacheError

_MAGIC = b"HEALSWEEP-CACHE-1\n"
_DIGEST_BYTES = 32


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


class StageCache:
    """A directory of content-keyed stage outputs.

    ``computed`` and ``hits`` count, per stage name, how often an entry was computed or served
    from disk in this process: tests use them to prove that a knob change re-uses upstream stages.
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.computed: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.corrupt: Counter[str] = Counter()
        self._lock = threading.Lock()

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key[:2] / f"{key}.hsc"

    def get(self, stage: str, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
        """The arrays and metadata of an entry, or None when absent or corrupt (then deleted)."""
        path = self.path(stage, key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot read cache entry {path}: {exc}") from exc
        decoded = _decode(blob)
        if decoded is None:
            with self._lock:
                self.corrupt[stage] += 1
            path.unlink(missing_ok=True)
            return None
        return decoded

    def put(self, stage: str, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping | None = None) -> None:
        """Write an entry atomically (temp file in the same directory, fsync, rename)."""
        path = self.path(stage, key)
        blob = _encode(arrays, dict(meta or {}))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".hsc")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(blob)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise CacheError(
                f"cannot write cache entry under {self.root}: {exc.strerror or exc}; "
                "free disk space or point HEALSWEEP_CACHE at a writable directory"
            ) from exc

    def get_or_compute(
        self,
        stage: str,
        key: str,
        compute: Callable[[], tuple[Mapping[str, np.ndarray], Mapping]],
    ) -> tuple[dict[str, np.ndarray], dict]:
        """Serve ``stage/key`` from disk, or run ``compute() -> (arrays, meta)`` and store it."""
        found = self.get(stage, key)
        if found is not None:
            with self._lock:
                self.hits[stage] += 1
            return found
        arrays, meta = compute()
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        self.put(stage, key, arrays, meta)
        with self._lock:
            self.computed[stage] += 1
        return arrays, dict(meta)


def _encode(arrays: Mapping[str, np.ndarray], meta: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, __meta__=np.frombuffer(canonical_json(meta).encode(), dtype=np.uint8), **arrays)
    payload = buffer.getvalue()
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(blob: bytes) -> tuple[dict[str, np.ndarray], dict] | None:
    head = len(_MAGIC) + _DIGEST_BYTES
    if len(blob) < head or not blob.startswith(_MAGIC):
        return None
    digest, payload = blob[len(_MAGIC) : head], blob[head:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    meta = json.loads(arrays.pop("__meta__").tobytes().decode())
    return arrays, meta
