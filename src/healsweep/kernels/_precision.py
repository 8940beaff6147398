"""Matrix products in full float32 for the statistics of healing.

XLA computes a float32 matrix product on an NVIDIA GPU with TF32 unless told otherwise (inputs
rounded to a 10-bit mantissa): relative errors near 1e-3, which the Gram of the ridge, its
eigenbasis and the alpha statistics cannot take (``healsweep doctor`` measured 1.6e-4 to 6.2e-4
against the CPU on an H200). The CPU always multiplies in float32, so there this changes nothing.
The model's forward keeps the backend's default: its logits are compared with other runtimes'
at tolerances TF32 meets, and it is where the speed matters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def full_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every matrix product it traces or runs at ``highest`` precision (put it under
    ``jax.jit``, so the products are traced that way, or on a function that runs eager ops)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped
