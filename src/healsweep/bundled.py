"""Where the packaged demo assets live, and how a MODEL argument resolves to a file.

At the bottom of the layer order (docs/contracts.md): the runtime opens ``demo`` as a model and a
corpus through this module, never through :mod:`healsweep.demo` (the builder, imported only by
the CLI)."""

from __future__ import annotations

from pathlib import Path

from healsweep.errors import GGUFFormatError


def _assets() -> Path:
    return Path(__file__).parent / "assets"


def demo_model_path() -> Path:
    """The packaged demo MoE model (``assets/demo-moe.gguf``)."""
    return _assets() / "demo-moe.gguf"


def demo_corpus_path() -> Path:
    """The packaged demo corpus (``assets/demo-corpus.jsonl``)."""
    return _assets() / "demo-corpus.jsonl"


def demo_tokenizer_path() -> Path:
    """The packaged demo tokenizer (``assets/demo-tokenizer.json``)."""
    return _assets() / "demo-tokenizer.json"


def resolve_model(arg: str | Path) -> Path:
    """``"demo"`` → the packaged demo model (which must exist); anything else → ``Path(arg)``."""
    if str(arg) != "demo":
        return Path(arg)
    path = demo_model_path()
    if not path.is_file():
        raise GGUFFormatError(
            f"the demo model {path} is missing; build it with `healsweep demo build`"
        )
    return path
