"""Stage keys cover the code a stage runs: traced against the digest's module set (issue 31)."""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
import pytest

import healsweep
from _heal_fixtures import heal_setup
from healsweep.cache import StageCache
from healsweep.data.windows import Window
from healsweep.heal import stages, trace
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.score.teacher_cache import teacher_outputs

setup = heal_setup
CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
PACKAGE = Path(healsweep.__file__).parent


def _module_of(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_relative_to(PACKAGE) or path.suffix != ".py":
        return None
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("healsweep", *parts)).removesuffix(".__init__")


class TracingCache(StageCache):
    """A real stage cache whose computations run under ``sys.settrace``: ``executed[stage]`` is
    every healsweep module with a frame executed while that stage computed (in any thread that
    computes it; a stage computed inside another counts for both)."""

    def __init__(self, root):
        super().__init__(root)
        self.executed: dict[str, set[str]] = defaultdict(set)
        self._active = threading.local()

    def _tracer(self, frame, event, arg):
        if event == "call":
            module = _module_of(frame.f_code.co_filename)
            if module is not None:
                for stage in self._active.stages:
                    self.executed[stage].add(module)
        return None

    def get_or_compute(self, stage, key, compute):
        def traced():
            active = getattr(self._active, "stages", None)
            if active is None:
                active = self._active.stages = []
            previous = sys.gettrace() if not active else None
            active.append(stage)
            if len(active) == 1:
                sys.settrace(self._tracer)
            try:
                return compute()
            finally:
                active.pop()
                if not active:
                    sys.settrace(previous)

        return super().get_or_compute(stage, key, traced)


# Cache stage name -> the name its key is built under, per quantizer.
QUANTIZE_KEY = {"search": "quantize", "gptq": "quantize_gptq", "plain": "quantize_plain"}
CONFIGS = {
    "act-mse-ridge": Knobs(importance="act", importance_down="act", alpha="mse", gamma=0.0),
    "gptq-refine": Knobs(quantizer="gptq", gptq_refine=1),
    "plain": Knobs(quantizer="plain", alpha="gaussian"),
    "expert-mse": Knobs(alpha="mse", alpha_granularity="expert"),
    "expert-gaussian": Knobs(alpha="gaussian", alpha_granularity="expert", ridge=False),
}


def digest_modules(key_stage: str) -> frozenset[str]:
    """The modules whose source a key of ``key_stage`` covers."""
    if key_stage == "calib_trace":
        return frozenset(trace.TRACE_CODE)
    if key_stage == "teacher_logits":
        return frozenset()
    return frozenset(stages.STAGE_CODE[key_stage])


def _missing(executed: dict[str, set[str]], knobs: Knobs | None) -> dict[str, list[str]]:
    missing = {}
    for stage, modules in executed.items():
        key_stage = stage
        if stage == "quantize" and knobs is not None:
            key_stage = QUANTIZE_KEY[knobs.quantizer]
        outside = sorted(modules - digest_modules(key_stage))
        if outside:
            missing[key_stage] = outside
    return missing


@pytest.fixture(scope="module")
def traced_runs(setup, tmp_path_factory):
    """Every cached stage computed once per knob setting (and the teacher cache in both
    formats), from cold caches and with JAX's traces cleared, so that the Python of every
    jitted function runs again."""
    model, corpus = setup
    jax.clear_caches()
    runs = {}
    for name, knobs in CONFIGS.items():
        cache = TracingCache(tmp_path_factory.mktemp(name))
        build_student(model, knobs, CAL, cache, corpus=corpus)
        runs[name] = (knobs, dict(cache.executed))
    tokens = np.arange(5, 60, dtype=np.int32)
    window = Window("w0", "d0", "s", 1, "a", "dev", "text", tokens, 20, 30)
    cache = TracingCache(tmp_path_factory.mktemp("teacher"))
    for fmt in ("exact", "compact"):
        teacher_outputs(model, [window], cache, fmt)
    runs["teacher"] = (None, dict(cache.executed))
    return runs


@pytest.mark.parametrize("run", [*CONFIGS, "teacher"])
def test_every_module_a_stage_executes_is_in_its_digest(traced_runs, run):
    knobs, executed = traced_runs[run]
    assert executed, "nothing was computed: the run did not exercise any stage"
    missing = _missing(executed, knobs)
    assert not missing, "executed but outside the digest:\n" + "\n".join(
        f"  {stage}: {', '.join(modules)}" for stage, modules in sorted(missing.items())
    )
