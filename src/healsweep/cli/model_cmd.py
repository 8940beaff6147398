"""`healsweep model info|logits|slice` and `healsweep bench forward`."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from healsweep._inputs import MIB, check_output, read_bytes
from healsweep.cli._apps import bench_app, model_app
from healsweep.heal.knobs import Knobs

ModelArg = Annotated[str, typer.Argument(help="GGUF path, or a packaged model: `demo`, `demo-medium-cpu`.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@model_app.command("info")
def model_info(
    model: ModelArg,
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="tokenizer.json to use instead of the GGUF's own."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Architecture, layers, experts, dims, tensor types and bytes, tokenizer summary."""
    # lazy: heavy (gguf, jax)
    from healsweep.model import describe_model, open_model

    info = describe_model(open_model(model, tokenizer_path=tokenizer))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"model        {info['path']}  ({_mib(info['file_bytes'])})")
    typer.echo(f"arch         {info['arch']}")
    typer.echo(f"layers       {info['layers']}  (one layer: {_mib(info['layer_bytes'])} stored, "
               f"{_mib(info['layer_bytes_f32'])} as float32)")
    typer.echo(f"routing      {info['routing']}")
    first_moe, stop = info["moe_layers"]
    if first_moe:
        typer.echo(f"dense        layers 0..{first_moe - 1} have a dense FFN (healing skips them)")
    typer.echo(f"attention    {info['attention']}")
    typer.echo(f"dims         n_embd {info['n_embd']}, heads {info['n_head']}/{info['n_head_kv']}"
               f" kv, head_dim {info['head_dim']}, ff_exp {info['n_ff_exp']}, "
               f"ff_shexp {info['n_ff_shexp']}, vocab {info['n_vocab']}")
    typer.echo(f"numerics     rope base {info['rope_freq_base']:g}, rms eps "
               f"{info['rms_norm_eps']:.3g}, context {info['context_length']}")
    typer.echo("tensor types")
    for name, row in info["tensor_types"].items():
        typer.echo(f"  {name:<8} {row['tensors']:>5} tensors  {_mib(row['bytes']):>14}  "
                   f"{row['elements']:>14,d} values")
    tok = info["tokenizer"]
    if "error" in tok:
        typer.echo(f"tokenizer    none usable: {tok['error']}")
    else:
        typer.echo(f"tokenizer    {tok['model']}/{tok['pre']} BPE, vocab {tok['vocab']}, merges "
                   f"{tok['merges']}, control {tok['control_tokens']}, user-defined "
                   f"{tok['user_defined_tokens']}, bos {tok['bos']!r}, eos {tok['eos']!r}, "
                   f"ChatML {'yes' if tok['chatml'] else 'no'}")
    template = info["chat_template"]
    if template is None:
        typer.echo("chat         no chat template in the file: documents are rendered as ChatML")
    else:
        typer.echo(f"chat         the file's chat template ({template['chars']} chars, sha256 "
                   f"{template['sha256']}): documents are rendered with it")
    _print_healsweep(info["healsweep"])


def _print_healsweep(meta: dict | None) -> None:
    """The ``healsweep.*`` metadata of a healed or exported file, one field a line."""
    if meta is None:
        typer.echo("healsweep    no healsweep.* metadata: not a file healsweep healed or exported")
        return
    typer.echo("healsweep    written by healsweep (healsweep.* metadata):")
    if meta.get("baseline"):
        typer.echo(f"  baseline     {meta['baseline']}: {meta.get('baseline_type', '-')}, "
                   f"imatrix {meta.get('imatrix', '-')}")
    bpw = meta.get("routed_bpw")
    bits = "" if bpw is None else f", routed experts {float(bpw):.5g} bits per weight"
    typer.echo(f"  experts      {meta.get('experts', '-')}{bits}")
    if meta.get("expert_types"):
        typer.echo(f"  layer types  {meta['expert_types']} (layer:gate-up/down)")
    knobs = meta.get("knobs")
    if isinstance(knobs, dict):
        defaults = Knobs().model_dump()
        changed = " ".join(f"{k}={v}" for k, v in knobs.items() if defaults.get(k) != v)
        typer.echo(f"  knobs        {changed or 'all at their defaults'} (others at defaults)")
    for key, label in (("teacher_fingerprint", "teacher"), ("student_key", "student key")):
        if meta.get(key):
            typer.echo(f"  {label:<12} {meta[key]}")
    if meta.get("sweep"):
        kld = meta.get("dev_kld_mean")
        dev = "" if kld is None else f", dev pooled KLD {float(kld):.5f}"
        typer.echo(f"  sweep        {meta['sweep']}, trial {meta.get('trial_id', '-')} "
                   f"(config {meta.get('config_hash', '-')}){dev}")
    if meta.get("confirmed_milestone"):
        typer.echo(f"  test         confirmed in milestone {meta['confirmed_milestone']!r}; "
                   f"ledger entry {meta.get('ledger_entry', '-')}")
    elif meta.get("sweep"):
        typer.echo("  test         not confirmed on the test split (dev figures only)")
    head = meta.get("ledger_head")
    if isinstance(head, dict):
        typer.echo(f"  ledger head  {head.get('entries')} entries, {head.get('hash')}")


