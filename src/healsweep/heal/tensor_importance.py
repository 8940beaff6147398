"""Stage ``tensor_importance``: E[x²] of the input of every tensor a group knob requantizes.

The teacher runs over the calibration pool's chunks (those the trace runs) and
:func:`healsweep.model.moments.input_moments` sums x² at each input site, as ``llama-imatrix``
records it for ``llama-quantize --imatrix``; :class:`~healsweep.heal.tensor_types.InputMoments`
is the entry, and :mod:`healsweep.heal.tensor_types` turns it into ggml's importance rows. Apart
from tensor_types because this runs the forward (jax), and the size of a config, which
tensor_types also answers, is read without it (``sweep status``, the budget).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from healsweep.data.chat_template import model_chat_format
from healsweep.data.corpus import load_corpus
from healsweep.heal._runner import StageRunner, stage_key
from healsweep.heal.tensor_types import InputMoments
from healsweep.heal.trace import _batches, budgeted, calibration_documents, make_chunks, trace_key
from healsweep.model.moments import input_moments
from healsweep.stage_names import Stage

if TYPE_CHECKING:
    from healsweep.cache import StageCache
    from healsweep.data.corpus import Corpus
    from healsweep.gguf_io import GGUFModel
    from healsweep.heal.knobs import CalibrationConfig


def importance_key(model: GGUFModel, calibration: CalibrationConfig, corpus: Corpus) -> str:
    """Key of the input moments: the calibration trace's inputs (model, settings, documents)."""
    docs = calibration_documents(corpus, calibration)
    return stage_key(Stage.TENSOR_IMPORTANCE, {"trace": trace_key(model, calibration, docs)})


def compute_moments(
    model: GGUFModel, calibration: CalibrationConfig, corpus: Corpus
) -> InputMoments:
    """The teacher's input moments over the calibration pool's chunks (those the trace runs)."""
    calibration = budgeted(model, calibration)
    docs = calibration_documents(corpus, calibration)
    chunks, _ = make_chunks(docs, model.tokenizer(), calibration, model_chat_format(model))
    sums: dict[str, np.ndarray] = {}
    tokens = 0
    for _, batch in _batches(chunks):
        found, n = input_moments(model, [chunks[i].tokens for i in batch])
        for site, value in found.items():
            sums[site] = sums[site] + value if site in sums else value
        tokens += n
    return InputMoments(sums, tokens)


def input_importance(
    model: GGUFModel,
    calibration: CalibrationConfig,
    cache: StageCache,
    corpus: Corpus | None = None,
) -> tuple[str, InputMoments]:
    """The cached input moments of ``model`` on ``calibration`` (computed once per key) and
    their key."""
    corpus = corpus if corpus is not None else load_corpus(calibration.corpus)
    key = importance_key(model, calibration, corpus)
    compute = partial(compute_moments, model, calibration, corpus)
    return key, StageRunner(cache).value(Stage.TENSOR_IMPORTANCE, key, InputMoments, compute)
