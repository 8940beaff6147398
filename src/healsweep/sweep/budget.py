"""A sweep's size budget: which configs may be scored, and the record of those that may not.

A config's size comes from its knobs and the model's shapes alone
(:class:`healsweep.heal.size.ModelShapes`), so the budget is applied before anything is
quantized or scored:

- **grid**: the expanded grid is split into the configs inside the budget (the trials) and those
  over it, which never become trials and are recorded in ``over_budget.json``;
- **tpe / random**: every point the Optuna sampler proposes is sized in the driver before Tune
  sees it (:class:`BudgetGate`, called by the driver's search algorithm). One over the budget is
  told to the sampler's study as ``PRUNED`` with no intermediate value, recorded, and the
  sampler asked again, so it never takes a trial slot nor a worker. TPE ranks a pruned trial
  without values below every completed and every scored-then-pruned trial, so it learns to
  propose elsewhere (Optuna's ``constraints_func`` would need the trial to finish first). Such
  trials count towards TPE's random start-up trials (``n_startup_trials``).

Reference rows share the baseline's size, which must fit; external files are reference points
and are scored whatever their size (the report places them in the tiers they fit).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from healsweep.errors import SpecError
from healsweep.heal.knobs import Knobs
from healsweep.heal.reads import student_key
from healsweep.heal.size import Budget, ConfigSize
from healsweep.results.store import record_over_budget
from healsweep.sweep.sizes import config_size
from healsweep.sweep.space import config_hash, grid_configs, with_point
from healsweep.sweep.spec import SweepSpec

MAX_ASKS = 1000  # proposals in a row over budget before the search is declared finished


def budget_of(spec: SweepSpec) -> Budget | None:
    """The spec's budget, if it states one."""
    return None if spec.budget is None else spec.budget.budget()


def over_entry(knobs: Knobs, size: ConfigSize) -> dict[str, Any]:
    """What ``over_budget.json`` records of a config: its knobs (as it names them) and size."""
    return {"knobs": knobs.identity(), "routed_bpw": size.routed_bpw, "file_bytes": size.file_bytes}


def planned_trials(spec: SweepSpec) -> int:
    """How many trials the sweep runs (grid size inside the budget, or num_samples; with the
    allocator, the grid's and at most ``allocator.proposals`` per budget limit)."""
    if spec.sampler.type == "allocator":
        per_limit = spec.allocator_settings().proposals
        return len(split_grid(spec)[0]) + per_limit * len(spec.budget.budget().limits)
    return len(split_grid(spec)[0]) if spec.sampler.type == "grid" else int(spec.num_samples or 0)


def split_grid(
    spec: SweepSpec, extra: Sequence[Knobs] = ()
) -> tuple[list[Knobs], dict[str, dict[str, Any]]]:
    """The grid's configs, then ``extra`` configs (the allocator's proposals) that build another
    student, inside the budget (all of them without one), and those over it by config hash
    (:func:`over_entry`)."""
    configs, budget = grid_configs(spec), budget_of(spec)
    students = {student_key(knobs) for knobs in configs}
    for knobs in extra:
        if student_key(knobs) not in students:
            students.add(student_key(knobs))
            configs.append(knobs)
    if budget is None:
        return configs, {}
    inside, over = [], {}
    for knobs in configs:
        size = config_size(spec.model, knobs)
        if size is None or budget.admits(size):
            inside.append(knobs)
        else:
            over[config_hash(knobs)] = over_entry(knobs, size)
    return inside, over


def check_budget(spec: SweepSpec, where: str = "sweep spec") -> None:
    """With a budget: the baseline fits it (references share its size), and some config of the
    search space does; else one ``SpecError`` line (at spec load, before anything starts)."""
    budget = budget_of(spec)
    if budget is None:
        return
    size = config_size(spec.model, spec.baseline)
    limits = ", ".join(budget.label(limit) for limit in budget.limits)
    if size is not None and not budget.admits(size):
        raise SpecError(
            f"{where}: field 'budget': the baseline takes {size.routed_bpw:.4g} bpw "
            f"({size.file_mib:.2f} MiB), over the budget ({limits}); the baseline and the "
            "references are always scored: choose a baseline inside the budget"
        )
    if spec.sampler.type in ("grid", "allocator"):
        return  # the baseline is a trial of the grid
    if not any(budget.admits(s) for s in _space_sizes(spec) if s is not None):
        raise SpecError(
            f"{where}: field 'budget': no point of search_space fits the budget ({limits}); "
            "widen the type knobs' choices or raise the budget"
        )


def _space_sizes(spec: SweepSpec) -> list[ConfigSize | None]:
    """The sizes of every combination of the searched type knobs (what a size depends on)."""
    dims = spec.search_space.dimensions()
    typed = {k: getattr(dims[k], "choices", dims[k]) for k in Knobs.TYPES if k in dims}
    points = [
        dict(zip(typed, values, strict=True)) for values in itertools.product(*typed.values())
    ]
    return [config_size(spec.model, with_point(spec, point)) for point in points[:10_000]]


class BudgetGate:
    """Sizes each point a sampler proposes (in the driver): admits it, or records it in
    ``over_budget.json`` and refuses it. Picklable (Tune saves the searcher with the sweep)."""

    def __init__(self, spec: SweepSpec, sweep_dir: str | Path) -> None:
        self.spec = spec
        self.sweep_dir = Path(sweep_dir)
        self.budget = budget_of(spec)

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its searcher with plain pickle, which cannot name the spec's generic
        # dimension classes: keep the spec's stored form and validate it again on load.
        return {"spec": self.spec.model_dump(mode="json"), "sweep_dir": str(self.sweep_dir)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(SweepSpec.model_validate(state["spec"]), state["sweep_dir"])

    def admits(self, point: Mapping[str, Any]) -> bool:
        """Whether the config of sampled ``point`` fits the budget (recorded when it does not)."""
        if self.budget is None:
            return True
        knobs = with_point(self.spec, point)
        size = config_size(self.spec.model, knobs)
        if size is None or self.budget.admits(size):
            return True
        record_over_budget(self.sweep_dir, {config_hash(knobs): over_entry(knobs, size)})
        return False
