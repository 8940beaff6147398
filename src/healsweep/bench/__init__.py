"""Benchmarks: ``healsweep bench forward | quant | trial | night`` and ``model bench``.

Imported by the CLI (and the benchmark scripts) only: no runtime package imports a module here,
so no stage's code digest covers one, and editing a benchmark table invalidates no cached
stage."""
