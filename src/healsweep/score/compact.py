"""The compact teacher record: a small fixed-size summary of the teacher per scored position.

Per position it keeps the teacher's top-K token ids and log-probs, ``S`` token ids drawn from
the teacher's tail (``p`` restricted to the non-top-K tokens and renormalised) with their
log-probs, the tail mass (and a flag: whether every tail token has ``p > 0``), and the exact
log-prob of the scored token: ``8 (K + S) + 9`` bytes
(int32 ids, float32 log-probs) whatever the vocabulary, instead of ``4 V``. With the student's
fresh logits that gives an unbiased KL estimate (:mod:`healsweep.kernels.kld_compact`) and exact
top-1, delta-p and perplexities. ``docs/teacher-cache.md`` has the measurements behind the
default size.

The tail draws are stratified along the tail's cumulative distribution (one uniform per
stratum ``[s/S, (s+1)/S)``: unbiased, and never worse than independent draws) and come from a
generator seeded by the window id alone, so every student is scored on the same draws and
config-vs-config differences keep only the students' own noise. Drawing is host-side numpy:
the same ids on every platform for the same teacher log-probs.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from healsweep.errors import CacheError
from healsweep.threads import host_threads

DEFAULT_TOP_K = 128
DEFAULT_TAIL_SAMPLES = 128
SAMPLER = "stratified-cdf-v1"  # part of the cache key: a new sampler means new entries
CACHE_KINDS = ("compact", "exact")


class TeacherCacheError(CacheError):
    """A teacher-cache choice that is not ``exact``, ``compact`` or ``compact:K:S``."""


@dataclass(frozen=True)
class TeacherCacheFormat:
    """What a teacher-cache entry holds: the full log-softmax, or a compact record of (K, S)."""

    kind: Literal["compact", "exact"] = "compact"
    top_k: int = DEFAULT_TOP_K
    tail_samples: int = DEFAULT_TAIL_SAMPLES

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise TeacherCacheError(
                f"teacher cache {self.kind!r}: use one of {', '.join(CACHE_KINDS)}"
            )
        if self.top_k < 1 or self.tail_samples < 1:
            raise TeacherCacheError(
                f"compact teacher cache K={self.top_k}, S={self.tail_samples}: both must be >= 1"
            )

    @property
    def label(self) -> str:
        """``exact`` or ``compact:K:S``."""
        return "exact" if self.kind == "exact" else f"compact:{self.top_k}:{self.tail_samples}"

    def key_inputs(self) -> dict[str, object]:
        """What a compact entry's cache key adds to the window's identity."""
        return {
            "format": "compact",
            "top_k": self.top_k,
            "tail_samples": self.tail_samples,
            "sampler": SAMPLER,
        }


EXACT = TeacherCacheFormat("exact")
COMPACT = TeacherCacheFormat("compact")


def cache_format(choice: str | TeacherCacheFormat) -> TeacherCacheFormat:
    """Parse ``exact``, ``compact`` (the default size) or ``compact:K:S``."""
    if isinstance(choice, TeacherCacheFormat):
        return choice
    kind, *size = str(choice).strip().lower().split(":")
    if kind == "exact" and not size:
        return EXACT
    if kind == "compact" and not size:
        return COMPACT
    if kind == "compact" and len(size) == 2 and all(s.isdigit() for s in size):
        return TeacherCacheFormat("compact", int(size[0]), int(size[1]))
    raise TeacherCacheError(f"teacher cache {choice!r}: use exact, compact or compact:K:S")


class CompactTeacher(NamedTuple):
    """A window's compact teacher record (``n`` scored positions)."""

    top_ids: np.ndarray  # [n, K] int32, by decreasing log-prob (ties: lower id first)
    top_logp: np.ndarray  # [n, K] float32
    tail_ids: np.ndarray  # [n, S] int32, drawn from p restricted to the non-top-K tokens
    tail_logp: np.ndarray  # [n, S] float32
    tail_mass: np.ndarray  # [n] float32, P_tail = sum of p over the non-top-K tokens
    tail_full: np.ndarray  # [n] bool, every non-top-K token has p > 0 (the control variate's case)
    logp_next: np.ndarray  # [n] float32, log p of the scored token
    topk_ids: np.ndarray  # [n, L, k] router expert ids (uint8/int16 on disk; int32 here)


