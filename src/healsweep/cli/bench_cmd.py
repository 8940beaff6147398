"""`healsweep bench trial`: per-stage time and peak RSS of heal trials, and the forward beside
llama.cpp's; `healsweep bench night`: a real sweep run measured end to end."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output_folder
from healsweep.cache import StageCache, parse_gb
from healsweep.cli._apps import CacheMaxGb, bench_app
from healsweep.data.corpus import load_corpus
from healsweep.heal.knobs import CalibrationConfig, Knobs, load_knobs


@bench_app.command("trial")
def bench_trial(
    model: Annotated[str, typer.Argument(help="GGUF path, or a packaged model: `demo`, `demo-medium-cpu`.")] = "demo",
    knobs: Annotated[Path | None, typer.Option(
        "--knobs", help="Base knobs of the cold trial; default: the shipped healer.")] = None,
    corpus: Annotated[str, typer.Option(
        "--corpus", help="Corpus whose calibration pool calibrates, or `demo`.")] = "demo",
    calib_tokens: Annotated[int, typer.Option(
        "--calib-tokens", min=64, help="Calibration tokens the teacher trace uses.")] = 4096,
    chunk_length: Annotated[int, typer.Option(
        "--chunk-length", min=16, help="Tokens per traced sequence.")] = 512,
    tokens: Annotated[str, typer.Option(
        "--tokens", help="Comma-separated token counts of the forward benchmark ('' skips it).")
    ] = "512,2048",
    seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="Tokens per sequence.")] = 256,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="llama.cpp threads (default: every core).")] = None,
    cache: Annotated[Path | None, typer.Option(
        "--cache", help="Stage cache directory (default: a fresh temporary one, so the first "
        "trial is cold).")] = None,
    cache_max_gb: CacheMaxGb = None,
    trials: Annotated[bool, typer.Option(
        "--trials/--no-trials", help="Run the heal trials (else only the forward).")] = True,
    cold_only: Annotated[bool, typer.Option(
        "--cold-only", help="Only the cold trial (the first), not the follow-ups.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Cold, quant-knob-only, rho-only, eta-only and (with ggml's quantizer) type_d-only heal
    trials (stage times, peak RSS), then teacher-forced tokens/s and peak RSS of the forward
    beside llama.cpp's (when the optional `llama-cpp-python` is installed; `pip install -e
    ".\\[bench]"`)."""
    # lazy: heavy (gguf, jax): --help stays instant
    from healsweep.bench.forward import bench_forward_pair, format_pairs

    # lazy: heavy (gguf, jax)
    from healsweep.bench.trial import bench_trials, format_trials, type_step

    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    try:
        counts = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"--tokens {tokens!r}: expected comma-separated integers") from None
    parse_gb(cache_max_gb, "--cache-max-gb")  # a bad value: refused before any work
    teacher = open_model(model)
    out: dict = {"model": str(teacher.path), "trials": [], "forward": []}
    if trials:
        base = load_knobs(knobs) if knobs else Knobs()
        calibration = CalibrationConfig(corpus=corpus, max_tokens=calib_tokens,
                                        chunk_length=chunk_length)
        with tempfile.TemporaryDirectory(prefix="healsweep-bench-") as scratch:
            out["trials"] = bench_trials(teacher, load_corpus(corpus),
                                         StageCache(cache if cache is not None else scratch,
                                                    cache_max_gb),
                                         calibration, base, 1 if cold_only else None)
        if not as_json:
            typer.echo(f"heal trials on {teacher!r}, {calib_tokens} calibration tokens:")
            typer.echo(format_trials(out["trials"]))
            _, why = type_step(base.type_d, teacher.hparams.n_ff_exp)
            if why:
                typer.echo(why)
    for n in counts:
        out["forward"].append(bench_forward_pair(teacher.path, n, seq_len, threads))
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
    elif counts:
        typer.echo(format_pairs(out["forward"]))


