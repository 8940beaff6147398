"""The one boundary between the sweep and a trial's real work (heal + score).

:func:`run_trial_work` builds the healed student through the stage caches and scores the dev
windows one by one in the trial's order (:func:`run_external_work`: a GGUF made elsewhere);
:func:`sweep_identity` is what the manifest records. The trainable takes the work function as a
parameter, so tests hand it their own with the same signature.

Only dev windows are ever built here, and never with a ledger grant: a sweep cannot open the
test split.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from healsweep.cache import StageCache
from healsweep.data.chat_template import model_chat_format, render_document
from healsweep.data.corpus import load_corpus
from healsweep.data.split import load_split, parity_split, resolve_split, split_lock_id
from healsweep.errors import SpecError, SplitError
from healsweep.heal.knobs import Knobs
from healsweep.heal.pipeline import build_student
from healsweep.heal.quantize import check_quantizable
from healsweep.heal.trace import calibration_documents
from healsweep.model import open_model
from healsweep.score.expert_cache import ExpertCacheConfig
from healsweep.score.record import WindowRecord
from healsweep.score.runner import score_windows, teacher_ahead
from healsweep.score.windows import scoring_windows
from healsweep.score.windows import window_options as scoring_window_options
from healsweep.sweep.space import GRIDDED, grid_configs, varied_knobs
from healsweep.sweep.spec import ScoringSpec, SweepSpec

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus
    from healsweep.data.split import SplitConfig
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel
    from healsweep.score.student import StudentModel

# A work function: (spec, knobs, ids of the windows done, seed) -> a record per window it scores.
WorkFn = Callable[[SweepSpec, Knobs, Collection[str], int], Iterator[WindowRecord]]


def trial_order(n_windows: int, seed: int) -> list[int]:
    """A trial's window order: a seeded permutation of the global order ``0..n_windows-1``."""
    return [int(i) for i in np.random.default_rng(seed).permutation(n_windows)]


def spec_split(spec: SweepSpec) -> tuple[Corpus, SplitConfig]:
    """``(corpus, split config)`` of a sweep spec (``split: auto`` is the corpus's parity split)."""

    corpus = load_corpus(spec.corpus)
    return corpus, parity_split(corpus) if spec.split == "auto" else load_split(spec.split)


def window_options(scoring: ScoringSpec, teacher: GGUFModel) -> dict[str, Any]:
    """``make_windows`` options of a spec's ``scoring`` (:func:`healsweep.score.windows
    .window_options`: the teacher's chat format, the context capped to the teacher's)."""
    return scoring_window_options(teacher, scoring.max_scored, scoring.max_context)


def dev_windows(spec: SweepSpec, teacher: GGUFModel) -> list[Window]:
    """The sweep's dev windows in the fixed global order (sorted ids), the first max_windows."""
    corpus, split_cfg = spec_split(spec)
    options = window_options(spec.scoring, teacher)
    windows = scoring_windows(
        corpus, teacher, split_cfg, "dev", options, spec.scoring.max_windows
    ).windows
    if not windows:
        raise SplitError(
            f"sweep {spec.name}: the dev split of corpus {spec.corpus} has no windows; "
            "check the split config"
        )
    return windows


def run_trial_work(
    spec: SweepSpec, knobs: Knobs, windows_done: Collection[str], seed: int
) -> Iterator[WindowRecord]:
    """Heal one config and score its dev windows not in ``windows_done``, one at a time.

    Windows come in the trial's seeded order (:func:`trial_order`); the student is built only
    when at least one window is left to score.
    """
    def healed(teacher: GGUFModel, cache: StageCache) -> StudentModel:
        # no held-out diagnostic: the sweep scores its own held-out windows (see build_student)
        return build_student(teacher, knobs, spec.calibration, cache, diagnostics=False)

    yield from _score_dev(spec, healed, windows_done, seed, ExpertCacheConfig.from_knobs(knobs))


def run_external_work(
    spec: SweepSpec, path: str, windows_done: Collection[str], seed: int
) -> Iterator[WindowRecord]:
    """Score the GGUF at ``path`` as the student on the sweep's dev windows (an ``external``
    entry of the spec), like :func:`run_trial_work` scores a healed config."""
    yield from _score_dev(spec, lambda teacher, cache: open_model(path), windows_done, seed)


