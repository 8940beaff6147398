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
config-vs-config differences keep only the students' own noise. The uniforms are numpy's (the
same numbers on every platform and jax version); top-K and the draws themselves run on the
default device (:mod:`healsweep.kernels.tail_draws`), so only the record leaves it. A device's
float32 rounding can move a draw that falls within ~1e-7 of a token's edge to its neighbour:
records made on different backends are equally valid samples, not the same bits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from healsweep.errors import CacheError
from healsweep.kernels import tail_draws as draws
from healsweep.kernels.kld_compact import teacher_top
from healsweep.score.metrics import _bucket, _pad_rows

DEFAULT_TOP_K = 128
DEFAULT_TAIL_SAMPLES = 128
SAMPLER = "stratified-cdf-device-v2"  # part of the cache key: a new sampler means new entries
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


def tail_strata(seed: int, n_rows: int, n_samples: int) -> np.ndarray:
    """``[n_rows, S]`` float32 in ``[0, 1)``: one uniform in each stratum ``[s/S, (s+1)/S)``,
    from numpy's generator seeded by ``seed`` (the same numbers on every backend and every jax
    version; ``n_rows x S`` floats is all the device needs from the host to draw)."""
    uniforms = np.random.default_rng(seed).random((n_rows, n_samples))  # [n, S]
    return ((np.arange(n_samples)[None, :] + uniforms) / n_samples).astype(np.float32)


def draw_tail(
    logp: Any, top_ids: Any, n_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tail_ids [n, S] int32, tail_mass [n] float32, tail_full [n] bool)``: stratified draws
    from each row's tail on the default device (:func:`healsweep.kernels.tail_draws.tail_draws`),
    its mass, and whether every tail token has ``p > 0``.

    ``logp [n, V]`` float32 teacher log-probs (a host or a device array); ``top_ids [n, K]`` the
    tokens left out. Rows with no tail mass get the row's argmax as a placeholder (their tail
    weighs 0).
    """

    strata = tail_strata(seed, logp.shape[0], n_samples)
    # through its module, so a fault planted there (doctor's tests) reaches the record
    ids, _, mass, full = draws.tail_draws(logp, np.asarray(top_ids, np.int32), strata)
    return np.asarray(ids), np.asarray(mass), np.asarray(full)


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
    """The compact record of one window from its exact teacher log-probs ``[n, V]`` (or
    ``[_bucket(n), V]``, the rows past ``n`` zero, as :func:`~healsweep.score.teacher_cache.
    run_teacher` leaves them on the device).

    ``next_ids [n]`` are the scored tokens, ``topk_ids [n, L, k]`` the router's expert ids;
    the tail draws are seeded by ``window_id``. K is capped at the vocabulary size.
    """
    # lazy: heavy (jax)
    import jax.numpy as jnp

    n = len(next_ids)
    top_k = min(fmt.top_k, logprobs.shape[1])
    # Rows padded as the scorer pads them: XLA's row reductions can round differently for
    # another row count, and the exact cache's log-probs come from the padded shape. The rows
    # stay on the device: top-K and the draws run there, only the record comes back.
    rows = _bucket(n)
    logprobs = jnp.asarray(logprobs, jnp.float32)
    if logprobs.shape[0] != rows:  # run_teacher's come padded (a pad compiled per n otherwise)
        logprobs = jnp.pad(logprobs, ((0, rows - n), (0, 0)))  # zero rows, as _pad_rows
    ids = _pad_rows(np.asarray(next_ids, np.int32), rows)
    logp, top_ids, top_logp, logp_next = teacher_top(logprobs, ids, top_k)  # on the device
    strata = _pad_rows(tail_strata(window_seed(window_id), n, fmt.tail_samples), rows)
    drawn = draws.tail_draws(logp, top_ids, strata)  # on the device
    tail_ids, tail_logp, tail_mass, tail_full = (np.asarray(a)[:n] for a in drawn)
    return CompactTeacher(
        top_ids=np.asarray(top_ids)[:n].astype(np.int32),
        top_logp=np.asarray(top_logp)[:n].astype(np.float32),
        tail_ids=tail_ids,
        tail_logp=tail_logp.astype(np.float32),
        tail_mass=tail_mass.astype(np.float32),
        tail_full=tail_full,
        logp_next=np.asarray(logp_next)[:n].astype(np.float32),
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
    "tail_strata",
    "window_seed",
]
