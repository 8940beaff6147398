"""Reading and writing GGUF files: metadata, lazy tensors, tokenizer, writer, layer slices,
scales folded into stored blocks.

What a file's metadata and tensors mean for its architecture is :mod:`healsweep.model`'s part
(``healsweep.model.open_model`` opens a model through this package).
"""

from healsweep.gguf_io._fold import FOLDABLE_TYPES, fold_scale
from healsweep.gguf_io._ggml_types import (
    GGML_Q2_0,
    QUANT_SIZES,
    TensorType,
    add_tensor_info,
    element_shape,
    q2_0_type,
)
from healsweep.gguf_io._header import GGUFHeader, read_header
from healsweep.gguf_io._hparams import ModelHparams
from healsweep.gguf_io._model import GGUFModel, check_tensors, file_fingerprint, read_gguf
from healsweep.gguf_io._names import HEAD, block_prefix, layer_tensor, split_block, tensor_name
from healsweep.gguf_io._slice import parse_layer_range, slice_model
from healsweep.gguf_io._summary import (
    chat_template_summary,
    layer_bytes,
    routed_expert_bpw,
    tensor_storage,
    tokenizer_summary,
)
from healsweep.gguf_io._tokenizer import (
    TokenizerMetadata,
    build_tokenizer,
    load_tokenizer_file,
    tokenizer_metadata_from_tokenizer,
)
from healsweep.gguf_io._tokenizer_checks import check_tokenizer_fields
from healsweep.gguf_io._writer import encode_tensor, write_gguf

__all__ = [
    "FOLDABLE_TYPES",
    "GGML_Q2_0",
    "HEAD",
    "QUANT_SIZES",
    "TensorType",
    "GGUFHeader",
    "GGUFModel",
    "ModelHparams",
    "TokenizerMetadata",
    "add_tensor_info",
    "block_prefix",
    "build_tokenizer",
    "chat_template_summary",
    "check_tensors",
    "check_tokenizer_fields",
    "element_shape",
    "encode_tensor",
    "file_fingerprint",
    "layer_bytes",
    "layer_tensor",
    "fold_scale",
    "load_tokenizer_file",
    "parse_layer_range",
    "q2_0_type",
    "read_gguf",
    "read_header",
    "routed_expert_bpw",
    "slice_model",
    "split_block",
    "tensor_name",
    "tensor_storage",
    "tokenizer_metadata_from_tokenizer",
    "tokenizer_summary",
    "write_gguf",
]
