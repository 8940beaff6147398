"""The typer application and its command groups.

Command modules import the group they extend from here and decorate functions onto it; heavy
imports happen inside the commands so that ``healsweep --help`` stays instant.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from healsweep.runtime import Runtime, use

# Plain help (click's formatter, not rich's panels): a flag reads `--quiet`, an option with a
# value `--n-boot <int>`; typer's rich panels label every flag `<bool>` as if it took a value.
app = typer.Typer(
    name="healsweep",
    help="Sweeps of 2-bit quantization healing for GGUF Mixture-of-Experts models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
)


def _group(name: str, help_text: str) -> typer.Typer:
    group = typer.Typer(name=name, help=help_text, no_args_is_help=True, rich_markup_mode=None)
    app.add_typer(group, name=name)
    return group


model_app = _group("model", "Inspect a GGUF MoE model and run its teacher-forced forward.")
demo_app = _group("demo", "The embedded demo corpus, tokenizer and MoE model.")
corpus_app = _group("corpus", "Import and inspect corpora.")
split_app = _group("split", "Make and show dev/test split configs.")
bench_app = _group("bench", "Benchmarks that print a table.")
sweep_app = _group("sweep", "Run, resume and inspect sweeps.")
ledger_app = _group("ledger", "Show and verify the tamper-evident ledger of test-split openings.")
cluster_app = _group("cluster", "Inspect the Ray cluster.")
baseline_app = _group("baseline", "External baselines: the routed experts quantized by other tools.")


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"healsweep {version('healsweep')}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="Print the version and exit."
    ),
) -> None:
    """Give the command a runtime of its own (:mod:`healsweep.runtime`): installed for the
    command, closed when it ends, and the process's previous one put back. (``--debug`` is
    read by :func:`healsweep.cli.main`, before the command runs.)"""

    rt = ctx.with_resource(Runtime())  # closed last: after the previous runtime is back
    ctx.with_resource(use(rt))


# The stage cache's size limit, on every command that uses the cache: a string, parsed by the
# cache (healsweep.cache.parse_gb), so a bad value is the library's one-line error and exit 1.
CacheMaxGb = Annotated[
    str | None,
    typer.Option(
        "--cache-max-gb",
        metavar="GIB",
        help="Size limit of the stage cache in GiB: the entries no running trial holds that "
        "are cheapest to recompute per byte are evicted (default: the sweep spec's cache_max_gb where there is one, "
        "else $HEALSWEEP_CACHE_MAX_GB, else no limit; inf: no limit).",
        show_default=False,
    ),
]
