"""`healsweep heal` (one config, no sweep) and `healsweep bench heal` (the routed-residual table)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output
from healsweep.cache import StageCache, parse_gb
from healsweep.cli._apps import CacheMaxGb, app, bench_app
from healsweep.data.corpus import load_corpus
from healsweep.heal.knobs import (
    EXPERT_TYPES,
    NIGHT,
    CalibrationConfig,
    Knobs,
    load_knobs,
    require_ggml_in,
)

ModelArg = Annotated[str, typer.Argument(help="GGUF path, or a packaged model: `demo`, `demo-medium-cpu`.")]
CorpusOpt = Annotated[str, typer.Option(
    "--corpus", help="Corpus JSONL whose `pool: calibration` documents calibrate, or `demo`.")]


def _max_tokens(value: str) -> int | str | None:
    """``--max-tokens``: a positive integer, ``night`` or ``all`` (null: every token)."""
    if value in (NIGHT, "all"):
        return None if value == "all" else NIGHT
    try:
        tokens = int(value)
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise typer.BadParameter(f"{value!r}: give a positive integer, `night` or `all`")
    return tokens


MaxTokensOpt = Annotated[str, typer.Option(
    "--max-tokens", metavar="N|night|all", callback=_max_tokens,
    help="Calibration tokens: N; `night`, as many as keep a layer's trace within 4 GB / 24 "
         "(13,451 at Qwen1.5-MoE-A2.7B's shape; a small model's whole pool, as the demo "
         "models'); or `all`.")]
ChunkOpt = Annotated[int, typer.Option(
    "--chunk-length", min=16, help="Tokens per traced sequence; longer documents are chunked.")]
MinTokensOpt = Annotated[int, typer.Option(
    "--min-tokens-per-expert", min=1,
    help="Experts with fewer routed tokens use the layer-wide `act` statistic.")]
CacheOpt = Annotated[Path | None, typer.Option(
    "--cache", help="Stage cache directory (default: $HEALSWEEP_CACHE or ~/.cache/healsweep).")]


def _calibration(corpus: str, max_tokens: int | str | None, chunk_length: int, min_tokens: int):

    return CalibrationConfig(corpus=corpus, max_tokens=max_tokens, chunk_length=chunk_length,
                             min_tokens_per_expert=min_tokens)


def _progress(stage: str, message: str) -> None:
    typer.echo(f"[{stage}] {message}")


def _ladder(value: str | None) -> list[str] | None:
    """``--ladder``: comma-separated routed-expert types, or None (the target's default)."""
    if value is None:
        return None
    names = [t.strip().lower() for t in value.split(",") if t.strip()]
    bad = [t for t in names if t not in EXPERT_TYPES]
    if bad or not names:
        raise typer.BadParameter(f"{value!r}: give comma-separated types of {', '.join(EXPERT_TYPES)}")
    return names


TargetBpwOpt = Annotated[float | None, typer.Option(
    "--target-bpw",
    help="Allocate the types on MODEL's own sensitivity under this routed bits per weight "
         "(the other groups keep --knobs' types), then heal with --knobs' healing knobs.")]
TargetMibOpt = Annotated[float | None, typer.Option(
    "--target-size-mib",
    help="Allocate every group's type (routed per layer and projection, attention, shared "
         "expert, embeddings, output, dense) under this whole-file size in MiB, then heal.")]
LadderOpt = Annotated[str | None, typer.Option(
    "--ladder", callback=_ladder, help="With a target: the types the allocator moves groups "
    "along, comma-separated (default iq1_s,iq1_m,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s,iq4_xs,q4_k).")]
RoundsOpt = Annotated[int, typer.Option(
    "--rounds", min=1, help="With a target: sensitivity passes at most. Each further round "
    "scores the last allocation, stops unless it beat every earlier one, else moves every group "
    "one step from it and allocates anew; the answer is the best allocation measured (1: the "
    "first allocation, as predicted).")]
WindowsOpt = Annotated[int, typer.Option(
    "--windows", min=1, help="With a target: dev windows of --corpus's split the sensitivity "
    "pass scores each config on.")]


def _allocated(model: str, chosen: Knobs, calibration: CalibrationConfig, target_bpw: float | None,
               target_mib: float | None, ladder: list[str] | None, windows: int, rounds: int,
               cache: Path | None, cache_max_gb: float | None) -> tuple[Knobs, dict]:
    """The knobs a target allocates on ``model`` (its sensitivity pass, cached), and the
    ``healsweep.*`` fields recording it; a target out of reach is refused before any work."""
    # lazy: heavy (gguf, ray, jax)
    from healsweep.heal.size import ModelShapes
    from healsweep.model import open_model
    from healsweep.sweep import target as targets

    goal = targets.Target.of(target_bpw, target_mib)
    shapes = ModelShapes.of(open_model(model))
    rungs = targets.usable_ladder(shapes, ladder)
    low, high = targets.check_target(chosen, shapes, goal, rungs)
    base = targets.target_base(chosen, shapes, goal, rungs)
    _progress("target", f"{goal.label()}: reachable {goal.label(low)} to {goal.label(high)} on "
              f"the ladder {', '.join(rungs)}; base {base.type_gu} everywhere"
              + ("" if goal.whole_file else " routed"))  # fmt: skip

    def spec_for(centre: Knobs):
        return targets.target_spec(model, calibration.corpus, calibration, centre, goal, rungs,
                                   windows=windows, cache_root=None if cache is None else str(cache),
                                   cache_max_gb=cache_max_gb)  # fmt: skip

    table, allocation, steps = targets.allocate_target(
        spec_for, base, shapes, goal, rounds=rounds,
        say=lambda line: _progress("sensitivity", line))  # fmt: skip
    _progress("allocate", targets.describe(allocation, goal, measured=rounds > 1))
    record = {"target": goal.metadata(),
              "allocation": targets.allocation_record(table, allocation, goal, steps)}  # fmt: skip
    return allocation.knobs, record


@app.command("heal")
def heal(
    model: ModelArg,
    knobs: Annotated[Path, typer.Option("--knobs", help="Knob file (YAML); see configs/knobs/.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the healed GGUF.")],
    experts: Annotated[str, typer.Option(
        "--experts", help="Routed experts in the GGUF: healed (each tensor in the type it was "
        "healed in, its blocks as scored, alpha folded in: Q2_0 as ggml type 42; llama.cpp runs "
        "it), q2_0 (the same, refused unless all are Q2_0) or f16 (dequantized, for any GGUF "
        "tool).")] = "healed",
    q2: Annotated[Path | None, typer.Option(
        "--q2", help="Also write the packed Q2_0 blocks and alphas to this .npz sidecar.")] = None,
    report: Annotated[Path | None, typer.Option(
        "--report", help="Also write the stage report (alphas, residuals, ridge) as JSON.")] = None,
    corpus: CorpusOpt = "demo",
    max_tokens: MaxTokensOpt = NIGHT,
    chunk_length: ChunkOpt = 512,
    min_tokens_per_expert: MinTokensOpt = 16,
    cache: CacheOpt = None,
    cache_max_gb: CacheMaxGb = None,
    target_bpw: TargetBpwOpt = None,
    target_size_mib: TargetMibOpt = None,
    ladder: LadderOpt = None,
    windows: WindowsOpt = 24,
    rounds: RoundsOpt = 3,  # sweep.target.ROUNDS (not imported here: --help stays instant)
) -> None:
    """Quantize the routed experts (Q2_0, or the types the knobs choose) and heal them under one
    knob file; write a GGUF.

    With ``--target-bpw`` or ``--target-size-mib`` the types are MODEL's own allocation under
    the target (a sensitivity pass on ``--corpus``'s dev windows, cached; the knapsack over
    every group), healed with the knob file's healing knobs; the file records the target and
    the allocation (``healsweep.target``, ``healsweep.allocation``).

    The GGUF holds the healed experts in their types (Q2_0 as ggml type 42; alpha folded into
    the scales) or, with ``--experts f16``, dequantized to F16; every other tensor as the model
    stores it; a ridge-healed shared-expert down projection keeps its storage type.
    """
    # lazy: heavy (gguf)
    from healsweep.heal import export

    # lazy: heavy (gguf, jax)
    from healsweep.heal.pipeline import build_student
    from healsweep.heal.quantize import check_quantizable
    from healsweep.model import open_model

    if experts not in export.EXPERT_FORMATS:
        raise typer.BadParameter(f"{experts!r}: choose one of {', '.join(export.EXPERT_FORMATS)}",
                                 param_hint="--experts")
    check_output(out, "healed GGUF")  # before the heal: a cold one takes minutes to hours
    for extra, what in ((q2, "Q2_0 sidecar"), (report, "stage report")):
        if extra is not None:
            check_output(extra, what)
    stage_cache = StageCache(cache, cache_max_gb)
    chosen = load_knobs(knobs, need_ggml=False)
    calibration = _calibration(corpus, max_tokens, chunk_length, min_tokens_per_expert)
    recorded: dict = {}
    for given, hint in ((ladder is not None, "--ladder"), (rounds != 3, "--rounds")):
        if given and target_bpw is None and target_size_mib is None:
            raise typer.BadParameter(f"{hint[2:]} is for a target: add --target-bpw or "
                                     "--target-size-mib", param_hint=hint)  # fmt: skip
    if target_bpw is not None or target_size_mib is not None:
        chosen, recorded = _allocated(model, chosen, calibration, target_bpw, target_size_mib,
                                      ladder, windows, rounds, cache,
                                      parse_gb(cache_max_gb, "--cache-max-gb"))  # fmt: skip
    teacher = open_model(model)
    # Whether the knobs' types fit this model's rows first (the error names where they do fit),
    # then whether ggml's quantizer is there for them.
    check_quantizable(teacher, chosen, str(knobs))
    require_ggml_in(chosen, str(knobs))
    typer.echo(f"[heal] {teacher!r}")
    typer.echo(f"[knobs] {' '.join(f'{k}={v}' for k, v in chosen.model_dump().items())}")
    student = build_student(teacher, chosen, calibration, stage_cache, progress=_progress)
    timings = ", ".join(f"{k} {v:.2f}s" for k, v in student.report["timings_s"].items())
    executed = ", ".join(f"{k} x{v}" for k, v in sorted(student.report["executed"].items()))
    typer.echo(f"[stages] {timings}; computed (not from cache): {executed or 'nothing'}")
    for warning in {(r.get("ridge") or {}).get("warning") for r in student.report["layers"]}:
        if warning:
            typer.echo(f"[warning] {warning}")
    export.write_healed_gguf(student, out, experts=experts, metadata=recorded)
    written = export.heal_metadata(student, experts)
    typer.echo(f"[write] {out} (routed experts {written['experts']}: "
               f"{written['routed_bpw']:.4g} bits a weight)")
    if q2 is not None:
        export.write_q2_sidecar(student, q2)
        typer.echo(f"[write] {q2}")
    if report is not None:
        report.write_text(json.dumps(student.report, indent=2, default=str))
        typer.echo(f"[write] {report}")


@bench_app.command("heal")
def bench_heal(
    model: ModelArg = "demo",
    knobs: Annotated[Path | None, typer.Option(
        "--knobs", help="Base knobs (quantization and ridge); default: the shipped healer.")] = None,
    corpus: CorpusOpt = "demo",
    heldout_every: Annotated[int, typer.Option(
        "--heldout-every", min=2, help="Hold out every n-th calibration document per stratum.")] = 4,
    max_tokens: MaxTokensOpt = NIGHT,
    chunk_length: ChunkOpt = 512,
    cache: Annotated[Path | None, typer.Option(
        "--cache", help="Stage cache directory (default: a fresh temporary one, so the first "
        "trial's timings are cold).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Per-layer routed residual for alpha in {1, gaussian, mse} (+ ridge), cal and held-out."""

    # lazy: heavy (gguf, jax)
    from healsweep.heal.evaluate import residual_table

    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    base = load_knobs(knobs) if knobs else Knobs()
    calibration = _calibration(corpus, max_tokens, chunk_length, 16)
    with tempfile.TemporaryDirectory(prefix="healsweep-bench-") as scratch:
        table = residual_table(open_model(model), load_corpus(corpus),
                               StageCache(cache if cache is not None else scratch),
                               calibration, base, heldout_every)
    if as_json:
        typer.echo(json.dumps(table, indent=2, default=str))
        return
    _print_table(table)


def _pct(x: float | None) -> str:
    return "    -  " if x is None else f"{100 * x:6.2f}%"


def _print_table(table: dict) -> None:
    # lazy: heavy (gguf, jax)
    from healsweep.heal.evaluate import VARIANTS

    tokens = table["tokens"]
    typer.echo(f"relative routed residual |y_ref - a*y_q|^2/|y_ref|^2; cal = {tokens['cal']} "
               f"fit tokens (in-sample), held-out = {tokens['heldout']} tokens")
    typer.echo("pooled over layers:")
    typer.echo("  split    " + "".join(f"{v:>16}" for v in VARIANTS))
    for split in ("cal", "heldout"):
        typer.echo(f"  {split:<8} " + "".join(
            f"{_pct(table['pooled'][f'{split}.{v}']):>16}" for v in VARIANTS))
    typer.echo("per layer (cal | held-out):")
    typer.echo("  layer  a_gauss  a_mse  a_oracle_ho   a=1 cal|ho        gauss cal|ho"
               "        mse cal|ho         gauss+ridge cal|ho  rank  dof   ridge LOBO")
    for row in table["rows"]:
        cells = "".join(f"  {_pct(row[f'cal.{v}'])}|{_pct(row[f'heldout.{v}'])}"
                        for v in ("alpha_1", "gaussian", "mse", "gaussian_ridge"))
        dof = row.get("ridge.dof")
        typer.echo(f"  {row['layer']:>5}  {row['alpha_gaussian']:7.4f} {row['alpha_mse']:6.4f} "
                   f"{row['alpha_oracle_heldout']:9.4f}  {cells}  {row.get('ridge.rank') or '-':>4}"
                   f"  {'-' if dof is None else f'{dof:5.1f}'}  {_pct(row.get('ridge.heldout_change'))}")
    for warning in table["ridge_warnings"]:
        typer.echo(f"warning: {warning}")
    cold, warm = table["trial_cold"], table["trial_eta_only"]
    typer.echo(f"one trial, cold cache: {cold['seconds']:.2f}s; stages: " + ", ".join(
        f"{k} {v:.2f}s" for k, v in cold["timings_s"].items()))
    typer.echo(f"same trial with only eta changed: {warm['seconds']:.2f}s; recomputed: "
               + (", ".join(f"{k} x{v}" for k, v in warm["executed"].items()) or "nothing"))
