"""The stage vocabulary's former home: :mod:`healsweep.stage_names` (a leaf beside the cache, so
the score layer names its stage without importing heal). Kept for the modules that still import
it from here."""

from healsweep.stage_names import STUDENT_STAGES, VERSIONS, Stage

__all__ = ["STUDENT_STAGES", "VERSIONS", "Stage"]
