"""`healsweep baseline llama`: the routed experts quantized by llama.cpp's own quantizer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from healsweep._inputs import check_output
from healsweep.cache import StageCache
from healsweep.cli._apps import CacheMaxGb, baseline_app
from healsweep.cli.heal_cmd import CacheOpt, ChunkOpt, CorpusOpt, MaxTokensOpt, MinTokensOpt
from healsweep.heal.knobs import NIGHT, CalibrationConfig


@baseline_app.command("llama")
def llama(
    model: Annotated[str, typer.Argument(help="Teacher GGUF path, or a packaged model: `demo`, `demo-medium-cpu`.")],
    qtype: Annotated[
        str, typer.Option("--type", help="q2_0 | q2_k | iq2_xxs | iq2_xs | iq2_s (ggml's names).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write the baseline GGUF.")],
    imatrix: Annotated[
        bool,
        typer.Option(
            "--imatrix-from-calibration",
            help="Pass ggml one importance row per expert: E[x²] (gate/up) and E[h²] (down) "
            "from the calibration trace, as llama-quantize does with an imatrix.",
        ),
    ] = False,
    all_tensors: Annotated[
        bool,
        typer.Option(
            "--all-tensors",
            help="Every matrix in the type, not only the routed experts (attention, shared "
            "expert, embeddings, output, dense layers; router and vectors as stored), each with "
            "its input's importance row from the calibration where --imatrix-from-calibration.",
        ),
    ] = False,
    corpus: CorpusOpt = "demo",
    max_tokens: MaxTokensOpt = NIGHT,
    chunk_length: ChunkOpt = 512,
    min_tokens_per_expert: MinTokensOpt = 16,
    cache: CacheOpt = None,
    cache_max_gb: CacheMaxGb = None,
) -> None:
    """Write MODEL with only its routed experts quantized by ggml (``ggml_quantize_chunk`` from
    llama-cpp-python's libggml; needs the \\[bench] extra); every other tensor is kept as stored
    (with --all-tensors: every matrix in the type).
    """
    # lazy: heavy (gguf)
    from healsweep.heal.llama_baseline import LLAMA_TYPES, bits_per_weight, write_llama_baseline

    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    check_output(out, "baseline GGUF")
    stage_cache = StageCache(cache, cache_max_gb)
    if qtype not in LLAMA_TYPES:
        raise typer.BadParameter(
            f"{qtype!r}: choose one of {', '.join(LLAMA_TYPES)}", param_hint="--type"
        )
    teacher = open_model(model)
    calibration = None
    if imatrix:
        calibration = CalibrationConfig(
            corpus=corpus, max_tokens=max_tokens, chunk_length=chunk_length,
            min_tokens_per_expert=min_tokens_per_expert,
        )  # fmt: skip
    what = "every matrix" if all_tensors else "routed experts"
    typer.echo(f"[baseline] {teacher!r}: {what} to {qtype} "
               f"({bits_per_weight(LLAMA_TYPES[qtype]):.4g} bits a weight), "
               f"imatrix {'from calibration' if imatrix else 'none'}")  # fmt: skip
    path = write_llama_baseline(
        teacher, qtype, out, calibration=calibration, cache=stage_cache,
        progress=lambda stage, message: typer.echo(f"[{stage}] {message}"), all_tensors=all_tensors,
    )  # fmt: skip
    typer.echo(f"[write] {path}")
