"""Pure ``jax.numpy`` kernels: Q2_0 and IQ4_NL codecs, alpha, ridge, KLD statistics."""

from healsweep.kernels import iq4_nl, q2_0
from healsweep.kernels.q2_0 import Q2Weight

__all__ = ["Q2Weight", "iq4_nl", "q2_0"]
