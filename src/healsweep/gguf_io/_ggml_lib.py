"""ggml's own quantizer and dequantizer, from the libggml-base that llama-cpp-python bundles.

Used for the external baseline (``healsweep baseline llama``: llama.cpp's quantization of the
routed experts) and, in tests, as an implementation of every block format independent of
healsweep's decoders, and for the routed experts stored in a ggml type (knobs ``type_gu``,
``type_d``). ``llama-cpp-python`` is an optional extra (``pip install -e ".[ggml]"``, also in
``[bench]``); without it these functions raise :class:`~healsweep.errors.SettingError`. The library is loaded
with ``ctypes`` directly, without importing ``llama_cpp`` (which would load libllama and its CPU
backend into the process).
"""

from __future__ import annotations

import ctypes
import importlib.util
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


def _library_path() -> Path:
    """Where the installed llama-cpp-python keeps its libggml-base; SettingError if nowhere."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SettingError(
            "llama-cpp-python is not installed; install the ggml extra "
            '(pip install -e ".[ggml]") to use ggml\'s quantizer'
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib"
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    candidates = [folder / f"libggml-base{suffix}", folder / "libggml-base.so"]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise SettingError(f"llama-cpp-python has no libggml-base in {folder}; reinstall it")
    return path


@cache
def libggml() -> ctypes.CDLL:
    """libggml-base of the installed llama-cpp-python, with the prototypes used here."""
    lib = ctypes.CDLL(str(_library_path()))
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
    """One line for ``healsweep doctor``: whether ggml's quantizer loads (and which
    llama-cpp-python provides it), or why not."""

    try:
        path = _library_path()
        libggml()
    except SettingError as exc:
        return f"ggml quantizer: absent ({exc}); routed-expert types other than q2_0 need it"
    try:
        provider = f"llama-cpp-python {version('llama-cpp-python')}"
    except PackageNotFoundError:  # pragma: no cover - the library loaded, so it is installed
        provider = "llama-cpp-python"
    return f"ggml quantizer: present ({provider}, {path.name})"


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
