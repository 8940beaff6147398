"""`healsweep bench trial`: per-stage time and peak RSS of heal trials, and the forward beside
llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from healsweep.cli._apps import bench_app


@bench_app.command("trial")
def bench_trial(
    model: Annotated[str, typer.Argument(help="GGUF path, or `demo`.")] = "demo",
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
    trials: Annotated[bool, typer.Option(
        "--trials/--no-trials", help="Run the heal trials (else only the forward).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Cold, quant-knob-only, rho-only, eta-only and (with ggml's quantizer) type_d-only heal
    trials (stage times, peak RSS), then teacher-forced tokens/s and peak RSS of the forward
    beside llama.cpp's (when the optional `llama-cpp-python` is installed; `pip install -e
    ".\\[bench]"`)."""
    import tempfile

    from healsweep.cache import StageCache
    from healsweep.data.corpus import load_corpus
    from healsweep.heal.knobs import CalibrationConfig, Knobs, load_knobs
    from healsweep.heal.trial_bench import bench_trials, format_trials
    from healsweep.model import open_model
    from healsweep.model.bench import bench_forward_pair, format_pairs

    try:
        counts = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"--tokens {tokens!r}: expected comma-separated integers") from None
    teacher = open_model(model)
    out: dict = {"model": str(teacher.path), "trials": [], "forward": []}
    if trials:
        base = load_knobs(knobs) if knobs else Knobs()
        calibration = CalibrationConfig(corpus=corpus, max_tokens=calib_tokens,
                                        chunk_length=chunk_length)
        with tempfile.TemporaryDirectory(prefix="healsweep-bench-") as scratch:
            out["trials"] = bench_trials(teacher, load_corpus(corpus),
                                         StageCache(cache if cache is not None else scratch),
                                         calibration, base)
        if not as_json:
            typer.echo(f"heal trials on {teacher!r}, {calib_tokens} calibration tokens:")
            typer.echo(format_trials(out["trials"]))
    for n in counts:
        out["forward"].append(bench_forward_pair(teacher.path, n, seq_len, threads))
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
    elif counts:
        typer.echo(format_pairs(out["forward"]))
