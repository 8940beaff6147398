"""`healsweep bench quant`: Q2_0 quantize throughput, side by side with C, numpy and naive jnp."""

from __future__ import annotations

from typing import Annotated

import typer

from healsweep.cli._apps import bench_app


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
    # lazy: heavy (jax): --help stays instant
    from healsweep.bench.quant import quant_table

    if rows % 16 or cols % 64:
        raise typer.BadParameter(f"--rows must be a multiple of 16 and --cols of 64, got "
                                 f"{rows} x {cols}")

    typer.echo(quant_table(rows, cols, repeats, progress=typer.echo))
