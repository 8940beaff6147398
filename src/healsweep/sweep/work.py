"""The one boundary between the sweep and a trial's real work (heal + score).

Everything the orchestrator needs from the healer and the scorer goes through this module:
:func:`run_trial_work` (build the healed student through the stage caches, then score the dev
windows one by one in the trial's order) and :func:`sweep_identity` (what the manifest records).
The trainable calls ``run_trial_work`` through a parameter, so tests can hand it their own
work function with the same signature.

Only dev windows are ever built here, and never with a ledger grant: a sweep cannot open the
test split.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from healsweep.errors import SplitError


@dataclass(frozen=True)
class WindowResult:
    """One scored window of one trial.

    ``window_index`` is the window's place in the sweep's fixed global order (window ids sorted),
    the step the pruner pairs trials on; ``position`` is its place in this trial's shuffled
    order; ``metrics`` is ``WindowMetrics.to_dict()``.
    """

    window_id: str
    window_index: int
    position: int
    windows_total: int
    stratum: str
    source: str
    doc_id: str
    kind: str
    metrics: dict[str, Any] = field(repr=False)


WorkFn = Callable[[Any, Any, Collection[str], int], Iterator[WindowResult]]


def trial_order(n_windows: int, seed: int) -> list[int]:
    """A trial's window order: a seeded permutation of the global order ``0..n_windows-1``."""
    return [int(i) for i in np.random.default_rng(seed).permutation(n_windows)]


def dev_windows(spec: Any, teacher: Any) -> list[Any]:
    """The sweep's dev windows in the fixed global order (sorted ids), capped at max_windows."""
    from healsweep.data.chat_template import model_chat_format
    from healsweep.data.corpus import load_corpus
    from healsweep.data.split import load_split, parity_split
    from healsweep.data.windows import make_windows

    corpus = load_corpus(spec.corpus)
    split_cfg = parity_split(corpus) if spec.split == "auto" else load_split(spec.split)
    extra = {} if spec.scoring.max_context is None else {"max_context": spec.scoring.max_context}
    windows = make_windows(
        corpus,
        teacher.tokenizer(),
        split_cfg,
        split="dev",
        grant=None,
        max_scored=spec.scoring.max_scored,
        chat=model_chat_format(teacher),
        **extra,
    )
    windows = sorted(windows, key=lambda w: w.window_id)
    if spec.scoring.max_windows is not None:
        windows = windows[: spec.scoring.max_windows]
    if not windows:
        raise SplitError(
            f"sweep {spec.name}: the dev split of corpus {spec.corpus} has no windows; "
            "check the split config"
        )
    return windows


def run_trial_work(
    spec: Any, knobs: Any, windows_done: Collection[str], seed: int
) -> Iterator[WindowResult]:
    """Heal one config and score its dev windows not in ``windows_done``, one at a time.

    Windows come in the trial's seeded order (:func:`trial_order`); the student is built only
    when at least one window is left to score.
    """
    from healsweep.heal.pipeline import build_student
    from healsweep.score.expert_cache import ExpertCacheConfig

    expert_cache = ExpertCacheConfig.from_knobs(knobs)

    def healed(teacher: Any, cache: Any) -> Any:
        return build_student(teacher, knobs, spec.calibration_config(), cache)

    yield from _score_dev(spec, healed, windows_done, seed, expert_cache)


def run_external_work(
    spec: Any, path: str, windows_done: Collection[str], seed: int
) -> Iterator[WindowResult]:
    """Score the GGUF at ``path`` as the student on the sweep's dev windows (an ``external``
    entry of the spec), like :func:`run_trial_work` scores a healed config."""
    from healsweep.gguf_io import open_model

    yield from _score_dev(spec, lambda teacher, cache: open_model(path), windows_done, seed)


def _score_dev(
    spec: Any,
    make_student: Callable[[Any, Any], Any],
    windows_done: Collection[str],
    seed: int,
    expert_cache: Any = None,
) -> Iterator[WindowResult]:
    from healsweep.cache import StageCache
    from healsweep.gguf_io import open_model
    from healsweep.score.runner import score_windows

    teacher = open_model(spec.model)
    windows = dev_windows(spec, teacher)
    order = trial_order(len(windows), seed)
    position = {wi: pos for pos, wi in enumerate(order)}
    todo = [windows[i] for i in order if windows[i].window_id not in windows_done]
    if not todo:
        return
    index = {w.window_id: i for i, w in enumerate(windows)}
    cache = StageCache()
    scored = score_windows(
        teacher,
        make_student(teacher, cache),
        todo,
        cache,
        batch=spec.scoring.batch,
        teacher_cache=spec.scoring.teacher_cache,
        expert_cache=expert_cache,
    )
    for window, metrics in scored:
        wi = index[window.window_id]
        yield WindowResult(
            window_id=window.window_id,
            window_index=wi,
            position=position[wi],
            windows_total=len(windows),
            stratum=window.stratum,
            source=window.source,
            doc_id=window.doc_id,
            kind=window.kind,
            metrics=metrics.to_dict(),
        )


def sweep_identity(spec: Any) -> dict[str, Any]:
    """What the manifest records about the sweep's inputs: model fingerprint, split lock id."""
    from healsweep.data.corpus import load_corpus
    from healsweep.data.split import load_split, parity_split, split_lock_id
    from healsweep.gguf_io import open_model
    from healsweep.heal.stages import check_quantizable

    model = open_model(spec.model)
    check_quantizable(model)  # before any trial starts
    corpus = load_corpus(spec.corpus)
    split_cfg = parity_split(corpus) if spec.split == "auto" else load_split(spec.split)
    return {
        "model_fingerprint": model.fingerprint,
        "split_lock_id": split_lock_id(split_cfg, corpus.documents),
    }


__all__ = [
    "WindowResult",
    "WorkFn",
    "dev_windows",
    "run_external_work",
    "run_trial_work",
    "sweep_identity",
    "trial_order",
]
