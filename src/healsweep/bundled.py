"""Where the packaged demo assets live, and how a MODEL argument resolves to a file.

At the bottom of the layer order (docs/contracts.md): the runtime opens ``demo`` as a model and a
corpus through this module, never through :mod:`healsweep.demo` (the builder, imported only by
the CLI)."""

from __future__ import annotations

from pathlib import Path

from healsweep.errors import GGUFFormatError


def _assets() -> Path:
    return Path(__file__).parent / "assets"


# a MODEL argument naming a packaged model -> its file under assets/ (docs/demo-model.md)
BUNDLED_MODELS = {
    "demo": "demo-moe.gguf",  # 4 layers, D 128, 16 experts of 128: the demo sweeps' model
    "demo-medium-cpu": "demo-moe-medium-cpu.gguf",  # rows of 256 + a shared expert: ggml types
}


def demo_model_path(name: str = "demo") -> Path:
    """A packaged model's file (``assets/demo-moe.gguf`` for ``demo``)."""
    return _assets() / BUNDLED_MODELS[name]


def demo_corpus_path() -> Path:
    """The packaged demo corpus (``assets/demo-corpus.jsonl``)."""
    return _assets() / "demo-corpus.jsonl"


def demo_tokenizer_path() -> Path:
    """The packaged demo tokenizer (``assets/demo-tokenizer.json``)."""
    return _assets() / "demo-tokenizer.json"


def is_bundled(arg: str | Path) -> bool:
    """Whether a MODEL argument names a packaged model (``demo``, ``demo-medium-cpu``)."""
    return str(arg) in BUNDLED_MODELS


def resolve_model(arg: str | Path) -> Path:
    """A packaged model's name (:data:`BUNDLED_MODELS`) → its file (which must exist); anything
    else → ``Path(arg)``."""
    if not is_bundled(arg):
        return Path(arg)
    path = demo_model_path(str(arg))
    if not path.is_file():
        preset = "" if str(arg) == "demo" else " --preset medium-cpu"
        raise GGUFFormatError(
            f"the packaged model {arg!r} ({path}) is missing; build it with "
            f"`healsweep demo build{preset}` and pass the file instead"
        )
    return path
