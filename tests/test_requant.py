"""Part B's requantization on the device (kernels.requant, StorageFormat.requantize_on_device).

Checked against gguf-py, an independent encoder and decoder: the Q8_0 bytes are gguf-py's bit for
bit, the values the device keeps are what gguf-py decodes those bytes to, and the formats without
a device codec give on the device exactly what their host path gives.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from healsweep.errors import GGUFFormatError
from healsweep.kernels import requant
from healsweep.quant.formats import Q8_0, format_of, requantize, requantize_on_device


def _hard_rows(rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random rows plus the blocks a rounding rule shows itself on: all zeros, codes at exact
    halves (x/d = k + 0.5), integers, a single large value, negative halves."""
    values = (rng.standard_normal((64, 256)) * scale).astype(np.float32)
    values[0, :32] = 0.0
    values[1, :32] = (np.arange(32) - 15.5) * scale  # halves after scaling by 127/max
    values[2, :32] = np.float32(127.0) * (np.arange(32) % 2 * 2 - 1) * scale
    values[3, :64] = rng.integers(-127, 128, 64).astype(np.float32) * 0.5 * scale
    values[4, :32] = 0.0
    values[4, 5] = -3.0 * scale  # one value: every other code 0, d = 3·scale/127
    values[5, :32] = -(np.arange(32) + 0.5) * scale
    return values


@pytest.mark.parametrize("scale", [1e-4, 0.02, 1.0, 300.0])
def test_q8_0_on_the_device_is_gguf_pys_bytes_and_values(scale):
    values = _hard_rows(np.random.default_rng(7), scale)
    raw = np.asarray(requant.encode_q8_0(jax.numpy.asarray(values))[0])
    np.testing.assert_array_equal(raw, quantize(values, T.Q8_0))
    got_raw, stored = requantize_on_device("w", jax.numpy.asarray(values), T.Q8_0)
    assert isinstance(stored, jax.Array)  # the values stay where they were made
    np.testing.assert_array_equal(got_raw, raw)
    want = np.asarray(dequantize(raw, T.Q8_0), np.float32).reshape(values.shape)
    np.testing.assert_array_equal(np.asarray(stored).view(np.uint32), want.view(np.uint32))
    # a property of the grid: each value within half a step of its block's scale, plus what
    # rounding that scale to fp16 moves its largest code (float64)
    blocks = values.reshape(64, -1, 32).astype(np.float64)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    d16 = d.astype(np.float16).astype(np.float64)
    err = np.abs(np.asarray(stored).reshape(64, -1, 32) - blocks)
    assert np.all(err <= 0.5 * d * (1 + 1e-6) + 127 * np.abs(d - d16) + 1e-30)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.Q4_0, T.IQ4_NL])
def test_every_format_requantizes_on_the_device_as_on_the_host(qtype):
    values = (np.random.default_rng(8).standard_normal((12, 128)) * 0.1).astype(np.float32)
    host_raw, host_values = requantize("w", values, qtype)
    raw, stored = requantize_on_device("w", jax.numpy.asarray(values), qtype)
    assert isinstance(stored, jax.Array) and stored.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(raw), np.asarray(host_raw))
    np.testing.assert_array_equal(np.asarray(stored), host_values)


def test_q8_0_has_its_class_and_a_bad_row_length_is_a_clear_error():
    assert format_of(T.Q8_0) is Q8_0
    with pytest.raises(GGUFFormatError, match="rows of 48 are not a multiple of its block size 32"):
        requantize_on_device("blk.0.ffn_down_shexp.weight", jax.numpy.zeros((2, 48)), T.Q8_0)
