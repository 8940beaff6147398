"""`healsweep sensitivity`: the allocator's sensitivity pass of a sweep spec, and its proposals."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from healsweep._inputs import check_output
from healsweep.cache import parse_gb
from healsweep.cli._apps import CacheMaxGb, app

_SPEC = typer.Argument(..., help="Sweep spec YAML with sampler allocator (see sweeps/).")
_ADDRESS = typer.Option(
    None, "--address", help="Ray cluster HEAD:PORT (default: an embedded local Ray)."
)
_CPUS = typer.Option(None, "--num-cpus", help="CPUs of the embedded local Ray.")
_JSON = typer.Option(None, "--json", help="Also write the table and proposals as JSON here.")


@app.command("sensitivity")
def sensitivity(
    spec: Path = _SPEC,
    address: str | None = _ADDRESS,
    num_cpus: int | None = _CPUS,
    json_out: Path | None = _JSON,
    cache_max_gb: CacheMaxGb = None,
) -> None:
    """The KLD cost on dev of moving each tensor group one type step down or up, around the
    spec's baseline with its fixed knobs (cached: `sweep run` of the spec reuses it), and the
    allocations the allocator proposes under the spec's budget."""
    # lazy: heavy (gguf, jax, optuna, pyarrow, ray)
    from healsweep.results.budget import sensitivity_lines
    from healsweep.sweep.driver import sensitivity_pass
    from healsweep.sweep.sensitivity import allocator_record
    from healsweep.sweep.spec_files import load_spec

    if json_out is not None:
        check_output(json_out, "sensitivity record")
    limit = parse_gb(cache_max_gb, "--cache-max-gb")
    loaded = load_spec(spec)
    if limit is not None:
        loaded = loaded.model_copy(update={"cache_max_gb": limit})
    table, proposals = sensitivity_pass(
        loaded, address=address, num_cpus=num_cpus, say=lambda line: typer.echo(line, err=True)
    )
    record = allocator_record(table, proposals)
    for line in sensitivity_lines(record["sensitivity"]):
        typer.echo(line)
    if proposals:
        typer.echo("")
        budget = loaded.budget.budget()
        for p in proposals:
            layers = f", layers {p.knobs.layer_types}" if p.knobs.layer_types else ""
            typer.echo(f"proposal within {budget.label(p.limit)}: {p.knobs.type_gu}/"
                       f"{p.knobs.type_d}{layers} at {p.size.routed_bpw:.4f} routed bpw, "
                       f"predicted ΔKLD {p.predicted_kld:+.5f}")  # fmt: skip
    if json_out is not None:
        json_out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        typer.echo(f"wrote {json_out}")
