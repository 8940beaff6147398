"""Quantization of the routed experts: one registered class per (quantizer, storage type).

:mod:`healsweep.quant.registry` is the table the heal pipeline asks: ``quantizer_for(type,
quantizer)`` returns the class that stores a layer's tensor group in ``type`` under the knob
``quantizer``; the class says which knobs and inputs it reads (its cache key), quantizes the group
and folds Part A's alpha into its scales. The classes: :mod:`healsweep.quant.q2_0` (Q2_0 by
``search``, ``gptq``, ``plain``) and :mod:`healsweep.quant.ggml` (every ggml type by ggml's own
quantizer, and GPTQ on the Q2_K/Q3_K and IQ2 grids). The other modules are their machinery (GPTQ,
ggml's grids, importance); :mod:`healsweep.quant.formats` holds each storage format's facts
(encode, decode, alpha's fold, its GGUF rows, requantizing any tensor into it: Part B's shared
expert back in its own type). Adding a type or a quantizer: ``docs/architecture.md``.

This face imports nothing: the trace's moment kernels live here too, and a stage's code digest
covers what the modules it imports import (``healsweep._code``), so the quantizers stay out of
the digests of the trace and the teacher cache.
"""
