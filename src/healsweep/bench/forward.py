"""Forward-pass benchmark: teacher-forced tokens/s and peak RSS, and RSS against layer count.

Peak RSS is a process-lifetime high-water mark, so the layer-scaling study runs each model in a
fresh interpreter (``python -m healsweep bench forward MODEL --json``) and collects one row each.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from healsweep._rss import peak_rss_bytes
from healsweep.gguf_io import split_block
from healsweep.gguf_io._summary import layer_bytes
from healsweep.model.forward import forward
from healsweep.model.synthetic import write_random_model


def bench_forward(
    model: Any, *, n_tokens: int = 512, seq_len: int = 256, repeats: int = 2, seed: int = 0
) -> dict[str, Any]:
    """Time ``forward`` on random token ids: ``n_tokens`` split into sequences of ``seq_len``.

    One untimed call compiles the layer function for this shape; the best of ``repeats`` timed
    calls gives tokens/s. Every logit row is computed, as ``model logits`` does.
    """

    hp = model.hparams
    sequences = bench_sequences(hp.n_vocab, n_tokens, seq_len, seed)
    start = time.perf_counter()
    forward(model, sequences)
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        forward(model, sequences)
        best = min(best, time.perf_counter() - start)
    stored, dequantized = layer_bytes(model, 0)
    return {
        "model": str(model.path),
        "layers": hp.n_layer,
        "file_mib": model.path.stat().st_size / 2**20,
        "layer_mib": stored / 2**20,
        "layer_f32_mib": dequantized / 2**20,
        "tokens": n_tokens,
        "sequences": len(sequences),
        "first_call_s": first,
        "tokens_per_s": n_tokens / best,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
    }


def layer_scaling(
    model: Any, layer_counts: tuple[int, ...] = (4, 8, 16), *, n_tokens: int = 512,
    seq_len: int = 256, workdir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Bench random models shaped like ``model`` with each layer count, one process each."""

    hp = model.hparams
    types = {split_block(n)[1]: model.tensor_type(n) for n in model.tensor_names}
    # every hparam but the layer count and the vocabulary (the tiny tokenizer's) carries over
    shape = {k: v for k, v in dataclasses.asdict(hp).items() if k not in ("arch", "n_vocab", "n_layer")}
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for n_layer in layer_counts:
            path = write_random_model(
                Path(tmp) / f"scaling-{n_layer}.gguf", hp.arch, types=types, **shape, n_layer=n_layer
            )
            rows.append(_bench_in_subprocess(path, n_tokens, seq_len))
            os.unlink(path)
    return rows


def _bench_in_subprocess(path: Path, n_tokens: int, seq_len: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "healsweep", "bench", "forward", str(path), "--tokens",
           str(n_tokens), "--seq-len", str(seq_len), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"bench subprocess for {path.name} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows of :func:`bench_forward` as an aligned text table."""
    cols = [("layers", "{:d}"), ("file_mib", "{:.1f}"), ("layer_mib", "{:.1f}"),
            ("layer_f32_mib", "{:.1f}"), ("tokens", "{:d}"), ("first_call_s", "{:.2f}"),
            ("tokens_per_s", "{:.1f}"), ("peak_rss_mib", "{:.0f}")]
    cells = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True))
                     for row in cells)




def llama_cpp_available() -> bool:
    """Whether ``llama-cpp-python`` (the optional ``[bench]`` extra) is importable."""

    return importlib.util.find_spec("llama_cpp") is not None


def bench_llama_cpp(
    path: str | Path, *, n_tokens: int = 512, seq_len: int = 256, repeats: int = 2,
    n_threads: int | None = None, seed: int = 0,
) -> dict[str, Any]:
    """llama.cpp's teacher-forced tokens/s and peak RSS on the same file and the same tokens.

    Runs in a fresh interpreter (``python -m healsweep.bench._llama_forward``) so its peak RSS is
    its own; every logit row is computed (``logits_all``), as :func:`bench_forward` does.
    """
    cmd = [sys.executable, "-m", "healsweep.bench._llama_forward", str(path), "--tokens",
           str(n_tokens), "--seq-len", str(seq_len), "--repeats", str(repeats), "--seed",
           str(seed), "--threads", str(n_threads or os.cpu_count() or 1)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama.cpp bench of {Path(path).name} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_sequences(n_vocab: int, n_tokens: int, seq_len: int, seed: int) -> list[np.ndarray]:
    """The random token sequences both forward benchmarks run: ``n_tokens`` in ``seq_len`` pieces."""
    rng = np.random.default_rng(seed)
    lengths = [seq_len] * (n_tokens // seq_len) + ([n_tokens % seq_len] if n_tokens % seq_len
                                                    else [])
    return [rng.integers(0, n_vocab, n, dtype=np.int32) for n in lengths]


def bench_forward_pair(
    path: str | Path, n_tokens: int, seq_len: int = 256, n_threads: int | None = None
) -> dict[str, Any]:
    """healsweep's forward and llama.cpp's (when installed) on the same file and tokens, each in
    a fresh process; ``llama`` is None without ``llama-cpp-python``."""
    ours = _bench_in_subprocess(Path(path), n_tokens, seq_len)
    theirs = None
    if llama_cpp_available():
        theirs = bench_llama_cpp(path, n_tokens=n_tokens, seq_len=seq_len, n_threads=n_threads)
    return {"tokens": n_tokens, "healsweep": ours, "llama": theirs}


def format_pairs(rows: list[dict[str, Any]]) -> str:
    """Rows of :func:`bench_forward_pair` as a table: tok/s and peak RSS, side by side."""
    head = ["tokens", "healsweep tok/s", "llama.cpp tok/s", "ratio", "healsweep RSS MiB",
            "llama.cpp RSS MiB"]
    cells = [head]
    for r in rows:
        ours, theirs = r["healsweep"], r["llama"]
        cells.append([
            str(r["tokens"]), f"{ours['tokens_per_s']:.1f}",
            "-" if theirs is None else f"{theirs['tokens_per_s']:.1f}",
            "-" if theirs is None else f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}",
            f"{ours['peak_rss_mib']:.0f}",
            "-" if theirs is None else f"{theirs['peak_rss_mib']:.0f}",
        ])
    widths = [max(len(row[j]) for row in cells) for j in range(len(head))]
    text = "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True))
                     for row in cells)
    if rows and rows[0]["llama"] is None:
        text += "\n(llama.cpp column empty: install the optional extra, pip install -e '.[bench]')"
    return text
