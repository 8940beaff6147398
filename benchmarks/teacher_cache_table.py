"""The compact teacher cache against the exact one, on the demo's first 96 dev windows.

Two healed students (``configs/knobs/shipped-audit.yaml`` = A, ``configs/knobs/no-heal.yaml``
= B) are scored on the windows the demo ablation sweep scores (``sweeps/demo-ablation.yaml``:
the first 96 dev windows by id, 128 scored tokens each) with the exact teacher log-softmax and
with compact records of several sizes, each built from the same exact teacher rows. Per row:

- ``B/pos``: bytes per position of the teacher distribution (router ids not included);
- ``pooled A/B %``: pooled KLD relative error vs exact, per student (mean over draw sets; draw
  set 0 is what ``score`` uses, seeded by the window id, the others re-seed with a suffix);
- ``worst %``: the largest |pooled error| over A, B and the draw sets;
- ``win worst %``: the largest |relative error| of one window's KLD, A and B (draw set 0);
- ``change pts``: the paired change (B vs A pooled KLD, %) compact minus exact, worst over
  draw sets (exact change in the header);
- ``sign %``: windows where the sign of B's minus A's KLD is the exact cache's (draw set 0);
- ``p99 %``: mean |relative error| of a window's per-token KLD p99, A and B (draw set 0);
- ``top-1 / dp``: windows whose top-1 count and delta-p equal the exact cache's, all students;
- ``pooled Q8 %``, ``Q8 win worst %``: the same errors for a student close to the teacher (the
  demo re-encoded as Q8_0; not healed), where a plain tail estimate is at its noisiest.

    .venv/bin/python benchmarks/teacher_cache_table.py [--draws 3] [--windows 96] [--cache DIR]

Estimators (``healsweep.kernels.kld_compact``): ``adaptive`` (the default), ``plain``
(importance-sampling mean of log p - log q over the tail draws), ``cv`` (the same with the
control variate e^y - 1 at coefficient 1), ``lumped`` (the tail as one bucket; no draws).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from healsweep.cache import StageCache
from healsweep.heal.knobs import Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import open_model
from healsweep.score.compact import TeacherCacheFormat, compact_record, record_bytes
from healsweep.score.metrics import compact_window_metrics, window_metrics
from healsweep.score.runner import run_student
from healsweep.score.teacher_cache import run_teacher
from healsweep.sweep.spec_files import load_spec
from healsweep.sweep.work import dev_windows

ROOT = Path(__file__).resolve().parents[1]
STUDENTS = {"A": "shipped-audit.yaml", "B": "no-heal.yaml"}
# (K, S) -> estimators scored on that record; lumped tails (no draws) for contrast.
SIZES = {
    (8, 8): ("adaptive", "plain", "cv", "lumped"),
    (32, 32): ("adaptive", "plain", "cv"),
    (64, 64): ("adaptive", "plain", "cv", "lumped"),
    (128, 128): ("adaptive", "plain", "cv"),
    (32, 96): ("adaptive", "plain"),
    (256, 1): ("lumped",),
}
VARIANTS = [(tail, k, s) for (k, s), tails in SIZES.items() for tail in tails]


def _q8_student(teacher, folder: Path):
    """The teacher with every 32-block-row matrix re-encoded as Q8_0: a student close to it."""
    from gguf import GGMLQuantizationType

    from healsweep.gguf_io._tokenizer import tokenizer_metadata_from_gguf
    from healsweep.model import write_model

    types = {
        name: GGMLQuantizationType.Q8_0
        for name in teacher.tensor_names
        if len(teacher.tensor_shape(name)) >= 2 and teacher.tensor_shape(name)[-1] % 32 == 0
    }
    meta = tokenizer_metadata_from_gguf(teacher.metadata, str(teacher.path))
    path = folder / "demo-q8_0.gguf"
    write_model(path, teacher.arch, teacher.hparams, teacher.tensors(), types, meta, name="q8")
    return open_model(path)


def _students(teacher, spec, cache, folder: Path):
    out = {}
    for name, file in STUDENTS.items():
        knobs = Knobs(**yaml.safe_load((ROOT / "configs" / "knobs" / file).read_text()))
        out[name] = build_student(teacher, knobs, spec.calibration, cache)
    out["Q8"] = _q8_student(teacher, folder)
    return out


def collect(n_windows: int, draws: int, cache: StageCache) -> dict:
    """Per window and student: exact metrics and, per variant and draw set, compact metrics."""
    spec = load_spec(ROOT / "sweeps" / "demo-ablation.yaml")
    teacher = open_model(spec.model)
    windows = dev_windows(spec, teacher)[:n_windows]
    folder = Path(tempfile.mkdtemp(prefix="teacher-cache-table-"))
    students = _students(teacher, spec, cache, folder)
    exact = {s: [] for s in students}
    compact = {(v, r, s): [] for v in VARIANTS for r in range(draws) for s in students}  # lists
    build_s, batch = 0.0, spec.scoring.batch
    for lo in range(0, len(windows), batch):
        group = windows[lo : lo + batch]
        taught = run_teacher(teacher, group)
        studied = {s: run_student(m, group) for s, m in students.items()}
        for i, (window, t_out) in enumerate(zip(group, taught, strict=True)):
            ids = window.scored_tokens
            for s in students:
                exact[s].append(window_metrics(t_out.logprobs, studied[s][i][0], ids))
            for (k, n_tail), tails in SIZES.items():
                fmt = TeacherCacheFormat("compact", k, n_tail)
                for r in range(draws if tails != ("lumped",) else 1):
                    seed_id = window.window_id if r == 0 else f"{window.window_id}#{r}"
                    start = time.perf_counter()
                    record = compact_record(t_out.logprobs, ids, t_out.topk_ids, seed_id, fmt)
                    build_s += time.perf_counter() - start
                    for tail in tails:
                        if tail == "lumped" and r > 0:
                            continue  # no draws: one set is all there is
                        for s in students:
                            m = compact_window_metrics(record, studied[s][i][0], ids, tail=tail)
                            compact[(tail, k, n_tail), r, s].append(m)
        print(f"  {lo + len(group)}/{len(windows)} windows", flush=True)
    return {"exact": exact, "compact": compact, "draws": draws, "build_s": build_s,
            "n_windows": len(windows), "n_vocab": teacher.hparams.n_vocab}  # fmt: skip


def _pooled(metrics) -> float:
    return sum(m.kld_sum for m in metrics) / sum(m.kld_count for m in metrics)


def table(data: dict) -> str:
    """The markdown table of :func:`collect`'s results."""
    exact, compact, n_vocab = data["exact"], data["compact"], data["n_vocab"]
    pool = {s: _pooled(m) for s, m in exact.items()}
    change = 100 * (pool["B"] / pool["A"] - 1)
    lines = [
        f"exact pooled KLD: A {pool['A']:.5f}, B {pool['B']:.5f}, Q8 {pool['Q8']:.6f}; "
        "paired change B vs A "
        f"{change:+.2f}%; {data['n_windows']} windows, {data['draws']} draw sets; exact "
        f"record {record_bytes(TeacherCacheFormat('exact'), n_vocab)} B/pos",
        "",
        "| estimator | K | S | B/pos | pooled A % | pooled B % | worst % | win worst % "
        "| change pts | sign % | p99 % | top-1 / dp | pooled Q8 % | Q8 win worst % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        tail, k, n_tail = variant
        draws = data["draws"] if tail != "lumped" else 1
        errs = {s: [] for s in exact}
        healed = ("A", "B")
        changes = []
        for r in range(draws):
            got = {s: _pooled(compact[variant, r, s]) for s in exact}
            for s in exact:
                errs[s].append(100 * (got[s] / pool[s] - 1))
            changes.append(100 * (got["B"] / got["A"] - 1) - change)
        first = {s: compact[variant, 0, s] for s in exact}
        win = max(
            abs(c.kld_sum / e.kld_sum - 1)
            for s in healed
            for c, e in zip(first[s], exact[s], strict=True)
        )
        same = sum(
            c.top1_count == e.top1_count and c.delta_p_mean == e.delta_p_mean
            for s in exact
            for c, e in zip(first[s], exact[s], strict=True)
        )
        sign = np.mean([
            np.sign(cb.kld_sum - ca.kld_sum) == np.sign(eb.kld_sum - ea.kld_sum)
            for ca, cb, ea, eb in zip(first["A"], first["B"], exact["A"], exact["B"], strict=True)
        ])  # fmt: skip
        p99 = np.mean([
            abs(c.kld_p99 / e.kld_p99 - 1)
            for s in healed
            for c, e in zip(first[s], exact[s], strict=True)
        ])  # fmt: skip
        worst = max(abs(x) for s in healed for x in errs[s])
        q8_win = max(
            abs(c.kld_sum / e.kld_sum - 1) for c, e in zip(first["Q8"], exact["Q8"], strict=True)
        )
        n_bytes = 8 * k + 8 if tail == "lumped" else 8 * (k + n_tail) + 9
        lines.append(
            f"| {tail} | {k} | {n_tail if tail != 'lumped' else '-'} | {n_bytes} "
            f"| {np.mean(errs['A']):+.2f} | {np.mean(errs['B']):+.2f} | {worst:.2f} "
            f"| {100 * win:.1f} | {max(changes, key=abs):+.2f} | {100 * sign:.0f} "
            f"| {100 * p99:.1f} | {same}/{3 * len(exact['A'])} "
            f"| {np.mean(errs['Q8']):+.2f} | {100 * q8_win:.1f} |"
        )
    lines.append(f"\ncompact record builds: {data['build_s']:.1f} s in all")
    return "\n".join(lines)


def main() -> None:
    """Collect and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=96)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=None, help="stage cache for the students")
    args = parser.parse_args()
    start = time.time()
    data = collect(args.windows, args.draws, StageCache(args.cache))
    print(table(data))
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
