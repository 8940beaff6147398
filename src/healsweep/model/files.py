"""A GGUF file as a model of its architecture: opening, writing, the tensor layout, its summary.

:mod:`healsweep.gguf_io` reads and writes the file; the architecture (``general.architecture``,
:mod:`healsweep.model.registry`) says what its metadata and tensors mean.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gguf import Keys

from healsweep.errors import GGUFFormatError
from healsweep.gguf_io import (
    GGUFModel,
    ModelHparams,
    chat_template_summary,
    check_tensors,
    check_tokenizer_fields,
    layer_bytes,
    read_gguf,
    tensor_storage,
    tokenizer_summary,
    write_gguf,
)
from healsweep.model.registry import ARCHITECTURES, GENERIC, SUPPORTED_ARCHS, architecture


def open_model(path_or_demo: str | Path, *, tokenizer_path: str | Path | None = None) -> GGUFModel:
    """Open and validate a GGUF model (``"demo"`` is the packaged demo model).

    Raises :class:`GGUFFormatError` (one line) for a missing, non-GGUF or truncated file, an
    unsupported ``general.architecture`` (:class:`UnsupportedArchitectureError`), a missing
    hyperparameter, and a missing or misshapen tensor. ``tokenizer_path`` replaces the GGUF's
    own tokenizer metadata with a tokenizer.json.
    """
    header = read_gguf(path_or_demo)
    path = header.path
    name = header.get(Keys.General.ARCHITECTURE)
    if name is None:
        raise GGUFFormatError(
            f"{path} is missing hparam {Keys.General.ARCHITECTURE}; the file is incomplete, "
            "re-export it"
        )
    arch = architecture(name, where=path)
    shapes = {t.name: t.shape for t in header.tensors}
    arch.check_file(path, list(shapes), SUPPORTED_ARCHS)
    missing = arch.missing_keys(lambda key: key in header.fields)
    if missing:
        raise GGUFFormatError(
            f"{path} is missing hparam {missing[0]}; the file is incomplete, re-export it"
        )
    try:
        hp = arch.read_hparams(header.get, shapes)
    except GGUFFormatError as exc:  # raised without the file's name
        raise GGUFFormatError(f"{path}: {exc}") from None
    tied = "output.weight" not in shapes
    check_tensors(header, arch.tensor_shapes(hp, tied_output=tied), hp.arch)
    # the embedding's rows (and the output head's, which check_tensors held to n_vocab)
    check_tokenizer_fields(header.fields, hp.n_vocab, str(path))
    return GGUFModel(header, hp, tokenizer_path)


def expected_tensor_shapes(hp: ModelHparams, *, tied_output: bool = False) -> dict[str, tuple]:
    """Every tensor the forward of ``hp``'s architecture reads, with its numpy shape."""
    return architecture(hp.arch).tensor_shapes(hp, tied_output=tied_output)


def write_model(
    path: str | Path, arch: str, hparams: ModelHparams, tensors: Mapping[str, Any], *args: Any,
    **options: Any,
) -> Path:  # fmt: skip
    """Write a GGUF of ``hparams`` (metadata as its architecture writes it) with ``tensors``.

    ``arch`` is written as ``general.architecture`` and as the key prefix: any string, so tests
    can write architectures healsweep refuses (with the shared keys only). The other arguments
    are :func:`healsweep.gguf_io.write_gguf`'s: ``types``, ``tokenizer_metadata``, ``name``,
    ``extra_metadata``, ``drop_keys``.
    """
    metadata = ARCHITECTURES.get(arch, GENERIC).metadata(hparams.replace(arch=arch))
    return write_gguf(path, arch, metadata, tensors, *args, **options)


def describe_model(model: GGUFModel) -> dict[str, Any]:
    """Everything ``healsweep model info`` prints, as plain data."""
    hp = model.hparams
    stored, dequantized = layer_bytes(model, 0)
    return {
        "path": str(model.path),
        "arch": hp.arch,
        "layers": hp.n_layer,
        "experts": hp.n_expert,
        "experts_used": hp.n_expert_used,
        "norm_topk_prob": hp.norm_topk_prob,
        "routing": hp.routing_summary(),
        "attention": architecture(hp.arch).attention_summary(hp),
        "moe_layers": [hp.moe_layers.start, hp.moe_layers.stop],
        "n_embd": hp.n_embd,
        "n_head": hp.n_head,
        "n_head_kv": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "n_ff_exp": hp.n_ff_exp,
        "n_ff_shexp": hp.n_ff_shexp,
        "n_vocab": hp.n_vocab,
        "context_length": hp.context_length,
        "rope_freq_base": hp.rope_freq_base,
        "rms_norm_eps": hp.rms_norm_eps,
        "file_bytes": model.path.stat().st_size,
        "layer_bytes": stored,
        "layer_bytes_f32": dequantized,
        "tensor_types": tensor_storage(model),
        "tokenizer": tokenizer_summary(model),
        "chat_template": chat_template_summary(model),
        "healsweep": healsweep_metadata(model),
    }


HEAL_PREFIX = "healsweep."


def healsweep_metadata(model: GGUFModel) -> dict[str, Any] | None:
    """The ``healsweep.*`` fields a healed or exported file carries (docs/export.md), keyed
    without the prefix, JSON fields (``knobs``, ``calibration``, ``ledger_head``) decoded; None
    for a file healsweep did not write."""
    keys = [k for k in model.metadata_keys() if k.startswith(HEAL_PREFIX)]
    if not keys:
        return None
    out: dict[str, Any] = {}
    for key in keys:
        value = model.metadata(key)
        if isinstance(value, str) and value[:1] in "{[":
            try:
                value = json.loads(value)
            except ValueError:
                pass
        elif isinstance(value, Sequence) and not isinstance(value, str):  # a list, or gguf_io's
            # arrays held as stored bytes (a string is a Sequence too: it stays a string)
            value = [float(v) if not isinstance(v, str) else v for v in value]
        out[key[len(HEAL_PREFIX) :]] = value
    return out
