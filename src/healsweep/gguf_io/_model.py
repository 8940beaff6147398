"""A GGUF model file with its hparams; its tensors read lazily, one layer at a time.

Opening reads only the header (:mod:`healsweep.gguf_io._header`). Dequantizing goes through
``os.pread``-style reads (``np.fromfile`` with an offset) into a fresh buffer instead of through
the memmap: pages of a memmap stay in the process's RSS once touched, so a forward over every
layer would end up holding the whole file; a plain read is freed with the array, and peak RSS
follows one layer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf.quants import dequantize

from healsweep import kernels  # a lazy face: jax is imported where a decoder runs
from healsweep._inputs import open_regular
from healsweep.bundled import resolve_model
from healsweep.errors import GGUFFormatError
from healsweep.gguf_io._ggml_types import QUANT_SIZES, TensorType
from healsweep.gguf_io._header import (
    GGUFHeader,
    HeaderProblem,
    TruncatedTensor,
    UnknownTensorType,
    read_header,
)
from healsweep.gguf_io._hparams import ModelHparams
from healsweep.gguf_io._names import block_prefix
from healsweep.gguf_io._tokenizer import (
    build_tokenizer,
    load_tokenizer_file,
    tokenizer_metadata_from_gguf,
)
from healsweep.kernels.ggml_types import row_bytes, stored_ids
from healsweep.runtime import current

_GGUF_MAGIC = b"GGUF"
_FULL_HASH_LIMIT = 2 << 30  # files above 2 GiB get the sampled fingerprint
_SAMPLE_CHUNKS, _SAMPLE_BYTES = 64, 1 << 20


class GGUFModel:
    """A validated GGUF MoE model; tensors are read and dequantized on demand."""

    def __init__(self, header: GGUFHeader, hparams: ModelHparams, tokenizer_path=None):
        self.path = header.path
        self.arch = hparams.arch
        self.hparams = hparams
        self.header = header  # metadata fields and tensor infos, as stored
        self._tensors = {t.name: t for t in header.tensors}
        self._tokenizer_path = tokenizer_path

    # --- metadata -------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._tensors)

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, int, float, bool or list), or ``default`` when absent."""
        return self.header.get(key, default)

    def metadata_keys(self) -> list[str]:
        """All metadata keys of the file (``GGUF.*`` header fields excluded)."""
        return list(self.header.fields)

    @cached_property
    def fingerprint(self) -> str:
        """sha256-based content fingerprint of the file (see :func:`file_fingerprint`)."""
        return file_fingerprint(self.path, header_bytes=self.header.data_offset)

    def with_hparams(self, **changes: Any) -> GGUFModel:
        """The same file seen with some hyperparameters overridden (for what-if forwards)."""
        return GGUFModel(self.header, self.hparams.replace(**changes), self._tokenizer_path)

    # --- tensors --------------------------------------------------------------------------
    def _info(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFFormatError(
                f"tensor {name!r} is not in {self.path}; list them with `healsweep model info`"
            ) from None

    def tensor_type(self, name: str) -> TensorType:
        """The tensor's ggml type (a :class:`TensorType`, equal to gguf-py's member where it has
        one)."""
        return self._info(name).type

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Numpy shape (reversed ggml ``ne``) of the dequantized tensor."""
        return self._info(name).shape

    def tensor_nbytes(self, name: str) -> int:
        """Bytes the tensor occupies in the file."""
        return self._info(name).n_bytes

    def raw_tensor(self, name: str) -> tuple[TensorType, np.ndarray]:
        """``(ggml_type, raw)``: the stored values, or bytes ``[..., row bytes]`` of a block type
        (a read-only memmap view)."""
        info = self._info(name)
        return info.type, _mapped(self.path, info)

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor, dequantized to float32, in numpy shape."""
        return self.tensor_rows(name, 0, None)

    def tensor_rows(self, name: str, start: int, stop: int | None) -> np.ndarray:
        """Slice ``[start:stop]`` along the first numpy axis, dequantized to float32."""
        info = self._info(name)
        shape = self.tensor_shape(name)
        stop = shape[0] if stop is None else min(stop, shape[0])
        dtype, raw_shape = info.stored()
        row_items = int(np.prod(raw_shape[1:], dtype=np.int64))
        row_bytes = row_items * dtype.itemsize
        raw = np.fromfile(
            self.path,
            dtype=dtype,
            count=(stop - start) * row_items,
            offset=info.offset + start * row_bytes,
        ).reshape((stop - start, *raw_shape[1:]))
        out = _dequantize(raw, info.type, shape[-1])
        return out.reshape((stop - start, *shape[1:]))

    def row_bytes(self, name: str) -> int:
        """Stored bytes of one row (the last numpy axis) of the tensor."""
        return row_bytes(int(self.tensor_type(name)), self.tensor_shape(name)[-1])

    def tensors(self) -> Mapping[str, np.ndarray]:
        """Every tensor by name, in file order, dequantized to float32 when accessed (one at a
        time: ``write_model(..., model.tensors(), ...)`` re-encodes a model in a layer's memory)."""
        return _LazyTensors(self)

    def raw_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The stored bytes of rows ``[start:stop]`` (first numpy axis): uint8 ``[n, ..., row]``.

        Read with one positioned read into a fresh buffer (never through the memmap, whose pages
        would stay resident), so a layer's bytes are freed with the array. This is what goes to
        the device for in-graph decoding: no float32 copy is made on the host.
        """
        info = self._info(name)
        shape = self.tensor_shape(name)
        if len(shape) < 2:
            raise ValueError(f"raw_rows: {name} is a vector; read it with tensor()")
        stop = shape[0] if stop is None else min(stop, shape[0])
        inner = (*shape[1:-1], self.row_bytes(name))
        first_bytes = int(np.prod(inner, dtype=np.int64))
        raw = _read_aligned(
            self.path, info.offset + start * first_bytes, (stop - start) * first_bytes
        )
        return raw.reshape((stop - start, *inner))

    def tensor_take(self, name: str, rows: Iterable[int]) -> np.ndarray:
        """Rows ``rows`` of a matrix (e.g. token embeddings), dequantized to float32."""
        info = self._info(name)
        idx = np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, np.int64)
        raw = np.array(_mapped(self.path, info)[idx])  # touches only those rows' pages
        out = _dequantize(raw, info.type, self.tensor_shape(name)[-1])
        return out.reshape((len(idx), *self.tensor_shape(name)[1:]))

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Every tensor of block ``i``, float32, keyed by suffix (``"ffn_gate_exps.weight"``)."""
        if not 0 <= i < self.hparams.n_layer:
            raise GGUFFormatError(
                f"layer {i} is out of range for {self.path} ({self.hparams.n_layer} layers)"
            )
        prefix = block_prefix(i)
        return {n[len(prefix) :]: self.tensor(n) for n in self._tensors if n.startswith(prefix)}

    # --- tokenizer ------------------------------------------------------------------------
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` of this model (from a tokenizer.json if one was given)."""
        if "_tokenizer_obj" not in self.__dict__:
            if self._tokenizer_path is not None:
                tok = load_tokenizer_file(self._tokenizer_path)
            else:
                meta = tokenizer_metadata_from_gguf(self.metadata, str(self.path))
                tok = build_tokenizer(meta, str(self.path))
            self.__dict__["_tokenizer_obj"] = tok
        return self.__dict__["_tokenizer_obj"]

    def __repr__(self) -> str:
        hp = self.hparams
        return (
            f"GGUFModel({str(self.path)!r}, arch={hp.arch}, layers={hp.n_layer}, "
            f"experts={hp.n_expert}x top{hp.n_expert_used})"
        )


def _mapped(path: Path, info: Any) -> np.ndarray:
    """A read-only memmap of a tensor's stored data."""
    dtype, shape = info.stored()
    return np.memmap(path, dtype=dtype, mode="r", offset=info.offset, shape=shape)


@cache
def host_decodable(qtype: int) -> bool:
    """Whether gguf-py's numpy code dequantizes ggml type ``qtype`` (tried on one zero block;
    gguf-py raises ``NotImplementedError`` for a type it has no code for)."""

    qtype = TensorType(int(qtype))
    block, size = QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(size if block > 1 else 4, np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _dequantize(raw: np.ndarray, qtype: Any, n_in: int) -> np.ndarray:
    """Stored values/bytes to float32 on the host: gguf-py's numpy decoder, or, for a type it
    has none for (Q2_0), the in-graph decoder run once."""

    if host_decodable(qtype):
        return np.asarray(dequantize(raw, qtype), dtype=np.float32)
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, row_bytes(qtype, n_in))
    return np.asarray(kernels.ggml_decode.decode_rows(rows, int(qtype), n_in))


class _LazyTensors(Mapping):
    """Name → float32 tensor of a model, read on access."""

    def __init__(self, model: GGUFModel):
        self._model = model

    def __getitem__(self, name: str) -> np.ndarray:
        return self._model.tensor(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it (what a writer lays out first)."""
        return tuple(self._model.tensor_shape(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._model.tensor_names)

    def __len__(self) -> int:
        return len(self._model.tensor_names)


_ALIGN = 64  # XLA's CPU client adopts 64-byte-aligned host buffers without copying them


def _read_aligned(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``path`` from ``offset`` into a fresh 64-byte-aligned uint8 buffer.

    Aligned, the buffer becomes a CPU device array without a second copy (measured: 0.08 s
    saved per 175 MiB expert tensor); a short read means the file changed under us.
    """
    backing = np.empty(nbytes + _ALIGN, np.uint8)
    skip = (-backing.ctypes.data) % _ALIGN
    out = backing[skip : skip + nbytes]
    view, done = memoryview(out), 0
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        while done < nbytes:
            got = fh.readinto(view[done:])
            if not got:
                raise GGUFFormatError(
                    f"{path} ended at byte {offset + done} while reading {nbytes} bytes from "
                    f"{offset}; the file was truncated or replaced, open it again"
                )
            done += got
    return out


def file_fingerprint(path: str | Path, *, header_bytes: int = 0) -> str:
    """A content fingerprint of a file, memoized per (path, size, mtime_ns) by this process's
    runtime (:func:`healsweep.runtime.current`).

    Files up to 2 GiB: the sha256 of all bytes. Larger files: hashing tens of GiB before every
    trial would dominate short sweeps, so the digest covers the size, the first ``header_bytes``
    (the GGUF metadata and tensor infos: every name, shape, type and offset) and 64 evenly spaced
    1 MiB chunks of tensor data; such fingerprints are prefixed ``sampled-sha256:`` so they are
    never mistaken for (or collide with) a full-file hash.
    """
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if st.st_size <= _FULL_HASH_LIMIT:
        return current().memo(("fingerprint", *key), lambda: _full_digest(path))
    return current().memo(("fingerprint", *key), lambda: _sampled_digest(path, header_bytes))


def _full_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sampled_digest(path: Path, header_bytes: int) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(b"healsweep-sampled-v1")
    digest.update(size.to_bytes(8, "little"))
    with path.open("rb") as fh:
        digest.update(fh.read(header_bytes))
        span = max(size - header_bytes - _SAMPLE_BYTES, 0)
        for j in range(_SAMPLE_CHUNKS):
            fh.seek(header_bytes + span * j // (_SAMPLE_CHUNKS - 1))
            digest.update(fh.read(_SAMPLE_BYTES))
    return "sampled-sha256:" + digest.hexdigest()


def read_gguf(path_or_demo: str | Path) -> GGUFHeader:
    """The header of a GGUF file (``"demo"`` is the packaged demo model), with a missing,
    truncated or corrupt file turned into a one-line :class:`GGUFFormatError`."""

    path = resolve_model(path_or_demo)
    try:
        with open_regular(path, "GGUF model", error=GGUFFormatError) as fh:
            magic = fh.read(4)
    except FileNotFoundError:
        raise GGUFFormatError(
            f"model file {path} does not exist; pass a .gguf path or `demo`"
        ) from None
    except OSError as exc:
        raise GGUFFormatError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if magic != _GGUF_MAGIC:
        raise GGUFFormatError(
            f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'); pass a .gguf model"
        )
    try:
        return read_header(path)
    except UnknownTensorType as unknown:
        raise GGUFFormatError(
            f"{path}: tensor {unknown.name} has ggml type {unknown.qtype}, which healsweep "
            "cannot read; requantize the model to a supported type (`healsweep model info` "
            "lists a readable model's types)"
        ) from None
    except TruncatedTensor as cut:
        raise GGUFFormatError(
            f"{path} is truncated: tensor {cut.name} ends at byte {cut.end} but the file has "
            f"{cut.size} bytes; re-download or re-export the file"
        ) from None
    except HeaderProblem as problem:
        raise GGUFFormatError(
            f"{path} is corrupt in its header: {problem}; re-download or re-export the file"
        ) from None
    except Exception as exc:  # struct.error, ValueError, ... on a cut or damaged header
        detail = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise GGUFFormatError(
            f"{path} is truncated or corrupt in its header ({type(exc).__name__}"
            f"{': ' + detail if detail else ''}); re-download or re-export the file"
        ) from exc


def check_tensors(header: GGUFHeader, expected: dict[str, tuple], arch: str) -> None:
    """Raise :class:`GGUFFormatError` unless every ``expected`` tensor (name → numpy shape) is in
    the file with that shape and a type healsweep can decode."""
    path, infos = header.path, {t.name: t for t in header.tensors}
    decodable = {int(t.type) for t in header.tensors if host_decodable(t.type)}
    decodable |= stored_ids()  # the in-graph decoders' types (kernels.ggml_decode)
    for name, shape in expected.items():
        if name not in infos:
            raise GGUFFormatError(
                f"{path} is missing tensor {name} required by {arch}; the file is "
                "incomplete, re-export it"
            )
        got = infos[name].shape
        if got != shape:
            raise GGUFFormatError(
                f"{path}: tensor {name} has shape {got}, expected {shape} from the hparams; "
                "the file is inconsistent, re-export it"
            )
        if int(infos[name].type) not in decodable:
            raise GGUFFormatError(
                f"{path}: tensor {name} has type {infos[name].type.name}, which healsweep "
                "cannot decode; requantize the model to a supported type"
            )
