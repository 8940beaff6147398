"""`healsweep bench quant`: Q2_0 quantize throughput, side by side with C, numpy and naive jnp."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Annotated

import typer

from healsweep.cli._apps import bench_app

_BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _load_benchmark():
    """``benchmarks/bench_quant.py`` of the source checkout (it owns the C and numpy contenders)."""
    script = _BENCHMARKS / "bench_quant.py"
    if not script.exists():
        typer.echo(f"error: {script} not found; run `healsweep bench quant` from a source "
                   "checkout (the benchmark and its C loop are not installed with the package)",
                   err=True)
        raise typer.Exit(1)
    if str(_BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(_BENCHMARKS))  # its GPU half imports it as a sibling
    spec = importlib.util.spec_from_file_location("bench_quant", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_quant"] = module
    spec.loader.exec_module(module)
    return module


@bench_app.command("quant")
def bench_quant(
    rows: Annotated[int, typer.Option("--rows", min=16, help="Matrix rows (a multiple of 16).")]
    = 2048,
    cols: Annotated[int, typer.Option("--cols", min=64, help="Matrix columns (a multiple of 64).")]
    = 2048,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Interleaved rounds.")] = 5,
) -> None:
    """Q2_0 quantize weights/s: the jitted kernel vs C loops (-O3, -march=native, -ffast-math),
    numpy and naive jnp on the CPU, or against the fp32 and memory ceilings on a GPU."""
    if rows % 16 or cols % 64:
        raise typer.BadParameter(f"--rows must be a multiple of 16 and --cols of 64, got "
                                 f"{rows} x {cols}")
    import jax

    bench = _load_benchmark()
    if jax.default_backend() == "cpu":
        table, notes = bench.cpu_table(rows, cols, repeats)
    else:
        from bench_quant_gpu import gpu_table

        table, notes = gpu_table(repeats)
    typer.echo(bench.format_table(table, notes))