def _score_dev(
    spec: SweepSpec,
    make_student: Callable[[GGUFModel, StageCache], StudentModel],
    windows_done: Collection[str],
    seed: int,
    expert_cache: ExpertCacheConfig | None = None,
) -> Iterator[WindowRecord]:
    teacher = open_model(spec.model)
    windows = dev_windows(spec, teacher)
    order = trial_order(len(windows), seed)
    position = {wi: pos for pos, wi in enumerate(order)}
    todo = [windows[i] for i in order if windows[i].window_id not in windows_done]
    if not todo:
        return
    index = {w.window_id: i for i, w in enumerate(windows)}
    # None: this worker's own ($HEALSWEEP_CACHE), bounded by $HEALSWEEP_CACHE_MAX_GB if set.
    # The knobs the sweep varies tell eviction which entries no later trial reads (routed_q
    # when no Part A knob varies, ridge_rhs when neither rho nor eta does: SPENT_UNLESS).
    cache = StageCache(spec.cache_root, spec.cache_max_gb, axes=varied_knobs(spec))
    # A streamed student reads its layers back from the stage entries while it is scored: they
    # stay held until its last window (else a tight cache evicts and recomputes them mid-trial).
    # On an accelerator the teacher's records are made on a thread while the student is built
    # (score.runner.teacher_ahead): a cold trial's teacher pass overlaps its host-bound stages.
    batch, fmt = spec.scoring.batch, spec.scoring.teacher_cache
    with cache.holding(), teacher_ahead(teacher, todo, cache, batch, fmt):
        scored = score_windows(
            teacher,
            make_student(teacher, cache),
            todo,
            cache,
            batch=batch,
            teacher_cache=fmt,
            expert_cache=expert_cache,
            group=spec.scoring.group_for(spec.pruner.type != "none"),
        )
        for window, metrics in scored:
            wi = index[window.window_id]
            yield WindowRecord.of(window, metrics, wi, len(windows), position[wi])


def check_documents(spec: SweepSpec, model: GGUFModel) -> None:
    """Build the dev windows and render the calibration documents in the model's chat format,
    as the trials will (raises what they would raise, once), and refuse a calibration document
    whose text is a test document's (a calibration corpus of its own could hold one)."""
    dev_windows(spec, model)
    corpus, split_cfg = spec_split(spec)
    resolved = resolve_split(split_cfg, corpus)
    test_text = {d.content_hash: d.doc_id for d in corpus.documents
                 if resolved.assignments[d.doc_id] == "test"}  # fmt: skip
    chat = model_chat_format(model)
    for doc in calibration_documents(load_corpus(spec.calibration.corpus), spec.calibration):
        if doc.content_hash in test_text:
            raise SplitError(
                f"calibration document {doc.doc_id!r} ({spec.calibration.corpus}) has the same "
                f"text as test document {test_text[doc.content_hash]!r} ({spec.corpus}); "
                "calibrating on test text would tune on the test split: remove it from the "
                "calibration corpus or exclude it (calibration.exclude_doc_ids)"
            )
        render_document(doc, chat)


def sweep_identity(spec: SweepSpec) -> dict[str, Any]:
    """What the manifest records about the sweep's inputs: model fingerprint, split lock id.
    Refuses (before any trial starts) a model whose experts cannot be quantized in the
    baseline's types or, for a grid, in any grid config's, a ``scoring.max_context`` that
    does not fit the model's context, and documents the model's chat template cannot render
    (the dev windows are built and the calibration documents rendered once here, as every
    trial would: a failing or runaway template stops the sweep in one line, not each trial)."""
    model = open_model(spec.model)
    # a grid's configs are known now; a sampler's points are checked when their trial starts
    for knobs in grid_configs(spec) if spec.sampler.type in GRIDDED else [spec.baseline]:
        check_quantizable(model, knobs)
    try:
        window_options(spec.scoring, model)
    except SplitError as exc:
        raise SpecError(f"sweep {spec.name}: field 'scoring.max_context': {exc}") from None
    check_documents(spec, model)
    corpus, split_cfg = spec_split(spec)
    return {
        "model_fingerprint": model.fingerprint,
        "split_lock_id": split_lock_id(split_cfg, corpus.documents),
    }
