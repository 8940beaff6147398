"""`healsweep demo` commands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output, check_output_folder
from healsweep.cli._apps import demo_app
from healsweep.data.corpus import load_corpus


@demo_app.command("corpus")
def demo_corpus(
    out: Annotated[Path, typer.Option("--out", help="Corpus JSONL to write.")] = Path(
        "demo-corpus.jsonl"
    ),
    tokenizer_out: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer-out",
            help="tokenizer.json to write (default: demo-tokenizer.json next to --out).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the partition and wording.")] = 0,
) -> None:
    """Build the demo corpus and its tokenizer from the Python standard library (no network)."""
    # lazy: heavy (tokenizers)
    from healsweep.demo.corpus_builder import (
        BUILT_WITH,
        DemoCorpusConfig,
        build_demo_corpus,
        write_demo_assets,
    )

    tokenizer_path = tokenizer_out or out.with_name("demo-tokenizer.json")
    check_output(out, "corpus")
    check_output(tokenizer_path, "tokenizer.json")
    build = build_demo_corpus(DemoCorpusConfig(seed=seed))
    write_demo_assets(build, out, tokenizer_path)
    report = build.report
    if report["python"] != BUILT_WITH:
        typer.echo(
            f"note: built with {report['python']}; the shipped assets came from {BUILT_WITH}"
        )
    typer.echo(f"wrote {len(build.documents)} documents to {out}, tokenizer to {tokenizer_path}")
    typer.echo(f"{'pool/stratum':<22}{'documents':>10}")
    for key, count in report["documents"].items():
        typer.echo(f"{key:<22}{count:>10}")
    for pool, tokens in report["tokens"].items():
        typer.echo(f"tokens {pool:<15}{tokens:>10}")
    typer.echo(
        f"calibration candidates dropped for a shared 16-gram: {report['calibration_dropped']}; "
        f"vocab {report['vocab_size']}; {report['seconds']} s"
    )


def _deterministic_gpu_ops() -> None:
    """Ask XLA for deterministic GPU kernels; must run before jax starts a backend."""

    flag = "--xla_gpu_deterministic_ops=true"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


@demo_app.command("build")
def demo_build(
    seed: Annotated[int, typer.Option("--seed", help="Seed of corpus, tokenizer and model.")] = 0,
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out-dir", help="Folder for demo-corpus.jsonl, demo-tokenizer.json and demo-moe.gguf."
        ),
    ] = Path("demo-build"),
    steps: Annotated[
        int | None,
        typer.Option("--steps", min=1, help="Training steps (default: the shipped recipe's)."),
    ] = None,
    preset: Annotated[
        str,
        typer.Option(
            "--preset",
            help="Model size: small (the shipped 10 MB model), medium (8 layers, D 256, 64 "
            "experts of 256, top-4; rows of 256 for llama.cpp's K- and IQ-quants; train it on a "
            "GPU) or medium-cpu (4 layers, D 256, 8 experts of 256, top-2, a shared expert; "
            "trains on a 2-core CPU within an hour). A stopped build resumes where it stopped.",
        ),
    ] = "small",
    figures: Annotated[
        bool,
        typer.Option(
            "--figures/--no-figures", help="Afterwards, score dev perplexity and the expert load."
        ),
    ] = True,
) -> None:
    """Regenerate the demo corpus, tokenizer and trained MoE model from a seed."""
    _deterministic_gpu_ops()
    # lazy: heavy (gguf, jax, optax)
    from healsweep.demo.build import build_demo, demo_figures, demo_preset, demo_train_config

    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    check_output_folder(out_dir, "demo build", make=True)
    recipe = demo_train_config(seed, steps, preset)
    typer.echo(
        f"{'copying' if demo_preset(preset).packaged_corpus else 'building'} corpus and "
        f"tokenizer, then training the {preset} model {recipe.steps} steps of "
        f"{recipe.batch_size}x{recipe.seq_len} tokens (seed {seed}) into {out_dir}"
    )

    def progress(log, _params) -> None:
        typer.echo(
            f"step {log.step:>6}  loss {log.loss:.4f}  nll {log.nll:.4f}  balance {log.aux:.4f}"
        )

    built = build_demo(out_dir, seed=seed, steps=steps, preset=preset, progress=progress)
    times = ", ".join(f"{stage} {sec:.0f} s" for stage, sec in built.seconds.items())
    typer.echo(f"wrote {built.model_path} (trained on {built.backend}; {times})")
    if not figures:
        return
    model = open_model(built.model_path)
    found = demo_figures(model, load_corpus(built.corpus_path), model.tokenizer())
    typer.echo(
        f"dev windows: perplexity {found.window_perplexity:.2f} over "
        f"{found.window_tokens} scored tokens; unigram {found.window_unigram_perplexity:.2f}"
    )
    typer.echo(
        f"dev documents: perplexity {found.dev_perplexity:.2f} over {found.dev_tokens} "
        f"tokens; unigram {found.unigram_perplexity:.2f}"
    )
    share = found.expert_load * 100
    typer.echo(
        f"routed share per expert on the calibration pool ({found.calibration_tokens} "
        f"tokens), %: min {share.min():.2f}, max {share.max():.2f}"
    )
    for layer, row in enumerate(share):
        typer.echo(f"  layer {layer}: " + " ".join(f"{s:4.1f}" for s in row))
