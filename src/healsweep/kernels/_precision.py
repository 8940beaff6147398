"""Matrix products in full float32 for the statistics of healing, compiled without autotuning.

XLA computes a float32 matrix product on an NVIDIA GPU with TF32 unless told otherwise (inputs
rounded to a 10-bit mantissa): relative errors near 1e-3, which the Gram of the ridge, its
eigenbasis and the alpha statistics cannot take (``healsweep doctor`` measured 1.6e-4 to 6.2e-4
against the CPU on an H200). The CPU always multiplies in float32, so there this changes nothing.
The model's forward keeps the backend's default: its logits are compared with other runtimes'
at tolerances TF32 meets, and it is where the speed matters.

At ``highest`` precision XLA's GPU compiler tries many GEMM kernels per product and times each
(autotuning): on an H200 the healing statistics of one cold real-size trial spent 133 s of its
150 s compiling, against 21 s with autotuning off, which made the cold trial 50 s. These
programs run once per layer and trial, so :func:`healing_jit` compiles them with autotuning off
on a GPU; the forward, which runs for every window, keeps it (turning it off everywhere cut the
forward from 54k to 17k tok/s there). docs/sizing.md has the figures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

# XLA debug options of the healing statistics' own compilations on a GPU backend.
GPU_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def full_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every matrix product it traces or runs at ``highest`` precision (put it under
    ``jax.jit``, so the products are traced that way, or on a function that runs eager ops)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped


def healing_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """``jax.jit(full_float32(fn), **jit_kwargs)``, compiled with :data:`GPU_COMPILER_OPTIONS`
    when it is the outermost jit on a GPU backend (JAX accepts compiler options only there:
    called inside another jitted function it traces as a plain jit)."""
    if fn is None:
        return functools.partial(healing_jit, **jit_kwargs)
    plain = jax.jit(full_float32(fn), **jit_kwargs)
    top: list[Any] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return plain(*args, **kwargs)
        if not top:
            gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
            options = GPU_COMPILER_OPTIONS if gpu else None
            top.append(jax.jit(full_float32(fn), compiler_options=options, **jit_kwargs))
        return top[0](*args, **kwargs)

    return call


# An eager product of the healing statistics (a bare ``a @ b`` would compile with autotuning).
matmul = healing_jit(lambda a, b: a @ b)