@bench_app.command("night")
def bench_night(
    model: Annotated[str, typer.Argument(help="GGUF path, or `demo`.")] = "demo",
    nodes: Annotated[
        int,
        typer.Option(
            "--nodes",
            min=0,
            help="Start a local pool of N Ray nodes on this host, each with its "
            "own stage cache (0: the sweep's embedded Ray).",
        ),
    ] = 0,
    placement: Annotated[
        str,
        typer.Option(
            "--placement",
            help="cache (trials go where their quantization is), ray (Ray alone), "
            "or both (each on a fresh pool, one after the other).",
        ),
    ] = "cache",
    grid: Annotated[
        str, typer.Option("--grid", help="QxRxE: quantization settings x rho values x eta values.")
    ] = "3x2x2",
    quant_knob: Annotated[
        str,
        typer.Option(
            "--quant-knob",
            help="The quantization knob the grid varies: gain_d (down only), gain_gu "
            "(gate and up) or type_d (down's type, by ggml's quantizer: the costliest).",
        ),
    ] = "gain_d",
    windows: Annotated[int, typer.Option("--windows", min=1, help="Dev windows per config.")] = 96,
    cpus_per_node: Annotated[int, typer.Option(
        "--cpus-per-node", min=1, help="CPUs each pool node offers Ray (with --nodes).")] = 1,
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", min=0, help="GPUs each pool node offers Ray.")
    ] = 0,
    gpu: Annotated[
        bool, typer.Option("--gpu", help="One trial per GPU: resources {cpu: 1, gpu: 1}.")
    ] = False,
    max_concurrent: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent", min=1, help="Trials at once (default: one per CPU or GPU slot)."
        ),
    ] = None,
    shared: Annotated[
        bool,
        typer.Option(
            "--shared-cache", help="One stage-cache root for every node (the spec's cache_root)."
        ),
    ] = False,
    calib_tokens: Annotated[
        int | None,
        typer.Option(
            "--calib-tokens", min=64, help="Calibration tokens (default: the spec's default)."
        ),
    ] = None,
    knobs: Annotated[
        Path | None,
        typer.Option(
            "--knobs",
            help="A knob file every config shares (the grid's knobs vary on top), e.g. "
            "configs/knobs/gptq.yaml for a quantization that costs what it does at night.",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Folder for the runs, night.json and night.md (default: a temporary one, "
            "removed after).",
        ),
    ] = None,
    cache_max_gb: CacheMaxGb = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A real `sweep run` of a quantization x rho x eta grid: configs per hour and per night,
    seconds per trial by kind, the stage-cache hit rate, the follow-ups run on the node holding
    their quantization, CPU/GPU utilization and peak RSS, the stage-cache bytes written per
    stage and the caches' size on disk at the end (see docs/sizing.md)."""

    # lazy: heavy (gguf, jax, pyarrow)
    from healsweep.bench.night import (
        NightError,
        cache_table,
        night_table,
        parse_grid,
        run_night,
    )

    if out is not None:  # the folder of a night's runs: checked before the night, not after
        check_output_folder(out, "night's runs", make=True)
    limit = parse_gb(cache_max_gb, "--cache-max-gb")
    modes = {"cache": ("cache",), "ray": ("ray",), "both": ("ray", "cache")}
    if placement not in modes:
        raise NightError(f"--placement {placement!r}: expected cache, ray or both")
    with tempfile.TemporaryDirectory(prefix="healsweep-night-") as scratch:
        folder = out or Path(scratch)
        night = run_night(
            model, folder, nodes=nodes, placements=modes[placement],
            grid=parse_grid(grid, quant_knob), windows=windows, cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, gpu=gpu,
            max_concurrent=max_concurrent, shared=shared, calib_tokens=calib_tokens,
            knobs=load_knobs(knobs) if knobs else None, cache_max_gb=limit,
        )  # fmt: skip
        table = night_table(night) + "\n\n" + cache_table(night)
        (folder / "night.json").write_text(json.dumps(night, indent=2, default=str))
        (folder / "night.md").write_text(table + "\n")
    if as_json:
        typer.echo(json.dumps(night, default=str))
    else:
        typer.echo(table)
