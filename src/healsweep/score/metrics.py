"""Per-window metrics of a student against its teacher.

One :class:`~healsweep.score.record.WindowMetrics` summarises the scored tokens of one window:
KL(teacher || student) (sum, count, mean and tail quantiles), top-1 agreement, the mean change in
the probability of the actual next token, both perplexities, and router agreement (Jaccard index
of the top-k expert sets per token, averaged per layer and overall). The arrays come from :mod:`healsweep.kernels.kld`
(full teacher log-probs) or :mod:`healsweep.kernels.kld_compact` (a compact teacher record); this
module only reduces them on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.kernels.kld import token_stats, topk_jaccard
from healsweep.kernels.kld_compact import compact_token_stats
from healsweep.score.record import WindowMetrics

QUANTILES = {"kld_p50": 0.5, "kld_p90": 0.9, "kld_p99": 0.99, "kld_p999": 0.999}
_MIN_ROWS = 8


def bucket_rows(n: int) -> int:
    """Rows padded to a power of two (>= 8): a handful of shapes for the jitted kernels."""
    return max(_MIN_ROWS, 1 << max(0, n - 1).bit_length())


_bucket = bucket_rows


def _pad_rows(x: np.ndarray | jax.Array, rows: int) -> np.ndarray | jax.Array:
    """``x`` with zero rows appended up to ``rows`` (zero logits: a uniform row, KL 0; the
    results of padded rows are dropped). A student's logits kept on the device come padded
    already (``forward_batches(pad_rows=bucket_rows)``); another device array is padded there:
    the same values reach the kernel without a host copy of ``[n, V]``."""
    if isinstance(x, jax.Array):
        if x.shape[0] == rows:
            return x
        return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
    x = np.asarray(x)
    if x.shape[0] == rows:
        return x
    pad = np.zeros((rows - x.shape[0], *x.shape[1:]), dtype=x.dtype)
    return np.concatenate([x, pad])


def router_agreement(
    teacher_topk: Sequence[np.ndarray], student_topk: Sequence[np.ndarray]
) -> tuple[float, np.ndarray]:
    """Mean Jaccard of top-k expert sets: (overall, per layer ``[L]``) from ``L x [T, k]`` ids."""
    if len(teacher_topk) != len(student_topk):
        raise ValueError(
            f"router_agreement: {len(teacher_topk)} teacher layers vs {len(student_topk)} student"
        )
    if not teacher_topk:
        return float("nan"), np.zeros(0, dtype=np.float32)
    per_token = []
    for t, s in zip(teacher_topk, student_topk, strict=True):
        n = len(t)
        rows = _bucket(n)
        padded = topk_jaccard(_pad_rows(t, rows), _pad_rows(s, rows))  # [rows]
        per_token.append(np.asarray(padded)[:n])
    per_layer = np.array([float(j.mean()) for j in per_token], dtype=np.float32)  # [L]
    return float(np.mean(np.concatenate(per_token))), per_layer


def window_metrics(
    teacher_logits: np.ndarray,
    student_logits: np.ndarray,
    next_ids: np.ndarray,
    teacher_topk: Sequence[np.ndarray] = (),
    student_topk: Sequence[np.ndarray] = (),
) -> WindowMetrics:
    """Metrics of one window from the logits (or log-probs) at its scored positions.

    ``teacher_logits, student_logits [n, V]``: row i predicts ``next_ids[i]``.
    ``teacher_topk, student_topk``: per layer ``[n, k]`` router top-k ids at the same positions
    (empty sequences skip router agreement).
    """
    n = _check_rows(next_ids)
    rows = _bucket(n)
    stats = token_stats(
        _pad_rows(teacher_logits, rows),
        _pad_rows(student_logits, rows),
        _pad_rows(np.asarray(next_ids, dtype=np.int32), rows),
    )
    return _reduce(stats, n, teacher_topk, student_topk)


def compact_window_metrics(
    record: Any,
    student_logits: np.ndarray,
    next_ids: np.ndarray,
    teacher_topk: Sequence[np.ndarray] = (),
    student_topk: Sequence[np.ndarray] = (),
    tail: str = "adaptive",
) -> WindowMetrics:
    """:func:`window_metrics` with the teacher given as a compact record.

    ``record`` is a :class:`~healsweep.score.compact.CompactTeacher` of the window. KL per
    token is the unbiased estimate of :mod:`healsweep.kernels.kld_compact` (``tail`` picks the
    estimator), so ``kld_sum`` and ``kld_mean`` are unbiased; the quantiles and ``kld_max`` are
    those of the per-token estimates (their sampling noise widens the spread a little, and one
    token's estimate can be slightly negative). Top-1,
    delta-p, perplexities and router agreement are exact: they need only the teacher's argmax,
    the scored token's log-prob and the router ids, which the record keeps.
    """
    n = _check_rows(next_ids)
    rows = _bucket(n)
    pad = partial(_pad_rows, rows=rows)
    stats = compact_token_stats(
        pad(record.top_ids),
        pad(record.top_logp),
        pad(record.tail_ids),
        pad(record.tail_logp),
        pad(record.tail_mass),
        pad(record.tail_full),
        pad(record.logp_next),
        pad(student_logits),
        pad(np.asarray(next_ids, dtype=np.int32)),
        tail=tail,
    )
    return _reduce(stats, n, teacher_topk, student_topk)


def _check_rows(next_ids: np.ndarray) -> int:
    n = len(next_ids)
    if n == 0:
        raise ValueError("window_metrics: a window needs at least one scored token")
    return n


def _reduce(
    stats: Any, n: int, teacher_topk: Sequence[np.ndarray], student_topk: Sequence[np.ndarray]
) -> WindowMetrics:
    """Host-side reduction of per-token stats (padded rows past ``n`` dropped)."""
    kld = np.asarray(stats.kld, dtype=np.float32)[:n]  # [n]
    logp_t = np.asarray(stats.teacher_logp_next, dtype=np.float32)[:n]  # [n]
    logp_s = np.asarray(stats.student_logp_next, dtype=np.float32)[:n]  # [n]
    agree = np.asarray(stats.top1_agree)[:n]
    jaccard, jaccard_layers = router_agreement(teacher_topk, student_topk)
    quantiles = {name: float(np.quantile(kld, q)) for name, q in QUANTILES.items()}
    top1_count = int(agree.sum())
    kld_sum = float(kld.astype(np.float64).sum())
    return WindowMetrics(
        kld_sum=kld_sum,
        kld_count=n,
        kld_mean=kld_sum / n,
        top1=top1_count / n,
        top1_count=top1_count,
        delta_p_mean=float(np.mean(np.exp(logp_s) - np.exp(logp_t))),
        teacher_nll_sum=float(-logp_t.astype(np.float64).sum()),
        student_nll_sum=float(-logp_s.astype(np.float64).sum()),
        router_jaccard=jaccard,
        router_jaccard_layers=jaccard_layers,
        kld_max=float(kld.max()),
        **quantiles,
    )


__all__ = [
    "QUANTILES",
    "WindowMetrics",
    "compact_window_metrics",
    "router_agreement",
    "window_metrics",
]
