"""Reading and writing GGUF MoE models: hparams, lazy tensors, tokenizer, writer, layer slices,
scales folded into stored blocks."""

from healsweep.gguf_io._fold import FOLDABLE_TYPES, fold_scale
from healsweep.gguf_io._ggml_types import GGML_Q2_0, q2_0_type
from healsweep.gguf_io._hparams import SUPPORTED_ARCHS, ModelHparams, expected_tensor_shapes
from healsweep.gguf_io._model import GGUFModel, file_fingerprint, open_model
from healsweep.gguf_io._slice import parse_layer_range, slice_model
from healsweep.gguf_io._summary import routed_expert_bpw
from healsweep.gguf_io._tokenizer import (
    TokenizerMetadata,
    build_tokenizer,
    load_tokenizer_file,
    tokenizer_metadata_from_tokenizer,
)
from healsweep.gguf_io._writer import encode_tensor, write_model

__all__ = [
    "FOLDABLE_TYPES",
    "GGML_Q2_0",
    "SUPPORTED_ARCHS",
    "GGUFModel",
    "ModelHparams",
    "TokenizerMetadata",
    "build_tokenizer",
    "encode_tensor",
    "expected_tensor_shapes",
    "file_fingerprint",
    "fold_scale",
    "load_tokenizer_file",
    "open_model",
    "parse_layer_range",
    "q2_0_type",
    "routed_expert_bpw",
    "slice_model",
    "tokenizer_metadata_from_tokenizer",
    "write_model",
]
