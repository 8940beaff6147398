"""The conformance suite: every kernel case, one per in-graph decoder type, and the layer forward."""

from __future__ import annotations

from healsweep.conformance.cases import KERNEL_CASES
from healsweep.conformance.decoders import decoder_cases
from healsweep.conformance.layer import layer_case
from healsweep.conformance.run import ConformanceResult, KernelCase, run_case


def all_cases() -> list[KernelCase]:
    """The kernel cases, one per in-graph decoder type, and the layer forward, in that order."""

    return [*KERNEL_CASES, *decoder_cases(), layer_case()]


def run_conformance(cases: list[KernelCase] | None = None) -> list[ConformanceResult]:
    """Every registered case (:func:`all_cases`), in order."""
    return [run_case(case) for case in (cases if cases is not None else all_cases())]
