"""healsweep: sweeps of 2-bit quantization healing for GGUF Mixture-of-Experts models."""

from healsweep.errors import HealsweepError

__version__ = "0.1.0"
__all__ = ["HealsweepError", "__version__"]
