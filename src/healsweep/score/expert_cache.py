"""The student's forward through a simulated expert cache, and its I/O figures per window.

A :class:`ExpertCacheConfig` (bonus, size in experts or MiB, warm or cold) turns into per-layer
capacities for a student (:func:`layer_capacities`, from the student's stored bytes of one routed
expert, :func:`expert_bytes`). ``healsweep.score.runner.CachedStudent`` runs the student's batched
forwards through the cache (``model.expert_cache``) and keeps, with ``warm``, each document's final
cache states for its next window. :class:`CacheWindowStats` counts a window's lookups and misses at its scored
positions (the positions whose logits are scored, as for router agreement); the context before
them runs through the same cache first, so it warms it. See docs/expert-cache.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from healsweep.errors import KnobError
from healsweep.gguf_io import block_prefix
from healsweep.score.record import CacheWindowStats, per_token
from healsweep.score.student import StudentModel

MIB = float(1 << 20)
_EXPERT_TENSORS = ("gate_exps", "up_exps", "down_exps")


class ExpertCacheConfig(BaseModel):
    """The cache of a scoring run: ``bonus`` added to resident experts' selection scores, the
    per-layer size in ``experts`` or in ``mib`` (MiB of one layer's cache at the student's
    stored expert size), and ``warm`` (carry a document's caches to its next window)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bonus: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    experts: int | None = Field(default=None, ge=1)
    mib: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    warm: bool = False

    @classmethod
    def from_knobs(cls, knobs: Any) -> ExpertCacheConfig | None:
        """The cache a trial's knobs (heal's ``Knobs``) ask for (``cache_experts`` > 0), else
        None; ``KnobError`` for a bonus without a cache (it would have nothing to act on)."""
        if not knobs.cache_experts:
            if knobs.moce_bonus:
                raise KnobError(f"knob 'moce_bonus' = {knobs.moce_bonus!r} needs an expert "
                                "cache: set cache_experts to the experts each layer's cache holds")  # fmt: skip
            return None
        return cls(bonus=knobs.moce_bonus, experts=knobs.cache_experts)

    def label(self) -> str:
        """``bonus 0.5, 4 experts per layer, cold``."""
        size = f"{self.experts} experts" if self.experts is not None else f"{self.mib:g} MiB"
        return f"bonus {self.bonus:g}, {size} per layer, {'warm' if self.warm else 'cold'}"


def expert_bytes(student: StudentModel) -> list[int]:
    """Per MoE layer (leading dense layers have no experts), the stored bytes of one routed
    expert (gate + up + down) of the student: its replacement weights' bytes where the layer is
    replaced, else the GGUF tensors' bytes."""
    model = getattr(student, "base", student)
    replacements = getattr(student, "replacements", None) or {}  # read layer by layer
    n_expert = model.hparams.n_expert
    sizes = []
    for layer in model.hparams.moe_layers:
        new = replacements.get(layer)
        total = 0
        for field in _EXPERT_TENSORS:
            weight = getattr(new, field, None) if new is not None else None
            if weight is not None:
                total += int(weight.nbytes)
            else:
                total += model.tensor_nbytes(f"{block_prefix(layer)}ffn_{field}.weight")
        sizes.append(total // n_expert)
    return sizes


def layer_capacities(config: ExpertCacheConfig, student: StudentModel) -> list[int]:
    """Experts each MoE layer's cache holds; ``KnobError`` unless it lies in [k, E]."""
    hp = getattr(student, "base", student).hparams
    if (config.experts is None) == (config.mib is None):
        raise KnobError("the expert cache needs exactly one size: experts (--cache-experts) "
                        "or mib (--cache-mib)")  # fmt: skip
    if config.experts is not None:
        capacities = [config.experts] * len(hp.moe_layers)
    else:
        capacities = [int(config.mib * MIB // size) for size in expert_bytes(student)]
    low, high = min(capacities), max(capacities)
    if low < hp.n_expert_used or high > hp.n_expert:
        what = f"{config.mib:g} MiB holds {low}" if config.mib is not None else f"{low}"
        raise KnobError(
            f"expert cache of {what} experts per layer is not allowed: a layer routes each token "
            f"to {hp.n_expert_used} of {hp.n_expert} experts, so the cache must hold between "
            f"{hp.n_expert_used} and {hp.n_expert}"
        )
    return capacities


def pooled_cache(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Token-pooled cache figures of window records (None when none has cache figures)."""
    stats = [s for s in map(CacheWindowStats.from_dict, records) if s is not None]
    if not stats:
        return None
    tokens = sum(s.tokens for s in stats)
    lookups = sum(s.lookups for s in stats)
    misses = sum(s.misses for s in stats)
    mib = sum(s.mib for s in stats)
    return {"windows": len(stats), "tokens": tokens, "lookups": lookups, "misses": misses,
            "mib": mib, **per_token(tokens, lookups, misses, mib)}  # fmt: skip


__all__ = [
    "CacheWindowStats",
    "ExpertCacheConfig",
    "expert_bytes",
    "layer_capacities",
    "per_token",
    "pooled_cache",
]
