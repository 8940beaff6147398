"""`healsweep model ...` commands."""

from __future__ import annotations

import typer

from healsweep.cli._apps import model_app


@model_app.command("info")
def model_info(model: str = typer.Argument(..., help="GGUF path, or `demo`.")) -> None:
    """Architecture, layers, experts, dims, tensor types and bytes, tokenizer summary."""
    raise NotImplementedError  # filled by the foundation work
