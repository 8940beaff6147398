"""Sweeps: a validated spec, a Ray Tune trainable reporting window by window, Optuna sampling
and per-window pruning, resume after a crash.

Entry points (import them from their modules; Ray is imported only there):
``healsweep.sweep.spec.load_spec``, ``healsweep.sweep.driver.run_sweep`` / ``resume_sweep``,
``healsweep.sweep.status.sweep_status``. The one boundary to the heal and score work of a trial is
``healsweep.sweep.work.run_trial_work``.
"""

from healsweep.sweep.spec import SweepSpec
from healsweep.sweep.spec_files import load_spec, spec_from_dict

__all__ = ["SweepSpec", "load_spec", "spec_from_dict"]
