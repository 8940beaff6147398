"""Pure ``jax.numpy`` kernels: Q2_0 and IQ4_NL codecs, alpha, ridge, KLD statistics.

The package face is lazy (PEP 562): importing a jax-free module of it, such as the type table
:mod:`healsweep.kernels.ggml_types` that the knobs read, does not import jax, so `sweep status`
reads a sweep without starting jax, and a module that must stay jax-free when imported (the
quantizer registry, the GGUF reader) imports this face at its top and reaches
``kernels.q2_0`` (or ``ggml_decode``, ``iq4_nl``, ``q2_0_plain``, ``requant``) where it runs a
kernel."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Q2Weight", "ggml_decode", "iq4_nl", "q2_0", "q2_0_plain", "requant"]


def __getattr__(name: str) -> Any:
    if name in ("ggml_decode", "iq4_nl", "q2_0", "q2_0_plain", "requant"):
        return importlib.import_module(f"healsweep.kernels.{name}")
    if name == "Q2Weight":
        return importlib.import_module("healsweep.kernels.q2_0").Q2Weight
    raise AttributeError(f"module 'healsweep.kernels' has no attribute {name!r}")
