"""Lexical leakage between calibration text and scoring windows.

For each window and each n (8 and 16 by default), count the scored tokens that *complete* an
n-gram seen anywhere in the calibration tokens: the n-gram ``tokens[j-n+1 : j+1]`` ending at
scored token ``j`` (its first tokens may be context). A calibration-fitted healer that has seen
that n-gram is flattered when token ``j`` is scored, so a 16-gram hit is an error unless the
caller explicitly allows it; 8-gram hits are reported as a warning sign.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from healsweep.data.chat_template import ChatFormat, render_document
from healsweep.errors import SplitError

DEFAULT_NS = (8, 16)
ERROR_N = 16


def ngram_set(sequences: Iterable[np.ndarray], n: int) -> set[bytes]:
    """Every n-gram of every token sequence, as the little-endian int32 bytes of its ids."""
    seen: set[bytes] = set()
    for seq in sequences:
        arr = np.ascontiguousarray(seq, dtype="<i4")
        if arr.shape[0] < n:
            continue
        rows = np.lib.stride_tricks.sliding_window_view(arr, n)  # [len - n + 1, n]
        seen.update(row.tobytes() for row in rows)
    return seen


def completed_ngram_hits(
    tokens: np.ndarray, scored_from: int, n_scored: int, seen: set[bytes], n: int
) -> int:
    """Scored positions ``j`` whose n-gram ending at ``j`` is in ``seen``."""
    arr = np.ascontiguousarray(tokens, dtype="<i4")
    first = max(scored_from, n - 1)
    hits = 0
    for j in range(first, scored_from + n_scored):
        if arr[j - n + 1 : j + 1].tobytes() in seen:
            hits += 1
    return hits


@dataclass(frozen=True)
class LeakageReport:
    """Per-n hit counts: ``hits[n][window_id]`` scored tokens completing a calibration n-gram."""

    ns: tuple[int, ...]
    hits: dict[int, dict[str, int]]
    n_windows: int
    n_scored: int

    def total(self, n: int) -> int:
        """Scored tokens over all windows that complete a calibration n-gram."""
        return sum(self.hits[n].values())

    def leaking_windows(self, n: int) -> list[str]:
        """Window ids with at least one n-gram hit."""
        return [wid for wid, count in self.hits[n].items() if count > 0]

    def summary(self) -> str:
        """One line: hits per n over all scored tokens."""
        parts = [
            f"{n}-gram {self.total(n)}/{self.n_scored} tokens in "
            f"{len(self.leaking_windows(n))}/{self.n_windows} windows"
            for n in self.ns
        ]
        return "; ".join(parts)


def calibration_tokens(
    corpus: Any, split_cfg: Any, tokenizer: Any, chat: ChatFormat | None = None
) -> list[np.ndarray]:
    """Token ids of every document that ``split_cfg`` assigns to ``calibration``, rendered in
    the model's ``chat`` format (None = ChatML) as the windows are."""
    docs = [d for d in getattr(corpus, "documents", corpus) if split_cfg.assign(d) == "calibration"]
    texts = [render_document(d, chat) for d in docs]
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]


def check_leakage(
    calibration_tokens: Sequence[np.ndarray],
    windows: Sequence,
    *,
    ns: Sequence[int] = DEFAULT_NS,
    allow_leakage: bool = False,
) -> LeakageReport:
    """Count calibration n-grams completed by the windows' scored tokens.

    Raises :class:`SplitError` when any scored token completes a calibration ``16``-gram (when
    16 is among ``ns``) unless ``allow_leakage`` is true.
    """
    ns = tuple(sorted(set(int(n) for n in ns)))
    if not ns or ns[0] < 1:
        raise ValueError(f"check_leakage: n-gram sizes must be >= 1, got {ns}")
    hits: dict[int, dict[str, int]] = {}
    for n in ns:
        seen = ngram_set(calibration_tokens, n)
        hits[n] = {
            w.window_id: completed_ngram_hits(w.tokens, w.scored_from, w.n_scored, seen, n)
            for w in windows
        }
    report = LeakageReport(
        ns=ns,
        hits=hits,
        n_windows=len(windows),
        n_scored=sum(int(w.n_scored) for w in windows),
    )
    if ERROR_N in ns and not allow_leakage:
        leaking = report.leaking_windows(ERROR_N)
        if leaking:
            first = next(w for w in windows if w.window_id == leaking[0])
            raise SplitError(
                f"calibration text leaks into {len(leaking)} scoring window(s): "
                f"{report.total(ERROR_N)} scored tokens complete a calibration {ERROR_N}-gram "
                f"(first: window {first.window_id} of document {first.doc_id!r}); take the "
                "document out of the calibration pool or the eval split, or allow leakage "
                "explicitly"
            )
    return report


__all__ = [
    "DEFAULT_NS",
    "LeakageReport",
    "calibration_tokens",
    "check_leakage",
    "completed_ngram_hits",
    "ngram_set",
]