def window_seed(window_id: str) -> int:
    """The tail sampler's seed: a hash of the window id (nothing about the student)."""
    digest = hashlib.sha256(f"healsweep/teacher-tail/{window_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def draw_tail(
    logp: np.ndarray, top_ids: np.ndarray, n_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tail_ids [n, S] int32, tail_mass [n] float64, tail_full [n] bool)``: stratified draws
    from each row's tail, its mass, and whether every tail token has ``p > 0``.

    ``logp [n, V]`` float32 teacher log-probs; ``top_ids [n, K]`` the tokens left out. Rows with
    no tail mass get the row's argmax as a placeholder (their tail weighs 0).

    The rows are shared among the process's host threads
    (:func:`healsweep.threads.host_threads`); each row is drawn alone (its float64 sums in one
    order), so the draws are the same bit for bit however many threads run.
    """
    n = logp.shape[0]
    uniforms = np.random.default_rng(seed).random((n, n_samples))  # [n, S]
    strata = (np.arange(n_samples)[None, :] + uniforms) / n_samples  # [n, S] in [0, 1)
    ids = np.empty((n, n_samples), dtype=np.int32)
    mass = np.zeros(n, dtype=np.float64)
    full = np.zeros(n, dtype=bool)

    def draw(rows: range) -> None:
        # Two V-long float64 buffers a thread, reused row after row: fresh ones each row cost
        # page faults (the allocator hands the freed memory back) that doubled the time.
        p, cdf = np.empty(logp.shape[1]), np.empty(logp.shape[1])
        for row in rows:
            ids[row], mass[row], full[row] = _draw_row(
                logp[row], top_ids[row], strata[row], p, cdf
            )

    threads = min(host_threads(), n)
    if threads <= 1:
        draw(range(n))
    else:  # numpy's exp, sums and searches run outside the GIL
        with ThreadPoolExecutor(threads, thread_name_prefix="teacher-tail") as pool:
            list(pool.map(draw, [range(t, n, threads) for t in range(threads)]))
    return ids, mass, full


def _draw_row(
    logp: np.ndarray, top_ids: np.ndarray, strata: np.ndarray, p: np.ndarray, cdf: np.ndarray
) -> tuple[np.ndarray, float, bool]:
    """One row of :func:`draw_tail`, ``(ids [S], tail mass, tail full)``, in the float64
    buffers ``p`` and ``cdf`` ([V] each)."""
    np.exp(logp, out=p, dtype=np.float64)
    p[top_ids] = 0.0
    positive = p > 0.0
    full = np.count_nonzero(positive) == len(p) - len(np.unique(top_ids))
    np.cumsum(p, out=cdf)
    mass = float(cdf[-1])
    if mass <= 0.0:
        return np.full(len(strata), top_ids[0]), mass, full
    last = len(p) - 1 - int(np.argmax(positive[::-1]))  # the last token with p > 0
    # side="right": cdf[i-1] <= target < cdf[i], so p[i] > 0; the clip guards rounding.
    picked = np.searchsorted(cdf, strata * mass, side="right")
    return np.minimum(picked, last), mass, full


def router_dtype(n_expert: int) -> np.dtype:
    """Smallest integer type that holds expert ids ``0 .. n_expert-1`` (router ids on disk)."""
    return np.dtype(np.uint8 if n_expert <= 256 else np.int16 if n_expert <= 32768 else np.int32)


def compact_record(
    logprobs: np.ndarray,
    next_ids: np.ndarray,
    topk_ids: np.ndarray,
    window_id: str,
    fmt: TeacherCacheFormat = COMPACT,
) -> CompactTeacher:
    """The compact record of one window from its exact teacher log-probs ``[n, V]``.

    ``next_ids [n]`` are the scored tokens, ``topk_ids [n, L, k]`` the router's expert ids;
    the tail draws are seeded by ``window_id``. K is capped at the vocabulary size.
    """
    # lazy: heavy (jax)
    from healsweep.kernels.kld_compact import teacher_top
    from healsweep.score.metrics import _bucket, _pad_rows

    n = len(next_ids)
    top_k = min(fmt.top_k, logprobs.shape[1])
    # Rows padded as the scorer pads them: XLA's row reductions can round differently for
    # another row count, and the exact cache's log-probs come from the padded shape.
    rows = _bucket(n)
    padded = teacher_top(
        _pad_rows(logprobs, rows), _pad_rows(np.asarray(next_ids, np.int32), rows), top_k
    )
    logp, top_ids, top_logp, logp_next = (np.asarray(a)[:n] for a in padded)
    tail_ids, tail_mass, tail_full = draw_tail(
        logp, top_ids, fmt.tail_samples, window_seed(window_id)
    )
    return CompactTeacher(
        top_ids=top_ids.astype(np.int32),
        top_logp=top_logp.astype(np.float32),
        tail_ids=tail_ids,
        tail_logp=np.take_along_axis(logp, tail_ids, axis=1).astype(np.float32),
        tail_mass=tail_mass.astype(np.float32),
        tail_full=tail_full,
        logp_next=logp_next.astype(np.float32),
        topk_ids=np.asarray(topk_ids, dtype=np.int32),
    )


def record_bytes(fmt: TeacherCacheFormat, n_vocab: int) -> int:
    """Bytes per position of the teacher distribution (router ids not included)."""
    if fmt.kind == "exact":
        return 4 * n_vocab
    return 8 * (min(fmt.top_k, n_vocab) + fmt.tail_samples) + 9


__all__ = [
    "COMPACT",
    "DEFAULT_TAIL_SAMPLES",
    "DEFAULT_TOP_K",
    "EXACT",
    "CompactTeacher",
    "TeacherCacheError",
    "TeacherCacheFormat",
    "cache_format",
    "compact_record",
    "draw_tail",
    "record_bytes",
    "router_dtype",
    "window_seed",
]
