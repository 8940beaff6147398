"""ggml's own quantizer and dequantizer, from the libggml-base that llama-cpp-python bundles.

Used for the external baseline (``healsweep baseline llama``: llama.cpp's quantization of the
routed experts) and, in tests, as an implementation of every block format independent of
healsweep's decoders, and for the routed experts stored in a ggml type (knobs ``type_gu``,
``type_d``). Only ``libggml-base`` is used, found in this order (:func:`library_source`):

1. ``$HEALSWEEP_GGML_LIB``: a ``libggml-base`` file, or a folder holding one (a llama.cpp build's
   ``build/bin``, an install prefix's ``lib``): a llama.cpp the user already has;
2. ``<venv>/lib/healsweep-ggml/``, where ``tools/build-ggml.sh`` builds that one library from the
   llama.cpp llama-cpp-python pins (seconds of compiling instead of the whole package's minutes);
3. the ``lib`` folder of an installed ``llama-cpp-python`` (the ``[ggml]`` / ``[bench]`` extras).

Without any of them these functions raise :class:`~healsweep.errors.SettingError`. The library
is loaded with ``ctypes`` directly, without importing ``llama_cpp`` (which would load libllama
and its CPU backend into the process).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from healsweep.errors import SettingError
from healsweep.threads import host_threads

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    """ggml's ``struct ggml_type_traits`` (ggml.h), the fields up to ``to_float``."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
    ]


ENV_VAR = "HEALSWEEP_GGML_LIB"
BUILT_DIR = Path("lib") / "healsweep-ggml"  # under sys.prefix: where tools/build-ggml.sh puts it
_SUFFIX = ".dylib" if sys.platform == "darwin" else ".so"
WAYS = (
    "build it with tools/build-ggml.sh (ggml's base library alone, under a minute of compiling), "
    f"point {ENV_VAR} at a llama.cpp build's libggml-base (a file, or its folder such as "
    "build/bin), or install the ggml extra (pip install -e \".[ggml]\": all of "
    "llama-cpp-python, several minutes of compiling)"
)


def _in_folder(folder: Path) -> Path | None:
    """The ``libggml-base`` in ``folder`` (or its ``lib``/``bin``), if there is one."""
    for where in (folder, folder / "lib", folder / "bin"):
        for name in (f"libggml-base{_SUFFIX}", "libggml-base.so", "ggml-base.dll"):
            if (where / name).is_file():
                return where / name
    return None


def library_source() -> tuple[Path, str]:
    """Where libggml-base is (see the module docstring for the order) and, in words, who
    provides it; SettingError when nowhere, saying how to get it."""
    given = os.environ.get(ENV_VAR, "").strip()
    if given:
        path = Path(given).expanduser()
        found = path if path.is_file() else (_in_folder(path) if path.is_dir() else None)
        if found is None:
            raise SettingError(
                f"{ENV_VAR}={given}: no libggml-base{_SUFFIX} there (name the file, or the folder "
                "holding it, e.g. a llama.cpp build's build/bin); unset it to use another source"
            )
        return found, f"{ENV_VAR}"
    built = _in_folder(Path(sys.prefix) / BUILT_DIR)
    if built is not None:
        return built, "tools/build-ggml.sh"
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SettingError(f"ggml's quantizer (libggml-base) was not found: {WAYS}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib"
    found = _in_folder(folder)
    if found is None:
        raise SettingError(f"llama-cpp-python has no libggml-base in {folder}; reinstall it")
    return found, "llama-cpp-python"


def _library_path() -> Path:
    """Where libggml-base is; SettingError if nowhere."""
    return library_source()[0]


@cache
def libggml() -> ctypes.CDLL:
    """libggml-base (:func:`library_source`), with the prototypes used here."""
    path, source = library_source()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise SettingError(f"{path} (from {source}) does not load: {exc}; {WAYS}") from None
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p,
    ]  # fmt: skip
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_blck_size.argtypes = [ctypes.c_int]
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_size.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def status_line() -> str:
    """One line for ``healsweep doctor``: whether ggml's quantizer loads, from where (and
    which llama-cpp-python or ggml version provides it), or why not and how to get it."""

    try:
        path, source = library_source()
        lib = libggml()
    except SettingError as exc:
        return f"ggml quantizer: absent ({exc}); routed-expert types other than q2_0 need it"
    if source == "llama-cpp-python":
        try:
            source = f"llama-cpp-python {version('llama-cpp-python')}"
        except PackageNotFoundError:  # pragma: no cover - the library loaded, so it is installed
            pass
    try:  # ggml_version() exists in ggml builds of 2025 and later
        lib.ggml_version.restype = ctypes.c_char_p
        source += f", ggml {lib.ggml_version().decode()}"
    except AttributeError:
        pass
    return f"ggml quantizer: present ({source}: {path})"


