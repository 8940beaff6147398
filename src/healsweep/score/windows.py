"""The windows a scoring run reads, and their leakage check: one assembly for every caller.

``healsweep score``, a sweep's dev windows (:func:`healsweep.sweep.work.dev_windows`) and a
milestone's test windows (:func:`healsweep.confirm.sealed_windows`) all score the first
``max_windows`` windows of a split by window id, rendered in the teacher's chat format with the
context capped to what the models hold (:func:`scoring_windows`); :func:`window_leakage` counts
the calibration n-grams the windows' scored tokens complete, and refuses a 16-gram unless told.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from healsweep.data.chat_template import model_chat_format
from healsweep.data.leakage import LeakageReport, calibration_tokens, check_leakage
from healsweep.data.windows import context_cap, first_windows, make_windows

if TYPE_CHECKING:
    from healsweep.data.chat_template import ChatFormat
    from healsweep.data.corpus import Corpus
    from healsweep.data.split import SplitConfig
    from healsweep.data.windows import Window
    from healsweep.gguf_io import GGUFModel
    from healsweep.ledger import Grant


class ScoringWindows(NamedTuple):
    """The windows to score: the first ``max_windows`` of the ``total`` in the split."""

    windows: list[Window]
    total: int
    chat: ChatFormat


def window_options(
    teacher: GGUFModel, max_scored: int, max_context: int | None, context_length: int | None = None
) -> dict[str, Any]:
    """``make_windows`` options: in the teacher's chat format, the context capped to
    ``context_length`` (default: the teacher's; :func:`~healsweep.data.windows.context_cap`
    raises :class:`~healsweep.errors.SplitError` for a cap that leaves no room)."""
    context = teacher.hparams.context_length if context_length is None else context_length
    return {
        "max_scored": max_scored,
        "max_context": context_cap(max_scored, max_context, context),
        "chat": model_chat_format(teacher),
    }


def scoring_windows(
    corpus: Corpus,
    teacher: GGUFModel,
    split_cfg: SplitConfig,
    split: str,
    options: dict[str, Any],
    max_windows: int | None,
    grant: Grant | None = None,
) -> ScoringWindows:
    """The first ``max_windows`` windows of ``split`` by window id (all with None), made with
    :func:`window_options`' ``options``; the test split needs the ledger's ``grant``."""
    every = make_windows(
        corpus, teacher.tokenizer(), split_cfg, split=split, grant=grant, **options
    )
    return ScoringWindows(first_windows(every, max_windows), len(every), options["chat"])


def window_leakage(
    corpus: Corpus,
    split_cfg: SplitConfig,
    teacher: GGUFModel,
    found: ScoringWindows,
    allow_leakage: bool = False,
) -> tuple[int, LeakageReport]:
    """(calibration documents, their n-grams the windows' scored tokens complete); raises
    :class:`~healsweep.errors.SplitError` for a completed 16-gram unless ``allow_leakage``."""
    calibration = calibration_tokens(corpus, split_cfg, teacher.tokenizer(), found.chat)
    leakage = check_leakage(calibration, found.windows, allow_leakage=allow_leakage)
    return len(calibration), leakage
