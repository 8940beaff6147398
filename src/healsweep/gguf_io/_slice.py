"""Cut a contiguous range of layers out of a GGUF MoE model into a smaller, valid GGUF.

The slice is written directly in the GGUF layout rather than through ``gguf.GGUFWriter``: every
metadata field is copied as its stored bytes (so its value type, and a tokenizer's 150k-entry
string arrays, come through unchanged and without decoding), and every tensor's data is copied
in bounded chunks from the source file, so peak memory stays a few MiB whatever the model's size.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys

from healsweep._atomic import atomic_file
from healsweep.errors import HealsweepError, SliceError
from healsweep.gguf_io._header import SCALAR_FORMATS as _SCALAR_FORMATS
from healsweep.gguf_io._model import GGUFModel
from healsweep.gguf_io._names import block_prefix, split_block

PROVENANCE_FINGERPRINT = "healsweep.slice.source_fingerprint"
PROVENANCE_LAYERS = "healsweep.slice.layers"
_COPY_CHUNK = 16 << 20
_RANGE = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*$")


def parse_layer_range(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` → ``(A, B)``; ``"A:"`` and ``":B"`` leave the open end ``None``."""
    match = _RANGE.match(text)
    if match is None or match.group(1) is None and match.group(2) is None:
        raise SliceError(
            f"layer range {text!r} is not of the form A:B; give the first layer and one past "
            "the last, e.g. 0:2 (A: and :B leave an end open)"
        )
    return tuple(None if g is None else int(g) for g in match.groups())  # type: ignore[return-value]


def _resolve_range(
    layers: tuple[int | None, int | None], n_layer: int, src: Path
) -> tuple[int, int]:
    start = 0 if layers[0] is None else int(layers[0])
    stop = n_layer if layers[1] is None else int(layers[1])
    shown = f"{'' if layers[0] is None else start}:{'' if layers[1] is None else stop}"
    if start < 0 or stop < 0:
        raise SliceError(
            f"layer range {shown} has a negative layer; layers are numbered 0 to "
            f"{n_layer - 1} in {src}"
        )
    if start >= stop:
        raise SliceError(
            f"layer range {shown} is empty (A must be less than B); e.g. "
            f"{start}:{start + 1} holds layer {start} alone"
        )
    if stop > n_layer:
        raise SliceError(
            f"layer range {shown} runs past the {n_layer} layers of {src}; B must "
            f"be at most {n_layer}"
        )
    return start, stop


def _check_out(src: Path, out: Path) -> None:
    if out.exists() and out.resolve() == src.resolve():
        raise SliceError(f"output {out} is the source model itself; pass another --out path")
    if not out.parent.is_dir():
        raise SliceError(
            f"output folder {out.parent} does not exist; create it or pass another --out path"
        )
    if out.is_dir():
        raise SliceError(f"output {out} is a folder; pass a file path such as {out}/slice.gguf")


class _Encoder:
    """Packs GGUF header values in the source file's byte order."""

    def __init__(self, little_endian: bool):
        self.order = "<" if little_endian else ">"

    def pack(self, fmt: str, *values: Any) -> bytes:
        return struct.pack(self.order + fmt, *values)

    def string(self, text: str) -> bytes:
        raw = text.encode("utf-8")
        return self.pack("Q", len(raw)) + raw

    def kv(self, key: str, value_type: Any, value: Any) -> bytes:
        """One metadata field: a scalar of ``value_type`` or (for STRING) a string."""

        head = self.string(key) + self.pack("I", int(value_type))
        if value_type == GGUFValueType.STRING:
            return head + self.string(value)
        return head + self.pack(_SCALAR_FORMATS[int(value_type)], value)


def _metadata_bytes(
    model: GGUFModel, enc: _Encoder, start: int, stop: int
) -> tuple[list[bytes], int]:
    """Every metadata field of the source, as stored, with the slice's changes applied.

    Returns the encoded fields and their count. Fields are copied byte for byte from the mapped
    header; only ``{arch}.block_count``, ``leading_dense_block_count`` (the dense layers kept),
    ``nextn_predict_layers`` (0: trailing prediction layers are never kept), per-layer
    ``{arch}.*`` arrays and the provenance keys are re-encoded.
    """

    header = model.header
    with open(header.path, "rb") as fh:
        raw = fh.read(header.kv_end)
    arch, n_layer = model.arch, model.hparams.n_layer

    prior = model.metadata(PROVENANCE_LAYERS)
    base = int(prior.split(":")[0]) if isinstance(prior, str) and ":" in prior else 0
    provenance = {
        PROVENANCE_FINGERPRINT: model.metadata(PROVENANCE_FINGERPRINT) or model.fingerprint,
        PROVENANCE_LAYERS: f"{base + start}:{base + stop}",
    }
    out = []
    for field in header.fields.values():
        key = field.name
        if key == Keys.LLM.BLOCK_COUNT.format(arch=arch):
            out.append(enc.kv(key, field.type, stop - start))
        elif key == Keys.LLM.LEADING_DENSE_BLOCK_COUNT.format(
            arch=arch
        ):  # the dense layers the range keeps
            dense = model.hparams.n_leading_dense
            out.append(enc.kv(key, field.type, min(max(dense - start, 0), stop - start)))
        elif key == Keys.LLM.NEXTN_PREDICT_LAYERS.format(
            arch=arch
        ):  # a slice never holds the MTP layers
            out.append(enc.kv(key, field.type, 0))
        elif key in provenance:
            out.append(enc.kv(key, GGUFValueType.STRING, provenance.pop(key)))
        elif (
            key.startswith(f"{arch}.")
            and field.type == GGUFValueType.ARRAY
            and len(field.value) == n_layer
            and int(field.item_type) in _SCALAR_FORMATS
        ):
            # one entry per layer (llama.cpp's per-layer head counts, FFN widths): keep the range
            dtype = np.dtype(_SCALAR_FORMATS[int(field.item_type)]).newbyteorder(enc.order)
            items = np.asarray(field.value[start:stop], dtype)
            out.append(
                enc.string(key)
                + enc.pack("IIQ", int(field.type), int(field.item_type), stop - start)
                + items.tobytes()
            )
        else:
            out.append(raw[field.offset : field.end])
    for key, value in provenance.items():
        out.append(enc.kv(key, GGUFValueType.STRING, value))
    return out, len(out)


