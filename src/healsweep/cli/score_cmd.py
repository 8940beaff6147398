"""`healsweep score`: KL divergence of one GGUF against a reference GGUF, window by window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output
from healsweep.cache import StageCache
from healsweep.cli._apps import CacheMaxGb, app
from healsweep.data.corpus import load_corpus
from healsweep.data.split import load_split, parity_split
from healsweep.errors import SplitError


def _progress(done: int, total: int, elapsed: float) -> None:
    rate = done / elapsed if elapsed > 0 else 0.0
    end = "\n" if done == total else ""
    typer.echo(f"\rscored {done}/{total} windows ({rate:.2f}/s)", err=True, nl=False)
    if end:
        typer.echo("", err=True)


@app.command("score")
def score(
    model: Annotated[str, typer.Option("--model", help="Student GGUF path, or a packaged model: `demo`, `demo-medium-cpu`.")],
    ref: Annotated[str, typer.Option("--ref", help="Reference (teacher) GGUF path, or a packaged model: `demo`, `demo-medium-cpu`.")],
    corpus: Annotated[str, typer.Option("--corpus", help="Corpus JSONL, or `demo`.")] = "demo",
    split: Annotated[
        str, typer.Option("--split", help="dev | canary | test (test needs a ledger grant).")
    ] = "dev",
    split_config: Annotated[
        Path | None,
        typer.Option("--split-config", help="Split YAML; default: parity split of the corpus."),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the full per-window record here.")
    ] = None,
    max_windows: Annotated[
        int | None,
        typer.Option(
            "--max-windows", min=1, help="Score the first N windows by window id (as a sweep)."
        ),
    ] = None,
    max_scored: Annotated[
        int, typer.Option("--max-scored", min=1, help="Scored tokens per window.")
    ] = 128,
    max_context: Annotated[
        int | None,
        typer.Option(
            "--max-context", min=0, help="Context tokens per window (default: fits the model)."
        ),
    ] = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Windows per forward.")] = 8,
    allow_leakage: Annotated[
        bool,
        typer.Option(
            "--allow-leakage", help="Score even if calibration 16-grams reach scored text."
        ),
    ] = False,
    cache_dir: Annotated[
        Path | None, typer.Option("--cache", help="Stage cache (default $HEALSWEEP_CACHE).")
    ] = None,
    cache_max_gb: CacheMaxGb = None,
    teacher_cache: Annotated[
        str,
        typer.Option(
            "--teacher-cache",
            help="compact (top-K + sampled tail per position, unbiased KLD) | exact (full "
            "log-softmax, for validation) | compact:K:S.",
        ),
    ] = "compact",
    moce_bonus: Annotated[
        float,
        typer.Option(
            "--moce-bonus", min=0.0, max=1.0,
            help="Added to resident experts' routing scores (needs --cache-experts/--cache-mib).",
        ),
    ] = 0.0,
    cache_experts: Annotated[
        int | None,
        typer.Option("--cache-experts", min=1,
                     help="Simulate an LRU cache of this many routed experts per MoE layer."),
    ] = None,
    cache_mib: Annotated[
        float | None,
        typer.Option("--cache-mib", min=0.0,
                     help="Cache size per MoE layer in MiB of the model's stored experts."),
    ] = None,
    warm_cache: Annotated[
        bool,
        typer.Option("--warm-cache",
                     help="Carry the caches over between the windows of one document."),
    ] = False,
) -> None:
    """Teacher-forced KLD(ref || model), top-1, delta-p, perplexity and router agreement;
    with an expert cache, its hit rate, misses and MiB read per token (docs/expert-cache.md)."""
    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    # lazy: heavy (jax): the compact record's kernels
    from healsweep.score.compact import TeacherCacheError, cache_format

    # lazy: heavy (gguf, jax)
    from healsweep.score.report import check_same_tokenizer, format_summary, score_report

    # lazy: heavy (gguf)
    from healsweep.score.windows import scoring_windows, window_leakage, window_options

    if json_out is not None:
        check_output(json_out, "score record", make_folder=True)
    stage_cache = StageCache(cache_dir, cache_max_gb)
    try:
        fmt = cache_format(teacher_cache)
    except TeacherCacheError as exc:
        raise typer.BadParameter(str(exc), param_hint="--teacher-cache") from None
    expert_cache = _expert_cache(moce_bonus, cache_experts, cache_mib, warm_cache)
    teacher, student = open_model(ref), open_model(model)
    n_vocab = check_same_tokenizer(teacher, student)
    docs = load_corpus(corpus)
    cfg = load_split(split_config) if split_config is not None else parity_split(docs)
    context_length = min(teacher.hparams.context_length, student.hparams.context_length)
    try:
        options = window_options(teacher, max_scored, max_context, context_length)
    except SplitError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-context") from None
    max_context = options["max_context"]
    found = scoring_windows(docs, teacher, cfg, split, options, max_windows)
    windows, chat = found.windows, found.chat
    n_calibration, leakage = window_leakage(docs, cfg, teacher, found, allow_leakage)
    typer.echo(f"ref        {teacher.path}  ({teacher.fingerprint[:16]})")
    typer.echo(f"model      {student.path}  ({student.fingerprint[:16]})")
    typer.echo(f"tokenizer  identical token lists ({n_vocab} tokens)")
    typer.echo(f"chat       {chat.describe()}")
    typer.echo(f"windows    {len(windows)} of {found.total} in split {split!r} of corpus {corpus}")
    typer.echo(f"leakage    vs {n_calibration} calibration documents: {leakage.summary()}")
    typer.echo(f"teacher    cache {fmt.label}")
    if expert_cache is not None:
        typer.echo(f"experts    cache {expert_cache.label()} (the teacher routes without it)")
    report = score_report(
        teacher,
        student,
        windows,
        stage_cache,
        batch=batch,
        progress=_progress,
        teacher_cache=fmt,
        expert_cache=expert_cache,
    )
    typer.echo(format_summary(report))
    if json_out is not None:
        record = {
            "ref": str(teacher.path),
            "ref_fingerprint": teacher.fingerprint,
            "model": str(student.path),
            "model_fingerprint": student.fingerprint,
            "corpus": corpus,
            "split": split,
            "max_scored": max_scored,
            "max_context": max_context,
            "teacher_cache": fmt.label,
            "leakage": {str(n): leakage.total(n) for n in leakage.ns},
            **report,
        }
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=1, allow_nan=True) + "\n")
        typer.echo(f"wrote {json_out}")


def _expert_cache(bonus: float, experts: int | None, mib: float | None, warm: bool):
    """The score run's ExpertCacheConfig, or None without a cache size."""
    # lazy: heavy (gguf)
    from healsweep.score.expert_cache import ExpertCacheConfig

    if experts is not None and mib is not None:
        raise typer.BadParameter("give --cache-experts or --cache-mib, not both",
                                 param_hint="--cache-mib")  # fmt: skip
    if experts is None and mib is None:
        if bonus or warm:
            raise typer.BadParameter("--moce-bonus and --warm-cache need a cache size: "
                                     "--cache-experts N or --cache-mib M",
                                     param_hint="--cache-experts")  # fmt: skip
        return None
    return ExpertCacheConfig(bonus=bonus, experts=experts, mib=mib, warm=warm)