def block_geometry(qtype: int) -> tuple[int, int]:
    """``(weights per block, bytes per block)`` of ggml type ``qtype``, as ggml says."""
    lib = libggml()
    return int(lib.ggml_blck_size(int(qtype))), int(lib.ggml_type_size(int(qtype)))


def requires_imatrix(qtype: int) -> bool:
    """Whether ggml refuses to quantize ``qtype`` without an importance matrix."""
    return bool(libggml().ggml_quantize_requires_imatrix(int(qtype)))


def quantize_rows(values: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml's quantization of float32 rows ``[n, n_per_row]`` to ``qtype``: uint8 ``[n, row_bytes]``.

    ``imatrix`` is one importance value per column (``[n_per_row]``, float32) or None; ggml uses
    it for the types whose quantizer reads one (and ignores it for the others). The rows are
    quantized in ranges on :func:`~healsweep.threads.host_threads` threads (ggml's quantizer
    runs outside the GIL); every row is quantized alone, so the bytes are the same however
    they are split.
    """
    lib = libggml()
    values = np.ascontiguousarray(values, np.float32)
    n_rows, n_per_row = values.shape
    block, size = block_geometry(qtype)
    if n_per_row % block:
        raise ValueError(
            f"quantize_rows: rows of {n_per_row} do not fill blocks of {block} (ggml type {qtype})"
        )
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"quantize_rows: imatrix must be [{n_per_row}], got {imatrix.shape}")
    lib.ggml_quantize_init(int(qtype))  # its tables, once, before threads share them
    out = np.zeros((n_rows, n_per_row // block * size), np.uint8)
    weights = None if imatrix is None else imatrix.ctypes.data

    def chunk(rows: range) -> int:  # ggml takes the first weight's index, not the row's
        return lib.ggml_quantize_chunk(
            int(qtype), values.ctypes.data, out.ctypes.data, rows.start * n_per_row, len(rows),
            n_per_row, weights,
        )  # fmt: skip

    ranges = row_ranges(n_rows, host_threads())
    if len(ranges) == 1:
        written = chunk(ranges[0])
    else:  # each row is quantized on its own: the bytes do not depend on the split
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="ggml-quantize") as pool:
            written = sum(pool.map(chunk, ranges))
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


MIN_ROWS_PER_THREAD = 16  # below this a thread's start costs more than its rows


def row_ranges(n_rows: int, threads: int) -> list[range]:
    """``n_rows`` split into at most ``threads`` contiguous ranges of nearly equal size (each of
    at least :data:`MIN_ROWS_PER_THREAD` rows where there are that many), as ``llama-quantize``
    gives its threads chunks of rows."""
    parts = max(1, min(threads, n_rows // MIN_ROWS_PER_THREAD))
    bounds = [n_rows * i // parts for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def dequantize_rows(raw: np.ndarray, qtype: int, n_per_row: int) -> np.ndarray:
    """ggml's ``to_float`` of rows of stored bytes ``uint8 [..., row_bytes]``: float32 ``[..., n]``."""
    traits = libggml().ggml_get_type_traits(int(qtype)).contents
    if not traits.to_float:
        raise ValueError(f"ggml type {qtype} ({traits.type_name!r}) has no to_float")
    raw = np.ascontiguousarray(raw, np.uint8)
    lead = raw.shape[:-1]
    out = np.empty((*lead, n_per_row), np.float32)
    count = int(np.prod(lead, dtype=np.int64)) * n_per_row
    _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                               count)  # fmt: skip
    return out