def _sliced_tensors(model: GGUFModel, start: int, stop: int) -> list[tuple[str, Any]]:
    """``(new name, tensor info)`` in file order: non-block tensors and blocks start..stop-1."""
    kept = []
    for tensor in model.header.tensors:
        layer, inside = split_block(tensor.name)
        if layer is None:
            kept.append((tensor.name, tensor))
        elif start <= layer < stop:
            kept.append((block_prefix(layer - start) + inside, tensor))
    return kept


def _copy_range(src_fh: Any, dst_fh: Any, offset: int, n_bytes: int, buffer: memoryview) -> None:
    src_fh.seek(offset)
    left = n_bytes
    while left:
        got = src_fh.readinto(buffer[: min(left, len(buffer))])
        if not got:
            raise SliceError(
                f"{src_fh.name} ended while copying tensor data; the file is "
                "truncated, re-download or re-export it"
            )
        dst_fh.write(buffer[:got])
        left -= got


def slice_model(model: GGUFModel, layers: tuple[int | None, int | None], out: str | Path) -> Path:
    """Write layers ``A..B-1`` of ``model`` to ``out`` as a valid GGUF; return ``out``.

    ``layers`` is ``(A, B)``; ``None`` for A or B means the first layer or one past the last.
    The slice holds blocks ``blk.{A+i}.*`` renamed ``blk.{i}.*``, every non-block tensor
    (embeddings, output norm and head) and every metadata field of ``src`` (tokenizer included)
    with its stored value type, except that ``{arch}.block_count`` becomes ``B - A`` and
    ``{arch}.*`` arrays with one entry per layer keep entries A..B-1. Two provenance keys are
    added: ``healsweep.slice.source_fingerprint`` (the source's :func:`file_fingerprint`) and
    ``healsweep.slice.layers`` (``"A:B"``); a slice of a slice records the range and fingerprint
    of the original model, so it is byte-identical to the direct slice. Tensor data is copied as
    stored bytes (any ggml type) in 16 MiB chunks. The file is written to a temp name in the
    destination folder and renamed; on any error no output is left behind.

    ``model`` is an open model (``healsweep.model.open_model``). Raises :class:`SliceError` for a
    bad range or output path.
    """
    src_path, out = model.path, Path(out)
    _check_out(src_path, out)
    start, stop = _resolve_range(layers, model.hparams.n_layer, src_path)
    header = model.header
    enc = _Encoder(header.little_endian)
    alignment, version = header.alignment, header.version

    kv_blobs, n_kv = _metadata_bytes(model, enc, start, stop)
    tensors = _sliced_tensors(model, start, stop)
    infos, offsets, offset = [], [], 0
    for name, tensor in tensors:
        offset += -offset % alignment
        dims = tensor.dims
        infos.append(
            enc.string(name)
            + enc.pack("I", len(dims))
            + enc.pack(f"{len(dims)}Q", *dims)
            + enc.pack("IQ", int(tensor.type), offset)
        )
        offsets.append(offset)
        offset += int(tensor.n_bytes)
    header = [b"GGUF", enc.pack("IQQ", version, len(tensors), n_kv), *kv_blobs, *infos]
    header_len = sum(len(b) for b in header)

    try:
        with open(src_path, "rb") as src_fh, atomic_file(out, "wb") as dst_fh:
            for blob in header:
                dst_fh.write(blob)
            dst_fh.write(b"\0" * (-header_len % alignment))
            data_start = header_len + (-header_len % alignment)
            buffer = memoryview(bytearray(_COPY_CHUNK))
            for (_, tensor), rel in zip(tensors, offsets, strict=True):
                dst_fh.write(b"\0" * (data_start + rel - dst_fh.tell()))
                _copy_range(src_fh, dst_fh, tensor.offset, tensor.n_bytes, buffer)
            dst_fh.write(b"\0" * (-dst_fh.tell() % alignment))
    except HealsweepError:
        raise
    except OSError as exc:
        raise SliceError(
            f"cannot write {out}: {exc.strerror or exc}; free disk space or pass another --out path"
        ) from exc
    return out