@model_app.command("logits")
def model_logits(
    model: ModelArg,
    tokens: Annotated[Path, typer.Option("--tokens", help="1-D integer token ids (.npy).")],
    out: Annotated[Path, typer.Option("--out", help="Where to write [T, vocab] float32 .npy.")],
) -> None:
    """Teacher-forced logits of one token sequence."""

    # lazy: heavy (gguf, jax)
    from healsweep.model import forward, open_model

    check_output(out, "logits .npy")
    try:
        ids = np.load(io.BytesIO(read_bytes(tokens, "token ids .npy", 256 * MIB)),
                      allow_pickle=False)  # fmt: skip
    except OSError as exc:
        raise typer.BadParameter(f"{tokens}: {exc.strerror or exc}", param_hint="--tokens") from None
    except ValueError as exc:
        raise typer.BadParameter(
            f"{tokens} is not a .npy array ({exc})", param_hint="--tokens"
        ) from exc
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise typer.BadParameter(
            f"{tokens} holds a {ids.dtype} array of shape {ids.shape}; need 1-D integer ids",
            param_hint="--tokens",
        )
    m = open_model(model)
    if ids.min() < 0 or ids.max() >= m.hparams.n_vocab:
        raise typer.BadParameter(
            f"token ids must lie in [0, {m.hparams.n_vocab}); got {ids.min()}..{ids.max()}",
            param_hint="--tokens",
        )
    logits = forward(m, [ids.astype(np.int32)]).logits[0]
    np.save(out, logits)
    typer.echo(f"wrote {out} float32 {list(logits.shape)}")


@model_app.command("slice")
def model_slice(
    model: ModelArg,
    layers: Annotated[
        str,
        typer.Option(
            "--layers",
            help="Layers A:B to keep (A to B-1, renumbered from 0); A: and :B leave an end open.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write the sliced .gguf.")],
) -> None:
    """A smaller GGUF of layers A..B-1 with the embeddings, head, tokenizer and all metadata."""

    # lazy: heavy (gguf)
    from healsweep.gguf_io import parse_layer_range, slice_model

    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    started = time.perf_counter()
    check_output(out, "sliced GGUF")
    start, stop = parse_layer_range(layers)  # checks the form before the model is opened
    source = open_model(model)
    slice_model(source, (start, stop), out)
    n_layer = source.hparams.n_layer
    start, stop = start or 0, n_layer if stop is None else stop
    typer.echo(
        f"wrote {out}: layers {start}:{stop} of {model} ({stop - start} of {n_layer}), "
        f"{_mib(out.stat().st_size)} in {time.perf_counter() - started:.1f} s"
    )


@bench_app.command("forward")
def bench_forward_cmd(
    model: ModelArg,
    n_tokens: Annotated[int, typer.Option("--tokens", min=1, help="Tokens per forward.")] = 512,
    seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="Tokens per sequence.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed calls; best kept.")] = 2,
    layers_scaling: Annotated[
        bool,
        typer.Option(
            "--layers-scaling",
            help="Also bench random models of MODEL's shape with 4, 8, 16 layers, one process each.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Teacher-forced tokens/s and peak RSS of the layer-by-layer forward."""
    # lazy: heavy (gguf, jax): --help stays instant
    from healsweep.bench.forward import bench_forward, format_table, layer_scaling

    # lazy: heavy (gguf, jax)
    from healsweep.model import open_model

    m = open_model(model)
    row = bench_forward(m, n_tokens=n_tokens, seq_len=seq_len, repeats=repeats)
    if as_json:
        typer.echo(json.dumps(row))
        return
    typer.echo(format_table([row]))
    if layers_scaling:
        typer.echo("\npeak RSS against layer count (same shape, random weights, fresh process):")
        typer.echo(format_table(layer_scaling(m, n_tokens=n_tokens, seq_len=seq_len)))
