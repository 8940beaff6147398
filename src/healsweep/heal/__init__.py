"""Quantize and heal: the stages of one trial, composed from kernels, each cached by content.

Public entry points: :class:`Knobs`, :class:`CalibrationConfig` and :func:`load_knobs` (here,
cheap to import), ``healsweep.heal.pipeline.build_student`` and ``healsweep.heal.export``
(import those modules directly; they pull in JAX).
"""

from healsweep.heal.knobs import CalibrationConfig, Knobs, load_knobs

__all__ = ["CalibrationConfig", "Knobs", "load_knobs"]
