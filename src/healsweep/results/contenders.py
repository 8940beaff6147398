"""The allocator's choice beside the other ways to a recipe of the same size (issue 49).

A recipe under a size budget can come from three places: the allocator (sampler ``allocator``:
its proposals, ``allocator.json``, scored as grid points of the sweep), one type for every
routed expert (a *uniform* config; under a file budget every other group it retypes takes that
type too), or a search (sampler ``tpe`` or ``random``: every trial it ran, the baseline it starts
from included). Per budget tier, :func:`contenders` takes the best completed config of each, so
the report shows them side by side with the allocator's paired change against the other two
(negative: the allocator's choice is better).

The three rarely come from one sweep (a sweep has one sampler), so the search may be another
sweep's: :func:`beside_sweep` admits it when it scored the same model on the same split, and a
pair is compared on the windows both scored (window ids are content hashes of the window).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from healsweep.errors import ResultsError
from healsweep.heal.knobs import TEACHER, Knobs
from healsweep.heal.reads import student_key
from healsweep.results.aggregate import ConfigResult, SweepSummary, paired
from healsweep.results.budget import is_uniform, measured
from healsweep.results.schema import Role, TrialStatus

SEARCHES = ("tpe", "random")  # samplers whose every trial is the search's
# the manifest entries two sweeps must share for their windows to be the same text
SAME_INPUTS = ("model_fingerprint", "split_lock_id")


class Origin(StrEnum):
    """Where a contender came from (the report's label of its row)."""

    ALLOCATOR = "the allocator's best"
    UNIFORM = "best uniform"
    SEARCH = "best search"


@dataclass(frozen=True)
class Candidate:
    """A completed tuned config and the sweep that scored it."""

    config: ConfigResult
    sweep: str
    sampler: str
    proposed: bool  # the student of an allocator proposal (of any sweep compared)


@dataclass
class Contender:
    """The best of one origin inside a tier, and the allocator's best against it."""

    origin: Origin
    candidate: Candidate
    comparison: Any  # the allocator's best vs this one (None for the allocator's own row)


@dataclass
class TierContenders:
    """One budget tier's contenders, the allocator's best first."""

    limit: float
    label: str
    rows: list[Contender]


def proposals(summary: SweepSummary) -> set[str]:
    """The students of the allocator's proposals in the sweep (``allocator.json``)."""
    return {student_key(Knobs(**p["knobs"])) for p in summary.allocator.get("proposals", [])}


def candidates(summary: SweepSummary, proposed: set[str] = frozenset()) -> list[Candidate]:
    """The sweep's completed trials (the baseline included) that have a size and a pooled KLD;
    those whose student is in ``proposed`` (or its own proposals) are the allocator's."""
    proposed = proposed | proposals(summary)
    return [
        Candidate(c, summary.name, summary.sampler, student_key(c.knobs) in proposed)
        for c in summary.configs
        if c.role.tuned and c.status == TrialStatus.COMPLETED and c.knobs is not None
        and c.pooled.get("kld_mean") is not None
    ]  # fmt: skip


def beside_sweep(summary: SweepSummary, other: SweepSummary) -> SweepSummary:
    """``other``, checked to have scored the model and split ``summary`` did; raise
    :class:`ResultsError` naming what differs."""
    for key in SAME_INPUTS:
        mine, theirs = summary.manifest.get(key), other.manifest.get(key)
        if mine is None or mine != theirs:
            raise ResultsError(
                f"sweep {other.name!r} cannot be compared with {summary.name!r}: its {key} is "
                f"{str(theirs)[:16]!r}, not {str(mine)[:16]!r}; put beside it a sweep of the same "
                "model and split"
            )
    return other


def is_uniform_under(config: ConfigResult, measure: str) -> bool:
    """One type for every routed expert (:func:`~healsweep.results.budget.is_uniform`); under a
    file budget also for every other tensor group the config retypes (a group left as the
    teacher stores it is not retyped): llama.cpp's one-type file, healed."""
    if not is_uniform(config):
        return False
    values = config.knob_values
    return measure == "routed_bpw" or all(
        values[k] in (TEACHER, values["type_gu"]) for k in Knobs.FILE_TYPES
    )


def _origin_of(candidate: Candidate, measure: str) -> list[Origin]:
    found = [Origin.ALLOCATOR] if candidate.proposed else []
    found += [Origin.UNIFORM] if is_uniform_under(candidate.config, measure) else []
    return found + ([Origin.SEARCH] if candidate.sampler in SEARCHES else [])


def contenders(summary: SweepSummary, beside: list[SweepSummary] = ()) -> list[TierContenders]:
    """Per budget tier of ``summary`` with a completed allocator proposal inside it (a config
    of any of the sweeps whose student an allocator proposed): the allocator's best, the best
    uniform config and the best config of a search (tpe/random), each from ``summary`` or the
    sweeps ``beside`` it, the last two with the allocator's best paired against them. [] without
    a budget or without allocator proposals."""
    budget = summary.budget
    sweeps = (summary, *beside)
    # a grid point of one sweep that another sweep's allocator proposed is the allocator's too
    proposed = set().union(*(proposals(s) for s in sweeps))
    pool = [c for s in sweeps for c in candidates(s, proposed)]
    if budget is None or not any(c.proposed for c in pool):
        return []
    out = []
    for limit in budget.limits:
        inside = [c for c in pool if (size := measured(c.config, budget.measure)) is not None
                  and budget.within(size, limit)]  # fmt: skip
        best = {}
        for candidate in sorted(inside, key=lambda c: c.config.pooled["kld_mean"]):
            for origin in _origin_of(candidate, budget.measure):
                best.setdefault(origin, candidate)
        mine = best.get(Origin.ALLOCATOR)
        if mine is None:
            continue
        rows = [Contender(Origin.ALLOCATOR, mine, None)]
        for origin in (Origin.UNIFORM, Origin.SEARCH):
            if (other := best.get(origin)) is not None:
                comp = paired(other.config, mine.config, n_boot=summary.n_boot, seed=summary.seed)
                rows.append(Contender(origin, other, comp))
        out.append(TierContenders(limit, budget.label(limit), rows))
    return out


def role_word(candidate: Candidate) -> str:
    """How the report names a contender's provenance: its sweep and sampler."""
    if candidate.proposed:
        what = "the allocator's choice"
    elif candidate.config.role == Role.BASELINE:
        what = "baseline"
    else:
        what = f"{candidate.sampler} trial" if candidate.sampler in SEARCHES else "grid point"
    return f"{what}, sweep {candidate.sweep}"
